"""Generation: ``TracedGeneration`` drives a generation one traced forward and one chosen token per step.

Private: ``_traced``."""

from tracer.generation._traced import (
    MAX_BATCH,
    MAX_RUN_STEPS,
    ContextFullError,
    GenerationStopped,
    PromptError,
    TracedGeneration,
)

__all__ = ["MAX_BATCH", "MAX_RUN_STEPS", "ContextFullError", "GenerationStopped", "PromptError", "TracedGeneration"]
