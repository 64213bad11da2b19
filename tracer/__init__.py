"""Record every tensor a model produces, step by step: shapes, values, ops.

Never imports streamlit: the app is one view on these traces; a notebook or
the command line (``gpt-shape-tracer trace``) is another.

* ``Tracer`` captures (``tracer.capture``, with ``hooks``, ``ops``, ``forensics``);
* ``TraceLog`` is the write side of a trace, ``Trace`` the read side;
* ``TracedGeneration`` drives a generation step by step and records its facts; ``dry_run`` one of a model on the
  meta device (config only, no weights); ``tracer.costs`` counts what every op costs and where it would run;
* ``trace_engine`` steps through transformers' continuous batching (a paged KV cache: pages, block tables, shared
  prefixes, preemption) and records an ``EngineRun``; ``engine_sizing`` says what pool fits (``tracer.engine``);
* ``save_trace`` / ``load_trace`` write and check files (``tracer.files``; ``save_trace_part`` /
  ``load_trace_parts``: one written a step at a time);
* ``ablate`` / ``patch`` change a forward (``tracer.capture``); ``logit_lens``,
  ``direct_logit_attribution``, ``diff_traces`` and the other experiments of ``tracer.experiments``
  answer "what if".
"""

from gpt_shape_tracer.tracer.capture import (
    HOWS,
    Intervention,
    InterventionError,
    Tracer,
    ablate,
    hooks_installed,
    patch,
)
from gpt_shape_tracer.tracer.costs import (
    ACCELERATORS,
    Accelerator,
    OpCost,
    Placement,
    StepCosts,
    StepFloor,
    collectives,
    collectives_sentence,
    costed_dry_run,
    costs_frame,
    count_forward,
    kv_cache_bytes,
    place,
    step_floor,
)
from gpt_shape_tracer.tracer.engine import (
    MAX_POOL_BYTES,
    EngineError,
    EngineRun,
    EngineSizing,
    EngineStep,
    engine_sizing,
    engine_sizing_table,
    load_engine_run,
    save_engine_run,
    trace_engine,
)
from gpt_shape_tracer.tracer.experiments import (
    CACHE_CLASSES,
    GRADIENT_LOSSES,
    HEAD_ROLES,
    CacheClassError,
    CacheClassRun,
    CacheClassStep,
    CachePrecisionRun,
    HeadGradients,
    LayerHolding,
    PatchingResult,
    PrecisionStep,
    Replay,
    activation_patching,
    aligned_values,
    attention_gradients,
    cache_class_run,
    cache_precision,
    diff_steps,
    diff_traces,
    direct_logit_attribution,
    gradient_trace,
    head_scores,
    logit_lens,
    pattern_changes,
    replay,
    replay_diff,
    text_loss,
)
from gpt_shape_tracer.tracer.files import (
    LIMITS,
    Limits,
    TraceFileError,
    TraceWritten,
    archive_bytes,
    load_trace,
    load_trace_parts,
    save_trace,
    save_trace_part,
)
from gpt_shape_tracer.tracer.generation import (
    MAX_BATCH,
    MAX_RUN_STEPS,
    BeamCandidate,
    BeamResult,
    BeamSearch,
    BeamSearchError,
    BeamStep,
    CacheEvent,
    ContextFullError,
    GenerationStopped,
    PromptError,
    SpeculativeDecoding,
    SpeculativeError,
    SpeculativeStep,
    TracedGeneration,
    dry_run,
    latent_cache,
    no_cyclic_collection,
    prepare_dry_run,
)
from gpt_shape_tracer.tracer.reading import (
    GenerationFacts,
    HeadStatistics,
    Overview,
    RegionError,
    Trace,
    attention_overview,
    attention_region,
    attention_source,
    check_output,
    head_statistics,
    is_derived,
    pattern_digest,
    query_row,
)
from gpt_shape_tracer.tracer.storage import (
    CAPTURE_LEVELS,
    DEFAULT_BUDGET_BYTES,
    TraceLog,
    summarize,
    tensor_stats,
    value_blocks,
)
from gpt_shape_tracer.tracer.storage.records import (
    ABLATIONS,
    FORWARD_CAPTURES,
    PADDING_SIDES,
    TENSOR_KINDS,
    CaptureLevel,
    Finite,
    ForwardFacts,
    GenerationInfo,
    GenerationStep,
    How,
    OpRecord,
    PaddingSide,
    PathCost,
    RecomputeComparison,
    SamplingRecord,
    StepRecord,
    TensorKind,
    TensorRecord,
    TensorStats,
    TraceErrorInfo,
)

__all__ = [
    "BeamCandidate", "BeamResult", "BeamSearch", "BeamSearchError", "BeamStep",
    "CacheEvent", "SpeculativeDecoding", "SpeculativeError", "SpeculativeStep",
    "ACCELERATORS", "Accelerator", "OpCost", "Placement", "StepCosts", "StepFloor", "collectives",
    "collectives_sentence", "costed_dry_run", "costs_frame",
    "count_forward", "kv_cache_bytes", "latent_cache", "place", "step_floor",
    "HeadStatistics", "Overview", "RegionError", "attention_overview", "attention_region", "attention_source",
    "check_output", "head_statistics", "is_derived", "pattern_digest", "query_row",
    "ABLATIONS", "CAPTURE_LEVELS", "FORWARD_CAPTURES", "CaptureLevel", "ContextFullError", "DEFAULT_BUDGET_BYTES",
    "Finite",
    "ForwardFacts", "GenerationFacts", "GenerationInfo", "GenerationStep", "GenerationStopped", "HEAD_ROLES", "HOWS",
    "How", "CachePrecisionRun", "PrecisionStep", "cache_precision",
    "CACHE_CLASSES", "CacheClassError", "CacheClassRun", "CacheClassStep", "LayerHolding", "cache_class_run",
    "GRADIENT_LOSSES", "HeadGradients",
    "attention_gradients", "gradient_trace",
    "Intervention", "InterventionError", "LIMITS", "Limits", "MAX_BATCH", "MAX_RUN_STEPS", "OpRecord",
    "PADDING_SIDES", "PaddingSide", "PatchingResult", "PathCost", "PromptError", "RecomputeComparison", "Replay",
    "SamplingRecord", "StepRecord", "TENSOR_KINDS", "TensorKind", "TensorRecord", "TensorStats", "Trace",
    "TraceErrorInfo", "TraceFileError", "TraceLog", "TracedGeneration", "Tracer", "ablate", "activation_patching",
    "aligned_values", "archive_bytes", "diff_steps", "diff_traces", "direct_logit_attribution", "dry_run",
    "head_scores",
    "hooks_installed",
    "load_trace", "load_trace_parts", "logit_lens", "no_cyclic_collection", "patch", "prepare_dry_run",
    "pattern_changes", "replay",
    "replay_diff", "save_trace", "save_trace_part",
    "TraceWritten",
    "summarize",
    "tensor_stats", "text_loss", "value_blocks",
    "EngineError", "EngineRun", "EngineStep", "MAX_POOL_BYTES", "EngineSizing", "engine_sizing", "engine_sizing_table",
    "load_engine_run",
    "save_engine_run", "trace_engine",
]
