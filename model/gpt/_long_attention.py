"""Attention at any length: the fused kernel runs the model, and any region of QKᵀ, the masked scores or
the pattern is recomputed exactly, tile by tile, from Q, K and a compact description of the mask.

Seed 002 §10.2 (FlashAttention): a row's softmax needs only its normaliser, the log-sum-exp
``lse_i = log Σ_j exp(s_ij)`` over the keys the row may see. It is computed one tile of key columns at a
time with a running max m and a running sum ℓ = Σ exp(s − m), rescaled by exp(m_old − m_new) whenever a
tile raises the max ("online softmax"); then any cell of the pattern is ``A_ij = exp(s_ij − lse_i)`` — the
same number the eager softmax gives, without ever holding a row block of n × t.

* ``MaskSpec`` describes the mask: causal with ``past`` cached keys, a sliding window, which key slots are
  padding (``key_is_token`` ``[B, t]``), what a query that may see no key does, the scale and the soft-cap.
  It builds the additive mask of any block of rows × columns, exactly as ``model.gpt.additive_mask`` (our
  GPT) or transformers' eager mask (``model.sources._hf_decoder.traced_mask``) would write those cells.
* ``fused_attention`` is the forward: PyTorch's ``scaled_dot_product_attention`` (one call when the mask is
  plain causal; otherwise over blocks of query rows with that block's mask, so at most ``ROW_BLOCK_ELEMENTS``
  mask cells exist at once). A soft-capped model (Gemma 2) runs the eager formula on the same row blocks.
* ``region``, ``row_logsumexp``, ``block_pool``, ``pattern_times_v`` read what the kernel computed.

Shape legend as in model/gpt.py: B batch, H query heads, G key/value heads, n new positions (queries),
t key positions (cache included), d_head.
"""

from __future__ import annotations

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
# auto: a layer runs fused when one [B,H,n,t] tensor would hold at least this many elements (64 MiB float32):
# GPT-2 small (12 heads) stays eager up to 1,182 tokens, where the app's views have always worked; a 4-head model
# runs fused from 2,048
DEFAULT_THRESHOLD = 1 << 24
ROW_BLOCK_ELEMENTS = 1 << 22  # mask or score cells per row block of the fused forward / the readers (16 MiB)
KEY_TILE = 2048  # key columns per tile when a reader sweeps a row block
POOL_BLOCK_CELLS = 1 << 19  # cells of one tile of the overview's sweep (2 MiB float32: a few such at once)


@dataclass
class _Settings:
    mode: AttentionMode = "auto"
    threshold: int = DEFAULT_THRESHOLD


_settings = _Settings()


