"""Generation: ``TracedGeneration`` drives a generation one traced forward and one chosen token per step.

Private: ``_traced``, ``_dry`` (a dry run: a meta-device model's prefill and decode steps, shapes only)."""

from gpt_shape_tracer.tracer.generation._dry import PlaceholderTokenizer, dry_run, latent_cache, prepare_dry_run
from gpt_shape_tracer.tracer.generation._traced import (
    MAX_BATCH,
    MAX_RUN_STEPS,
    ContextFullError,
    GenerationStopped,
    PromptError,
    TracedGeneration,
)

__all__ = ["MAX_BATCH", "MAX_RUN_STEPS", "ContextFullError", "GenerationStopped", "PlaceholderTokenizer", "PromptError",
           "TracedGeneration", "dry_run", "latent_cache", "prepare_dry_run"]
