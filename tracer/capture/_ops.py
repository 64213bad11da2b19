"""Op-level capture: every torch function and tensor method called inside a traced forward.

It uses PyTorch's own interception (``TorchFunctionMode``), which is
thread-local and active only while the traced forward runs. Before an in-place
op writes into a tensor whose value the trace keeps, the recorder asks for that
value to be copied first.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from gpt_shape_tracer.tracer.storage import dtype_name

_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
                    "__setitem__"}


class OpListener(Protocol):
    """What the recorder tells the tracer."""

    in_hook: bool  # True while the tracer itself runs: its own tensor calls are not the model's ops
    keeps_values: bool

    def protect(self, t: torch.Tensor) -> None: ...

    def op_done(self, name: str, input_shapes: tuple, output_shapes: tuple, dtype: str) -> None: ...

    def op_failed(self, name: str, input_shapes: tuple, exc: Exception) -> None: ...


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__" and hasattr(func, "__self__"):  # a property such as Tensor.T
        return "Tensor." + getattr(func.__self__, "__name__", "attribute")
    qual = getattr(func, "__qualname__", name) or name
    if qual.startswith(("TensorBase.", "Tensor.", "_TensorBase.")):
        return "Tensor." + qual.split(".", 1)[1]
    module = getattr(func, "__module__", None) or ""
    if module.startswith(("torch.nn.functional", "torch._C._nn")):
        return "F." + name
    return "torch." + name


def is_inplace(name: str) -> bool:
    short = name.rsplit(".", 1)[-1]
    return (short.endswith("_") and not short.endswith("__")) or short in _INPLACE_DUNDERS


def tensor_shapes(args: Any, kwargs: dict) -> tuple[tuple[int, ...], ...]:
    shapes = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            shapes.append(_shape(a))
        elif isinstance(a, (list, tuple)):
            shapes.extend(_shape(x) for x in a if isinstance(x, torch.Tensor))
    return tuple(shapes)


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    try:
        return tuple(t.shape)
    except (RuntimeError, TypeError):  # a nested tensor has no single shape
        return ()


class OpRecorder(TorchFunctionMode):
    def __init__(self, listener: OpListener) -> None:
        super().__init__()
        self._listener = listener
        self._names: dict[Any, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        listener = self._listener
        if listener.in_hook:
            return func(*args, **kwargs)
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = op_name(func)
        if listener.keeps_values and args and is_inplace(name) and isinstance(args[0], torch.Tensor):
            target = args[0]
            if name.endswith("__setitem__") and len(args) > 1:
                try:
                    target = target[args[1]]  # only the indexed region is written
                except Exception:  # noqa: BLE001 - an index only the real op understands: assume all of it
                    target = args[0]
            listener.protect(target)
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            listener.op_failed(name, tensor_shapes(args, kwargs), e)
            raise
        if isinstance(out, torch.Tensor):
            listener.op_done(name, tensor_shapes(args, kwargs), (_shape(out),), dtype_name(out.dtype))
        elif isinstance(out, (tuple, list)):
            tensors = [t for t in out if isinstance(t, torch.Tensor)]
            if tensors:
                listener.op_done(name, tensor_shapes(args, kwargs), tuple(_shape(t) for t in tensors),
                                 dtype_name(tensors[0].dtype))
        return out
