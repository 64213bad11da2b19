"""Experiments ("what if", with the interventions of ``tracer.capture``): replay a step,
activation patching, the logit lens and direct logit attribution, head scores, the diff of two runs, a KV cache
stored at a lower precision, every cache class transformers has run step by step, the gradients through one
attention head.

Private: ``_whatif``, ``_lens``, ``_diff``, ``_cache_precision``, ``_cache_classes``, ``_gradients``."""

from gpt_shape_tracer.tracer.experiments._cache_classes import (
    CACHE_CLASSES,
    GENERATE_SETTINGS,
    CacheClassError,
    CacheClassRun,
    CacheClassStep,
    LayerHolding,
    cache_class_run,
)
from gpt_shape_tracer.tracer.experiments._cache_precision import CachePrecisionRun, PrecisionStep, cache_precision
from gpt_shape_tracer.tracer.experiments._diff import aligned_values, diff_steps, diff_traces
from gpt_shape_tracer.tracer.experiments._gradients import (
    GRADIENT_LOSSES,
    HeadGradients,
    attention_gradients,
    gradient_trace,
)
from gpt_shape_tracer.tracer.experiments._lens import direct_logit_attribution, logit_lens
from gpt_shape_tracer.tracer.experiments._whatif import (
    HEAD_ROLES,
    PatchingResult,
    Replay,
    activation_patching,
    head_scores,
    pattern_changes,
    replay,
    replay_diff,
    text_loss,
)

__all__ = [
    "CACHE_CLASSES", "GENERATE_SETTINGS", "CacheClassError", "CacheClassRun", "CacheClassStep", "LayerHolding",
    "cache_class_run",
    "CachePrecisionRun", "GRADIENT_LOSSES", "HEAD_ROLES", "HeadGradients", "PatchingResult", "PrecisionStep", "Replay",
    "activation_patching", "aligned_values", "attention_gradients", "cache_precision", "diff_steps", "diff_traces",
    "gradient_trace",
    "direct_logit_attribution", "head_scores", "logit_lens", "pattern_changes", "replay", "replay_diff", "text_loss",
]
