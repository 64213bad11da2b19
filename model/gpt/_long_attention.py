"""Attention at any length: the fused kernel runs the model, and any region of QKᵀ, the masked scores or
the pattern is recomputed exactly, tile by tile, from Q, K and a compact description of the mask.

FlashAttention (Dao et al. 2022, arXiv:2205.14135): a row's softmax needs only its normaliser, the log-sum-exp
``lse_i = log Σ_j exp(s_ij)`` over the keys the row may see (kept as the row's max m and Σ exp(s − m)); then any
cell of the pattern is ``A_ij = exp(s_ij − m_i) / Σ_i`` — the same number the eager softmax gives. The readers
(``ScoreSweep``) compute it in chunks of whole rows, a few query rows × every key they see (≤ ``SWEEP_CELLS``),
one BLAS call each: the chunk's own max and sum, no running rescale, never n × t.

* ``MaskSpec`` describes the mask: causal with ``past`` cached keys, a sliding window, which key slots are
  padding (``key_is_token`` ``[B, t]``), what a query that may see no key does, the scale and the soft-cap.
  It builds the additive mask of any block of rows × columns, exactly as ``model.gpt.additive_mask`` (our
  GPT) or transformers' eager mask (``model.sources._hf_attention.traced_mask``) would write those cells.
* ``fused_attention`` is the forward: PyTorch's ``scaled_dot_product_attention`` (one call when the mask is
  plain causal; otherwise over blocks of query rows with that block's mask, so at most ``ROW_BLOCK_ELEMENTS``
  mask cells exist at once). A soft-capped model (Gemma 2) runs the eager formula on the same row blocks.
* ``region``, ``row_norm``, ``pool_pattern`` (the overview: block mean and max), ``pattern_times_v`` read what
  the kernel computed.

Shape legend as in model/gpt/_gpt.py: B batch, H query heads, G key/value heads, n new positions (queries),
t key positions (cache included), d_head.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

AttentionMode = Literal["auto", "eager", "fused"]
ATTENTION_MODES = ("auto", "eager", "fused")
STAGES = ("qk", "scores", "softcapped", "mask", "masked_scores", "pattern")  # the [B,H,n,t] hook points
EmptyRows = Literal["self", "uniform"]
# auto: a listened layer runs fused when one [B,H,n,t] tensor would hold at least this many elements — 0: at every
# length (issue 53). Materialising QKᵀ, the scaled and masked scores and the pattern during the forward was most of a
# values trace's cost (×1.5–1.7 the untraced forward at 1,024 tokens); a tracer now keeps Q and K, and its readers
# recompute those stages exactly when asked (tracer.reading's Trace.value, tracer.reading._regions)
DEFAULT_THRESHOLD = 0
# a derived [B,H,n,t] record of at most this many elements is handed whole to a reader that asks for its value (64 MiB
# float32: the size up to which the eager path used to hold every stage, GPT-2 small up to 1,182 tokens); a larger
# one is read by region, overview or digest, as a long context always was
WHOLE_DERIVED = 1 << 24
ROW_BLOCK_ELEMENTS = 1 << 22  # mask or score cells per row block of the fused forward / the readers (16 MiB)
# score cells the readers hold at once (16 MiB float32): a chunk of query rows × every key they may see; large
# enough that QKᵀ is one efficient BLAS call per chunk, small enough for the memory probe's bound
SWEEP_CELLS = 1 << 22


@dataclass
class _Settings:
    mode: AttentionMode = "auto"
    threshold: int = DEFAULT_THRESHOLD


_settings = _Settings()


def set_attention_path(mode: AttentionMode, threshold: int | None = None) -> None:
    """How every attention layer runs, traced or not.

    "auto": fused when one ``[B,H,n,t]`` tensor holds at least ``threshold`` elements or when nothing reads or
    writes the layer's n × t hook points (an untraced forward), else eager (every hook point holds a real
    tensor); "eager": always eager; "fused": always fused. Fused, the scores, the mask
    and the pattern are derived records for a tracer, recomputed on demand. A forward hook on one of those
    hook points (an intervention that writes the pattern or the scores) always makes its layer eager."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0):
        raise ValueError(f"threshold must be a number of elements ≥ 0, got {threshold!r}")
    _settings.mode = mode
    if threshold is not None:
        _settings.threshold = threshold


def attention_path_settings() -> tuple[AttentionMode, int]:
    return _settings.mode, _settings.threshold


@contextmanager
def attention_path(mode: AttentionMode, threshold: int | None = None) -> Iterator[None]:
    """``set_attention_path`` for the duration of a block (process-wide), then the previous settings."""
    before = (_settings.mode, _settings.threshold)
    set_attention_path(mode, threshold)
    try:
        yield
    finally:
        _settings.mode, _settings.threshold = before


