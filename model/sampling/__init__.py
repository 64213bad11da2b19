"""Choosing the next token from logits and running generation: greedy (τ = 0), temperature, top-k, top-p, seeded
(``SamplingConfig``, ``sample``); one step is one forward and one token (``generate_step``, ``generate``)."""

from gpt_shape_tracer.model.sampling._sampling import (
    CANDIDATES,
    MAX_TEMPERATURE,
    STAGES,
    SampleResult,
    SamplingConfig,
    SamplingError,
    StepOutput,
    generate,
    generate_step,
    sample,
)

__all__ = ["CANDIDATES", "MAX_TEMPERATURE", "STAGES", "SampleResult", "SamplingConfig", "SamplingError", "StepOutput",
           "generate", "generate_step", "sample"]
