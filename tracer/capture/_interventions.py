"""What if: switch a head or a hook point off (ablate) or put another run's value in it (patch).

``ablate(name, head=None, how="zero" | "mean")`` and ``patch(name, value_or_trace, head=None,
positions=None)`` make ``Intervention``s; ``Tracer(…, interventions=[…])`` and
``TracedGeneration(…, interventions=[…])`` apply them through ordinary forward
hooks on the named hook points. A tracer's taps run after every forward hook,
so the trace records the value the model went on to use — the patched one —
and each step records which interventions were active (``StepRecord``).

Everything that can be checked before a forward is: the name must be a hook
point of the model, the head inside that hook's head axis, the positions inside
its position axis; with the forward's sizes known (``check_shapes``) a patch's
value must fit. Each refusal is an ``InterventionError`` naming the problem.

The hooks act only on the thread that activated them, so a model shared by
several browser sessions is changed for the session that asked, and no other.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import HookPoint, dims_of, resolve, spec_for
from gpt_shape_tracer.tracer.reading import Trace
from gpt_shape_tracer.tracer.storage.records import ABLATIONS, InterventionRecord


class InterventionError(ValueError):
    """An intervention that cannot be applied to this model or this forward; the message says why."""


@dataclass(frozen=True)
class Intervention:
    """One change to one hook point. ``record`` is what a trace keeps (plain facts, no tensors)."""

    record: InterventionRecord
    value: torch.Tensor | None = None  # patch: the value itself
    source: Trace | None = None  # patch: take the value the same hook had at the same step of this trace

    @property
    def name(self) -> str:
        return self.record.name

    def describe(self) -> str:
        return self.record.describe()


def ablate(name: str, head: int | None = None, how: str = "zero") -> Intervention:
    """Replace the hook's value (or one head's slice of it) by zeros, or by its mean over the positions
    the run has fed so far ("mean": at a one-token decode step, the mean of every position up to it)."""
    if how not in ABLATIONS:
        raise InterventionError(f"ablate how={how!r}: choose 'zero' or 'mean'")
    return Intervention(InterventionRecord(name=name, how=how, head=_index(head, "head"), positions=None, source=""))


def patch(name: str, value_or_trace: torch.Tensor | Trace, head: int | None = None,
          positions: Sequence[int] | None = None) -> Intervention:
    """Put another value in the hook: a tensor (the hook's shape, or one head's / the chosen positions'
    slice of it), or a trace, whose record of this hook at the same step is used."""
    pos = None if positions is None else tuple(_whole(p, "position") for p in positions)
    if isinstance(value_or_trace, Trace):
        source = value_or_trace.generation.info.prompts[0][:60] if value_or_trace.generation else "another trace"
        return Intervention(InterventionRecord(name, "patch", _index(head, "head"), pos, f"from the run of {source!r}"),
                            source=value_or_trace)
    if not isinstance(value_or_trace, torch.Tensor):
        raise InterventionError(f"patch needs a tensor or a Trace, got {type(value_or_trace).__name__}")
    shape = list(value_or_trace.shape)
    return Intervention(InterventionRecord(name, "patch", _index(head, "head"), pos, f"a given tensor {shape}"),
                        value=value_or_trace.detach())


def _index(value: object, what: str) -> int | None:
    return None if value is None else _whole(value, what)


def _whole(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InterventionError(f"{what} must be a whole number ≥ 0, got {value!r}")
    return value


def _axes(name: str, config) -> tuple[str, ...]:
    spec = spec_for(name, config) if config is not None else None
    return spec.shape if spec is not None else ()


def _no_attention(name: str, config: Any) -> str | None:
    """For a hook point inside block L's attention (``blocks.L.attn.…``) where a hybrid model's layer L has no
    attention, what that layer is (``GPTConfig.no_attention_sentence``); else None."""
    parts = name.split(".")
    if not (len(parts) >= 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] == "attn"):
        return None
    layer = int(parts[1])
    if config is None or not hasattr(config, "no_attention_sentence") or layer >= config.n_layer:
        return None
    return config.no_attention_sentence(layer)


def check(interventions: Sequence[Intervention], model: nn.Module) -> None:
    """Refuse, before any forward, what cannot apply to ``model``: unknown names, heads or positions
    on a hook without such an axis, heads out of range."""
    if not interventions:  # every traced forward calls this: no walk over every module when there is nothing to check
        return
    points = {n: m for n, m in model.named_modules() if isinstance(m, HookPoint)}
    config = getattr(model, "config", None)
    for iv in interventions:
        if not isinstance(iv, Intervention):
            raise InterventionError(f"expected an Intervention (from ablate or patch), got {type(iv).__name__}")
        rec = iv.record
        said = _no_attention(rec.name, config)
        if said is not None:  # a hybrid model's state layer: no heads, no Q, K, V or pattern to change
            attending = ", ".join(map(str, getattr(config, "attention_layers", ())))
            raise InterventionError(f"{rec.name}: {said}, so it has no softmax attention head to switch off or patch; "
                                    f"choose a layer with attention ({attending})")
        if rec.name not in points:
            import difflib

            close = difflib.get_close_matches(rec.name, list(points), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise InterventionError(f"{rec.name!r} is not a hook point of this model{hint}")
        axes = _axes(rec.name, config)
        if rec.head is not None:
            if len(axes) < 2 or axes[1] not in ("H", "G"):
                raise InterventionError(f"{rec.name} has no head axis ({list(axes)}): give head=None")
            heads = resolve(axes[1], dims_of(config, 1, 1, 1))
            if rec.head >= heads:
                raise InterventionError(f"head {rec.head} is out of range: {rec.name} has {heads} heads (0 … "
                                        f"{heads - 1})")
        if rec.positions is not None and "n" not in axes:
            raise InterventionError(f"{rec.name} has no position axis n ({list(axes)}): give positions=None")


def check_shapes(interventions: Sequence[Intervention], model: nn.Module, batch: int, new: int, keys: int,
                 step: int) -> None:
    """With the forward's sizes known: positions inside n, and every patch value the size of its target."""
    config = getattr(model, "config", None)
    for iv in interventions:
        rec = iv.record
        axes = _axes(rec.name, config)
        if not axes or config is None:
            continue
        dims = dims_of(config, batch, new, keys)
        dims["B|1"] = batch
        shape = [resolve(a, dims) for a in axes]
        if rec.positions is not None and max(rec.positions) >= shape[axes.index("n")]:
            raise InterventionError(f"position {max(rec.positions)} is outside the {shape[axes.index('n')]} new "
                                    f"position(s) of this forward ({rec.name})")
        if rec.how == "patch":
            value = _patch_value(iv, step)
            target = _target_shape(shape, axes, rec)
            if value is not None and list(value.shape) not in (target, shape):
                raise InterventionError(f"the patch for {rec.name} has shape {list(value.shape)}, but this forward's "
                                        f"{'slice' if target != shape else 'tensor'} is {target}")


