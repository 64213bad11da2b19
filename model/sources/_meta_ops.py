"""Faster forwards on the meta device (a dry run): each op's output computed once per distinct input.

On the meta device an op costs what PyTorch's meta kernel costs — for element-wise ops and reductions a Python
reference (``torch._refs``, registered by ``torch._meta_registrations.activate_meta``), 0.4–1 ms an op — whatever
the sizes. A decoder's layers are alike: layer 1 runs the same ops on tensors of the same shapes as layer 0, so
most of a dry run's time is the same questions asked again.

``meta_op_cache()`` answers them once. A meta tensor holds no values, so what a *functional* op (no argument or
result aliased or written, one tensor returned) gives back — its shape, strides, dtype — is a function of what the
meta kernel can see: the inputs' shapes, strides, dtypes and storage offsets, the other arguments, and the default
dtype. All of them are the key; the first call runs the kernel, and a later call with the same key gets a fresh
tensor (its own storage, as the kernel's is) with the kernel's shape, strides and dtype. An output kept only where
it is provably such a tensor: on the meta device, strided, at offset 0, in a storage of its own of the size
``empty_strided`` gives. Anything else — a view, an in-place op, an ``out=`` op, several results, an argument the
key cannot hold (a generator, a tensor elsewhere) — runs its kernel every time. The cache lives for one ``with``
block (one forward, or one dry run) and is never shared between threads (dispatch modes are thread-local).

It is a ``TorchDispatchMode`` and must be the innermost one: a mode pushed after it sees every op first (the
tracer's ``OpCounter``, ``FlopCounterMode``), while one pushed before would miss the ops it answers — so it only
starts when no other dispatch mode is active, and is a no-op otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _len_torch_dispatch_stack
from torch.utils._pytree import tree_leaves

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_FUNCTIONAL: dict[Any, bool] = {}  # op overload → whether its schema is functional (module doc); schemas never change


def _functional(func: Any) -> bool:
    known = _FUNCTIONAL.get(func)
    if known is None:
        schema = func._schema
        known = (not any(a.alias_info is not None for a in schema.arguments)
                 and not any(r.alias_info is not None for r in schema.returns)
                 and len(schema.returns) == 1 and str(schema.returns[0].type) == "Tensor")
        _FUNCTIONAL[func] = known
    return known


def _key_parts(value: Any, out: list) -> bool:
    """Appends what ``value`` tells a meta kernel to ``out``; False where it holds something the key cannot."""
    if isinstance(value, torch.Tensor):
        if not value.is_meta or value.layout != torch.strided or value.is_conj() or value.is_neg():
            return False
        out.append((tuple(value.shape), value.stride(), value.dtype, value.storage_offset()))
        return True
    if isinstance(value, _PLAIN):
        out.append((type(value), value))  # the type too: 1, 1.0 and True promote differently
        return True
    if isinstance(value, (tuple, list)):
        out.append((type(value), len(value)))
        return all(_key_parts(v, out) for v in value)
    return False


class MetaOpCache(TorchDispatchMode):
    """The mode itself (module doc); use ``meta_op_cache()``. ``hits`` / ``misses`` count the answered ops."""

    def __init__(self) -> None:
        super().__init__()
        self._outputs: dict[tuple, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]] = {}
        self.hits = 0
        self.misses = 0
        # told of every op while set: (op, args, kwargs, result) — tracer/costs follows the memory of ops it does
        # not count that way (a replicated block's)
        self.listener: Callable[[Any, tuple, dict, Any], None] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        parts: list = [func, torch.get_default_dtype()]
        if not (_functional(func) and _key_parts(args, parts) and _key_parts(tuple(sorted(kwargs.items())), parts)):
            out = func(*args, **kwargs)
        else:
            key = tuple(parts)
            known = self._outputs.get(key)
            if known is not None:
                self.hits += 1
                out = torch.empty_strided(known[0], known[1], dtype=known[2], device="meta")
            else:
                self.misses += 1
                out = func(*args, **kwargs)
                if self._fresh(out, args, kwargs):
                    self._outputs[key] = (tuple(out.shape), out.stride(), out.dtype)
        if self.listener is not None:
            self.listener(func, args, kwargs, out)
        return out

    @staticmethod
    def _fresh(out: Any, args: tuple, kwargs: dict) -> bool:
        """Whether ``out`` is what ``empty_strided`` would make: a meta tensor at offset 0 in a storage of its own,
        of the size its shape and strides need."""
        if not (isinstance(out, torch.Tensor) and type(out) is torch.Tensor and out.is_meta
                and out.layout == torch.strided and out.storage_offset() == 0):
            return False
        storage = out.untyped_storage()
        inputs = [v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
        if any(t.untyped_storage() is storage for t in inputs):  # a storage keeps one Python object, as a tensor
            return False
        like = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
        return like.untyped_storage().nbytes() == storage.nbytes()


@contextlib.contextmanager
def meta_op_cache() -> Iterator[MetaOpCache | None]:
    """Within the block, meta ops answered from a cache (module doc); the mode, or None where another dispatch
    mode is already active (the cache would hide ops from it)."""
    if _len_torch_dispatch_stack() > 0:
        yield None
        return
    with MetaOpCache() as mode:
        yield mode


__all__ = ["MetaOpCache", "meta_op_cache"]