def set_attention_path(mode: AttentionMode, threshold: int | None = None) -> None:
    """How every attention layer runs, traced or not (the same rule both ways, so a traced forward's logits
    equal the untraced forward's bit for bit).

    "auto": fused when one ``[B,H,n,t]`` tensor holds at least ``threshold`` elements, else eager (every hook
    point holds a real tensor); "eager": always eager; "fused": always fused. Fused, the scores, the mask
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


def choose_path(writers: bool, elements: int) -> Literal["eager", "fused"]:
    """Eager or fused for one layer: ``writers`` (forward hooks on an n × t hook point: they may change it),
    ``elements`` of one ``[B,H,n,t]`` tensor. Whether a tracer listens does not matter: tracing never changes
    the path, so never the numbers."""
    if writers or _settings.mode == "eager":
        return "eager"
    if _settings.mode == "fused":
        return "fused"
    return "fused" if elements >= _settings.threshold else "eager"


@dataclass(frozen=True)
class MaskSpec:
    """The attention mask and the scores' arithmetic, described without any ``[n, t]`` tensor.

    Query i (0 … n−1) sits at key slot ``past + i`` (``past = t − n``); it may see key slot j when
    j ≤ past + i, j > past + i − window (a sliding window), and key j is a token (not padding). A query
    that sees no key at all: ``empty_rows="self"`` lets a padding query see its own slot (model/gpt.py);
    ``"uniform"`` leaves the whole row at ``finfo.min``, so its softmax is 1/t everywhere (transformers'
    eager mask, model/hf_decoder.py). Scores are ``QKᵀ·scale``, then ``c·tanh(·/c)`` with a soft-cap c."""

    n: int
    t: int
    scale: float | None  # None: 1/√d_head, divided as model/gpt.py's attention() does
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
    if spec.softcap is None and spec.plain_causal:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=spec.scale, enable_gqa=gqa)
    n = q.size(-2)
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


@torch.no_grad()
def row_norm(q: torch.Tensor, k: torch.Tensor, spec: MaskSpec, heads: list[int] | None = None,
             rows: range | None = None) -> RowNorm:
    """The normaliser of each of ``rows`` for ``heads``, computed one key tile at a time with FlashAttention's
    running max and rescaled running sum (seed 002 §10.2); only the keys a row may see are read."""
    H = q.size(-3)
    heads = list(range(H)) if heads is None else heads
    rows = _as_range(rows, spec.n, "rows")
    B = max(q.size(0), spec.batch)
    m = torch.full((B, len(heads), len(rows)), float("-inf"), dtype=torch.float32)
    total = torch.zeros(m.shape, dtype=torch.float64)
    first, end = spec.key_range(rows)
    for start in range(first, end, KEY_TILE):
        cols = range(start, min(end, start + KEY_TILE))
        x = _stage_tile(q, k, spec, "masked_scores", rows, cols, heads).float()  # [B,h,r,c]
        m_new = torch.maximum(m, x.amax(-1))
        seen = torch.isfinite(m_new)  # a row that has read only masked keys so far has m = −∞ and sum 0
        rescale = torch.where(seen, torch.exp((m - m_new).double()), torch.zeros_like(total))
        total = total * rescale + torch.exp(x - torch.where(seen, m_new, 0.0)[..., None]).sum(-1).double()
        m = m_new
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
    """A·V ``[B,H,n,d_v]`` from the recomputed pattern, one row block and key tile at a time (float64): the
    check that the pattern the views show is the attention the kernel ran (compare with its O)."""
    H = q.size(-3)
    B = max(q.size(0), spec.batch)
    out = torch.zeros(B, H, spec.n, v.size(-1), dtype=torch.float64)
    heads = list(range(H))
    vh = _head_k(v, heads, H).double()
    for rows in _row_blocks(spec.n, KEY_TILE, H):
        norm = row_norm(q, k, spec, heads, rows)
        first, end = spec.key_range(rows)
        if norm.empty is not None:
            first, end = 0, spec.t
        for start in range(first, end, KEY_TILE):
            cols = range(start, min(end, start + KEY_TILE))
            p = region(q, k, spec, "pattern", heads, rows, cols, norm=norm).double()
            out[:, :, rows.start:rows.stop] += p @ vh[:, :, cols.start:cols.stop]
    return out


def attention_bytes(B: int, H: int, n: int, t: int, itemsize: int = 4) -> int:
    """Bytes of one ``[B,H,n,t]`` tensor."""
    return B * H * n * t * itemsize


def grid_edges(size: int, bins: int) -> list[int]:
    """Edges splitting ``size`` positions into at most ``bins`` contiguous blocks of one width w = ⌈size/bins⌉
    (the last block may be narrower): 0, w, 2w, …, size."""
    width = max(1, math.ceil(size / max(1, bins)))
    return [*range(0, size, width), size]


@torch.no_grad()
def block_pool(q: torch.Tensor, k: torch.Tensor, spec: MaskSpec, head: int, batch: int = 0, bins: int = 128,
               rows: range | None = None, cols: range | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                list[int], list[int]]:
    """The pattern of one head pooled into ≤ ``bins`` × ``bins`` blocks, tile by tile: (block mean
    ``[R, C]``, block max ``[R, C]``, row edges, column edges) over ``rows`` × ``cols`` (default: all).
    A masked cell counts as weight 0. Tiles are whole blocks, so each is pooled by a reshape."""
    rows = _as_range(rows, spec.n, "rows")
    cols = _as_range(cols, spec.t, "cols")
    r_edges = [rows.start + e for e in grid_edges(len(rows), bins)]
    c_edges = [cols.start + e for e in grid_edges(len(cols), bins)]
    wr, wc = r_edges[1] - r_edges[0], c_edges[1] - c_edges[0]
    R, C = len(r_edges) - 1, len(c_edges) - 1
    total = torch.zeros(R, C, dtype=torch.float64)
    peak = torch.zeros(R, C, dtype=torch.float32)
    q1, k1 = q[batch:batch + 1], k[batch:batch + 1] if k.size(0) > 1 else k
    spec1 = _one_sequence(spec, batch)
    tile_cols = wc * max(1, KEY_TILE // wc)
    block_rows = wr * max(1, POOL_BLOCK_CELLS // (tile_cols * wr))
    for r0 in range(rows.start, rows.stop, block_rows):
        block = range(r0, min(rows.stop, r0 + block_rows))
        i = (r0 - rows.start) // wr
        norm = row_norm(q1, k1, spec1, [head], block)
        first, end = spec1.key_range(block)
        if norm.empty is not None:
            first, end = 0, spec1.t
        first, end = max(first, cols.start), min(end, cols.stop)
        if first >= end:
            continue
        first = cols.start + (first - cols.start) // wc * wc  # aligned to a block edge
        for c0 in range(first, end, tile_cols):
            tile = range(c0, min(end, c0 + tile_cols))
            j = (c0 - cols.start) // wc
            p = region(q1, k1, spec1, "pattern", [head], block, tile, norm=norm)[0, 0].float()  # [r, c]
            nr, nc = math.ceil(p.shape[0] / wr), math.ceil(p.shape[1] / wc)
            p = F.pad(p, (0, nc * wc - p.shape[1], 0, nr * wr - p.shape[0]))  # zeros: no weight, no max
            blocks = p.view(nr, wr, nc, wc)
            total[i:i + nr, j:j + nc] += blocks.sum((1, 3)).double()
            peak[i:i + nr, j:j + nc] = torch.maximum(peak[i:i + nr, j:j + nc], blocks.amax((1, 3)))
    sizes = torch.tensor(r_edges).diff()[:, None] * torch.tensor(c_edges).diff()[None, :]
    return (total / sizes).float(), peak, r_edges, c_edges


def _one_sequence(spec: MaskSpec, batch: int) -> MaskSpec:
    if spec.key_is_token is None:
        return spec
    return MaskSpec(n=spec.n, t=spec.t, scale=spec.scale, window=spec.window,
                    key_is_token=spec.key_is_token[batch:batch + 1], empty_rows=spec.empty_rows,
                    softcap=spec.softcap)


__all__ = ["ATTENTION_MODES", "DEFAULT_THRESHOLD", "STAGES", "MaskSpec", "attention_path",
           "attention_path_settings", "block_pool", "choose_path", "fused_attention", "pattern_times_v",
           "RowNorm", "region", "row_logsumexp", "row_norm", "set_attention_path"]
