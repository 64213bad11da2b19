"""Regions of an attention record at any length: exact values of rows × columns, a tile-by-tile overview,
one query row, per-head statistics — without ever holding the whole ``[B,H,n,t]``.

A record a fused attention announced (``TraceLog.derived``) has no value: its region is recomputed from the
same layer's Q (``hook_rot_q`` where the model rotates, else ``hook_q``) and K (``hook_k_all``) records of the
same step and the record's mask description (``model.gpt``'s long attention). A record the eager path kept is
sliced. Either way the caller asks the same question and gets the same numbers (to float32 rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from gpt_shape_tracer.model.gpt import (
    SWEEP_CELLS,
    MaskSpec,
    RowNorm,
    ScoreSweep,
    grid_edges,
    pattern_times_v,
    pool_pattern,
    region,
)
from gpt_shape_tracer.tracer.reading._trace import Trace, hook_of, record_name
from gpt_shape_tracer.tracer.storage.records import TensorRecord

MEMO_ENTRIES = 64  # row normalisers (12 bytes × n each), overviews and statistics a trace remembers
MAX_REGION_CELLS = 1 << 24  # cells of one region the library hands back (the app asks for ≤ 256 × 256 per head)
STAGE_OF_HOOK = {"hook_qk": "qk", "hook_attn_scores": "scores", "hook_softcapped": "softcapped", "hook_mask": "mask",
                 "hook_masked_scores": "masked_scores", "hook_pattern": "pattern"}


class RegionError(ValueError):
    """A region that cannot be computed: not an attention record, Q or K not kept, a range outside it."""


@dataclass(frozen=True)
class AttentionSource:
    """What a derived record is computed from: the layer's Q ``[B,H,n,d_head]``, K ``[B,G,t,d_head]`` (and V, O
    where kept) as the attention received / produced them, and the mask description."""

    stage: str
    spec: MaskSpec
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None
    z: torch.Tensor | None


def _record(trace: Trace, name_or_record: str | TensorRecord, step: int | None) -> TensorRecord:
    return name_or_record if isinstance(name_or_record, TensorRecord) else trace.record(name_or_record, step)


T = TypeVar("T")


def _memo(trace: Trace, key: tuple, compute: Callable[[], T]) -> T:
    """``compute()`` once per key (the log's epoch included, so discarded records are never answered from it);
    the least recently used entries are forgotten past ``MEMO_ENTRIES``."""
    memo = trace.attention_memo
    key = (trace.log.epoch, *key)
    if key in memo:
        memo.move_to_end(key)
        return memo[key]  # type: ignore[return-value]
    value = compute()
    memo[key] = value
    while len(memo) > MEMO_ENTRIES:
        memo.popitem(last=False)
    return value


def _known_norm(trace: Trace, rec: TensorRecord, batch: int, head: int) -> RowNorm | None:
    """The normaliser of every row of one head, when a view already computed it (``[1, 1, n]``)."""
    return trace.attention_memo.get((trace.log.epoch, "norm", rec.index, batch, head))  # type: ignore[return-value]


def _remember_norm(trace: Trace, rec: TensorRecord, batch: int, head: int, norm: RowNorm) -> None:
    _memo(trace, ("norm", rec.index, batch, head), lambda: norm)


def is_derived(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None) -> bool:
    """Whether a record's values are recomputed on demand (a fused attention's n × t stage)."""
    return trace.log.derived(_record(trace, name_or_record, step).index) is not None


def can_recompute(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None) -> bool:
    """Whether a record is derived (the fused kernel ran) and the Q and K its regions are recomputed from are kept:
    then any region of it can be read (``attention_region``), at any length."""
    if not is_derived(trace, name_or_record, step):
        return False
    try:
        attention_source(trace, name_or_record, step)
    except RegionError:
        return False
    return True


def attention_source(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None) -> AttentionSource:
    rec = _record(trace, name_or_record, step)
    derived = trace.log.derived(rec.index)
    if derived is None:
        raise RegionError(f"{rec.name} was computed eagerly: it is not derived from Q and K")
    stage, spec = derived
    parent = rec.module.rsplit(".", 1)[0]

    def get(hook: str) -> torch.Tensor | None:
        name = record_name(f"{parent}.{hook}", "hook", "", rec.call)
        return trace.get(name, rec.step) if trace.has(name, rec.step) else None

    q = get("hook_rot_q")
    if q is None:
        q = get("hook_q")
    k = get("hook_k_all")
    if q is None or k is None:
        raise RegionError(f"{rec.name} is recomputed from {parent}'s Q and K, and the trace no longer holds "
                          f"{'Q' if q is None else 'K'} at step {rec.step} (shapes only, or past the values budget)")
    return AttentionSource(stage, spec, _contiguous_aligned(q), _contiguous_aligned(k), get("hook_v_all"),
                           get("hook_z"))


def _contiguous_aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and at a 64-byte-aligned address. A kept K is often a view of the KV cache's buffer (strided
    by its capacity), a loaded one is not; and a loaded value sits wherever its file's bytes put it (a trace read
    from parts: 40 bytes past a 64-byte boundary, measured). A matmul over other strides or another alignment may
    round differently (by up to 4e-6 in a score, measured): so the same numbers live and from a file, to the bit."""
    t = t.contiguous()
    return t if t.data_ptr() % 64 == 0 else t.clone()


