"""Record every tensor a model produces, step by step: shapes, values, ops.

Never imports streamlit: the app is one view on these traces; a notebook or
the command line (``python -m tracer``) is another.
"""

from tracer.capture import CAPTURE_LEVELS, Tracer, hooks_installed
from tracer.generation import ContextFullError, PromptError, RecomputeComparison, TracedGeneration
from tracer.records import OpRecord, StepInfo, TensorRecord, TensorStats, TraceErrorInfo
from tracer.stats import summarize, tensor_stats
from tracer.store import DEFAULT_BUDGET_BYTES
from tracer.trace import Trace

__all__ = [
    "CAPTURE_LEVELS",
    "DEFAULT_BUDGET_BYTES",
    "ContextFullError",
    "OpRecord",
    "PromptError",
    "RecomputeComparison",
    "StepInfo",
    "TensorRecord",
    "TensorStats",
    "Trace",
    "TraceErrorInfo",
    "TracedGeneration",
    "Tracer",
    "hooks_installed",
    "summarize",
    "tensor_stats",
]
