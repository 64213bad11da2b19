"""A derived attention record read like a kept one: its whole value, statistics and NaN/∞ flag, recomputed from the
layer's kept Q and K when a reader asks (``Trace.value``, ``Trace.stats``, ``Trace.finite_flag`` call here).

A traced forward runs attention fused at every length (``model.gpt.choose_path``): the n × t stages — QKᵀ, the
scaled (and soft-capped) scores, the mask, the masked scores, the pattern — are never held during the forward, so a
values trace costs about what the model does. Up to ``WHOLE_DERIVED`` elements (the size up to which the eager path
used to hold them) a reader gets the whole tensor, recomputed by ``model.gpt.region`` exactly as the eager path would
have computed it (float32 rounding apart): the views, the tables and a saved file show the same numbers as before.

The flag is what the Shapes table shows at once, so it is worked out without recomputing a stage wherever that is
exact: QKᵀ of finite Q and K whose largest products cannot overflow is finite, the mask's −∞ is wherever its
description hides a key, and a softmax over rows that each see a finite score is finite. Anything else (a NaN in Q,
values near the float32 limit, half precision) is recomputed and counted."""

from __future__ import annotations

import torch

from gpt_shape_tracer.model.gpt import WHOLE_DERIVED, MaskSpec, region
from gpt_shape_tracer.tracer.reading._regions import RegionError, attention_source
from gpt_shape_tracer.tracer.reading._trace import Trace
from gpt_shape_tracer.tracer.storage import tensor_stats
from gpt_shape_tracer.tracer.storage.records import Finite, TensorRecord, TensorStats

WHOLE_MEMO_BYTES = 256 << 20  # recomputed whole values a trace remembers (a Stages view reads 4–6 of one layer)
SAFE_BOUND = 1e30  # |QKᵀ·scale| below this: finite, and finfo.min + a score rounds back to finfo.min (no −∞)
MASK_ROWS_CELLS = 1 << 22  # mask cells looked at once when counting its −∞


def whole_value(trace: Trace, rec: TensorRecord) -> torch.Tensor | None:
    """The whole value of a derived record up to ``WHOLE_DERIVED`` elements, recomputed from Q and K (remembered,
    least recently read forgotten past ``WHOLE_MEMO_BYTES``); None when larger, or when Q or K is not kept."""
    if rec.numel > WHOLE_DERIVED:
        return None
    memo = trace.derived_memo
    key = (trace.log.epoch, rec.index)
    if key in memo:
        memo.move_to_end(key)
        return memo[key]
    try:
        src = attention_source(trace, rec)
    except RegionError:
        return None
    # each row's normaliser computed here, never one a view remembered (pool_pattern sums by blocks: the same
    # number to rounding, not to the bit), so the whole value is the same live and read back from a file
    value = region(src.q, src.k, src.spec, src.stage)
    memo[key] = value
    while sum(v.numel() * v.element_size() for v in memo.values()) > WHOLE_MEMO_BYTES and len(memo) > 1:
        memo.popitem(last=False)
    return value


def recomputable(trace: Trace, rec: TensorRecord) -> bool:
    """Whether ``whole_value`` would return a tensor (Q and K kept, the record small enough), without computing it."""
    if rec.numel > WHOLE_DERIVED:
        return False
    try:
        attention_source(trace, rec)
    except RegionError:
        return False
    return True


def derived_stats(trace: Trace, rec: TensorRecord) -> TensorStats | None:
    """Statistics of a derived record's recomputed value, taken once and kept in the log; None when it cannot be
    recomputed whole."""
    value = whole_value(trace, rec)
    if value is None:
        return None
    stats = tensor_stats(value)
    trace.log.remember_stats(rec.index, stats)
    return stats


def derived_flag(trace: Trace, rec: TensorRecord) -> int:
    """``Finite`` of a derived record: inferred from Q, K and the mask description where that is exact, else from
    the recomputed value's statistics; ``UNKNOWN`` when Q or K is not kept."""
    derived = trace.log.derived(rec.index)
    assert derived is not None
    stage, spec = derived
    try:
        src = attention_source(trace, rec)
    except RegionError:
        return Finite.UNKNOWN
    flag = _inferred(stage, spec, src.q, src.k)
    if flag is None:
        stats = trace.log.stats(rec.index) or derived_stats(trace, rec)
        if stats is None:
            return Finite.UNKNOWN
        flag = Finite.from_stats(stats)
    trace.log.remember_flag(rec.index, flag)
    return flag


def _inferred(stage: str, spec: MaskSpec, q: torch.Tensor, k: torch.Tensor) -> int | None:
    """The flag of ``stage`` without its values, or None where it cannot be told exactly."""
    if stage == "mask":
        return Finite.NEG_INF if _mask_hides(spec) else Finite.CLEAN
    if q.dtype != torch.float32 or k.dtype != torch.float32:
        return None  # half precision overflows far sooner: counted, not inferred
    q_top, k_top = q.abs().amax(), k.abs().amax()  # NaN propagates through amax
    if not (bool(torch.isfinite(q_top)) and bool(torch.isfinite(k_top))):
        return None
    scale = 1.0 if spec.scale is None else max(1.0, abs(spec.scale))
    if float(q_top) * float(k_top) * q.size(-1) * scale >= SAFE_BOUND:  # |q·k| ≤ d·max|q|·max|k|
        return None
    if stage in ("qk", "scores", "softcapped"):
        return Finite.CLEAN
    if stage == "masked_scores":
        return Finite.NEG_INF if _mask_hides(spec) else Finite.CLEAN
    if stage == "pattern":  # every row sees a finite score (or, seeing nothing, is 1/t): a finite softmax
        return Finite.CLEAN
    return None


def _mask_hides(spec: MaskSpec) -> bool:
    """Whether the mask writes −∞ anywhere (a row that sees nothing holds finfo.min instead), a block of rows at a
    time."""
    if spec.all_visible(range(spec.n), range(spec.t)):
        return False
    step = max(1, MASK_ROWS_CELLS // max(1, spec.batch * spec.t))
    for start in range(0, spec.n, step):
        rows = range(start, min(spec.n, start + step))
        if bool(torch.isneginf(spec.additive(rows, range(spec.t), torch.float32)).any()):
            return True
    return False
