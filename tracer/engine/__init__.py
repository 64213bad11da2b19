"""Engine: the KV cache as serving engines hold it — a pool of fixed-size pages, a block table per request,
continuous batching (requests arriving and finishing mid-run, prefill chunks beside decode tokens) and shared
prefixes — traced one engine step at a time through transformers' own continuous batching.

Public: ``trace_engine`` and ``EngineRun`` (the run and its records, ``_records``), ``engine_sizing`` (what
fits in an accelerator's memory, transformers' own arithmetic), ``save_engine_run`` / ``load_engine_run``.
Private: ``_engine`` (the step driver and the recording attention), ``_records``, ``_sizing``, ``_files``."""

from gpt_shape_tracer.tracer.engine._engine import (
    MAX_ENGINE_STEPS,
    MAX_MASK_BYTES,
    MAX_POOL_BYTES,
    MAX_REQUESTS,
    EngineError,
    EngineRun,
    pages_for,
    trace_engine,
)
from gpt_shape_tracer.tracer.engine._files import load_engine_run, save_engine_run
from gpt_shape_tracer.tracer.engine._records import (
    CONTRIBUTIONS,
    FINISH_REASONS,
    EngineRequest,
    EngineStep,
    PoolFacts,
    RequestAttention,
    RequestInStep,
)
from gpt_shape_tracer.tracer.engine._sizing import EngineSizing, engine_sizing, engine_sizing_table

__all__ = ["CONTRIBUTIONS", "FINISH_REASONS", "MAX_ENGINE_STEPS", "MAX_MASK_BYTES", "MAX_POOL_BYTES", "MAX_REQUESTS",
           "EngineError", "EngineRequest", "EngineRun", "EngineSizing", "EngineStep", "PoolFacts",
           "RequestAttention", "RequestInStep", "engine_sizing", "engine_sizing_table", "load_engine_run",
           "pages_for", "save_engine_run", "trace_engine"]
