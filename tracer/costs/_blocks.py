"""Identical blocks costed once: a dry run's decoder blocks of one kind cost the same, op for op, so the ops of
one are counted and the others' costs are that block's, its path put in place of the template's.

A model's **blocks** are the children of each outermost ``nn.ModuleList`` of two or more modules (our GPT's
``blocks``, transformers' ``model.layers``). A block's **kind**, at a call, is what can make its ops differ:

* its structure: every submodule's relative path and class, every parameter's and buffer's relative name, shape,
  dtype and strides, and every submodule's plain attributes (numbers, strings, flags, tuples of them, the names of
  functions it holds: an attention module's ``sliding_window``, ``is_sliding``, ``is_kv_shared_layer``), except an
  attribute that equals the block's index in every block of its list that has it (``layer_idx``: the index);
* the config's per-layer fields: every config attribute (ours, transformers', and their sub-configs) that holds one
  entry per block (``layer_types``, ``no_rope_layers``, …), the block's entry;
* the call's arguments: every tensor's shape, strides and dtype, the plain values, and the fields of a dataclass
  argument (our ``MaskSpec``); any other object (a cache) by its class.

So an MoE model's dense first layers, sliding and full attention, a hybrid's state-space layers and per-layer
overrides are kinds of their own, read from what the model is, not from a list of families. Within a step the
blocks of a kind are counted op by op (``Template``: their ops, with modules relative to the block, output shapes,
multiply-adds and bytes; the shapes the block returns) until two consecutive ones agree (one that disagrees with the
block before it becomes the one the next is compared with), and then the kind is replicated.
A later block of it still runs (its outputs, the KV cache's update are real), but its ops go past the counter
(``OpCounter`` steps off the dispatch stack) to the meta-op cache, which tells the counter of each one
(``MetaOpCache.listener``): the new memory they make is tracked as a counted op's is, so the peak is the one a
counted block gives. At its end its op count and the shapes it returned are checked against the template's, and
its costs are the template's at its path. A block whose check fails raises ``ReplicationMismatch`` (a kind this
module failed to tell apart) rather than guess.

Only for models on the meta device (``costed_dry_run``): with values, data can steer a block's ops (an MoE's
experts loop runs the experts its tokens chose), and no kind could say so.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import HookPoint

_PLAIN = (int, float, bool, str, type(None))
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType)
_DEPTH = 4  # nesting of a block's arguments (tuples of tensors, dicts of them) and of configs read


class ReplicationMismatch(RuntimeError):
    """A replicated block did not do what its template did: its costs cannot be the template's."""


@dataclasses.dataclass(frozen=True)
class Template:
    """What one counted block of a kind did (module doc)."""

    ops: list[tuple]  # each op as ``relative`` gives it
    outputs: tuple  # the shapes of the tensors it returned (``output_shapes``)


class Kind:
    """One kind of block within a step: the latest block of it counted, verified once the next agrees with it
    (until then each block is counted, and one that disagrees becomes the one the next is compared with)."""

    __slots__ = ("template", "verified")

    def __init__(self) -> None:
        self.template: Template | None = None
        self.verified = False

    def add(self, template: Template) -> None:
        if not self.verified:
            self.verified = template == self.template
            self.template = template


class InBlock:
    """The outermost block in progress: its path, where its ops start in the counter's list, its kind (None: none
    could be read); whether it is replicated, and then how many ops it ran."""

    __slots__ = ("kind", "ops", "path", "replica", "start")

    def __init__(self, path: str, start: int, kind: Kind | None) -> None:
        self.path, self.start, self.kind = path, start, kind
        self.replica = False
        self.ops = 0


def relative(op: Any, path: str) -> tuple:
    """An ``OpCost`` as (module relative to the block at ``path`` — ".attn", "" for the block itself — or None
    where it ran outside it, op, output shape, the module where outside, then its numbers)."""
    inside = op.module == path or op.module.startswith(f"{path}.")
    return (op.module[len(path):] if inside else None, op.op, op.output_shape, "" if inside else op.module,
            op.macs, op.weight_bytes, op.read_bytes, op.written_bytes, op.spread_bytes)


def output_shapes(output: Any) -> tuple:
    """The shapes and dtypes of the tensors a block returned, in order (nested tuples, lists, dicts)."""
    parts: list = []
    _call_parts(output, parts, 0)
    return tuple(parts)


def _plain(value: Any) -> Any:
    """``value`` as a key part where it is plain (a number, a string, a function's name, tuples of them); None
    where it is not something a kind is read from."""
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if isinstance(value, _FUNCTIONS):
        return ("function", getattr(value, "__qualname__", repr(value)))
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        parts = tuple(_plain(v) for v in value)
        return None if any(p is None for p in parts) else (type(value).__name__, parts)
    return None


