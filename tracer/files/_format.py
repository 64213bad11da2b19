"""Saving and loading traces: files other tools can open, checked before they are trusted.

A trace is a directory, or the same files in one ``.zip`` archive:

* ``manifest.json`` — format and version, capture level, modules, steps, the
  model that made it (name, config, weights digest), the generation (prompts,
  sampling, every step's facts and cached-vs-recompute comparisons), the error
  if a forward failed;
* ``records.parquet`` — the record table (``Trace.to_frame()`` plus the columns
  needed to rebuild the trace); pandas, DuckDB or Polars read it as is;
* ``ops.parquet`` — op-level records, when captured;
* ``values.safetensors`` — the kept values: each storage once (``s<k>``, flat),
  and every record's value a view into one (storage, offset, strides in
  ``records.parquet``). A KV cache viewed by sixty steps is written once, so a
  saved trace is never larger than the bytes it kept plus its tables.

Loading never unpickles anything: JSON, Parquet and safetensors only. Before
anything is inflated or allocated, the declared sizes are checked: each
archive member against its limit and its compression ratio, the number of
records and ops from the Parquet metadata, every tensor's bytes from the
safetensors header. Then the manifest is checked against one schema
(``tracer.files._schema``), and every number that sizes something is checked against
what the file actually holds (layers against modules, n and t against the
attention records' shapes). A refusal is a ``TraceFileError`` naming the field
or the limit, and by how much.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from gpt_shape_tracer.model.gpt import FAMILIES, GPTConfig, ModelIdentity
from gpt_shape_tracer.model.sampling import SamplingConfig
from gpt_shape_tracer.tracer.files._schema import (
    Bool,
    Float,
    Int,
    ListOf,
    Maybe,
    Obj,
    OneOf,
    Str,
    Then,
    TraceFileError,
    TupleOf,
)
from gpt_shape_tracer.tracer.storage import CAPTURE_LEVELS, dtype_name
from gpt_shape_tracer.tracer.storage.records import (
    HOWS,
    PADDING_SIDES,
    ForwardFacts,
    GenerationStep,
    InterventionRecord,
    ModuleInfo,
    PathCost,
    RecomputeComparison,
    SamplingRecord,
    StepRecord,
    TraceErrorInfo,
)

FORMAT = "gpt-shape-trace"
VERSION = 3  # 3: labelled modules and steps, finite as words, axes as lists, tensor_id (2 still loads)
READABLE_VERSIONS = (2, 3)
MANIFEST, RECORDS, OPS, VALUES = "manifest.json", "records.parquet", "ops.parquet", "values.safetensors"
MEMBERS = (MANIFEST, RECORDS, OPS, VALUES)
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_DTYPES = {dtype_name(d): d for d in _ST_DTYPES.values()}
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What a trace file may hold. Each limit is checked before the thing it bounds is read or allocated."""

    manifest_bytes: int = 16 * 2**20  # the JSON manifest, inflated
    table_bytes: int = 256 * 2**20  # records.parquet / ops.parquet, inflated
    value_bytes: int = 2 * 2**30  # values.safetensors, inflated
    ratio: int = 200  # most bytes out per compressed byte in a deflated member
    # 2,124 records a step for 48 layers: a 48-layer run of 940 steps, an 80-layer one of about 560 (the tables'
    # bytes, not this count, bound what loading them costs; save_trace refuses what these limits would)
    records: int = 2_000_000
    records_per_step: int = 100_000
    ops: int = 2_000_000
    modules: int = 100_000
    steps: int = 100_000
    batch: int = 64
    layers: int = 10_000
    n_ctx: int = 1 << 20
    tensor_dims: int = 8
    tensor_elements: int = 1 << 40


LIMITS = Limits()


def _sampling_record(fields: dict) -> SamplingRecord:
    """A step's sampling, once its parts agree: one entry per sequence in every list, one label and one
    probability per candidate at every stage, and no stage whose probabilities add up to more than 1."""
    rows = len(fields["tokens"])
    for name in ("labels", "probs", "candidates", "candidate_labels", "stage_probs", "kept"):
        if len(fields[name]) != rows:
            raise ValueError(f"{name} has {len(fields[name])} entries for {rows} sequence(s)")
    for row, (ids, labels, stages) in enumerate(zip(fields["candidates"], fields["candidate_labels"],
                                                    fields["stage_probs"])):
        if len(labels) != len(ids):
            raise ValueError(f"sequence {row}: {len(labels)} labels for {len(ids)} candidates")
        for stage, probs in enumerate(stages):
            if len(probs) != len(ids):
                raise ValueError(f"sequence {row}, stage {stage}: {len(probs)} probabilities for {len(ids)} candidates")
            if math.fsum(probs) > 1 + 1e-3:
                raise ValueError(f"sequence {row}, stage {stage}: the probabilities add up to {math.fsum(probs):.4g}, "
                                 "more than 1")
    return SamplingRecord(**fields)


