"""Costs of whole steps: every op (``OpCounter``) of one forward, summed per module, with the step's peak
activation memory; a costed dry run; the KV cache's bytes at each step."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd
from torch import nn

from gpt_shape_tracer.model.sources import meta_op_cache, on_meta
from gpt_shape_tracer.tracer.costs._blocks import Blocks
from gpt_shape_tracer.tracer.costs._counter import FusedOnMeta, OpCost, OpCounter
from gpt_shape_tracer.tracer.generation import no_cyclic_collection, prepare_dry_run

if TYPE_CHECKING:
    from gpt_shape_tracer.model.sources import Decoder, TextTokenizer
    from gpt_shape_tracer.tracer.generation import TracedGeneration
    from gpt_shape_tracer.tracer.reading import Trace

CACHE_HOOKS = ("hook_k_all", "hook_v_all")  # [B, G, t, d_head] each: what the cache holds after the step
LATENT_HOOKS = ("hook_kv_latent_all", "hook_k_rope_all")  # [B, 1, t, d_c], [B, 1, t, d_R]: what it holds instead
STATE_HOOKS = ("hook_conv_state", "hook_ssm_state")  # a hybrid model's state-space layers: a fixed-size state


@dataclass(frozen=True)
class StepCosts:
    """What one forward costs, op by op."""

    step: int
    ops: tuple[OpCost, ...]
    peak_activation_bytes: int  # the most bytes of new tensors alive at once during the forward
    # the blocks whose costs are their kind's template's, at their path (tracer/costs/_blocks.py); () where every
    # block was counted op by op
    replicated_blocks: tuple[str, ...] = ()

    @property
    def macs(self) -> int:
        return sum(op.macs for op in self.ops)

    @property
    def weight_bytes(self) -> int:
        return sum(op.weight_bytes for op in self.ops)

    @property
    def written_bytes(self) -> int:
        return sum(op.written_bytes for op in self.ops)

    def by_module(self, inclusive: bool = False) -> dict[str, dict[str, int]]:
        """Per module path: macs, weight_bytes, written_bytes, ops — of its own ops, or (``inclusive``) of every op
        inside it (its children's too; "" is then the whole forward)."""
        out: dict[str, dict[str, int]] = {}
        for op in self.ops:
            paths = [op.module]
            if inclusive:
                parts = op.module.split(".") if op.module else []
                paths = [""] + [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
            for path in paths:
                row = out.setdefault(path, {"macs": 0, "weight_bytes": 0, "written_bytes": 0, "ops": 0})
                row["macs"] += op.macs
                row["weight_bytes"] += op.weight_bytes
                row["written_bytes"] += op.written_bytes
                row["ops"] += 1
        return out


def count_forward(model: nn.Module, forward: Callable[[], Any], step: int = 0,
                  blocks: Blocks | None = None) -> tuple[Any, StepCosts]:
    """Run ``forward()`` (a call of ``model``) with every op counted; returns its result and the costs.
    ``blocks`` (``Blocks(model)``, a model on the meta device only): identical blocks costed once
    (tracer/costs/_blocks.py)."""
    meta = on_meta(model)
    if blocks is not None and not meta:
        raise ValueError("identical blocks are costed once only in a dry run: with values, data can steer a "
                         "block's ops (an MoE's experts loop), so each block of a model with weights is counted")
    return _counted(model, forward, step, blocks, meta)


def _counted(model: nn.Module, forward: Callable[[], Any], step: int, blocks: Blocks | None,
             meta: bool) -> tuple[Any, StepCosts]:
    # the meta-op cache first, so that the counter, pushed after it, sees every op (model.sources.meta_op_cache)
    with meta_op_cache() if meta else contextlib.nullcontext() as cache, \
            FusedOnMeta() if meta else contextlib.nullcontext(), OpCounter(model, step, blocks, cache) as counter:
        result = forward()
    return result, StepCosts(step, tuple(counter.ops), counter.peak_bytes, tuple(counter.replicated))


def costed_dry_run(model: Decoder, tokenizer: TextTokenizer | None = None, prompt: str | None = None, *,
                   n: int = 16, steps: int = 4, batch: int = 1, use_cache: bool = True,
                   replicate: bool = True) -> tuple[TracedGeneration, list[StepCosts]]:
    """``tracer.dry_run`` with every step's ops counted (``OpCounter``). ``replicate``: a block of a kind already
    counted and checked (its first two blocks agree) takes their costs instead of being counted op by op
    (tracer/costs/_blocks.py: the same costs, in less time); False counts every block."""
    gen = prepare_dry_run(model, tokenizer, prompt, n=n, steps=steps, batch=batch, use_cache=use_cache)
    blocks = Blocks(model) if replicate else None
    costs = []
    with no_cyclic_collection():
        for step in range(1 + steps):
            _, cost = _counted(model, gen.step, step, blocks, True)  # on the meta device: prepare_dry_run checked
            costs.append(cost)
    return gen, costs


def kv_cache_bytes(trace: Trace, step: int) -> int:
    """Bytes the cache holds after ``step``: every layer's ``hook_k_all`` + ``hook_v_all``, or — in a
    latent-attention layer (DeepSeek-V2/V3), whose cache holds no K and V — its ``hook_kv_latent_all`` +
    ``hook_k_rope_all``; plus a hybrid model's convolution / state-space state (``hook_conv_state``,
    ``hook_ssm_state``); XLNet's held hidden states (``hook_mems``) in place of its K and V. A layer that attends
    over another layer's K and V (KV sharing, ``GPTConfig.kv_shared``) holds nothing of its own: its records are
    that layer's."""
    shared = {f"blocks.{L}.attn" for L, _ in getattr(trace.config, "kv_shared", ()) or ()}
    # XLNet: a layer whose cache holds its input hidden states (hook_mems) holds no K, V; they are made again
    hidden = [rec for rec in trace.filter(step=step, kind="hook") if rec.name.rsplit(".", 1)[-1] == "hook_mems"]
    shared |= {rec.name.rsplit(".", 1)[0] + ".attn" for rec in hidden}
    records = [rec for rec in trace.filter(step=step, kind="hook")
               if rec.name.rsplit(".", 1)[-1] in CACHE_HOOKS + LATENT_HOOKS
               and rec.name.rsplit(".", 1)[0] not in shared]
    latent = {rec.name.rsplit(".", 2)[0] for rec in records if rec.name.rsplit(".", 1)[-1] in LATENT_HOOKS}
    state = sum(rec.nbytes for rec in trace.filter(step=step, kind="hook")
                if rec.name.rsplit(".", 1)[-1] in STATE_HOOKS)  # a hybrid model's fixed-size state
    return state + sum(rec.nbytes for rec in hidden) + sum(rec.nbytes for rec in records
                       if rec.name.rsplit(".", 1)[-1] in LATENT_HOOKS or rec.name.rsplit(".", 2)[0] not in latent)


def costs_frame(costs: StepCosts, modules: bool = True) -> pd.DataFrame:
    """One row per module (its own ops) or per op: what the costs table shows."""
    if not modules:
        return pd.DataFrame([{"module": op.module or "model", "op": op.op, "output": list(op.output_shape),
                              "multiply-adds": op.macs, "weight bytes": op.weight_bytes,
                              "bytes written": op.written_bytes} for op in costs.ops])
    rows = [{"module": path or "model", "ops": row["ops"], "multiply-adds": row["macs"],
             "weight bytes": row["weight_bytes"], "bytes written": row["written_bytes"]}
            for path, row in costs.by_module().items()]
    return pd.DataFrame(rows)
