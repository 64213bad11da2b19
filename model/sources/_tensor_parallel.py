"""One rank of a tensor-parallel model, on the meta device: transformers' own plan applied to a dry run.

transformers declares, for each family, how its Linear layers split across k ranks (``model.tp_plan``:
``"colwise"`` — each rank holds ``out/k`` of the output features, so its heads are ``H/k`` and ``G/k``;
``"rowwise"`` — each rank holds ``in/k`` input features and produces a partial sum that the ranks add together,
an all-reduce; ``"embedding_rowwise"`` — ``V/k`` of the vocabulary's rows, all-reduced; ``"colwise_gather_output"``
— the logits' columns, gathered). ``shard(model, k)`` resizes a dry run's parameters exactly as that plan shards
them, so the traced forward *is* rank 0's forward: every record has the shape it has on one of k GPUs, and the
costs counted are one rank's (Shoeybi et al. 2019, Megatron-LM, for the pattern).

Checked against transformers' own tensor parallelism run for real (``tests/model/test_tensor_parallel.py``: two
processes, the gloo backend, on this CPU): every module's input and output shape per rank equals the recorded one,
and every parameter's shape here the local shard that rank holds.

Where the plan gathers the output (the language-model head, ``"colwise_gather_output"``: transformers'
``ColwiseParallel`` with a replicated output), the weight is split as a colwise one — each rank holds ``V/k`` rows
and computes ``V/k`` logits — and the module's output is then the k shares side by side (``torch.cat``, standing
for the all-gather): its record is the gathered ``[B, n, V]`` every rank ends with, its multiply-adds one rank's.
Styles outside those above (experts, latent-attention projections, sequence parallelism) are refused by name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

SPLITS: dict[str, tuple[Literal["out", "in", "rows", "none"], Literal["none", "all-reduce", "all-gather"]]] = {
    # transformers' style → (which dimension of the weight is divided by k, the collective after the module)
    "colwise": ("out", "none"),
    "packed_colwise": ("out", "none"),
    "rowwise": ("in", "all-reduce"),
    "packed_rowwise": ("in", "all-reduce"),
    "embedding_rowwise": ("rows", "all-reduce"),
    "colwise_gather_output": ("out", "all-gather"),  # Shard(0) weight, output made whole (an all-gather)
    "replicated_with_grad_allreduce": ("none", "none"),
}
MAX_RANKS = 1024


class TensorParallelError(ValueError):
    """A model this plan cannot split k ways: the message names the plan entry or the count that does not divide."""


@dataclass(frozen=True)
class ShardedModule:
    """One module the plan names: its path, transformers' style, the weight's shape on one rank and in whole."""

    path: str
    style: str
    whole: tuple[int, ...]
    per_rank: tuple[int, ...]
    collective: Literal["none", "all-reduce", "all-gather"]


@dataclass(frozen=True)
class TensorParallelPlan:
    ranks: int
    source: str  # whose plan: "transformers' tp_plan of Qwen3ForCausalLM"
    modules: tuple[ShardedModule, ...]

    def collectives(self) -> dict[str, int]:
        """How many modules end in each collective, per forward."""
        out: dict[str, int] = {}
        for m in self.modules:
            if m.collective != "none":
                out[m.collective] = out.get(m.collective, 0) + 1
        return out


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")


def shard(hf: nn.Module, ranks: int) -> TensorParallelPlan:
    """Resize ``hf``'s (meta) parameters to one rank's share of transformers' plan, in place (module doc)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise TensorParallelError(f"tensor-parallel ranks must be an integer from 1 to {MAX_RANKS}, got {ranks!r}")
    if not all(p.is_meta for p in hf.parameters()):
        raise TensorParallelError("one rank of a tensor-parallel model is a dry run: build it on the meta device")
    plan = dict(getattr(hf, "tp_plan", None) or {})
    source = f"transformers' tp_plan of {type(hf).__name__}"
    if not plan:
        raise TensorParallelError(f"{type(hf).__name__} has no tensor-parallel plan in transformers (tp_plan is "
                                  "empty): transformers cannot split it across GPUs, and neither is it split here")
    unknown = sorted({style for style in plan.values() if style not in SPLITS})
    if unknown and ranks > 1:
        raise TensorParallelError(f"{source} uses style(s) {', '.join(unknown)}, which are not modelled here "
                                  f"(modelled: {', '.join(SPLITS)})")
    _check_heads(hf, ranks, source)
    patterns = [(_pattern(key), style) for key, style in plan.items()]
    sharded: list[ShardedModule] = []
    for path, module in hf.named_modules():
        style = next((s for p, s in patterns if p.match(path)), None)
        if style is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            continue
        weight = module.weight
        whole = tuple(weight.shape)
        axis = {"out": 0, "in": 1, "rows": 0}.get(SPLITS[style][0])
        new = list(whole)
        if axis is not None and ranks > 1:
            if whole[axis] % ranks:
                raise TensorParallelError(f"{path} ({style}): its weight {list(whole)} has {whole[axis]} "
                                          f"{'rows' if axis == 0 else 'columns'}, which {ranks} ranks cannot share "
                                          "equally (transformers' plan splits them evenly)")
            new[axis] //= ranks
            module.weight = nn.Parameter(torch.empty(new, dtype=weight.dtype, device="meta"), requires_grad=False)
            bias = getattr(module, "bias", None)
            if axis == 0 and isinstance(bias, torch.Tensor) and SPLITS[style][0] == "out":
                module.bias = nn.Parameter(torch.empty(new[0], dtype=bias.dtype, device="meta"), requires_grad=False)
            if SPLITS[style][1] == "all-gather":  # each rank's V/k logits, then every rank holds all V
                module.register_forward_hook(_gathered(ranks))
        sharded.append(ShardedModule(path, style, whole, tuple(new), SPLITS[style][1]))
    return TensorParallelPlan(ranks, source, tuple(sharded))


def _gathered(ranks: int):
    """A forward hook standing for the all-gather after a colwise module: its output's last dimension, one rank's
    share, made k shares wide (on the meta device the values are none, only the shape the ranks end with)."""
    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return torch.cat([output] * ranks, dim=-1)
    return hook


def _check_heads(hf: nn.Module, ranks: int, source: str) -> None:
    """A colwise split of Q, K, V gives each rank whole heads only when k divides H and G: transformers'
    attention reshapes each rank's share into heads of d_head, and a share of half a head cannot be."""
    whole: Any = getattr(hf, "config", None)
    config = whole.get_text_config() if hasattr(whole, "get_text_config") else whole
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, count in (("query heads H", heads), ("key/value heads G", kv_heads)):
        if isinstance(count, int) and count % ranks:
            raise TensorParallelError(f"{source} splits the attention's heads across ranks, and {count} {what} "
                                      f"cannot be shared equally by {ranks} ranks")
