"""The Tracer: records every tensor a model's modules produce, one forward pass (step) at a time.

* **A step is one top-level module call**: it starts when a module is entered
  with nothing else on this thread's module stack and ends when that call
  returns. For a model called as ``model(x)`` that is one forward pass.
* **The hot path appends one plain tuple per tensor** (``TraceLog.add_record``);
  ``TensorRecord`` objects, statistics and tables are built when looked at.
* **Values are references, copied only when needed.** A kept value is the
  detached tensor itself. Before a module flagged ``inplace=True`` (ReLU,
  Dropout, …) or an in-place op seen at op level overwrites it, the kept value
  is swapped for a copy; any other mutation — in this step or any later one —
  is caught by its version counter when the value is read, and that value is
  dropped with a note rather than shown wrong. Not caught: writes through
  ``.data`` (it has a version counter of its own), through a NumPy view from ``.numpy()``, or by native code
  writing the storage directly. Tensors made under
  ``torch.inference_mode`` have no version counter, so those are copied when
  kept. ``copy="all"`` copies everything. A value off the CPU (a GPU's) is copied to the host as it is
  recorded — started there, ``non_blocking`` on CUDA, and waited for once when the step ends, never once
  per record (``tracer.storage._host``).
* **NaN and ±∞ are flagged at every capture level.** With values, from the
  statistics of each value; with shapes only, from the smallest and largest
  element of each residual-stream hook point and the logits (a bad value shows
  there in the block where it first appears), or of every module's tensors for
  models without hook points. A small tensor's check waits until a flag is read
  (or too many wait), then all are read together; one the model writes in place
  before that is marked not checked, with a note (``tracer.storage._log``).

The hook machinery is in ``tracer.capture._hooks``, op capture in ``tracer.capture._ops``,
failure reports in ``tracer.capture._forensics``, the storage in ``tracer.storage``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import DerivedAttention, GPTConfig, PathNote, identity_of
from gpt_shape_tracer.model.sources import on_meta
from gpt_shape_tracer.tracer.capture import _hooks as hooks
from gpt_shape_tracer.tracer.capture._forensics import describe_failure
from gpt_shape_tracer.tracer.capture._interventions import Intervention, RunningMeans, _Applied, applied, check
from gpt_shape_tracer.tracer.capture._nested import MAX_TENSORS, flatten_tensors
from gpt_shape_tracer.tracer.capture._ops import OpRecorder
from gpt_shape_tracer.tracer.reading import Trace
from gpt_shape_tracer.tracer.storage import DEFAULT_BUDGET_BYTES, TraceLog
from gpt_shape_tracer.tracer.storage.records import FORWARD_CAPTURES, ModuleInfo

COPY_POLICIES = ("auto", "all")
STREAM_HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_logits")  # NaN-checked in shapes mode


def flagged_modules(modules: list[ModuleInfo]) -> list[int]:
    """Module indices whose tensors shapes capture checks for NaN/±∞: the residual stream and logits
    hook points, or every module of a model that has no hook points."""
    if any(m.is_hook for m in modules):
        return [i for i, m in enumerate(modules) if m.is_hook and m.path.rsplit(".", 1)[-1] in STREAM_HOOKS]
    return list(range(len(modules)))


class Tracer:
    """Record every tensor a model's modules (and, at "ops" level, every torch op) produce.

    ``with Tracer(model, capture="values") as tr: model(tokens)`` then ``tr.trace``.

    capture: "shapes" keeps shape/dtype only; "values" also keeps the tensors
        (detached, on CPU, within ``budget_bytes``); "ops" adds every torch
        function and tensor method call, with input and output shapes.
    budget_bytes: most bytes of tensor values the trace may hold in memory (default 512 MiB).
    spill_bytes: "keep every value": what the budget evicts is written to a private temporary file, up to this
        many bytes, and read back when asked for (default 0: evicted values keep their statistics only).
    copy: "auto" (copy only what an in-place op would change) or "all".
    trace: an existing ``Trace`` to continue (steps keep counting).
    interventions: ablations and patches (``tracer.ablate``, ``tracer.patch``) applied during every traced
        forward, and recorded with each step; checked against the model here, before any forward.
    """

    def __init__(self, model: nn.Module, capture: str = "values", *, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                 copy: str = "auto", trace: Trace | None = None, interventions: Sequence[Intervention] = (),
                 running_means: RunningMeans | None = None, spill_bytes: int = 0) -> None:
        if capture == "gradients":
            raise ValueError("a Tracer records forwards; gradients come from a backward pass: "
                             "tracer.gradient_trace(generation, step, loss)")
        if capture not in FORWARD_CAPTURES:
            raise ValueError(f"capture must be one of {FORWARD_CAPTURES}, got {capture!r}")
        if copy not in COPY_POLICIES:
            raise ValueError(f"copy must be one of {COPY_POLICIES}, got {copy!r}")
        if not isinstance(model, nn.Module):
            raise TypeError(f"Tracer needs an nn.Module, got {type(model).__name__}")
        if trace is not None and trace.capture != capture:
            raise ValueError(f"the trace to continue was captured at {trace.capture!r}, not {capture!r}")
        if capture != "shapes" and on_meta(model):
            raise ValueError(f"this model's weights are on the meta device (a dry run): it has shapes but no values "
                             f"to keep, so it is traced with capture='shapes', not {capture!r}")
        check(interventions, model)
        self.interventions = tuple(interventions)
        # a "mean" ablation averages over every position the run has fed, across steps (not one step's)
        self.running_means: RunningMeans = running_means if running_means is not None else {}
        self.model = model
        self.capture = capture
        self.keeps_values = capture in ("values", "ops")
        self.in_hook = False  # read by the op recorder: the tracer's own tensor calls are not the model's
        self.trace = trace if trace is not None else Trace(TraceLog(capture, budget_bytes, copy_all=copy == "all",
                                                                          spill_bytes=spill_bytes))
        self.trace.attach_model(model)
        self._log = self.trace.log
        self._record = self._log.add_record
        self._hooks: hooks.InstalledHooks | None = None
        self._finalizer: weakref.finalize | None = None
        self._stack: list[tuple[int, int, Any, Any]] = []
        self._inplace: frozenset[int] = frozenset()  # the model's in-place modules (InstalledHooks.inplace)
        self._calls: dict[int, int] = self._log.calls  # the step's calls of each module (TraceLog.calls)
        self._last_exited: tuple | None = None
        self._failed_op: tuple[str, tuple, int] | None = None
        self._step_started = 0.0
        self._ops: OpRecorder | None = None
        self._applied: _Applied | None = None
        if capture == "ops":
            # the hook methods wrapped, so that the op recorder skips the tensor calls they make; replaced on this
            # instance (mypy's method-assign) so that a tracer without the op recorder pays nothing on its hot path
            self.on_enter = self._flagged(self.on_enter)  # type: ignore[method-assign]
            self.on_exit = self._flagged(self.on_exit)  # type: ignore[method-assign]
            self.on_hook_point = self._flagged(self.on_hook_point)  # type: ignore[method-assign]
        # a hook point's plain tensor or fused stage, handed straight to the log (it counts the call and checks a
        # step is in progress); at "ops" level through the wrapped method, so the op recorder skips the log's
        # tensor calls
        self.record_hook = self.on_hook_point if capture == "ops" else self._log.add_record
        self.record_derived = self.on_hook_point if capture == "ops" else self._log.add_derived
        # (at "ops" level through _flagged, which holds this tracer weakly: a bound method kept on it would be a cycle)
        self.record_derived_each = self._flagged(self._each_on_hook_point) if capture == "ops" \
            else self._log.add_derived_each

    # -- lifetime ------------------------------------------------------------------------------
    def install(self) -> Tracer:
        """Put the hooks on the model (once; ``close`` or garbage collection removes them)."""
        if self._hooks is None:
            installed = hooks.acquire(self.model)
            self._finalizer = weakref.finalize(self, hooks.release, id(self.model))
            self._hooks = installed
            self._inplace = installed.inplace
            self._log.set_modules(installed.modules, flagged=flagged_modules(installed.modules))
            if isinstance(getattr(self.model, "config", None), GPTConfig):
                self._log.set_model(identity_of(self.model))
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
        if hooks.listener_for(self.model) is not None:  # refuse before taking any hooks: nothing to leak
            raise RuntimeError("another Tracer is already active for this model on this thread")
        self.install()
        hooks.activate(self.model, self)
        try:
            with applied(self.model, self.interventions, self.running_means) as self._applied:
                yield self.trace
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._applied = None
            hooks.deactivate(self.model)
            if self._stack:  # a forward raised and was caught inside the block: its step closed as failed
                self._abort_step()
            self._stop_ops()

    def __enter__(self) -> Tracer:
        self._ctx = self.active()
        try:
            self._ctx.__enter__()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        try:
            self._ctx.__exit__(exc_type, exc, tb)
        except BaseException:
            pass  # the original exception propagates below, with the note added in _fail
        finally:
            self.close()
        return False

    # -- hot path: called by the hooks -----------------------------------------------------------
    def on_enter(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        stack = self._stack
        if index == 0 and stack:
            self._abort_step()  # the model is called again: an earlier forward raised and was caught
        if not stack:
            self._begin_step()
        calls = self._calls
        call = calls.get(index, 0)
        calls[index] = call + 1
        stack.append((index, call, args, kwargs))
        inplace = index in self._inplace
        if inplace and self.keeps_values:
            for a in args:
                if isinstance(a, torch.Tensor):
                    self._log.protect(a)
        if not kwargs and len(args) == 1 and type(args[0]) is torch.Tensor:
            self._record(index, args[0], "input", "[0]", call)
        else:
            self._record_all(index, "input", call, args, "")
            if kwargs:
                self._record_all(index, "input", call, kwargs, "")
        if inplace:  # the module writes its input: NaN/∞ checks held until read are read now, as recorded
            self._log.read_held_flags()

    def on_hook_point(self, index: int, value: Any) -> None:
        if not self._stack:
            return  # a hook point called on its own, outside any forward of the model
        calls = self._calls
        call = calls.get(index, 0)
        calls[index] = call + 1
        if type(value) is torch.Tensor:
            self._record(index, value, "hook", "", call)
        elif type(value) is DerivedAttention:  # a fused attention's [B,H,n,t] record: no value, recomputed on demand
            self._log.add_derived(index, value, call)
        elif type(value) is PathNote:  # said after the eager attention recorded this hook point's value
            calls[index] = call  # not a call of the hook point
            self._log.note_latest(index, value.text)
        else:
            self._record_all(index, "hook", call, value, "")

    def _each_on_hook_point(self, told: list[tuple[int, Any]]) -> None:
        for index, value in told:
            self.on_hook_point(index, value)

    def on_exit(self, index: int, module: nn.Module, output: Any) -> None:
        stack = self._stack
        if not stack or stack[-1][0] != index:
            return  # a module that started before this tracer became active
        entry = stack.pop()
        self._last_exited = entry
        if type(output) is torch.Tensor:
            self._record(index, output, "output", "", entry[1])
        else:
            self._record_all(index, "output", entry[1], output, "")
        if not stack:
            self._end_step()

    def _record_all(self, index: int, kind: str, call: int, obj: Any, prefix: str) -> None:
        items = flatten_tensors(obj, prefix, limit=MAX_TENSORS + 1)
        for slot, t in items[:MAX_TENSORS]:
            self._record(index, t, kind, slot, call)
        if len(items) > MAX_TENSORS:
            self._log.add_note(self._log.n_records - 1, f"more tensors followed in this {kind} and were not "
                                                        f"recorded: at most {MAX_TENSORS} per call")

    def _flagged(self, method):
        # through a weak reference: the wrapper is stored on this instance, and a closure over self (or the
        # bound method) would be a cycle that keeps a finished trace alive until the cyclic collector runs
        func, me = method.__func__, weakref.ref(self)

        def flagged(*args):
            tracer = me()
            if tracer is None:
                return None
            tracer.in_hook = True
            try:
                return func(tracer, *args)
            finally:
                tracer.in_hook = False

        return flagged

    # -- called by the op recorder ------------------------------------------------------------------
    def protect(self, t: torch.Tensor) -> None:
        self._log.protect(t)

    def op_done(self, name: str, input_shapes: tuple, output_shapes: tuple, dtype: str) -> None:
        module = self._stack[-1][0] if self._stack else -1
        self._log.add_op(name, module, input_shapes, output_shapes, dtype)

    def op_failed(self, name: str, input_shapes: tuple, exc: Exception) -> None:
        module = self._stack[-1][0] if self._stack else -1
        self._log.add_op(name, module, input_shapes, (), "", f"{type(exc).__name__}: {exc}")
        self._failed_op = (name, input_shapes, id(exc))

    # -- steps -------------------------------------------------------------------------------------
    def _begin_step(self) -> None:
        step = self._log.begin_step()
        if self._applied is not None:
            self._applied.set_step(step)
        self._calls = self._log.calls
        self._failed_op = None
        self._last_exited = None
        if self.capture == "ops":
            self._ops = OpRecorder(self)
            self._ops.__enter__()
        self._step_started = time.perf_counter()

    def _end_step(self) -> None:
        seconds = time.perf_counter() - self._step_started
        self._stop_ops()
        self._log.end_step(seconds, tuple(iv.record for iv in self.interventions))

    def _abort_step(self) -> None:
        """Close a step whose forward raised inside the traced block and was caught there."""
        self._stop_ops()
        self._stack.clear()
        self._log.fail_step(None, None)

    def _stop_ops(self) -> None:
        ops, self._ops = self._ops, None
        if ops is not None:
            ops.__exit__(None, None, None)

    def _fail(self, exc: BaseException) -> None:
        """A forward raised: keep what was recorded, say where it failed, annotate the exception."""
        self._stop_ops()
        log = self._log
        step = log.step_in_progress if log.step_in_progress is not None else len(log.steps)
        error = describe_failure(exc, step, self.model, log.modules, self._stack, self._last_exited,
                                 self._failed_op)
        log.fail_step(error, exc)
        self._stack.clear()
        if hasattr(exc, "add_note"):
            exc.add_note(error.describe())