def _attributes(module: nn.Module) -> dict[str, Any]:
    """A module's plain attributes (module doc); PyTorch's own bookkeeping (``_parameters`` …) left out."""
    out = {}
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        part = _plain(value)
        if part is not None:
            out[name] = part
    return out


def _configs(model: nn.Module) -> list[Any]:
    """The config objects of the model and its modules (ours, transformers'), each once, sub-configs included."""
    found: dict[int, Any] = {}

    def add(config: Any, depth: int) -> None:
        if config is None or isinstance(config, (nn.Module, torch.Tensor) + _PLAIN) or id(config) in found:
            return
        if not (dataclasses.is_dataclass(config) or hasattr(config, "to_dict")):
            return
        found[id(config)] = config
        if depth < _DEPTH:
            for value in _fields(config).values():
                add(value, depth + 1)

    for module in model.modules():
        add(getattr(module, "config", None), 0)
    return list(found.values())


def _fields(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config):
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def _outermost_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    lists: list[tuple[str, nn.ModuleList]] = []
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 \
                and not any(path.startswith(f"{outer}.") for outer, _ in lists):
            lists.append((path, module))
    return lists


class Blocks:
    """The blocks of one model and each one's static kind (module doc), read once."""

    def __init__(self, model: nn.Module) -> None:
        self.where: dict[int, tuple[str, int]] = {}  # id(block) → (its path, its index)
        self.static: dict[int, tuple] = {}  # id(block) → the kind's part that no call changes
        configs = _configs(model)
        for list_path, blocks in _outermost_lists(model):
            n = len(blocks)
            attributes = [{(rel, name): value for rel, m in block.named_modules() if not isinstance(m, HookPoint)
                           for name, value in _attributes(m).items()} for block in blocks]
            # an attribute equal to the block's index in every block that has it (two at least) is the index
            # (layer_idx; a hybrid's attention and state-space modules each hold their own)
            having: dict[tuple, list[bool]] = {}
            for i, attrs in enumerate(attributes):
                for key, value in attrs.items():
                    having.setdefault(key, []).append(value == ("int", i))
            index_keys = {key for key, equal in having.items() if len(equal) >= 2 and all(equal)}
            per_layer = [(c_index, name) for c_index, config in enumerate(configs)
                         for name, value in _fields(config).items()
                         if isinstance(value, (list, tuple)) and len(value) == n]
            for i, block in enumerate(blocks):
                structure = tuple((rel, type(m).__qualname__) for rel, m in block.named_modules())
                tensors = tuple((name, tuple(t.shape), t.dtype, t.stride())
                                for name, t in [*block.named_parameters(), *block.named_buffers()])
                plain = tuple(sorted((k, v) for k, v in attributes[i].items() if k not in index_keys))
                config = tuple((c_index, name, repr(_fields(configs[c_index])[name][i]))
                               for c_index, name in per_layer)
                self.where[id(block)] = (f"{list_path}.{i}", i)
                self.static[id(block)] = (list_path, type(block).__qualname__, structure, tensors, plain, config)

    def kind(self, block: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """The block's kind at this call (module doc), or None where an argument cannot be read into one."""
        parts: list = [self.static[id(block)]]
        if not (_call_parts(args, parts, 0) and _call_parts(tuple(sorted(kwargs.items())), parts, 0)):
            return None
        return tuple(parts)


def _call_parts(value: Any, out: list, depth: int) -> bool:
    if isinstance(value, torch.Tensor):
        out.append(("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type,
                    value.requires_grad))
        return True
    plain = _plain(value) if not isinstance(value, (tuple, list)) else None
    if plain is not None:
        out.append(plain)
        return True
    if depth >= _DEPTH:
        return False
    if isinstance(value, (tuple, list)):
        out.append((type(value).__name__, len(value)))
        return all(_call_parts(v, out, depth + 1) for v in value)
    if isinstance(value, dict):
        out.append(("dict", tuple(value)))
        return all(_call_parts(v, out, depth + 1) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out.append(("dataclass", type(value).__qualname__))
        return all(_call_parts(getattr(value, f.name), out, depth + 1) for f in dataclasses.fields(value))
    out.append(("object", type(value).__qualname__))  # a cache: its layer's state shows in the ops (the check)
    return True


__all__ = ["Blocks", "InBlock", "Kind", "ReplicationMismatch", "Template", "output_shapes", "relative"]
