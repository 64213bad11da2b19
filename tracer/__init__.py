"""Record every tensor a model produces, step by step: shapes, values, ops.

Never imports streamlit: the app is one view on these traces; a notebook or
the command line (``python -m tracer``) is another.

* ``Tracer`` captures (``tracer.capture``, with ``hooks``, ``ops``, ``forensics``);
* ``TraceLog`` is the write side of a trace, ``Trace`` the read side;
* ``TracedGeneration`` drives a generation step by step and records its facts;
* ``save_trace`` / ``load_trace`` write and check files (``tracer.io``, ``tracer.schema``);
* ``ablate`` / ``patch`` change a forward (``tracer.interventions``); ``logit_lens``,
  ``direct_logit_attribution`` (``tracer.lens``), ``diff_traces`` (``tracer.diff``) and the
  experiments of ``tracer.whatif`` answer "what if".
"""

from tracer.capture import Tracer
from tracer.diff import diff_steps, diff_traces
from tracer.generation import ContextFullError, GenerationStopped, PromptError, TracedGeneration
from tracer.hooks import hooks_installed
from tracer.interventions import Intervention, InterventionError, ablate, patch
from tracer.io import load_trace, save_trace
from tracer.lens import direct_logit_attribution, logit_lens
from tracer.log import CAPTURE_LEVELS, TraceLog
from tracer.records import (
    Finite,
    ForwardFacts,
    GenerationInfo,
    GenerationStep,
    OpRecord,
    PathCost,
    RecomputeComparison,
    SamplingRecord,
    StepRecord,
    TensorRecord,
    TensorStats,
    TraceErrorInfo,
)
from tracer.schema import TraceFileError
from tracer.stats import summarize, tensor_stats
from tracer.store import DEFAULT_BUDGET_BYTES
from tracer.trace import Trace

__all__ = [
    "CAPTURE_LEVELS",
    "DEFAULT_BUDGET_BYTES",
    "ContextFullError",
    "Finite",
    "ForwardFacts",
    "GenerationInfo",
    "GenerationStep",
    "GenerationStopped",
    "Intervention",
    "InterventionError",
    "OpRecord",
    "PathCost",
    "PromptError",
    "RecomputeComparison",
    "SamplingRecord",
    "StepRecord",
    "TensorRecord",
    "TensorStats",
    "Trace",
    "TraceErrorInfo",
    "TraceFileError",
    "TraceLog",
    "TracedGeneration",
    "Tracer",
    "ablate",
    "diff_steps",
    "diff_traces",
    "direct_logit_attribution",
    "hooks_installed",
    "load_trace",
    "logit_lens",
    "patch",
    "save_trace",
    "summarize",
    "tensor_stats",
]
