"""Capture: forward hooks on every module, and optionally every torch op.

Design choices (and why):

* **Forward hooks on every module; a tap on our own hook points.** Any
  ``nn.Module`` gets a forward pre-hook and a forward hook per submodule. Our
  GPT's ``HookPoint`` modules (268 in GPT-2 small) are read through their
  ``_tap`` instead: PyTorch's hook dispatch alone cost 7% of a GPT-2-small
  decode step when every module had a hook. A tap runs after any user forward
  hook on that hook point, so it records the value the model goes on to use.
* **Hooks are per model, routing is per thread.** A model shared between
  browser sessions gets one pre-hook and one forward hook per module, installed
  once and reference-counted. Each hook looks up the tracer active *on the
  calling thread* for that model and hands it the tensors; with none active it
  returns at once. So two traces running at the same time in two threads on
  one model never see each other's tensors, and neither waits for the other.
* **The hot path stores raw tuples**; ``TensorRecord`` objects, statistics and
  tables are built afterwards (post-processing), so tracing costs little.
* **Values are references, copied only when needed.** A kept value is the
  detached tensor itself. Before a module flagged ``inplace=True`` (ReLU,
  Dropout, …) or an in-place op seen at op level overwrites it, the kept value
  is swapped for a copy; anything else that mutates a kept tensor — in this
  step or any later one — is caught by its version counter when the value is
  read, and that value is dropped with a note rather than shown wrong.
  ``copy="all"`` copies everything instead.
* **Op level uses PyTorch's own interception** (``TorchFunctionMode``), which is
  thread-local, active only while the traced forward runs.
* **A step is one top-level module call**: it starts when a module is entered
  with nothing else on this thread's module stack and ends when that call
  returns. For a model called as ``model(x)`` that is one forward pass.
"""

from __future__ import annotations

import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tracer.records import TraceErrorInfo
from tracer.store import DEFAULT_BUDGET_BYTES
from tracer.trace import ModuleInfo, Trace

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    # records hold only ints and strings, which the garbage collector stops tracking
    name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name

CAPTURE_LEVELS = ("shapes", "values", "ops")
COPY_POLICIES = ("auto", "all")
_MAX_FLATTEN = 256  # nested inputs/outputs beyond this many tensors are not recorded one by one

_thread = threading.local()  # .active: dict[id(model), Tracer]


def _active_tracers() -> dict[int, Tracer]:
    active = getattr(_thread, "active", None)
    if active is None:
        active = _thread.active = {}
    return active