# -- loading: the manifest schema -------------------------------------------------------------------
def _schemas(limits: Limits, version: int = VERSION) -> Obj:
    size = Int(0, limits.tensor_elements)
    shape = ListOf(size, limits.tensor_dims)
    count = Int(0, 2**62)
    tokens_row = ListOf(Int(0, 2**31), limits.n_ctx)
    config = Then(Obj({}, open=True), _checked_config)
    identity = Then(Obj({"name": Str(500), "source": Str(5000), "family": Str(50), "config": config,
                         "weights_digest": Str(200)}), lambda d: ModelIdentity(**d))
    sampling = Then(Obj({"temperature": Float(0, 100), "top_k": Maybe(Int(0, 2**31)),
                         "top_p": Maybe(Float(0, 1)), "seed": Int(-(2**63), 2**64 - 1)}),
                    lambda d: SamplingConfig(**d))
    info = Obj({
        "prompts": ListOf(Str(1_000_000), limits.batch), "prompt_tokens": ListOf(tokens_row, limits.batch),
        "prompt_labels": ListOf(ListOf(Str(1000), limits.n_ctx), limits.batch),
        "padding_side": OneOf(PADDING_SIDES), "pad_id": Int(0, 2**31), "use_cache": Bool(),
        "sampling": sampling, "n_ctx": Int(1, limits.n_ctx), "warnings": ListOf(Str(10_000), 100),
    })
    k_list = ListOf(Int(0, 2**31), 256)
    prob = Float(0, 1, finite=False)  # NaN: a dry run's placeholder choice, made from no distribution
    choice = Then(Obj({
        "tokens": ListOf(Int(0, 2**31), limits.batch), "labels": ListOf(Str(1000), limits.batch),
        "probs": ListOf(prob, limits.batch), "candidates": ListOf(k_list, limits.batch),
        "candidate_labels": ListOf(ListOf(Str(1000), 256), limits.batch),
        "stage_probs": ListOf(ListOf(ListOf(prob, 256), 8), limits.batch),
        "kept": ListOf(ListOf(Int(0, 2**31), 8), limits.batch),
    }), _sampling_record)
    forward = Then(Obj({"n": Int(1, limits.n_ctx), "t": Int(1, limits.n_ctx), "cache_before": Int(0, limits.n_ctx),
                        "cache_after": Int(0, limits.n_ctx), "fed_tokens": ListOf(tokens_row, limits.batch)}),
                   lambda d: ForwardFacts(**d))
    gen_step = Then(Obj({"step": Int(0, limits.steps), "forward": forward, "sampling": Maybe(choice)}),
                    lambda d: GenerationStep(**d))
    path_cost = Then(Obj({"query_rows": Int(0, limits.n_ctx), "macs": count, "weight_bytes": count,
                          "kv_bytes": count, "seconds": Maybe(Float(0))}), lambda d: PathCost(**d))
    comparison = Then(Obj({"step": Int(0, limits.steps), "cached": path_cost, "full": path_cost,
                           "max_abs_delta": Float(0, finite=False), "tolerance": Float(0),
                           "run_used_cache": Bool(), "timing_repeats": Int(1, 1000), "note": Str(10_000),
                           "cached_rows_delta": ListOf(TupleOf((Float(0, finite=False), Float(0, finite=False))),
                                                       limits.layers)},
                          optional=frozenset({"cached_rows_delta"})),
                      lambda d: RecomputeComparison(**d))
    generation = Obj({"info": info, "steps": ListOf(gen_step, limits.steps),
                      "comparisons": ListOf(comparison, limits.steps)})
    error = Then(Obj({
        "step": Int(0, limits.steps), "exception_type": Str(500), "message": Str(100_000), "module": Str(5000),
        "module_type": Str(5000), "module_stack": ListOf(Str(5000), 10_000),
        "input_shapes": ListOf(TupleOf((Str(1000), shape)), 1000), "op": Str(500),
        "op_input_shapes": ListOf(shape, 1000), "source": Str(10_000),
    }), lambda d: TraceErrorInfo(**d))
    intervention = Then(Obj({"name": Str(500), "how": OneOf(HOWS), "head": Maybe(Int(0, 4096)),
                             "positions": Maybe(ListOf(Int(0, limits.n_ctx), limits.n_ctx)), "source": Str(1000)}),
                        lambda d: InterventionRecord(**d))
    module_fields = (Str(5000), Str(500), Int(0, 2**50), Bool())  # path, type, parameters, is_hook
    step_fields = (Int(0, limits.steps), count, count, Float(0), ListOf(intervention, 1000))
    if version == 2:  # positional arrays
        module = Then(TupleOf(module_fields), lambda t: ModuleInfo(*t))
        step = Then(TupleOf(step_fields), lambda t: StepRecord(t[0], t[1], t[2], t[3], tuple(t[4])))
    else:
        module = Then(Obj(dict(zip(("path", "type", "params", "is_hook"), module_fields))),
                      lambda d: ModuleInfo(**d))
        step = Then(Obj(dict(zip(("step", "first_record", "end_record", "seconds", "interventions"), step_fields))),
                    lambda d: StepRecord(**{**d, "interventions": tuple(d["interventions"])}))
    return Obj({
        "format": OneOf((FORMAT,)), "version": Int(0, 2**31), "capture": OneOf(CAPTURE_LEVELS),
        "budget_bytes": Int(0, 2**50),
        "modules": ListOf(module, limits.modules),
        "steps": ListOf(step, limits.steps),
        "model": Maybe(identity), "generation": Maybe(generation), "error": Maybe(error),
        "counts": Obj({"records": Int(0, limits.records), "ops": Int(0, limits.ops), "storages": count}),
        # a part of a trace written in parts (save_trace_part): where the files before it end
        "continues": Obj({"steps": Int(1, limits.steps), "records": Int(1, limits.records), "ops": Int(0, limits.ops),
                          "storages": count,
                          # [this file's (empty) storage standing for an earlier one joined, the earlier storage's
                          # number over the files, its length joined, [[slab storage, offset, shape, strides], …]]
                          "extends": ListOf(TupleOf((count, count, count, ListOf(TupleOf(
                              (count, count, shape, ListOf(count, limits.tensor_dims))), limits.records))),
                              limits.records)}),
    }, optional=frozenset({"continues"}))


