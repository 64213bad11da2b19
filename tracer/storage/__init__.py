"""Storage: the write side of a trace (``TraceLog``), values under a byte budget, statistics, and the
plain frozen records everything else reads.

Public: ``records`` (the record types), ``TraceLog``, ``tensor_stats``/``summarize``, ``value_blocks``; for the
sibling rooms (reading, capture, files, generation): ``RawRecord``/``RawOp`` (what the log holds), ``dtype_name``,
``storage_key`` (a tensor's storage identity), ``on_host`` (tensors copied to the host together).
Private: ``_log``, ``_store`` (values under the budget), ``_stats``, ``_fused`` (the one-pass kernel), ``_host``
(kept values copied to the host, waited for once per step), ``_spill``."""

from gpt_shape_tracer.tracer.storage._host import on_host
from gpt_shape_tracer.tracer.storage._log import CAPTURE_LEVELS, RawOp, RawRecord, TraceLog
from gpt_shape_tracer.tracer.storage._stats import dtype_name, summarize, tensor_stats, value_blocks
from gpt_shape_tracer.tracer.storage._store import DEFAULT_BUDGET_BYTES, storage_key

__all__ = ["CAPTURE_LEVELS", "DEFAULT_BUDGET_BYTES", "RawOp", "RawRecord", "TraceLog", "dtype_name", "on_host",
           "storage_key", "summarize", "tensor_stats", "value_blocks"]