def flatten_tensors(obj: Any, prefix: str = "", out: list | None = None, depth: int = 0) -> list:
    """``[(slot, tensor)]`` for every tensor inside nested tuples, lists and dicts."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
    elif depth < 6 and len(out) < _MAX_FLATTEN:
        if isinstance(obj, (tuple, list)):
            for i, item in enumerate(obj):
                flatten_tensors(item, f"{prefix}[{i}]", out, depth + 1)
        elif isinstance(obj, dict):
            for key, item in obj.items():
                flatten_tensors(item, f"{prefix}.{key}", out, depth + 1)
    return out


class _InstalledHooks:
    """One pre-hook and one forward hook on every module of one model."""

    def __init__(self, model: nn.Module) -> None:
        from model.gpt import HookPoint  # only to tell hook points apart; any nn.Module works

        self.model_id = id(model)
        self.modules: list[ModuleInfo] = []
        self.handles: list[Any] = []
        self.taps: list[Any] = []
        self.users = 0
        for index, (path, module) in enumerate(model.named_modules()):
            is_hook = isinstance(module, HookPoint)
            params = sum(p.numel() for p in module.parameters())
            self.modules.append(ModuleInfo(path, type(module).__name__, params, is_hook))
            if is_hook:  # identity: nothing runs inside it, so its value is all there is to record
                self.taps.append(module.add_tap(self._hook_point(index)))
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(index), with_kwargs=True))

    def _pre(self, index: int):
        model_id = self.model_id

        def pre_hook(module, args, kwargs):
            active = getattr(_thread, "active", None)
            if active:
                tracer = active.get(model_id)
                if tracer is not None:
                    tracer._enter(index, module, args, kwargs)

        return pre_hook

    def _post(self, index: int):
        model_id = self.model_id

        def post_hook(module, args, kwargs, output):
            active = getattr(_thread, "active", None)
            if active:
                tracer = active.get(model_id)
                if tracer is not None:
                    tracer._exit(index, module, output)

        return post_hook

    def _hook_point(self, index: int):
        model_id = self.model_id

        def hook_point_tap(value):
            active = getattr(_thread, "active", None)
            if active:
                tracer = active.get(model_id)
                if tracer is not None:
                    tracer._hook_point(index, value)

        return hook_point_tap

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for handle in self.taps:
            handle.remove()
        self.taps.clear()


_installed: dict[int, _InstalledHooks] = {}
_installed_lock = threading.Lock()
_pending_releases: list[int] = []  # releases that could not take the lock (list.append is atomic)


def _drain_pending() -> None:
    """Apply deferred releases; the caller holds ``_installed_lock``."""
    while _pending_releases:
        _release_locked(_pending_releases.pop())


def _acquire(model: nn.Module) -> _InstalledHooks:
    with _installed_lock:
        _drain_pending()
        hooks = _installed.get(id(model))
        if hooks is None:
            hooks = _installed[id(model)] = _InstalledHooks(model)
        hooks.users += 1
        _drain_pending()  # building the hooks may have run the garbage collector, and with it finalizers
        return hooks


def _release_locked(model_id: int) -> None:
    hooks = _installed.get(model_id)
    if hooks is None:
        return
    hooks.users -= 1
    if hooks.users <= 0:
        hooks.remove()
        del _installed[model_id]


def _release(model_id: int) -> None:
    """Called by ``Tracer.close`` or by a garbage-collected tracer's finalizer — which can run at
    any allocation, even inside ``_acquire`` on this very thread. So never wait for the lock:
    when it is taken, leave the release for whoever holds it."""
    if _installed_lock.acquire(blocking=False):
        try:
            _release_locked(model_id)
            _drain_pending()
        finally:
            _installed_lock.release()
    else:
        _pending_releases.append(model_id)


def hooks_installed(model: nn.Module) -> int:
    """How many tracers currently hold hooks on ``model`` (0: the model is untouched)."""
    with _installed_lock:
        _drain_pending()
        hooks = _installed.get(id(model))
        return hooks.users if hooks else 0


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    if name == "__get__" and hasattr(func, "__self__"):  # a property such as Tensor.T
        return "Tensor." + getattr(func.__self__, "__name__", "attribute")
    qual = getattr(func, "__qualname__", name) or name
    if qual.startswith(("TensorBase.", "Tensor.", "_TensorBase.")):
        return "Tensor." + qual.split(".", 1)[1]
    module = getattr(func, "__module__", None) or ""
    if module in ("torch.nn.functional", "torch._C._nn"):
        return "F." + name
    if module.startswith("torch.nn.functional") or module.startswith("torch._C._nn"):
        return "F." + name
    return "torch." + name


_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__",
                    "__setitem__"}


def _is_inplace(name: str) -> bool:
    short = name.rsplit(".", 1)[-1]
    return (short.endswith("_") and not short.endswith("__")) or short in _INPLACE_DUNDERS


class _OpRecorder(TorchFunctionMode):
    def __init__(self, tracer: Tracer) -> None:
        super().__init__()
        self.tracer = tracer
        self._names: dict[Any, str] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tracer = self.tracer
        if tracer._in_hook:
            return func(*args, **kwargs)
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = op_name(func)
        if tracer._keep_values and args and _is_inplace(name) and isinstance(args[0], torch.Tensor):
            target = args[0]
            if name.endswith("__setitem__") and len(args) > 1:
                try:
                    target = target[args[1]]  # only the indexed region is written
                except Exception:  # noqa: BLE001 - an index only the real op understands: assume all
                    target = args[0]
            tracer._protect(target)
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            tracer._op_failed(name, args, kwargs, e)
            raise
        tracer._op_done(name, args, kwargs, out)
        return out


def _shapes(args: Any, kwargs: dict) -> tuple[tuple[int, ...], ...]:
    shapes = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            shapes.append(tuple(a.shape))
        elif isinstance(a, (list, tuple)):
            shapes.extend(tuple(x.shape) for x in a if isinstance(x, torch.Tensor))
    return tuple(shapes)


class Tracer:
    """Record every tensor a model's modules (and, at "ops" level, every torch op) produce.

    ``with Tracer(model, capture="values") as tr: model(tokens)`` then ``tr.trace``.

    capture: "shapes" keeps shape/dtype only; "values" also keeps the tensors
        (detached, on CPU, within ``budget_bytes``); "ops" adds every torch
        function and tensor method call, with input and output shapes.
    budget_bytes: most bytes of tensor values the trace may hold (default 512 MiB).
    copy: "auto" (copy only what an in-place op would change) or "all".
    trace: an existing ``Trace`` to continue (steps keep counting).
    """

    def __init__(
        self,
        model: nn.Module,
        capture: str = "values",
        *,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        copy: str = "auto",
        trace: Trace | None = None,
    ) -> None:
        if capture not in CAPTURE_LEVELS:
            raise ValueError(f"capture must be one of {CAPTURE_LEVELS}, got {capture!r}")
        if copy not in COPY_POLICIES:
            raise ValueError(f"copy must be one of {COPY_POLICIES}, got {copy!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"Tracer needs an nn.Module, got {type(model).__name__}")
        self.model = model
        self.capture = capture
        self._keep_values = capture in ("values", "ops")
        self._copy_all = copy == "all"
        self.trace = trace if trace is not None else Trace(capture=capture, budget_bytes=budget_bytes)
        self._hooks: _InstalledHooks | None = None
        self._finalizer: weakref.finalize | None = None
        self._stack: list[tuple[int, int, Any, Any]] = []
        self._calls: dict[int, int] = {}
        self._step_first_record = 0
        self._step_started = 0.0
        self._in_hook = False
        self._ops: _OpRecorder | None = None
        self._failed_op: tuple[str, tuple, str, int] | None = None
        self._step_in_progress = False
        self._raw = self.trace._raw
        self._put = self.trace.values.put
        self._step_number = -1
        if capture == "ops":
            self._enter = self._with_flag(self._enter)
            self._exit = self._with_flag(self._exit)
            self._hook_point = self._with_flag(self._hook_point)

    # -- lifetime ----------------------------------------------------------------
    def install(self) -> Tracer:
        """Put the hooks on the model (once; ``close`` or garbage collection removes them)."""
        if self._hooks is None:
            self._hooks = _acquire(self.model)
            self.trace._set_modules(self._hooks.modules)
            self._finalizer = weakref.finalize(self, _release, id(self.model))
        return self

    def close(self) -> None:
        """Remove this tracer's claim on the model's hooks."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            self._hooks = None

    @contextmanager
    def active(self) -> Iterator[Trace]:
        """Route this thread's forwards of the model to this tracer while the block runs."""
        self.install()
        active = _active_tracers()
        key = id(self.model)
        if key in active:
            raise RuntimeError("another Tracer is already active for this model on this thread")
        active[key] = self
        try:
            yield self.trace
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            active.pop(key, None)
            if self._ops is not None:
                self._stop_ops()
            self._stack.clear()

    def __enter__(self) -> Tracer:
        self._ctx = self.active()
        self._ctx.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            self._ctx.__exit__(exc_type, exc, tb)
        except BaseException:
            pass  # the original exception propagates below, with the note added in _fail
        finally:
            self.close()
        return False

    # -- hot path ----------------------------------------------------------------
    # Hooks call self._enter / self._exit / self._hook_point. Outside "ops" capture these are the
    # plain methods below; at op level __init__ wraps them so that the op recorder ignores the
    # tracer's own tensor calls (detach, data_ptr, …) while a hook runs.
    def _enter(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        stack = self._stack
        if index == 0 and stack:
            self._abort_step()  # the model is called again: an earlier forward raised and was caught
        if not stack:
            self._begin_step()
        calls = self._calls
        call = calls.get(index, 0)
        calls[index] = call + 1
        stack.append((index, call, args, kwargs))
        if self._keep_values and getattr(module, "inplace", False) is True:
            for a in args:
                if isinstance(a, torch.Tensor):
                    self._protect(a)
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:
            self._add(index, "input", "[0]", call, args[0])
            return
        for slot, t in flatten_tensors(args):
            self._add(index, "input", slot, call, t)
        if kwargs:
            for slot, t in flatten_tensors(kwargs):
                self._add(index, "input", slot, call, t)

    def _hook_point(self, index: int, output: Any) -> None:
        if not self._stack:
            return  # a hook point called on its own, outside any forward of the model
        calls = self._calls
        call = calls.get(index, 0)
        calls[index] = call + 1
        if type(output) is torch.Tensor:
            self._add(index, "hook", "", call, output)
        else:
            for slot, t in flatten_tensors(output):
                self._add(index, "hook", slot, call, t)

    def _exit(self, index: int, module: nn.Module, output: Any) -> None:
        stack = self._stack
        if not stack or stack[-1][0] != index:
            return  # a module that started before this tracer became active
        call = stack.pop()[1]
        if type(output) is torch.Tensor:
            self._add(index, "output", "", call, output)
        else:
            for slot, t in flatten_tensors(output):
                self._add(index, "output", slot, call, t)
        if not stack:
            self._end_step()

    def _add(self, module_index: int, kind: str, slot: str, call: int, t: torch.Tensor) -> None:
        raw = self._raw
        index = len(raw)
        step = self._step_number
        dtype = t.dtype
        raw.append((index, step, module_index, kind, slot, call, tuple(t.shape),  # RawRecord's fields
                    _DTYPE_NAMES.get(dtype) or _dtype_name(dtype), "cpu" if t.is_cpu else t.device.type,
                    t.data_ptr()))
        if self._keep_values:
            value = t.detach() if t.requires_grad else t  # without autograd history there is nothing to cut
            if not value.is_cpu:
                value = value.to("cpu")
            elif self._copy_all:
                value = value.clone()
            reason = self._put(index, step, value)
            if reason:
                self.trace._notes[index] = reason

    def _with_flag(self, method):
        def flagged(*args):
            self._in_hook = True
            try:
                return method(*args)
            finally:
                self._in_hook = False

        return flagged

    def _protect(self, t: torch.Tensor) -> None:
        """``t`` is about to be changed in place: kept values with elements in it get a private copy."""
        store = self.trace.values
        indices = store.overlapping(t)
        for index in indices:
            value = store.get(index)
            if value is not None:
                store.replace(index, value.clone())

    # -- steps ---------------------------------------------------------------------
    def _begin_step(self) -> None:
        trace = self.trace
        self._calls = {}
        self._failed_op = None
        self._step_first_record = len(trace._raw)
        self._step_in_progress = True
        trace._begin_step()
        self._step_number = trace._step
        if self.capture == "ops":
            self._start_ops()
        self._step_started = time.perf_counter()

    def _end_step(self) -> None:
        seconds = time.perf_counter() - self._step_started
        if self._ops is not None:
            self._stop_ops()
        self._step_in_progress = False
        self.trace._end_step(seconds)

    def _abort_step(self) -> None:
        """Close a step whose forward raised inside the traced block and was caught there."""
        if self._ops is not None:
            self._stop_ops()
        self._stack.clear()
        self._step_in_progress = False
        self.trace._end_step(time.perf_counter() - self._step_started, failed=True)

    def _start_ops(self) -> None:
        self._ops = _OpRecorder(self)
        self._ops.__enter__()

    def _stop_ops(self) -> None:
        ops, self._ops = self._ops, None
        if ops is not None:
            ops.__exit__(None, None, None)

    # -- op level ------------------------------------------------------------------
    def _op_done(self, name: str, args: tuple, kwargs: dict, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            outs = ((tuple(out.shape),), out.dtype)
        else:
            tensors = [t for _, t in flatten_tensors(out)] if isinstance(out, (tuple, list)) else []
            if not tensors:
                return
            outs = (tuple(tuple(t.shape) for t in tensors), tensors[0].dtype)
        module = self._stack[-1][0] if self._stack else -1
        self.trace._raw_ops.append((self.trace._step, name, module, _shapes(args, kwargs), outs[0], outs[1], ""))

    def _op_failed(self, name: str, args: tuple, kwargs: dict, exc: Exception) -> None:
        module = self._stack[-1][0] if self._stack else -1
        shapes = _shapes(args, kwargs)
        message = f"{type(exc).__name__}: {exc}"
        self.trace._raw_ops.append((self.trace._step, name, module, shapes, (), None, message))
        self._failed_op = (name, shapes, message, id(exc))

    # -- failure -------------------------------------------------------------------
    def _fail(self, exc: BaseException) -> None:
        """A forward raised: keep what was recorded, say where it failed, annotate the exception."""
        if self._ops is not None:
            self._stop_ops()
        trace = self.trace
        modules = trace._modules
        if self._stack:
            index, call, args, kwargs = self._stack[-1]
            info = modules[index]
            inputs = [(slot, tuple(t.shape)) for slot, t in flatten_tensors(args)]
            inputs += [(slot, tuple(t.shape)) for slot, t in flatten_tensors(kwargs)]
            stack = [modules[i].path or "model" for i, *_ in self._stack]
            source = _source_line(exc, self.model.get_submodule(info.path) if info.path else self.model)
            error = TraceErrorInfo(
                step=trace._step, exception_type=type(exc).__name__, message=str(exc), module=info.path,
                module_type=info.type, module_stack=stack, input_shapes=inputs, source=source,
            )
        else:
            error = TraceErrorInfo(
                step=trace._step, exception_type=type(exc).__name__, message=str(exc), module="",
                module_type="(outside any module)", module_stack=[], input_shapes=[],
            )
        if self._failed_op is not None and self._failed_op[3] == id(exc):
            error.op, error.op_input_shapes = self._failed_op[0], list(self._failed_op[1])
        if self._step_in_progress:
            self._step_in_progress = False
            trace._end_step(time.perf_counter() - self._step_started, failed=True)
        self._stack.clear()
        trace.error = error
        trace.exception = exc
        if hasattr(exc, "add_note"):
            exc.add_note(error.describe())


def _source_line(exc: BaseException, module: nn.Module) -> str:
    """``file:line: code`` of the innermost frame running inside ``module``'s forward."""
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_locals.get("self") is module:
            summary = traceback.extract_tb(tb, limit=1)[0]
            found = f"{summary.filename}:{summary.lineno}: {(summary.line or '').strip()}"
        tb = tb.tb_next
    if found:
        return found
    frames = traceback.extract_tb(exc.__traceback__)
    for summary in reversed(frames):
        if "/torch/" not in summary.filename:
            return f"{summary.filename}:{summary.lineno}: {(summary.line or '').strip()}"
    return ""