def _whole(value: object, what: str, low: int, high: int | None = None) -> int:
    """``value`` as an int in [low, high) (high None: no upper end), else a RegionError naming the range (a float,
    a bool or a string is not a position, and a negative one would silently count from the end)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value >= high):
        where = f"in [{low}, {high})" if high is not None else f"≥ {low}"
        raise RegionError(f"{what} must be a whole number {where}, got {value!r}")
    return value


def _range(r: range | tuple[int, int] | None, size: int, what: str) -> range:
    if r is None:
        return range(size)
    if isinstance(r, tuple):
        if len(r) != 2 or any(isinstance(x, bool) or not isinstance(x, int) for x in r):
            raise RegionError(f"{what} must be a non-empty range inside [0, {size}) of whole numbers, got {r!r}")
        r = range(*r)
    if not isinstance(r, range) or r.step != 1 or not 0 <= r.start < r.stop <= size:
        raise RegionError(f"{what} must be a non-empty range inside [0, {size}), got {r!r}")
    return r


def _heads(heads: object, H: int) -> list[int]:
    """The listed heads, each a whole number in [0, H), each once. A recomputed region gathers Q and K for every
    listed head (and sweeps each over all t keys for its rows' normaliser), so a head listed twice costs as much as
    a second head: a million copies of head 0 asked for gigabytes while the answer's cells passed the cap."""
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
        raise RegionError(f"heads must be a list of whole numbers in [0, {H}), got {heads!r}")
    listed: list[int] = []
    seen: set[int] = set()
    for h in heads:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < H:
            raise RegionError(f"heads must lie in [0, {H}) as whole numbers, got {h!r}")
        if h in seen:
            raise RegionError(f"head {h} is listed twice: each head is asked for once")
        seen.add(h)
        listed.append(h)
    if not listed:
        raise RegionError(f"heads must lie in [0, {H}), got an empty list")
    return listed


def attention_region(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None, *,
                     rows: range | tuple[int, int] | None = None, cols: range | tuple[int, int] | None = None,
                     heads: list[int] | None = None) -> torch.Tensor:
    """The exact values of an attention record (``hook_pattern``, ``hook_attn_scores``, …) over query ``rows``
    × key ``cols`` for ``heads`` (default: all): ``[B, h, r, c]`` (``[B|1, 1, r, c]`` for the mask). Sliced from
    a kept value, or recomputed from Q and K for a derived record; None for an eager record whose value is gone."""
    rec = _record(trace, name_or_record, step)
    if len(rec.shape) != 4:
        raise RegionError(f"{rec.name} is not an attention record of shape [B, H, n, t]")
    B, H, n, t = rec.shape
    rows, cols = _range(rows, n, "rows"), _range(cols, t, "cols")
    heads = list(range(H)) if heads is None else _heads(heads, H)
    if B * len(heads) * len(rows) * len(cols) > MAX_REGION_CELLS:
        raise RegionError(f"a region of {B * len(heads) * len(rows) * len(cols):,} cells is more than "
                          f"{MAX_REGION_CELLS:,}: ask for fewer rows, columns or heads")
    derived = trace.log.derived(rec.index)
    if derived is None:
        value = trace.value(rec)
        if value is None:
            return None  # type: ignore[return-value]
        if H == 1:
            heads = [0]
        return value[:, heads, rows.start:rows.stop, cols.start:cols.stop]
    src = attention_source(trace, rec)
    norm = None
    if src.stage == "pattern" and B == 1:
        known = [_known_norm(trace, rec, 0, h) for h in heads]
        if all(x is not None for x in known):  # every row's max and sum already computed: read only these cells
            norm = RowNorm(torch.cat([x.m for x in known], 1)[..., rows.start:rows.stop],  # type: ignore[union-attr]
                           torch.cat([x.total for x in known], 1)[..., rows.start:rows.stop],  # type: ignore[union-attr]
                           None if known[0].empty is None else known[0].empty[:, rows.start:rows.stop])  # type: ignore[union-attr]
    return region(src.q, src.k, src.spec, src.stage, None if src.stage == "mask" else heads, rows, cols, norm=norm)


@dataclass(frozen=True)
class Overview:
    """A head's pattern pooled into blocks: ``mean[i, j]`` / ``peak[i, j]`` are the mean / max weight over query
    rows ``row_edges[i] … row_edges[i+1]−1`` × keys ``col_edges[j] … col_edges[j+1]−1`` (masked cells count 0)."""

    mean: torch.Tensor  # [R, C]
    peak: torch.Tensor  # [R, C]
    row_edges: list[int]
    col_edges: list[int]

    @property
    def exact(self) -> bool:
        """Every block is one cell: the values are the pattern itself."""
        return all(b - a == 1 for a, b in zip(self.row_edges, self.row_edges[1:])) and \
            all(b - a == 1 for a, b in zip(self.col_edges, self.col_edges[1:]))

    def label(self) -> str:
        """How to read a cell, from the block sizes."""
        if self.exact:
            return "exact weights (one cell per query × key)"
        rh = max(b - a for a, b in zip(self.row_edges, self.row_edges[1:]))
        cw = max(b - a for a, b in zip(self.col_edges, self.col_edges[1:]))
        return f"block mean / block max over up to {rh:,} queries × {cw:,} keys per cell"


def attention_overview(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None, *, head: int = 0,
                       batch: int = 0, bins: int = 128, rows: range | tuple[int, int] | None = None,
                       cols: range | tuple[int, int] | None = None) -> Overview:
    """One head's pattern over ``rows`` × ``cols`` (default: all) in ≤ ``bins`` × ``bins`` blocks, computed tile
    by tile for a derived record (``model.gpt.block_pool``), pooled from the value for a kept one."""
    rec = _record(trace, name_or_record, step)
    if hook_of(rec.name) != "hook_pattern":
        raise RegionError(f"an overview is of attention weights (hook_pattern), not {rec.name}")
    B, H, n, t = rec.shape
    _whole(head, f"head (the record has {H})", 0, H)
    _whole(batch, f"batch (the record has {B} sequences)", 0, B)
    _whole(bins, "bins", 1)
    rows, cols = _range(rows, n, "rows"), _range(cols, t, "cols")
    if trace.log.derived(rec.index) is not None:
        return _memo(trace, ("overview", rec.index, head, batch, bins, rows, cols),
                     lambda: _derived_overview(trace, rec, head, batch, bins, rows, cols))
    value = trace.value(rec)
    if value is None:
        raise RegionError(f"{rec.name} was computed eagerly and its value is no longer kept")
    r_edges = [rows.start + e for e in grid_edges(len(rows), bins)]
    c_edges = [cols.start + e for e in grid_edges(len(cols), bins)]
    x = value[batch, head].double()
    mean = torch.stack([torch.stack([x[a:b, c:d].mean() for c, d in zip(c_edges, c_edges[1:])])
                        for a, b in zip(r_edges, r_edges[1:])])
    peak = torch.stack([torch.stack([x[a:b, c:d].max() for c, d in zip(c_edges, c_edges[1:])])
                        for a, b in zip(r_edges, r_edges[1:])])
    return Overview(mean.float(), peak.float(), r_edges, c_edges)


def _derived_overview(trace: Trace, rec: TensorRecord, head: int, batch: int, bins: int, rows: range,
                      cols: range) -> Overview:
    """One pass over the head's QKᵀ (``model.gpt.pool_pattern``); the rows' normaliser it computes on the way is
    remembered, so a later overview of a zoomed range, a region or a query row of this head reads only its cells."""
    src = attention_source(trace, rec)
    norm = _known_norm(trace, rec, batch, head)
    whole_rows = rows == range(rec.shape[2])
    pooled = pool_pattern(src.q, src.k, src.spec, [head], batch, bins, rows, cols, norm=norm)
    if pooled.norm is not None and whole_rows:
        _remember_norm(trace, rec, batch, head, pooled.norm)
    return Overview(pooled.mean[0], pooled.peak[0], pooled.row_edges, pooled.col_edges)


def derived_digest(trace: Trace, rec: TensorRecord, side: int = 128) -> torch.Tensor | None:
    """``[B, H, R, C]`` block means (R, C ≤ ``side``) of a derived pattern, every sequence and head, tile by tile:
    what the views draw where a kept pattern would be pooled. None when Q or K is not kept."""
    B, H, n, t = rec.shape
    try:
        src = attention_source(trace, rec)
    except RegionError:
        return None
    means = []
    for b in range(B):  # every head of a sequence in one pass over QKᵀ
        pooled = pool_pattern(src.q, src.k, src.spec, list(range(H)), b, side)
        if pooled.norm is not None:
            for h in range(H):
                _remember_norm(trace, rec, b, h, pooled.norm.heads([h]))
        means.append(pooled.mean)
    return torch.stack(means)


def pattern_digest(trace: Trace, rec: TensorRecord) -> torch.Tensor | None:
    """The pooled summary of an attention-weights record: the one kept when its values were evicted
    (``TraceLog.digest``); for a pattern a fused attention left derived, the same summary (``[B, H, ≤128, ≤128]``
    block means) computed tile by tile from Q and K the first time it is asked for and kept in the trace's one
    bounded memo; None when there is neither (Q or K not kept, or not an attention record)."""
    kept = trace.log.digest(rec.index)
    if kept is not None or trace.log.derived(rec.index) is None or hook_of(rec.name) != "hook_pattern":
        return kept
    return _memo(trace, ("digest", rec.index), lambda: derived_digest(trace, rec))


def query_row(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None, *, row: int, head: int = 0,
              batch: int = 0, top: int = 10) -> tuple[torch.Tensor, list[tuple[int, float]]]:
    """One query row's exact weights over all t keys ``[t]`` and its ``top`` keys as (key, weight), heaviest
    first."""
    rec = _record(trace, name_or_record, step)
    if len(rec.shape) != 4:
        raise RegionError(f"{rec.name} is not an attention record of shape [B, H, n, t]")
    B, H, n, t = rec.shape
    _whole(row, "row", 0, n)
    _whole(head, f"head (the record has {H})", 0, H)
    _whole(batch, f"batch (the record has {B} sequences)", 0, B)
    _whole(top, "top", 1)
    w = attention_region(trace, rec, rows=(row, row + 1), cols=(0, t), heads=[head])
    if w is None:
        raise RegionError(f"{rec.name}'s value is no longer kept")
    weights = w[batch, 0, 0].float()
    values, keys = weights.topk(min(top, t))
    return weights, [(int(k), float(v)) for k, v in zip(keys, values)]


def check_output(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None) -> float:
    """max |A·V − O| over the layer: the recomputed pattern times the recorded V against the output the fused
    kernel produced (``hook_z``) — that the pattern shown is the attention the model ran."""
    src = attention_source(trace, name_or_record, step)
    if src.v is None or src.z is None:
        raise RegionError("V or O of this layer is not kept, so A·V = O cannot be checked")
    return float((pattern_times_v(src.q, src.k, src.v, src.spec) - src.z.double()).abs().max())


@dataclass(frozen=True)
class HeadStatistics:
    """Long-context statistics of one head, over every query row: mean row entropy (nats), the mean weight on
    the first ``sink`` key slots, the mean weight by distance (query slot − key slot) in powers of two, and
    the keys receiving the most weight summed over rows."""

    head: int
    entropy: float
    sink_mass: float
    distance_edges: list[int]  # bucket b holds distances [edges[b], edges[b+1])
    distance_mass: list[float]  # mean over rows of the weight in each bucket (sums to 1)
    top_keys: list[tuple[int, float]]  # (key slot, weight summed over rows), heaviest first


def head_statistics(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None, *, batch: int = 0,
                    sink: int = 4, top: int = 10) -> list[HeadStatistics]:
    """``HeadStatistics`` for every head of one pattern record. A derived record is read in one pass over QKᵀ, all
    heads together, by chunks of whole rows (``model.gpt.ScoreSweep``): with ``e = exp(s − m)`` and the row's
    ``Σ = Σ_j e_j``, the weights are ``e/Σ``, so each statistic is a sum over e weighed per row by 1/Σ — the
    entropy ``log Σ − Σ_j e_j (s_j − m) / Σ``, the column sums one ``(1/Σ)ᵀ·e`` product, the mass by distance
    from each row's running sum along the keys. A kept value is read the same way, chunk by chunk."""
    rec = _record(trace, name_or_record, step)
    if hook_of(rec.name) != "hook_pattern":
        raise RegionError(f"statistics are of attention weights (hook_pattern), not {rec.name}")
    B = rec.shape[0]
    _whole(batch, f"batch (the record has {B} sequences)", 0, B)
    _whole(sink, "sink (key slots counted as the sink)", 0)
    _whole(top, "top", 1)
    return _memo(trace, ("statistics", rec.index, batch, sink, top),
                 lambda: _head_statistics(trace, rec, batch, sink, top))


def _head_statistics(trace: Trace, rec: TensorRecord, batch: int, sink: int, top: int) -> list[HeadStatistics]:
    B, H, n, t = rec.shape
    past = t - n
    src = attention_source(trace, rec) if trace.log.derived(rec.index) is not None else None
    value = trace.value(rec) if src is None else None
    if src is None and value is None:
        raise RegionError(f"{rec.name} was computed eagerly and its value is no longer kept")
    edges = [0] + [2 ** b for b in range(max(1, math.ceil(math.log2(t)) + 1))]  # [0,1), [1,2), [2,4), …
    edge_t = torch.tensor(edges)
    entropy = torch.zeros(H, dtype=torch.float64)
    sink_mass = torch.zeros(H, dtype=torch.float64)
    at_least = torch.zeros(H, len(edges), dtype=torch.float64)  # weight at distance ≥ edges[e], summed over rows
    column = torch.zeros(H, t, dtype=torch.float64)

    def add(e: torch.Tensor, inv: torch.Tensor, rows: range, cols: range, scratch: torch.Tensor) -> None:
        """Weights ``e·inv`` (``e`` [H, r, c], ``inv`` [H, r]) of rows × cols into the sums."""
        if cols.start < sink:
            sink_mass.add_((e[..., :sink - cols.start].sum(-1) * inv).sum(-1, dtype=torch.float64))
        column[:, cols.start:cols.stop] += torch.bmm(inv[:, None, :], e)[:, 0].double()  # Σ_i e_ij / Σ_i
        running = torch.cumsum(e, -1, out=scratch)  # [H, r, c]
        q_pos = past + torch.arange(rows.start, rows.stop)  # [r]
        last = q_pos[:, None] - edge_t[None, :] - cols.start  # [r, E]: last column at distance ≥ edge
        got = running.gather(-1, last.clamp(0, len(cols) - 1)[None].expand(H, -1, -1)) * inv[..., None]
        at_least.add_(torch.where((last >= 0)[None], got, 0.0).sum(1, dtype=torch.float64))

    if src is not None:
        q, k, spec = src.q[batch:batch + 1], src.k[batch:batch + 1] if src.k.size(0) > 1 else src.k, \
            _one(src.spec, batch)
        sweep = ScoreSweep(q, k, spec, list(range(H)))
        m_all = torch.empty(1, H, n, dtype=torch.float32)
        total_all = torch.empty(1, H, n, dtype=torch.float64)
        spare = torch.empty(SWEEP_CELLS, dtype=torch.float32)
        for rows in sweep.chunks(range(n)):
            cols = sweep.visible(rows)
            y = sweep.scores(rows, cols)[0]  # [H, r, c] masked scores
            m = y.amax(-1)  # [H, r]
            y.sub_(m[..., None])  # s − m, −∞ where masked
            if spare.numel() < y.numel():
                spare = torch.empty(y.numel(), dtype=torch.float32)
            e = torch.exp(y, out=spare[:y.numel()].view(y.shape))  # [H, r, c]
            row_total = e.sum(-1)  # [H, r], the eager softmax's sum
            inv = 1.0 / row_total
            # −Σ p log p = log Σ − Σ_j e_j (s_j − m) / Σ  (a masked key: e = 0, its −∞ clamped so 0·x = 0)
            e_times_y = torch.mul(e, y.clamp_(min=torch.finfo(y.dtype).min), out=y).sum(-1)
            entropy.add_((torch.log(row_total.double()) - e_times_y.double() * inv.double()).sum(-1))
            add(e, inv, rows, cols, y)
            m_all[0, :, rows.start:rows.stop] = m
            total_all[0, :, rows.start:rows.stop] = row_total
        empty = spec.sees_nothing(range(n))
        for h in range(H):
            _remember_norm(trace, rec, batch, h, RowNorm(m_all[:, h:h + 1], total_all[:, h:h + 1], empty))
    else:
        assert value is not None
        step_rows = max(1, SWEEP_CELLS // (H * t))
        for r0 in range(0, n, step_rows):
            rows = range(r0, min(n, r0 + step_rows))
            p = value[batch, :, rows.start:rows.stop].float()  # [H, r, t]
            entropy.sub_(torch.special.xlogy(p, p).sum((1, 2), dtype=torch.float64))
            add(p, torch.ones(p.shape[:2]), rows, range(t), torch.empty_like(p))
    out = []
    for h in range(H):
        values, keys = column[h].topk(min(top, t))
        by_distance = at_least[h, :-1] - at_least[h, 1:]
        out.append(HeadStatistics(h, float(entropy[h] / n), float(sink_mass[h] / n), edges,
                                  [float(x) for x in by_distance / n],
                                  [(int(kk), float(v)) for kk, v in zip(keys, values)]))
    return out


def _one(spec: MaskSpec, batch: int) -> MaskSpec:
    if spec.key_is_token is None:
        return spec
    return MaskSpec(n=spec.n, t=spec.t, scale=spec.scale, window=spec.window,
                    key_is_token=spec.key_is_token[batch:batch + 1], empty_rows=spec.empty_rows, softcap=spec.softcap)


__all__ = ["AttentionSource", "HeadStatistics", "MAX_REGION_CELLS", "Overview", "RegionError", "attention_overview",
           "attention_region", "attention_source", "check_output", "head_statistics", "is_derived", "query_row"]
