"""The process-wide hook registry: one set of hooks per model, shared by every tracer, routed per thread.

* **Hooks are per model, routing is per thread.** A model shared between
  browser sessions gets one tap per hook point and per module of our GPT, or one
  pre-hook and one forward hook per module of any other model, installed once
  and reference-counted. Each hook looks up
  the listener active *on the calling thread* for that model and hands it the
  tensors; with none active it returns at once. So two traces running at the
  same time in two threads on one model never see each other's tensors, and
  neither waits for the other.
* **Taps, not hooks, on our GPT.** Its ``HookPoint`` modules (268 in GPT-2 small)
  and its other modules (``TappedModule``: 125) are read through their public taps
  (``add_tap``) instead of forward hooks: PyTorch's hook dispatch alone cost 7% of a
  GPT-2-small decode step when every module had a hook. A tap on a hook point, and a
  module tap's ``leave``, run after any forward hook there, so they record the value
  the model goes on to use; a module tap's ``enter`` sees the arguments the module was
  called with. Any other module gets a forward pre-hook and a forward hook. A hook point's
  plain tensor goes to the listener's ``record_hook``, a fused attention's stage to its
  ``record_derived`` — a tracer points both straight at its log — and anything else to
  ``on_hook_point``: most of a decode step's records pass through one Python call fewer. A model's hook point
  taps are one group (``_TapGroup``): a fused attention asks the group once whether its five n × t points are
  listened, and tells it their derived stages in one call (``HookPoint``'s ``listened_each``, ``tell_each``).
* **Release never blocks.** A tracer that is garbage-collected releases its
  claim from a finalizer, which can run at any allocation — even inside
  ``acquire`` on this very thread — so a release that finds the lock taken is
  queued for whoever holds it.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import DerivedAttention, HookPoint, TappedModule
from gpt_shape_tracer.tracer.storage.records import ModuleInfo


class Listener(Protocol):
    """What a tracer offers the hooks (the six calls they make)."""

    def record_hook(self, index: int, value: torch.Tensor) -> None:
        """A hook point's value that is a plain tensor (``on_hook_point`` gets any other value)."""

    def record_derived(self, index: int, value: DerivedAttention) -> None:
        """A fused attention's stage told to its hook point."""

    def record_derived_each(self, told: list[tuple[int, DerivedAttention]]) -> None:
        """A fused attention's stages told to their hook points together, ``(index, stage)`` in order."""

    def on_enter(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None: ...

    def on_exit(self, index: int, module: nn.Module, output: Any) -> None: ...

    def on_hook_point(self, index: int, value: Any) -> None: ...


_Tensor = torch.Tensor
_thread = threading.local()  # .active: dict[id(model), Listener]


def _active() -> dict[int, Listener]:
    active = getattr(_thread, "active", None)
    if active is None:
        active = _thread.active = {}
    return active


def listener_for(model: nn.Module) -> Listener | None:
    return _active().get(id(model))


def activate(model: nn.Module, listener: Listener) -> None:
    """Route this thread's forwards of ``model`` to ``listener`` (one listener per model per thread)."""
    active = _active()
    if id(model) in active:
        raise RuntimeError("another Tracer is already active for this model on this thread")
    active[id(model)] = listener


def deactivate(model: nn.Module) -> None:
    _active().pop(id(model), None)


def module_table(model: nn.Module) -> list[ModuleInfo]:
    """Every module of ``model`` in ``named_modules`` order: a record's module index points into this."""
    return [ModuleInfo(path, type(module).__name__, sum(p.numel() for p in module.parameters()),
                       isinstance(module, HookPoint)) for path, module in model.named_modules()]


class _TapGroup:
    """The hook point taps of one model, as ``HookPoint``'s ``listened_each`` and ``tell_each`` see them: they all
    answer "listening" alike (a listener is active on this thread for the model, or not), so the question is asked
    once for a fused attention's n × t points, and their derived stages are heard in one call."""

    __slots__ = ("model_id",)

    def __init__(self, model_id: int) -> None:
        self.model_id = model_id

    def listening(self) -> bool:
        active = getattr(_thread, "active", None)
        return active is not None and active.get(self.model_id) is not None

    def hear(self, told: list[tuple[_Tap, Any]]) -> None:
        """Each ``(tap, what)`` as the tap would have heard it, in order: a fused layer's stages (all derived) in
        one call to the listener."""
        active = getattr(_thread, "active", None)
        if active:
            listener = active.get(self.model_id)
            if listener is not None:
                stages = []
                for tap, what in told:
                    if type(what) is not DerivedAttention:
                        break
                    stages.append((tap.index, what))
                else:
                    listener.record_derived_each(stages)
                    return
                derived = listener.record_derived
                for tap, what in told:
                    if type(what) is DerivedAttention:
                        derived(tap.index, what)
                    elif type(what) is _Tensor:
                        listener.record_hook(tap.index, what)
                    else:
                        listener.on_hook_point(tap.index, what)


class _Tap:
    """A hook point's tap: hands the value to the listener active on this thread for the model, if any. It says
    whether it reads now (``listening``, ``HookPoint.listened``): with no listener active an attention layer
    need not make its n × t stages real tensors (an untraced forward of a model a tracer is installed on runs
    fused, as one with no tracer installed does). Its ``group`` is the model's ``_TapGroup``."""

    __slots__ = ("group", "index", "model_id")

    def __init__(self, group: _TapGroup, index: int) -> None:
        self.group, self.model_id, self.index = group, group.model_id, index

    def __call__(self, value: Any) -> None:
        active = getattr(_thread, "active", None)
        if active:
            listener = active.get(self.model_id)
            if listener is not None:
                kind = type(value)
                if kind is _Tensor:
                    listener.record_hook(self.index, value)
                elif kind is DerivedAttention:
                    listener.record_derived(self.index, value)
                else:
                    listener.on_hook_point(self.index, value)

    def listening(self) -> bool:
        active = getattr(_thread, "active", None)
        return active is not None and active.get(self.model_id) is not None


class _ModuleTap:
    """A module's tap: hands its calls to the listener active on this thread for the model, if any. A
    ``TappedModule`` calls ``enter`` and ``leave`` itself; any other module has ``enter`` as its forward pre-hook
    and ``hooked`` as its forward hook."""

    __slots__ = ("index", "model_id")

    def __init__(self, model_id: int, index: int) -> None:
        self.model_id, self.index = model_id, index

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        active = getattr(_thread, "active", None)
        if active:
            listener = active.get(self.model_id)
            if listener is not None:
                listener.on_enter(self.index, module, args, kwargs)

    def leave(self, module: nn.Module, output: Any) -> None:
        active = getattr(_thread, "active", None)
        if active:
            listener = active.get(self.model_id)
            if listener is not None:
                listener.on_exit(self.index, module, output)

    def hooked(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """``leave``, as a forward hook registered ``with_kwargs`` calls it."""
        self.leave(module, output)


class InstalledHooks:
    """A tap on every hook point and ``TappedModule`` of one model; one pre-hook and one forward hook on every other
    module."""

    def __init__(self, model: nn.Module) -> None:
        self.model_id = id(model)
        self.modules = module_table(model)
        self._handles: list[Any] = []
        self._group = _TapGroup(self.model_id)
        self.users = 0
        # modules that overwrite their input (``inplace=True``: ReLU, Dropout, …), read once here: on a module
        # without the attribute ``getattr`` goes through nn.Module's failing lookup, ~1.5 µs per call of a step
        inplace: set[int] = set()
        for index, (_, module) in enumerate(model.named_modules()):
            # a hook point is an identity: nothing runs inside it, so its value is all there is to record
            if isinstance(module, HookPoint):
                self._handles.append(module.add_tap(self._tap(index)))
                continue
            tap = _ModuleTap(self.model_id, index)
            if isinstance(module, TappedModule):
                self._handles.append(module.add_tap(tap))
                continue
            if getattr(module, "inplace", False) is True:
                inplace.add(index)
            self._handles.append(module.register_forward_pre_hook(tap.enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(tap.hooked, with_kwargs=True))
        self.inplace = frozenset(inplace)

    def _tap(self, index: int) -> _Tap:
        return _Tap(self._group, index)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


_installed: dict[int, InstalledHooks] = {}
_installed_lock = threading.Lock()
_pending_releases: list[int] = []  # releases that could not take the lock (list.append is atomic)


def _drain_pending() -> None:
    """Apply deferred releases; the caller holds ``_installed_lock``."""
    while _pending_releases:
        _release_locked(_pending_releases.pop())


def acquire(model: nn.Module) -> InstalledHooks:
    with _installed_lock:
        _drain_pending()
        hooks = _installed.get(id(model))
        if hooks is None:
            hooks = _installed[id(model)] = InstalledHooks(model)
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


def release(model_id: int) -> None:
    """Called by ``Tracer.close`` or by a garbage-collected tracer's finalizer (see the module doc)."""
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
