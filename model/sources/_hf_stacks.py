"""Attention in several lists of layers (BLT, the Byte Latent Transformer, Pagnoni et al. 2024): one block per
attention call, in the order of the calls, each named by its path in the model.

BLT runs six lists: the entropy patcher's layers (a small causal LM over bytes that decides where patches end), the
local encoder's layers over bytes, its cross-attention pooling bytes into patch slots, the global transformer's
layers over patches, and the local decoder's cross-attention (bytes reading patches) and layers over bytes. The
trace keeps its flat block index (``blocks.{L}``, every view's address), and says for each block which list and
which element of it the block is (``StackBlock``), and whether it is a cross-attention: queries from one stream, keys
and values from another, under a mask that is not causal over the same positions.

Its cache: transformers' own cached forward of BLT fails on its own config (it builds ``DynamicCache(config=…)``
from a config with no ``num_hidden_layers``), and with a cache handed in, only the local encoder's and the local
decoder's self-attention layers keep K and V (over bytes, each list numbering its slots from 0) while the patcher and
the global transformer get none and see only the new bytes: that step is not the model's forward of the whole text.
Such a model is traced without a cache (``no_cache_reason``): every step recomputes the whole text, as transformers'
forward without a cache does (``load_hf``'s guard holds the trace to it and says so in ``reference_note``).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

_Call = Any  # _hf_probe's _Call (that module imports this one)


@dataclass(frozen=True)
class StackBlock:
    """What one block is in a model whose attention runs in several lists of layers."""

    path: str  # the layer's path in the model, its base model's prefix left out: "local_encoder.layers.0"
    stack: str  # the list it is an element of: "local_encoder.layers"
    index: int  # its place in that list
    size: int  # how many elements the list has
    module: str  # the attention module's class: "BltSelfAttention", "BltCrossAttention"
    cross: bool  # queries from one stream, keys and values from another (the module takes that other stream)

    def sentence(self, block: int) -> str:
        where = f"Block {block} is {self.path} ({self.module}), element {self.index} of the {self.size} in {self.stack}"
        if self.cross:
            return (where + ": a cross-attention — its queries come from one stream and its keys and values from "
                    "another, so query i and key i are not the same position, and which keys each query sees is "
                    "its mask, not a causal one")
        return where + ": self-attention over that list's own stream (queries, keys and values from the same positions)"


def _takes_other_stream(module: nn.Module) -> bool:
    """Whether an attention module's forward takes a second stream for its keys and values (transformers' names
    for it: ``cross_attention_states``, ``encoder_hidden_states``, ``key_value_states``)."""
    try:
        names = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(n in names for n in ("cross_attention_states", "encoder_hidden_states", "key_value_states"))


def stack_blocks(calls: Sequence[_Call], lists: dict[int, nn.ModuleList]) -> nn.ModuleList | None:
    """One block per attention call where the calls come from more than one list of layers, each element of each
    list making one call of a module of its own (BLT): per call, the layer it is an element of. None where they do
    not (a call outside every list, a layer calling twice, one module in several layers), or where a module that is
    not causal takes no second stream (bidirectional self-attention: an encoder, refused as any)."""
    if not calls or any(c.layer is None for c in calls):
        return None
    if len({c.layer[0] for c in calls}) < 2 or len({c.layer for c in calls}) != len(calls) \
            or len({id(c.module) for c in calls}) != len(calls):
        return None
    if any(getattr(c.module, "is_causal", True) is False and not _takes_other_stream(c.module) for c in calls):
        return None
    return nn.ModuleList([lists[c.layer[0]][c.layer[1]] for c in calls])


def stack_of_blocks(hf: nn.Module, layers: Sequence[nn.Module] | nn.ModuleList,
                    attns: Sequence[nn.Module | None]) -> tuple[StackBlock, ...] | None:
    """Per block, which list of layers it is an element of (``StackBlock``); None where every block is an element
    of one list (the ordinary decoder), or where a layer is several blocks (HRM's re-run layers, LongCat-Flash's
    sublayers: ``call_blocks``, whose cache slots are transformers' own)."""
    if len({id(layer) for layer in layers}) < len(layers):
        return None
    paths = {id(m): name for name, m in hf.named_modules()}
    prefix = str(getattr(hf, "base_model_prefix", "") or "")
    found = []
    for layer, attn in zip(layers, attns):
        path = paths.get(id(layer), "?")
        if prefix and path.startswith(prefix + "."):
            path = path[len(prefix) + 1:]
        stack, _, index = path.rpartition(".")
        owner = hf.get_submodule(paths[id(layer)].rpartition(".")[0]) if id(layer) in paths else None
        cross = attn is not None and getattr(attn, "is_causal", True) is False and _takes_other_stream(attn)
        found.append(StackBlock(path=path, stack=stack, index=int(index) if index.isdigit() else -1,
                                size=len(owner) if isinstance(owner, nn.ModuleList) else 1,
                                module=type(attn).__name__ if attn is not None else "", cross=cross))
    return tuple(found) if len({b.stack for b in found}) > 1 else None


def no_cache_reason(model_type: str, stacks: tuple[StackBlock, ...] | None) -> str | None:
    """Why a model whose blocks lie in several lists of layers is traced without a cache (None for one list): the
    trace's KV cache keeps one K, V slot per block, which is not the cache such a model keeps (BLT's lists number
    their slots from 0 each, and its patcher and global transformer keep none)."""
    if stacks is None:
        return None
    lists = sorted({b.stack for b in stacks})
    return (f"this model's attention ({model_type}) runs in {len(lists)} lists of layers ({', '.join(lists)}), and "
            "the trace's KV cache, one K, V slot per block, is not the cache such a model keeps: it is traced without "
            "a cache")


def _input_width(attn: nn.Module | None) -> int | None:
    """The width of the stream an attention module reads: its first linear map's input."""
    first = next((m for m in attn.modules() if isinstance(m, nn.Linear)), None) if attn is not None else None
    return first.in_features if first is not None else None


def with_stacks(stacks: tuple[StackBlock, ...] | None, origins: tuple[str | None, ...],
                block_hooks: Sequence[nn.Module]) -> tuple[str | None, ...]:
    """The blocks' origins (``HFDecoder.block_origins``): each block's list of layers where there are several —
    whose attentions then run eagerly with the masks they are given (``given_mask``) — else ``origins``."""
    if stacks is None:
        return origins
    for hooks in block_hooks:
        if hasattr(hooks, "attn"):
            cast(Any, hooks).attn.given_mask = True
    return tuple(where.sentence(b) for b, where in enumerate(stacks))


def refuse_unequal_heads(model_type: str, stacks: tuple[StackBlock, ...] | None, block_hooks: Sequence[nn.Module],
                         attns: Sequence[nn.Module | None]) -> None:
    """Refuses a model whose lists of layers differ in head counts, head widths (what each block's attention
    received in the routing check: H, G, d_head, d_v) or the width of the stream they read: the trace's config,
    which every view reads, holds one of each."""
    from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError

    if stacks is None:
        return
    seen = [getattr(getattr(b, "attn", None), "seen", None) for b in block_hooks]
    shapes = {(*s, _input_width(a)) for s, a in zip(seen, attns) if s is not None}
    if len(shapes) > 1:
        per = "; ".join(sorted({f"{b.stack}: H, G, d_head, d_v, d = {(*s, _input_width(a))}"
                                for b, s, a in zip(stacks, seen, attns) if s is not None}))
        raise HFDecoderError(f"{model_type}: its lists of layers attend with different heads or widths ({per}); the "
                             "trace's config holds one head count and width for every block", reason="several stacks")


def stacks_width(hf: nn.Module) -> int:
    """d, the width of the stream the logits are read from (the output embedding's input), where the model's
    config names no one width (BLT's, over its lists of layers; ``refuse_unequal_heads`` holds every list to it)."""
    head = hf.get_output_embeddings()  # type: ignore[operator]
    return int(head.in_features if isinstance(head, nn.Linear) else head.weight.shape[-1])