def _target_shape(shape: list[int], axes: tuple[str, ...], rec: InterventionRecord) -> list[int]:
    target = list(shape)
    if rec.positions is not None:
        target[axes.index("n")] = len(rec.positions)
    if rec.head is not None:
        del target[1]
    return target


def _patch_value(iv: Intervention, step: int) -> torch.Tensor | None:
    if iv.value is not None:
        return iv.value
    if iv.source is None:
        return None
    try:
        value = iv.source.get(iv.record.name, step)
    except KeyError:
        raise InterventionError(f"the source trace has no {iv.record.name} at step {step}") from None
    if value is None:
        raise InterventionError(f"the source trace kept no value of {iv.record.name} at step {step} (capture "
                                "values, or raise its budget)")
    return value


RunningMeans = dict[int, tuple[torch.Tensor, int]]  # intervention's index → (running sum, count) for "mean"


def _target(out: torch.Tensor, rec, axes: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                      int | None]:
    """(view, target, position index, position axis): the slice of a hook's value an intervention acts on."""
    view = out[:, rec.head] if rec.head is not None else out
    pos_axis = axes.index("n") - (1 if rec.head is not None else 0) if "n" in axes else None
    if rec.positions is not None and pos_axis is not None:
        index = torch.tensor(rec.positions, dtype=torch.long)
        return view, view.index_select(pos_axis, index), index, pos_axis
    return view, view, None, pos_axis


def _reduced(target: torch.Tensor, pos_axis: int | None) -> tuple[torch.Tensor, int]:
    """The sum of ``target`` over the batch and the positions (kept as size-1 axes), and how many it summed."""
    reduce = tuple(d for d in range(target.dim()) if d == 0 or d == pos_axis)
    return target.sum(dim=reduce, keepdim=True), math.prod(target.shape[d] for d in reduce)


