"""Experiments ("what if", with the interventions of ``tracer.capture``): replay a step,
activation patching, the logit lens and direct logit attribution, head scores, the diff of two runs, a KV cache
stored at a lower precision.

Private: ``_interventions``, ``_whatif``, ``_lens``, ``_diff``, ``_cache_precision``."""

from tracer.experiments._cache_precision import CachePrecisionRun, PrecisionStep, cache_precision
from tracer.experiments._diff import aligned_values, diff_steps, diff_traces
from tracer.experiments._lens import direct_logit_attribution, logit_lens
from tracer.experiments._whatif import (
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
    "CachePrecisionRun", "HEAD_ROLES", "PatchingResult", "PrecisionStep", "Replay",
    "activation_patching", "aligned_values", "cache_precision", "diff_steps", "diff_traces",
    "direct_logit_attribution", "head_scores", "logit_lens", "pattern_changes", "replay", "replay_diff", "text_loss",
]