_CONFIG_BOUNDS = {"vocab_size": 2**24, "n_ctx": 1 << 20, "d_model": 1 << 16, "n_layer": 1024, "n_head": 1024,
                  "n_kv_head": 1024, "head_dim": 1 << 12, "d_mlp": 1 << 18, "sliding_window": 1 << 20}


def _checked_config(raw: dict) -> dict:
    """A model config from a file: plain values, and the numbers that size things within sane bounds
    (they are checked against the records afterwards)."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        where = f"model.config.{key}"
        if isinstance(value, bool) or value is None or isinstance(value, str):
            out[key] = Str(200)(value, where) if isinstance(value, str) else value
        elif isinstance(value, int):
            out[key] = Int(0, _CONFIG_BOUNDS.get(key, 2**31))(value, where)
        elif isinstance(value, float):
            out[key] = Float(0, 1e12)(value, where)
        elif isinstance(value, list) and len(value) <= 1024 and all(
                isinstance(v, int) and not isinstance(v, bool) or isinstance(v, str) and len(v) <= 200 for v in value):
            out[key] = value  # one entry per layer (a hybrid model's mixers, its state layers)
        elif isinstance(value, list) and len(value) <= 1024 and all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v)
                for v in value):
            out[key] = value  # pairs of layer numbers (KV sharing: a layer and the layer whose K and V it reads)
        elif isinstance(value, dict) and len(value) <= 32:
            out[key] = {str(k): v for k, v in value.items() if isinstance(v, (int, float, str, bool, type(None)))}
        else:
            raise TraceFileError(f"unexpected value of type {type(value).__name__}", where)
    if out.get("family") in FAMILIES:  # it describes our GPT: it must be one GPTConfig accepts
        known = {k: v for k, v in out.items() if k in GPTConfig.__dataclass_fields__}
        try:
            GPTConfig(**known)
        except (TypeError, ValueError) as e:
            raise TraceFileError(str(e), "model.config") from None
    return out