def choose_path(writers: bool, elements: int, listened: bool = True) -> Literal["eager", "fused"]:
    """Eager or fused for one layer: ``writers`` (forward hooks on an n × t hook point: they may change it),
    ``elements`` of one ``[B,H,n,t]`` tensor, ``listened`` (a tracer's taps read an n × t hook point).

    Under "auto" a layer nobody reads or writes an n × t tensor of runs fused at every length: nothing needs its
    scores or pattern, and the fused kernel is the faster (×1.9 at 1,024 tokens of a 4-head model,
    docs/benchmarks.md). A listened layer follows the threshold — 0 by default, so a traced forward runs fused too
    and its logits equal the untraced forward's bit for bit; a threshold above 0 keeps eager hook points below it
    (then the logits equal the untraced forward's to float32 rounding)."""
    if writers or _settings.mode == "eager":
        return "eager"
    if _settings.mode == "fused" or not listened:
        return "fused"
    return "fused" if elements >= _settings.threshold else "eager"


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask and the scores' arithmetic, described without any ``[n, t]`` tensor.

    Query i (0 … n−1) sits at key slot ``past + i`` (``past = t − n``); it may see key slot j when
    j ≤ past + i, j > past + i − window (a sliding window), and key j is a token (not padding). A query
    that sees no key at all: ``empty_rows="self"`` lets a padding query see its own slot (model/gpt/_gpt.py);
    ``"uniform"`` leaves the whole row at ``finfo.min``, so its softmax is 1/t everywhere (transformers'
    eager mask, model/sources/_hf_attention.py). Scores are ``QKᵀ·scale``, then ``c·tanh(·/c)`` with a soft-cap c."""

    n: int
    t: int
    scale: float | None  # None: 1/√d_head, divided as model/gpt/_gpt.py's attention() does
    window: int | None = None
    key_is_token: torch.Tensor | None = None  # [B, t] bool, False = padding; None: every slot is a token
    empty_rows: EmptyRows = "self"
    softcap: float | None = None
    _full: dict = field(default_factory=dict, compare=False, repr=False)  # the eager path's mask, built once

    def __post_init__(self) -> None:
        if not 0 < self.n <= self.t:
            raise ValueError(f"MaskSpec needs 0 < n ≤ t, got n = {self.n}, t = {self.t}")
        if self.key_is_token is not None and (self.key_is_token.dim() != 2 or self.key_is_token.shape[1] != self.t):
            raise ValueError(f"key_is_token must be [B, t = {self.t}], got {list(self.key_is_token.shape)}")
        if self.empty_rows not in ("self", "uniform"):
            raise ValueError(f"empty_rows must be 'self' or 'uniform', got {self.empty_rows!r}")

    @property
    def past(self) -> int:
        return self.t - self.n

    @property
    def batch(self) -> int:
        """The mask's batch dimension: B with padding, else 1 (it broadcasts)."""
        return self.key_is_token.shape[0] if self.key_is_token is not None else 1

    @property
    def plain_causal(self) -> bool:
        """Lower-triangular from the first key, nothing else: SDPA's ``is_causal`` (top-left aligned)."""
        return self.past == 0 and self.window is None and self.key_is_token is None

    def key_range(self, rows: range) -> tuple[int, int]:
        """[first, end) of the key slots any query of ``rows`` may see (padding queries' own slots included)."""
        end = self.past + rows.stop
        first = 0 if self.window is None else max(0, self.past + rows.start - self.window + 1)
        return first, end

    def allowed(self, rows: range, cols: range, device: torch.device | None = None) -> torch.Tensor:
        """``[B|1, r, c]`` bool: which cells of rows × cols are visible (before the empty-row rule)."""
        q_pos = torch.arange(self.past + rows.start, self.past + rows.stop, device=device)[:, None]  # [r, 1]
        k_pos = torch.arange(cols.start, cols.stop, device=device)[None, :]  # [1, c]
        ok = k_pos <= q_pos
        if self.window is not None:
            ok = ok & (k_pos > q_pos - self.window)
        if self.key_is_token is None:
            return ok[None]
        kit = self.key_is_token.to(device)
        ok = ok[None] & kit[:, None, cols.start:cols.stop]  # [B, r, c]
        if self.empty_rows == "self":  # a padding query sees itself
            own = (k_pos == q_pos)[None] & ~kit[:, self.past + rows.start:self.past + rows.stop, None]
            ok = ok | own
        return ok

    def all_visible(self, rows: range, cols: range) -> bool:
        """Whether every cell of rows × cols is visible (a tile wholly below the diagonal, inside the window,
        no padding): its mask is 0 everywhere and need not be built."""
        if self.key_is_token is not None or cols.stop - 1 > self.past + rows.start:
            return False
        return self.window is None or cols.start > self.past + rows.stop - 1 - self.window

    def sees_nothing(self, rows: range, device: torch.device | None = None) -> torch.Tensor | None:
        """``[B, r]`` bool: under ``empty_rows="uniform"``, the rows that may see no key; None if there are none."""
        if self.empty_rows != "uniform" or self.key_is_token is None:
            return None
        tokens = torch.cat([torch.zeros(self.batch, 1, dtype=torch.int64),
                            self.key_is_token.to("cpu", torch.int64).cumsum(1)], 1)  # [B, t+1]: prefix counts
        q_pos = torch.arange(self.past + rows.start, self.past + rows.stop)
        lo = q_pos - self.window + 1 if self.window is not None else torch.zeros_like(q_pos)
        seen = tokens[:, q_pos + 1] - tokens[:, lo.clamp(min=0)]  # [B, r] tokens within the row's keys
        empty = seen == 0
        return empty.to(device) if bool(empty.any()) else None

    def additive(self, rows: range, cols: range, dtype: torch.dtype,
                 device: torch.device | None = None) -> torch.Tensor:
        """``[B|1, 1, r, c]``: 0 where visible, −∞ where hidden; a row that sees nothing under "uniform" is
        ``finfo.min`` throughout (transformers' value)."""
        ok = self.allowed(rows, cols, device)
        mask = torch.zeros(ok.shape, dtype=dtype, device=device).masked_fill_(~ok, float("-inf"))
        empty = self.sees_nothing(rows, device)
        if empty is not None:
            mask = mask.masked_fill(empty[:, :, None], torch.finfo(dtype).min)
        return mask.unsqueeze(1)

    def full_additive(self, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """The whole ``[B|1, 1, n, t]`` mask, for the eager path (built once per forward, shared by layers)."""
        key = (dtype, device)
        if key not in self._full:
            self._full[key] = self.additive(range(self.n), range(self.t), dtype, device)
        return self._full[key]

    def use_mask(self, mask: torch.Tensor) -> None:
        """Give the eager path a mask already built (transformers' own, which this description matches)."""
        self._full[(mask.dtype, mask.device)] = mask

    def describe(self) -> str:
        parts = [f"causal over {self.t:,} keys ({self.past:,} cached)"]
        if self.window is not None:
            parts.append(f"sliding window {self.window:,}")
        if self.key_is_token is not None:
            parts.append(f"{int((~self.key_is_token).sum()):,} padding slot(s)")
        parts.append("scale 1/√d_head" if self.scale is None else f"scale {self.scale:.6g}")
        if self.softcap is not None:
            parts.append(f"soft-cap {self.softcap:g}")
        return ", ".join(parts)

    def to_json(self) -> dict:
        """Plain JSON values (the key padding as run lengths per sequence, alternating token / padding)."""
        runs = None
        if self.key_is_token is not None:
            runs = [_run_lengths(row) for row in self.key_is_token.to("cpu", torch.bool)]
        return dict(n=self.n, t=self.t, scale=self.scale, window=self.window, key_is_token_runs=runs,
                    empty_rows=self.empty_rows, softcap=self.softcap)

    @classmethod
    def from_json(cls, data: object) -> MaskSpec:
        if not isinstance(data, dict):
            raise ValueError(f"a mask description must be a JSON object, got {type(data).__name__}")
        try:
            n, t, scale = int(data["n"]), int(data["t"]), data["scale"]
            window = data.get("window")
            softcap = data.get("softcap")
            runs = data.get("key_is_token_runs")
            key_is_token = None
            if runs is not None:
                key_is_token = torch.stack([_from_runs(r, t) for r in runs])
            return cls(n=n, t=t, scale=float(scale) if scale is not None else None,
                       window=int(window) if window is not None else None,
                       key_is_token=key_is_token, empty_rows=data.get("empty_rows", "self"),
                       softcap=float(softcap) if softcap is not None else None)
        except (KeyError, TypeError) as e:
            raise ValueError(f"a mask description is missing or has a wrong field: {e}") from None


def _run_lengths(row: torch.Tensor) -> list[int]:
    """[True × a, False × b, True × c, …] → [a, b, c, …] (the first run counts tokens; may be 0)."""
    values = row.tolist()
    runs, current, count = [], True, 0
    for v in values:
        if v == current:
            count += 1
        else:
            runs.append(count)
            current, count = v, 1
    runs.append(count)
    return runs


def _from_runs(runs: object, t: int) -> torch.Tensor:
    if not isinstance(runs, list) or not all(isinstance(r, int) and r >= 0 for r in runs) or sum(runs) != t:
        raise ValueError(f"key padding runs must be non-negative integers summing to t = {t}")
    row = torch.ones(t, dtype=torch.bool)
    start = 0
    for i, r in enumerate(runs):
        if i % 2:
            row[start:start + r] = False
        start += r
    return row


# ---- the forward -------------------------------------------------------------------------------------------


def _row_blocks(n: int, width: int, heads: int = 1) -> Iterator[range]:
    step = max(1, ROW_BLOCK_ELEMENTS // max(1, width * heads))
    for start in range(0, n, step):
        yield range(start, min(n, start + step))


def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """``softmax(QKᵀ·scale + M)·V`` ``[B,H,n,d_v]`` without an ``[n, t]`` tensor: q ``[B,H,n,d_head]``,
    k ``[B,G,t,d_head]``, v ``[B,G,t,d_v]`` (G divides H, Hugging Face's ``repeat_kv`` order)."""
    gqa = k.size(-3) != q.size(-3)
    n = q.size(-2)
    if spec.softcap is None and spec.plain_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale, enable_gqa=gqa)
    if spec.softcap is None and spec.all_visible(range(n), range(spec.t)):  # a decode step reading every key
        return F.scaled_dot_product_attention(q, k, v, scale=spec.scale, enable_gqa=gqa)
    out = q.new_empty(*q.shape[:-1], v.size(-1))  # [B,H,n,d_v]
    for rows in _row_blocks(n, spec.t, q.size(-3) if spec.softcap is not None else 1):
        first, end = spec.key_range(rows)
        if spec.empty_rows == "uniform" and spec.sees_nothing(rows) is not None:
            first, end = 0, spec.t  # an empty row reads every key (1/t each)
        cols = range(first, end)
        q_rows = q[..., rows.start:rows.stop, :]
        k_cols, v_cols = k[..., first:end, :], v[..., first:end, :]
        mask = spec.additive(rows, cols, q.dtype, q.device)  # [B|1,1,r,c]
        if spec.softcap is None:
            out[..., rows.start:rows.stop, :] = F.scaled_dot_product_attention(
                q_rows, k_cols, v_cols, attn_mask=mask, scale=spec.scale, enable_gqa=gqa)
        else:
            qk = _qk(q_rows, k_cols)  # [B,H,r,c]
            scores = qk / math.sqrt(q.size(-1)) if spec.scale is None else qk * spec.scale
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
            weights = torch.softmax((scores + mask).float(), dim=-1).to(q.dtype)
            out[..., rows.start:rows.stop, :] = _weights_v(weights, v_cols)
    return out


def _qk(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``[B,H,r,d] @ [B,G,c,d]ᵀ -> [B,H,r,c]``, each query head with its key/value head (no copy of K)."""
    B, H, r, d = q.shape
    G, c = k.size(-3), k.size(-2)
    if G == H:
        return q @ k.transpose(-2, -1)
    return (q.reshape(B, G, (H // G) * r, d) @ k.transpose(-2, -1)).view(B, H, r, c)


def _weights_v(w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[B,H,r,c] @ [B,G,c,d_v] -> [B,H,r,d_v]``."""
    B, H, r, c = w.shape
    G = v.size(-3)
    if G == H:
        return w @ v
    return (w.reshape(B, G, (H // G) * r, c) @ v).view(B, H, r, v.size(-1))


# ---- reading what the kernel computed -------------------------------------------------------------------


def _select(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """``x[:, index]``, as a view when the indices are consecutive (one head, or all of them)."""
    if index == list(range(index[0], index[0] + len(index))):
        return x[:, index[0]:index[0] + len(index)]
    return x[:, index]


def _head_k(k: torch.Tensor, heads: list[int], H: int) -> torch.Tensor:
    """K ``[B,G,t,d]`` -> ``[B,h,t,d]``: the key/value head each of ``heads`` reads."""
    G = k.size(-3)
    return _select(k, [h // (H // G) for h in heads])


def _stage_tile(q: torch.Tensor, k: torch.Tensor, spec: MaskSpec, stage: str, rows: range, cols: range,
                heads: list[int]) -> torch.Tensor:
    """``[B, h, r, c]`` of one stage for ``heads``, from q ``[B,H,n,d]`` and k ``[B,G,t,d]`` (only the tile's rows
    and columns are gathered)."""
    H = q.size(-3)
    q_rows = _select(q[:, :, rows.start:rows.stop], heads)
    k_cols = _head_k(k[:, :, cols.start:cols.stop], heads, H)
    qk = q_rows @ k_cols.transpose(-2, -1)
    if stage == "qk":
        return qk
    scores = qk / math.sqrt(q.size(-1)) if spec.scale is None else qk * spec.scale  # as attention() scales
    if stage == "scores":
        return scores
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    if stage == "softcapped":
        return scores
    if spec.all_visible(rows, cols):
        return scores  # + 0 everywhere
    return scores + spec.additive(rows, cols, scores.dtype, scores.device)  # masked_scores


def _as_range(r: range | slice | tuple[int, int] | None, size: int, what: str) -> range:
    if r is None:
        return range(size)
    if isinstance(r, tuple):
        r = range(*r)
    if isinstance(r, slice):
        r = range(*r.indices(size))
    if not isinstance(r, range) or r.step != 1 or not 0 <= r.start < r.stop <= size:
        raise ValueError(f"{what} must be a non-empty contiguous range inside [0, {size}), got {r!r}")
    return r


class RowNorm(NamedTuple):
    """Each row's softmax normaliser, as the eager softmax holds it: the row max ``m`` ``[B,h,r]`` (float32, of
    the masked scores) and ``total = Σ_j exp(s_j − m)`` ``[B,h,r]`` (float64); ``empty`` ``[B,r]`` marks rows
    that see nothing under ``empty_rows="uniform"`` (weights 1/t), or is None."""

    m: torch.Tensor
    total: torch.Tensor
    empty: torch.Tensor | None

    @property
    def lse(self) -> torch.Tensor:
        """log Σ_j exp(s_j) ``[B,h,r]`` float64 (+∞ on an empty row)."""
        lse = self.m.double() + torch.log(self.total)
        return lse if self.empty is None else lse.masked_fill(self.empty[:, None, :], float("inf"))

    def rows(self, rows: range, offset: int = 0) -> RowNorm:
        """The normaliser of ``rows`` (positions counted from ``offset``, the first row this one holds)."""
        a, b = rows.start - offset, rows.stop - offset
        return RowNorm(self.m[..., a:b], self.total[..., a:b], None if self.empty is None else self.empty[:, a:b])

    def heads(self, index: list[int]) -> RowNorm:
        return RowNorm(self.m[:, index], self.total[:, index], self.empty)


class ScoreSweep:
    """The masked scores ``[B,h,r,c]`` of any rows × key columns of ``heads``, written into one buffer that is
    reused from call to call (a fresh ``[B,h,r,c]`` tensor per tile would fault its pages in each time).

    The sweeps below read whole rows at once — a chunk of query rows × every key they may see, at most
    ``SWEEP_CELLS`` cells — so that a row's normaliser is that chunk's own max and sum, computed exactly as the
    eager softmax computes it (``m = max_j s_j``, ``Σ_j exp(s_j − m)``) in one pass over QKᵀ, with no running
    rescale. The matmul is one large BLAS call per chunk; the mask is written only into the columns the diagonal
    or the window cross (the rest is visible), as −∞ exactly where the eager additive mask adds −∞."""

    def __init__(self, q: torch.Tensor, k: torch.Tensor, spec: MaskSpec, heads: list[int]) -> None:
        H = q.size(-3)
        self.spec, self.heads = spec, heads
        self.q = _select(q, heads)  # [B,h,n,d]
        self.k = _head_k(k, heads, H)  # [B,h,t,d]: each query head's key head (a copy only for GQA subsets)
        if self.k.size(0) != self.q.size(0):
            self.k = self.k.expand(self.q.size(0), *self.k.shape[1:])
        self.batch = max(self.q.size(0), spec.batch)
        self.d = q.size(-1)
        # scaling by a power of two (1/√64 = 1/8) is exact, so Q·2⁻ᵏ·Kᵀ is QKᵀ·2⁻ᵏ bit for bit: fold it into Q
        scale = 1 / math.sqrt(self.d) if spec.scale is None else spec.scale
        self.folded = scale > 0 and math.frexp(scale)[0] == 0.5 and q.dtype == torch.float32
        if self.folded:
            self.q = self.q * scale
        self._buffer = torch.empty(0, dtype=torch.float32, device=q.device)

    def visible(self, rows: range) -> range:
        """The key columns a chunk of rows reads: those any of its rows may see (every key for a chunk holding a
        row that sees nothing, whose weights are 1/t over all of them)."""
        if self.spec.empty_rows == "uniform" and self.spec.sees_nothing(rows) is not None:
            return range(self.spec.t)
        return range(*self.spec.key_range(rows))

    def rows_per_chunk(self, width: int) -> int:
        """Rows of a chunk reading ``width`` keys: ≤ ``SWEEP_CELLS`` cells, and at most width/8 rows (≥ 64), so
        the triangle the causal mask hides in the chunk's corner (r²/2 cells computed for nothing) stays small."""
        budget = SWEEP_CELLS // max(1, self.batch * len(self.heads) * width)
        return max(1, min(budget, max(64, width // 8)))

    def chunks(self, rows: range) -> Iterator[range]:
        """Row chunks of ``rows``, each with ≤ ``SWEEP_CELLS`` cells over every key its last row may see."""
        start = rows.start
        while start < rows.stop:
            stop = min(rows.stop, start + self.rows_per_chunk(len(self.visible(range(start, rows.stop)))))
            yield range(start, stop)
            start = stop

    def scores(self, rows: range, cols: range) -> torch.Tensor:
        """``[B,h,r,c]`` masked scores, float32, a view of the reused buffer (valid until the next call)."""
        shape = (self.q.size(0), len(self.heads), len(rows), len(cols))
        size = math.prod(shape)
        if self._buffer.numel() < size:
            self._buffer = torch.empty(max(size, min(SWEEP_CELLS, 4 * size)), dtype=torch.float32,
                                       device=self.q.device)
        x = self._buffer[:size].view(shape)
        q_rows = self.q[:, :, rows.start:rows.stop]
        k_cols = self.k[:, :, cols.start:cols.stop]
        spec = self.spec
        if q_rows.dtype != torch.float32:  # bf16 / fp16: the scores in that dtype, as attention() computes them
            y = q_rows @ k_cols.transpose(-2, -1)
            y = y / math.sqrt(self.d) if spec.scale is None else y * spec.scale
            if spec.softcap is not None:
                y = torch.tanh(y / spec.softcap) * spec.softcap
            return _mask_(x.copy_(y), spec, rows, cols)
        torch.matmul(q_rows, k_cols.transpose(-2, -1), out=x)
        if self.folded:
            pass
        elif spec.scale is None:
            x.div_(math.sqrt(self.d))  # as attention() scales: QKᵀ / √d_head
        else:
            x.mul_(spec.scale)
        if spec.softcap is not None:
            x.div_(spec.softcap).tanh_().mul_(spec.softcap)
        return _mask_(x, spec, rows, cols)


def _mask_(x: torch.Tensor, spec: MaskSpec, rows: range, cols: range) -> torch.Tensor:
    """Add the mask of rows × cols to the scores ``x`` ``[B,h,r,c]`` in place; without padding only the columns the
    diagonal or the window cross are touched (−∞ written where hidden: x + −∞ = −∞, x + 0 = x)."""
    if spec.key_is_token is not None:
        if x.size(0) < spec.batch:
            return x + spec.additive(rows, cols, x.dtype, x.device)
        return x.add_(spec.additive(rows, cols, x.dtype, x.device))
    r = len(rows)
    above = max(cols.start, spec.past + rows.start + 1)  # from here some row has keys above its diagonal
    if above < cols.stop:  # cell (i, j) hidden when j > past + rows.start + i: a band above a diagonal
        x[..., above - cols.start:].masked_fill_(
            _band(r, cols.stop - above, spec.past + rows.start + 1 - above, True, x.device), float("-inf"))
    if spec.window is not None:
        behind = min(cols.stop, spec.past + rows.stop - spec.window)  # before here some row's window has passed
        if behind > cols.start:  # hidden when j ≤ past + rows.start + i − window
            x[..., :behind - cols.start].masked_fill_(
                _band(r, behind - cols.start, spec.past + rows.start - spec.window - cols.start, False, x.device),
                float("-inf"))
    return x


@functools.lru_cache(maxsize=16)
def _band(r: int, c: int, diagonal: int, upper: bool, device: torch.device) -> torch.Tensor:
    """``[r, c]`` bool: True at j ≥ i + diagonal (``upper``) or j ≤ i + diagonal — the hidden cells of a chunk's
    corner, built once per shape (a sweep's chunks mostly share one height)."""
    ones = torch.ones(r, c, dtype=torch.bool, device=device)
    return ones.triu(diagonal) if upper else ones.tril(diagonal)


def _normalise_(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn masked scores ``x`` ``[B,h,r,c]`` (every key the rows may see) into ``e = exp(x − m)`` in place;
    returns (m ``[B,h,r]``, total ``[B,h,r]`` float32) — the eager softmax's own max and sum."""
    m = x.amax(-1)
    x.sub_(m[..., None]).exp_()
    return m, x.sum(-1)


@torch.no_grad()
def row_norm(q: torch.Tensor, k: torch.Tensor, spec: MaskSpec, heads: list[int] | None = None,
             rows: range | None = None) -> RowNorm:
    """The normaliser of each of ``rows`` for ``heads``: one pass over QKᵀ in chunks of whole rows (every key a
    row may see), max and sum as the eager softmax takes them (FlashAttention's point: the log-sum-exp of each row is
    all a region of the pattern needs, ``A_ij = exp(s_ij − lse_i)``)."""
    H = q.size(-3)
    heads = list(range(H)) if heads is None else heads
    rows = _as_range(rows, spec.n, "rows")
    sweep = ScoreSweep(q, k, spec, heads)
    m = torch.empty(sweep.batch, len(heads), len(rows), dtype=torch.float32)
    total = torch.empty(m.shape, dtype=torch.float64)
    for chunk in sweep.chunks(rows):
        x = sweep.scores(chunk, sweep.visible(chunk))
        cm, ct = _normalise_(x)
        m[..., chunk.start - rows.start:chunk.stop - rows.start] = cm
        total[..., chunk.start - rows.start:chunk.stop - rows.start] = ct
    return RowNorm(m, total, spec.sees_nothing(rows))


def row_logsumexp(q: torch.Tensor, k: torch.Tensor, spec: MaskSpec, heads: list[int] | None = None,
                  rows: range | None = None) -> torch.Tensor:
    """Each row's ``lse = log Σ_j exp(s_j)`` over its masked scores, ``[B, h, r]`` float64 (``row_norm``)."""
    return row_norm(q, k, spec, heads, rows).lse


@torch.no_grad()
def region(q: torch.Tensor, k: torch.Tensor, spec: MaskSpec, stage: str, heads: list[int] | None = None,
           rows: range | slice | tuple[int, int] | None = None, cols: range | slice | tuple[int, int] | None = None,
           norm: RowNorm | None = None) -> torch.Tensor:
    """One stage's values over rows × cols, ``[B, h, r, c]`` (``[B|1, 1, r, c]`` for "mask"): q
    ``[B,H,n,d_head]``, k ``[B,G,t,d_head]`` as the attention received them. "pattern" is
    ``exp(s − m) / Σ exp(s − m)`` with each row's max and sum over all its keys (``norm``, when the caller has it
    for these rows and heads) — the eager softmax's own arithmetic."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    H = q.size(-3)
    heads = list(range(H)) if heads is None else heads
    rows = _as_range(rows, spec.n, "rows")
    cols = _as_range(cols, spec.t, "cols")
    if stage == "mask":
        return spec.additive(rows, cols, q.dtype, q.device)
    if stage == "softcapped" and spec.softcap is None:
        raise ValueError("this attention has no soft-cap")
    x = _stage_tile(q, k, spec, stage, rows, cols, heads)
    if stage != "pattern":
        return x
    if norm is None:
        norm = row_norm(q, k, spec, heads, rows)
    return pattern_from(x, norm, spec.t).to(q.dtype)


def pattern_from(x: torch.Tensor, norm: RowNorm, t: int) -> torch.Tensor:
    """The weights ``[B,h,r,c]`` (float32) of masked scores ``x`` ``[B,h,r,c]`` given their rows' ``norm``:
    ``exp(x − m) / total``, and 1/t on a row that sees nothing."""
    p = torch.exp(x.float() - norm.m[..., None]) / norm.total.float()[..., None]
    if norm.empty is not None:
        p = p.masked_fill(norm.empty[:, None, :, None], 1.0 / t)
    return p


@torch.no_grad()
def pattern_times_v(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MaskSpec) -> torch.Tensor:
    """A·V ``[B,H,n,d_v]`` from the recomputed pattern, one chunk of whole rows at a time (the products in
    float64): the check that the pattern the views show is the attention the kernel ran (compare with its O)."""
    H = q.size(-3)
    heads = list(range(H))
    sweep = ScoreSweep(q, k, spec, heads)
    out = torch.zeros(sweep.batch, H, spec.n, v.size(-1), dtype=torch.float64)
    vh = _head_k(v, heads, H)
    for chunk in sweep.chunks(range(spec.n)):
        cols = sweep.visible(chunk)
        e = sweep.scores(chunk, cols)
        _, total = _normalise_(e)
        p = e / total[..., None]  # the weights, as pattern_from writes them
        out[:, :, chunk.start:chunk.stop] = p.double() @ vh[:, :, cols.start:cols.stop].double()
    return out


def attention_bytes(B: int, H: int, n: int, t: int, itemsize: int = 4) -> int:
    """Bytes of one ``[B,H,n,t]`` tensor."""
    return B * H * n * t * itemsize


def grid_edges(size: int, bins: int) -> list[int]:
    """Edges splitting ``size`` positions into at most ``bins`` contiguous blocks of one width w = ⌈size/bins⌉
    (the last block may be narrower): 0, w, 2w, …, size."""
    width = max(1, math.ceil(size / max(1, bins)))
    return [*range(0, size, width), size]


@dataclass(frozen=True)
class Pooled:
    """The pattern of ``heads`` pooled into blocks: ``mean`` / ``peak`` ``[h, R, C]`` over query rows
    ``row_edges[i] … row_edges[i+1]−1`` × keys ``col_edges[j] … col_edges[j+1]−1`` (a masked cell is weight 0),
    and the rows' normaliser ``norm`` ``[1, h, r]`` when this pass computed it (every visible key was read)."""

    mean: torch.Tensor
    peak: torch.Tensor
    row_edges: list[int]
    col_edges: list[int]
    norm: RowNorm | None


@torch.no_grad()
def pool_pattern(q: torch.Tensor, k: torch.Tensor, spec: MaskSpec, heads: list[int], batch: int = 0,
                 bins: int = 128, rows: range | None = None, cols: range | None = None,
                 norm: RowNorm | None = None) -> Pooled:
    """The pattern of ``heads`` of sequence ``batch`` pooled into ≤ ``bins`` × ``bins`` blocks (mean and max) over
    ``rows`` × ``cols`` (default: all), in one pass over QKᵀ by chunks of whole rows: each chunk's ``exp(s − m)``
    is reduced to per-row block sums and block maxima; the row's ``1/Σ`` then weighs those ``[r, C]`` numbers,
    never a cell. ``norm`` (``[1, h, n]``, every
    row of the sequence) lets a pass over a few columns skip the rest of each row; without it every visible key is
    read and the normaliser computed on the way is returned."""
    rows = _as_range(rows, spec.n, "rows")
    cols = _as_range(cols, spec.t, "cols")
    r_edges = [rows.start + e for e in grid_edges(len(rows), bins)]
    c_edges = [cols.start + e for e in grid_edges(len(cols), bins)]
    wc = c_edges[1] - c_edges[0]
    h, R, C = len(heads), len(r_edges) - 1, len(c_edges) - 1
    total = torch.zeros(h, R, C, dtype=torch.float64)
    peak = torch.zeros(h, R, C, dtype=torch.float32)
    spec1 = _one_sequence(spec, batch)
    sweep = ScoreSweep(q[batch:batch + 1], k[batch:batch + 1] if k.size(0) > 1 else k, spec1, heads)
    whole = norm is None
    if whole:
        m_all = torch.empty(1, h, len(rows), dtype=torch.float32)
        total_all = torch.empty(1, h, len(rows), dtype=torch.float64)
    for i, g, chunk in _pool_chunks(sweep, r_edges):
        visible = sweep.visible(chunk)
        first, end = max(visible.start, cols.start), min(visible.stop, cols.stop)
        if whole:
            first, end = visible.start, visible.stop  # the normaliser needs every key the rows see
        if first >= end:
            continue
        x = sweep.scores(chunk, range(first, end))[0]  # [h, r, c]
        # the pooled columns [lo, hi): the grid's blocks they cross, the first and last perhaps cut short
        lo, hi = max(first, cols.start), min(end, cols.stop)
        covers = whole and lo == first and hi == end  # the pooled blocks hold every key these rows see
        if whole and not covers:
            m, row_total = _normalise_(x)  # [h, r]: the row's max and Σ exp(s − m) over every key it sees
        if lo >= hi:
            pass  # none of these rows' visible keys lies in the pooled columns
        elif covers:  # the row's max from its block maxima, its Σ from its block sums: no extra pass
            block_max = _blocks(x, lo - cols.start, wc, "amax")  # [h, r, nb] of scores
            m = block_max.amax(-1)
            block_max = torch.exp(block_max - m[..., None])  # max exp = exp max
            block_sum = _blocks(x.sub_(m[..., None]).exp_(), lo - cols.start, wc, "sum")
            row_total = block_sum.sum(-1)
        else:
            e_pool = x[..., lo - first:hi - first]  # [h, r, c']
            if not whole:
                assert norm is not None
                part = norm.rows(chunk)
                m, row_total = part.m[0], part.total[0].float()
                e_pool.sub_(m[..., None]).exp_()
            block_sum = _blocks(e_pool, lo - cols.start, wc, "sum")  # [h, r, nb] of exp(s − m)
            block_max = _blocks(e_pool, lo - cols.start, wc, "amax")
        if whole:
            m_all[0, :, chunk.start - rows.start:chunk.stop - rows.start] = m
            total_all[0, :, chunk.start - rows.start:chunk.stop - rows.start] = row_total
        if lo >= hi:
            continue
        j0 = (lo - cols.start) // wc
        inv = (1.0 / row_total)[..., None]  # [h, r, 1]
        nb = block_sum.size(-1)
        per_row = (block_sum * inv).unflatten(1, (g, -1))  # [h, g, r/g, nb]: g block rows of the grid
        total[:, i:i + g, j0:j0 + nb] += per_row.sum(2, dtype=torch.float64)
        top = (block_max * inv).unflatten(1, (g, -1)).amax(2)  # [h, g, nb]
        peak[:, i:i + g, j0:j0 + nb] = torch.maximum(peak[:, i:i + g, j0:j0 + nb], top)
    sizes = torch.tensor(r_edges).diff()[:, None] * torch.tensor(c_edges).diff()[None, :]
    made = RowNorm(m_all, total_all, spec1.sees_nothing(rows)) if whole else None
    return Pooled((total / sizes).float(), peak, r_edges, c_edges, made)


def _pool_chunks(sweep: ScoreSweep, r_edges: list[int]) -> Iterator[tuple[int, int, range]]:
    """(first block row i, block rows g, query rows) of each chunk of a pooling sweep: as many whole block rows of
    the grid as fit ``SWEEP_CELLS`` (g ≥ 1, all of one height), or one block row in several chunks (g = 1)."""
    R = len(r_edges) - 1
    height = r_edges[1] - r_edges[0]
    i = 0
    while i < R:
        g = 1
        while (i + g < R and r_edges[i + g + 1] - r_edges[i + g] == height
               and (g + 1) * height <= sweep.rows_per_chunk(len(sweep.visible(range(r_edges[i], r_edges[i + g + 1]))))):
            g += 1
        if g > 1 or height <= sweep.rows_per_chunk(len(sweep.visible(range(r_edges[i], r_edges[i + 1])))):
            yield i, g, range(r_edges[i], r_edges[i + g])
        else:
            for chunk in sweep.chunks(range(r_edges[i], r_edges[i + 1])):
                yield i, 1, chunk
        i += g


def _blocks(x: torch.Tensor, offset: int, width: int, how: Literal["amax", "sum"]) -> torch.Tensor:
    """Reduce ``x`` ``[h, r, c]`` over the grid's column blocks ``[h, r, nb]``: x's first column sits ``offset``
    columns into the grid; a first block cut short (the visible range starts inside it) and a last one are
    reduced on their own, the whole blocks between by one reshape."""
    parts = []
    c = x.size(-1)
    head = min(c, (-offset) % width)  # columns before the first block edge
    if head:
        parts.append(getattr(x[..., :head], how)(-1, keepdim=True))
    body = (c - head) // width * width
    if body:
        whole = x[..., head:head + body].unflatten(-1, (body // width, width))
        parts.append(getattr(whole, how)(-1))
    if head + body < c:
        parts.append(getattr(x[..., head + body:], how)(-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


@torch.no_grad()
def block_pool(q: torch.Tensor, k: torch.Tensor, spec: MaskSpec, head: int, batch: int = 0, bins: int = 128,
               rows: range | None = None, cols: range | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                list[int], list[int]]:
    """The pattern of one head pooled into ≤ ``bins`` × ``bins`` blocks: (block mean ``[R, C]``, block max
    ``[R, C]``, row edges, column edges) over ``rows`` × ``cols`` (default: all); ``pool_pattern`` for one head."""
    pooled = pool_pattern(q, k, spec, [head], batch, bins, rows, cols)
    return pooled.mean[0], pooled.peak[0], pooled.row_edges, pooled.col_edges


def _one_sequence(spec: MaskSpec, batch: int) -> MaskSpec:
    if spec.key_is_token is None:
        return spec
    return MaskSpec(n=spec.n, t=spec.t, scale=spec.scale, window=spec.window,
                    key_is_token=spec.key_is_token[batch:batch + 1], empty_rows=spec.empty_rows,
                    softcap=spec.softcap)


__all__ = ["ATTENTION_MODES", "DEFAULT_THRESHOLD", "STAGES", "SWEEP_CELLS", "WHOLE_DERIVED", "MaskSpec", "Pooled",
           "RowNorm", "ScoreSweep", "attention_path", "attention_path_settings", "block_pool", "choose_path",
           "fused_attention", "pattern_times_v", "pool_pattern", "region", "row_logsumexp", "row_norm",
           "set_attention_path"]