def running_means_before(trace, step: int, interventions: Sequence[Intervention], model: nn.Module) -> RunningMeans:
    """The running sums a "mean" ablation would hold entering ``step`` of the run ``trace`` recorded: its hook's
    values at steps 0 … step − 1 (the positions fed before), so that replaying one decode step alone averages
    over every position up to it, as the run would — not over its one new position. Steps whose values were
    not kept are left out of the mean."""
    config = getattr(model, "config", None)
    means: RunningMeans = {}
    for i, iv in enumerate(interventions):
        if iv.record.how != "mean":
            continue
        axes = _axes(iv.name, config)
        for s in range(step):
            value = trace.get(iv.name, s) if trace.has(iv.name, s) else None
            if value is None:
                continue
            _, target, _, pos_axis = _target(value, iv.record, axes)
            total, count = _reduced(target.to(torch.float32), pos_axis)
            before = means.get(i)
            means[i] = (total + before[0], count + before[1]) if before is not None else (total, count)
    return means


class _Applied:
    """The forward hooks of one set of interventions, acting on one thread only. ``means`` holds the running
    sums of the "mean" ablations; the caller keeps it across steps (a Tracer keeps one for its whole run)."""

    def __init__(self, model: nn.Module, interventions: Sequence[Intervention],
                 means: RunningMeans | None = None) -> None:
        self._owner = threading.get_ident()
        self._step = 0
        self._means: RunningMeans = means if means is not None else {}
        config = getattr(model, "config", None)
        self._handles = []
        by_name: dict[str, list[tuple[int, Intervention]]] = {}
        for i, iv in enumerate(interventions):
            by_name.setdefault(iv.name, []).append((i, iv))
        for name, ivs in by_name.items():
            axes = _axes(name, config)
            hook = model.get_submodule(name).register_forward_hook(self._hook(ivs, axes))
            self._handles.append(hook)

    def set_step(self, step: int) -> None:
        self._step = step

    def _hook(self, ivs: list[tuple[int, Intervention]], axes: tuple[str, ...]):
        def hook(module, args, output):
            if threading.get_ident() != self._owner:
                return None  # another session's forward of a shared model: untouched
            out = output.clone()
            for i, iv in ivs:
                self._apply(i, iv, out, axes)
            return out

        return hook

    def _apply(self, i: int, iv: Intervention, out: torch.Tensor, axes: tuple[str, ...]) -> None:
        rec = iv.record
        view, target, index, pos_axis = _target(out, rec, axes)
        if rec.how == "zero":
            new = torch.zeros_like(target)
        elif rec.how == "mean":  # the mean over every position fed so far in this run, this step's included
            added, added_count = _reduced(target.to(torch.float32), pos_axis)
            before = self._means.get(i)
            total, count = (before[0] + added, before[1] + added_count) if before is not None else (added, added_count)
            self._means[i] = (total, count)
            new = (total / count).to(target.dtype).expand_as(target)
        else:
            value = _patch_value(iv, self._step)
            if value is None:
                raise InterventionError(f"the patch for {rec.name} has neither a value nor a trace to take it from")
            if list(value.shape) == list(out.shape) and (rec.head is not None or rec.positions is not None):
                value = value[:, rec.head] if rec.head is not None else value  # a whole tensor: take the slice
                if index is not None:
                    assert pos_axis is not None  # index is set only where the hook has a position axis
                    value = value.index_select(pos_axis, index)
            if value.shape != target.shape:
                raise InterventionError(f"the patch for {rec.name} has shape {list(value.shape)}, this forward's "
                                        f"slice is {list(target.shape)}")
            new = value.to(target.dtype)
        if index is not None:
            assert pos_axis is not None  # as above
            view.index_copy_(pos_axis, index, new)
        else:
            view.copy_(new)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@contextmanager
def applied(model: nn.Module, interventions: Sequence[Intervention],
            means: RunningMeans | None = None) -> Iterator[_Applied]:
    """Apply ``interventions`` to this thread's forwards of ``model`` while the block runs; ``means``, when
    given, carries the "mean" ablations' running sums from one step to the next."""
    check(interventions, model)
    hooks = _Applied(model, interventions, means)
    try:
        yield hooks
    finally:
        hooks.remove()
