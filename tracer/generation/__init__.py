"""Generation: ``TracedGeneration`` drives a generation one traced forward and one chosen token per step.

``BeamSearch`` drives beam search the same way, k beams per prompt, the cache reordered every step.
``SpeculativeDecoding`` drives assisted decoding: drafts (an assistant model or prompt lookup) verified in one
traced forward per step, the rejected rows cropped. ``CacheEvent``: what each step did to the cache, one model
for every strategy.

Private: ``_traced``, ``_beams``, ``_speculative``, ``_events``, ``_dry`` (a dry run: a meta-device model's
prefill and decode steps, shapes only)."""

from gpt_shape_tracer.tracer.generation._beams import BeamCandidate, BeamResult, BeamSearch, BeamSearchError, BeamStep
from gpt_shape_tracer.tracer.generation._dry import (
    PlaceholderTokenizer,
    dry_run,
    latent_cache,
    no_cyclic_collection,
    prepare_dry_run,
)
from gpt_shape_tracer.tracer.generation._events import CACHE_EVENT_KINDS, CacheEvent
from gpt_shape_tracer.tracer.generation._speculative import SpeculativeDecoding, SpeculativeError, SpeculativeStep
from gpt_shape_tracer.tracer.generation._traced import (
    MAX_BATCH,
    MAX_RUN_STEPS,
    ContextFullError,
    GenerationStopped,
    PromptError,
    TracedGeneration,
)

__all__ = ["MAX_BATCH", "BeamCandidate", "BeamResult", "BeamSearch", "BeamSearchError", "BeamStep",
           "CACHE_EVENT_KINDS", "CacheEvent", "SpeculativeDecoding", "SpeculativeError", "SpeculativeStep",
           "MAX_RUN_STEPS", "ContextFullError", "GenerationStopped", "PlaceholderTokenizer", "PromptError",
           "TracedGeneration", "dry_run", "latent_cache", "no_cyclic_collection", "prepare_dry_run"]
