"""``HookPoint``: the identity module every intermediate passes through, so that a forward hook sees it under a
stable name (its module path, ``blocks.0.attn.hook_q``), and the taps the tracer adds to it; ``TappedModule``: the
base of our GPT's other modules, which a tracer reads through taps too (on entry and on return).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module


def _global_forward_hooks() -> bool:
    """Whether forward hooks registered for every module (the public ``register_module_forward_hook``) exist: they
    may replace any module's output.

    torch keeps them, and their backward kin, in private module globals; reading those lets a module with no hooks
    of any kind skip ``nn.Module.__call__`` (``bench/bench_model.py`` prints what that saves per forward).
    If a torch release renames them, ``getattr`` answers True and every call takes the full, correct
    path; ``tests/model/test_model_hooks.py`` pins that a global hook still sees every module."""
    return bool(getattr(_torch_module, "_global_forward_hooks", True)
                or getattr(_torch_module, "_global_forward_pre_hooks", True))


def _torch_runs_more(module: nn.Module) -> bool:
    """Whether ``nn.Module.__call__`` would do more than call ``forward``: a hook of any kind on this module or on
    every module, or an in-place ``module.compile()``."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or module._compiled_call_impl is not None) or _global_forward_hooks() \
        or bool(getattr(_torch_module, "_global_backward_hooks", True)
                or getattr(_torch_module, "_global_backward_pre_hooks", True))


def _always() -> bool:
    return True


class TapHandle:
    """Returned by ``add_tap``; ``remove()`` takes the tap off again (idempotent)."""

    __slots__ = ("_point", "_tap")

    def __init__(self, point: HookPoint | TappedModule, tap) -> None:
        self._point, self._tap = point, tap

    def remove(self) -> None:
        self._point.remove_tap(self._tap)


class HookPoint(nn.Module):
    """Identity module. It exists so that a plain forward hook on it sees the
    tensor under a stable name: the module path, e.g. ``blocks.0.attn.hook_q``.

    A *tap* (``add_tap(fn)``) is a read-only listener: ``fn(tensor)`` is called
    with the value the model goes on to use, after every forward hook on this
    module has run — an ablation or a patch made by a hook included. It cannot
    change the value, and it is cheaper than a forward hook (PyTorch's hook
    dispatch costs about a microsecond per module call, and a GPT-2 small
    forward passes 268 hook points); a tracer reads the model through taps."""

    def __init__(self) -> None:
        super().__init__()
        self.taps: tuple = ()  # in the order added; read them here, change them through add_tap / remove_tap

    def add_tap(self, tap) -> TapHandle:
        """Call ``tap(tensor)`` on every value passing this point, until the handle is removed."""
        self.taps = (*self.taps, tap)
        return TapHandle(self, tap)

    def remove_tap(self, tap) -> None:
        self.taps = tuple(t for t in self.taps if t is not tap)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def tell(self, what: object) -> None:
        """Hand the taps a description instead of a tensor: a fused attention announces its ``[B,H,n,t]``
        records this way (``DerivedAttention``), and a tracer records them as derived (no value)."""
        for tap in self.taps:
            tap(what)

    @property
    def listened(self) -> bool:
        """Whether a tap reads this point now. A tap may say it is idle: one with a ``listening()`` method that
        returns False (a tracer's, installed on the model while no trace is active on this thread) reads
        nothing, so a forward it would only pass through runs as one nobody reads (fused attention)."""
        return listened_each((self,))[0]

    @property
    def written(self) -> bool:
        """Whether forward hooks (which may replace the value) sit on this point, or on every module."""
        return bool(self._forward_hooks or self._forward_pre_hooks) or _global_forward_hooks()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _torch_runs_more(self):
            x = super().__call__(x)  # identity, then the forward hooks, which may replace x
        for tap in self.taps:
            tap(x)
        return x


def listened_each(points: Sequence[HookPoint]) -> list[bool]:
    """``point.listened`` for each point, with the taps of one group asked once.

    A tap may belong to a ``group`` (an object with ``listening()`` and ``hear(told)``: a tracer's taps on one
    model share one) whose taps answer alike at any moment; one question per group, not per tap, serves a
    fused attention's five n × t points. A tap without a group answers through its own ``listening()``, or
    is always listening."""
    answers: dict[Any, bool] = {}
    heard = []
    for point in points:
        yes = False
        for tap in point.taps:
            group = getattr(tap, "group", None)
            if group is None:
                yes = getattr(tap, "listening", _always)()
            else:
                yes = answers.get(group)  # type: ignore[assignment]
                if yes is None:
                    yes = answers[group] = group.listening()
            if yes:
                break
        heard.append(yes)
    return heard


def tell_each(told: Sequence[tuple[HookPoint, object]]) -> None:
    """``point.tell(what)`` for each pair, in order, with the taps of one group (``listened_each``) told
    together: their group hears ``[(tap, what), …]`` in one call (``group.hear``). A traced decode step of GPT-2
    small tells 60 derived stages; one call per layer instead of three Python calls per stage. A tap without a
    group is called in its place, after everything told before it has been heard."""
    together: dict[Any, list[tuple[Any, object]]] = {}
    for point, what in told:
        for tap in point.taps:
            group = getattr(tap, "group", None)
            if group is None:
                _hear(together)
                tap(what)
            else:
                heard = together.get(group)
                if heard is None:
                    heard = together[group] = []
                heard.append((tap, what))
    _hear(together)


def _hear(together: dict[Any, list[tuple[Any, object]]]) -> None:
    """Hand each group what it has been told so far, and forget it."""
    if together:
        for group, heard in together.items():
            group.hear(heard)
        together.clear()


class TappedModule(nn.Module):
    """A module of our GPT that a tracer reads through taps instead of forward hooks.

    A tap (``add_tap(tap)``) is an object with ``enter(module, args, kwargs)``, called before the module runs (before
    any forward pre-hook on it: the arguments it was called with), and ``leave(module, output)``, called after it
    returned (after any forward hook on it: the output the model goes on to use); neither changes anything. Without
    taps and without torch hooks of any kind, the call goes straight to ``forward``: ``nn.Module.__call__``'s
    checks and a forward hook pair cost 2–3 µs per module call, 125 calls in a GPT-2 small forward (a tracer read
    them with hooks until ``bench/bench_tracer.py`` said a decode step paid that for every module)."""

    taps: tuple = ()  # in the order added; read them here, change them through add_tap / remove_tap

    def add_tap(self, tap) -> TapHandle:
        """Call ``tap.enter`` and ``tap.leave`` around every call of this module, until the handle is removed."""
        self.taps = (*self.taps, tap)
        return TapHandle(self, tap)

    def remove_tap(self, tap) -> None:
        self.taps = tuple(t for t in self.taps if t is not tap)

    def __call__(self, *args, **kwargs):
        taps = self.taps
        for tap in taps:
            tap.enter(self, args, kwargs)
        if _torch_runs_more(self) or torch.jit.is_tracing():
            out = super().__call__(*args, **kwargs)
        else:
            out = self.forward(*args, **kwargs)
        for tap in taps:
            tap.leave(self, out)
        return out
