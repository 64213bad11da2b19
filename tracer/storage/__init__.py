"""Storage: the write side of a trace (``TraceLog``), values under a byte budget, statistics, and the
plain frozen records everything else reads.

Public: ``records`` (the record types), ``TraceLog``, ``tensor_stats``/``summarize``, ``value_blocks``.
Private: ``_log``, ``_store`` (values under the budget), ``_stats``, ``_fused`` (the one-pass kernel), ``_host``
(kept values copied to the host, waited for once per step)."""

from gpt_shape_tracer.tracer.storage._log import CAPTURE_LEVELS, TraceLog
from gpt_shape_tracer.tracer.storage._stats import summarize, tensor_stats, value_blocks
from gpt_shape_tracer.tracer.storage._store import DEFAULT_BUDGET_BYTES

__all__ = ["CAPTURE_LEVELS", "DEFAULT_BUDGET_BYTES", "TraceLog", "summarize", "tensor_stats", "value_blocks"]
