"""Regions of an attention record at any length: exact values of rows × columns, a tile-by-tile overview,
one query row, per-head statistics — without ever holding the whole ``[B,H,n,t]``.

A record a fused attention announced (``TraceLog.derived``) has no value: its region is recomputed from the
same layer's Q (``hook_rot_q`` where the model rotates, else ``hook_q``) and K (``hook_k_all``) records of the
same step and the record's mask description (``model.gpt``'s long attention). A record the eager path kept is
sliced. Either way the caller asks the same question and gets the same numbers (to float32 rounding).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from model.gpt import (
    KEY_TILE,
    MaskSpec,
    block_pool,
    grid_edges,
    pattern_from,
    pattern_times_v,
    region,
    row_norm,
)
from tracer.reading._trace import Trace, hook_of, record_name
from tracer.storage.records import TensorRecord

STATS_BLOCK_CELLS = 1 << 20  # cells of one tile of the statistics' sweep, all heads together
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


def is_derived(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None) -> bool:
    """Whether a record's values are recomputed on demand (a fused attention's n × t stage)."""
    return trace.log.derived(_record(trace, name_or_record, step).index) is not None


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
    return AttentionSource(stage, spec, q, k, get("hook_v_all"), get("hook_z"))


def _range(r: range | tuple[int, int] | None, size: int, what: str) -> range:
    if r is None:
        return range(size)
    if isinstance(r, tuple):
        r = range(*r)
    if not isinstance(r, range) or r.step != 1 or not 0 <= r.start < r.stop <= size:
        raise RegionError(f"{what} must be a non-empty range inside [0, {size}), got {r!r}")
    return r


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
    heads = list(range(H)) if heads is None else list(heads)
    if not heads or any(not 0 <= h < H for h in heads):
        raise RegionError(f"heads must lie in [0, {H}), got {heads}")
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
    return region(src.q, src.k, src.spec, src.stage, None if src.stage == "mask" else heads, rows, cols)


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
    if not 0 <= head < H or not 0 <= batch < B:
        raise RegionError(f"head {head} / sequence {batch} outside the record's {H} heads / {B} sequences")
    rows, cols = _range(rows, n, "rows"), _range(cols, t, "cols")
    if trace.log.derived(rec.index) is not None:
        src = attention_source(trace, rec)
        mean, peak, r_edges, c_edges = block_pool(src.q, src.k, src.spec, head, batch, bins, rows, cols)
        return Overview(mean, peak, r_edges, c_edges)
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


def derived_digest(trace: Trace, rec: TensorRecord, side: int = 128) -> torch.Tensor | None:
    """``[B, H, R, C]`` block means (R, C ≤ ``side``) of a derived pattern, every sequence and head, tile by tile:
    what the views draw where a kept pattern would be pooled. None when Q or K is not kept."""
    B, H, n, t = rec.shape
    try:
        src = attention_source(trace, rec)
    except RegionError:
        return None
    blocks = [[block_pool(src.q, src.k, src.spec, h, b, side)[0] for h in range(H)] for b in range(B)]
    return torch.stack([torch.stack(row) for row in blocks])


def query_row(trace: Trace, name_or_record: str | TensorRecord, step: int | None = None, *, row: int, head: int = 0,
              batch: int = 0, top: int = 10) -> tuple[torch.Tensor, list[tuple[int, float]]]:
    """One query row's exact weights over all t keys ``[t]`` and its ``top`` keys as (key, weight), heaviest
    first."""
    rec = _record(trace, name_or_record, step)
    t = rec.shape[-1]
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
    """``HeadStatistics`` for every head of one pattern record, one row block and key tile at a time (for a
    derived record nothing of n × t is held; a kept value is read the same way). Entropy per row is
    ``lse − Σ_j p_j·s_j``; the mass by distance comes from each tile's running sums along the keys."""
    rec = _record(trace, name_or_record, step)
    if hook_of(rec.name) != "hook_pattern":
        raise RegionError(f"statistics are of attention weights (hook_pattern), not {rec.name}")
    B, H, n, t = rec.shape
    if not 0 <= batch < B:
        raise RegionError(f"sequence {batch} outside the record's {B}")
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
    if src is not None:
        q, k, spec = src.q[batch:batch + 1], src.k[batch:batch + 1] if src.k.size(0) > 1 else src.k, \
            _one(src.spec, batch)
    step_rows = max(1, STATS_BLOCK_CELLS // (KEY_TILE * H))
    for r0 in range(0, n, step_rows):
        rows = range(r0, min(n, r0 + step_rows))
        q_pos = past + torch.arange(rows.start, rows.stop)  # [r]
        norm = row_norm(q, k, spec, None, rows) if src is not None else None
        first, end = (0, t) if norm is None or norm.empty is not None else spec.key_range(rows)
        for c0 in range(first, end, KEY_TILE):
            cols = range(c0, min(end, c0 + KEY_TILE))
            if src is not None and norm is not None:
                x = region(q, k, spec, "masked_scores", None, rows, cols)[0].float()  # [H, r, c]
                p = pattern_from(x[None], norm, spec.t)[0]  # one QKᵀ per tile, not two
                entropy -= torch.where(p > 0, p * x, 0.0).sum((1, 2), dtype=torch.float64)
            else:
                assert value is not None
                p = value[batch, :, rows.start:rows.stop, cols.start:cols.stop].float()
                entropy -= torch.where(p > 0, p * torch.log(p), 0.0).sum((1, 2), dtype=torch.float64)
            if cols.start < sink:
                sink_mass += p[:, :, :sink - cols.start].sum((1, 2), dtype=torch.float64)
            running = p.cumsum(-1)  # [H, r, c]
            last = q_pos[:, None] - edge_t[None, :] - cols.start  # [r, E]: last column at distance ≥ edge
            inside = last >= 0
            got = running.gather(-1, last.clamp(0, len(cols) - 1)[None].expand(H, -1, -1))
            at_least += torch.where(inside[None], got, 0.0).sum(1, dtype=torch.float64)
            column[:, cols.start:cols.stop] += p.sum(1, dtype=torch.float64)
        if norm is not None:  # −Σ p log p = lse − Σ p·s (a row seeing nothing: log t)
            lse = norm.lse[0]
            entropy += torch.where(torch.isfinite(lse), lse, math.log(t)).sum(-1)
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
