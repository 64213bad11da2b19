"""The trace: records of one run, post-processed on demand into records, stats and tables."""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import pandas as pd
import torch

from tracer.records import OpRecord, StepInfo, TensorRecord, TensorStats, TraceErrorInfo
from tracer.stats import dtype_name, summarize, tensor_stats
from tracer.store import DEFAULT_BUDGET_BYTES, ValueStore

NEG_INF_EXPECTED = ("hook_mask", "hook_masked_scores")  # hook names whose −∞ entries are the causal mask
_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


@dataclass(slots=True)
class ModuleInfo:
    path: str
    type: str
    params: int
    is_hook: bool


class RawRecord(NamedTuple):
    """What the hot path stores: enough to build a TensorRecord later.

    ``Trace._raw`` holds these as plain tuples of ints and strings (field order
    as here): the garbage collector stops tracking such tuples, while it keeps
    scanning every instance of a tuple subclass — on a long trace that made
    full collections take 100+ ms."""

    index: int
    step: int
    module: int  # index into Trace._modules
    kind: str
    slot: str
    call: int
    shape: Any  # torch.Size (or tuple, after loading)
    dtype: Any  # torch.dtype (or its name, after loading)
    device: Any
    data_ptr: int  # where the first element lives: records with equal data_ptr, shape and stride alias


STEP, MODULE, DATA_PTR = (RawRecord._fields.index(f) for f in ("step", "module", "data_ptr"))


def raw_record(trace: Trace, index: int) -> RawRecord:
    return RawRecord._make(trace._raw[index])


def layer_of(path: str) -> int | None:
    m = _LAYER.search(path)
    return int(m.group(1)) if m else None


def record_name(path: str, kind: str, slot: str, call: int) -> str:
    base = path or "model"
    if call:
        base = f"{base}#{call}"
    if kind == "hook":
        return base + slot
    return f"{base}:{'in' if kind == 'input' else 'out'}{slot}"


def _dtype_str(dtype: Any) -> str:
    return dtype_name(dtype) if isinstance(dtype, torch.dtype) else str(dtype)


def _itemsize(dtype: Any) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    return getattr(torch, str(dtype)).itemsize


class Trace:
    """Every tensor record of one or more forward passes (steps), and their kept values."""

    def __init__(self, capture: str = "values", budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.capture = capture
        self.values = ValueStore(budget_bytes)
        self.values.on_evict = self._on_evict
        self.steps: list[StepInfo] = []
        self.meta: dict[str, Any] = {}
        self.error: TraceErrorInfo | None = None
        self.exception: BaseException | None = None
        self._modules: list[ModuleInfo] = []
        self._raw: list[tuple] = []  # RawRecord fields, as plain tuples
        self._raw_ops: list[tuple] = []
        self._records: list[TensorRecord] = []
        self._by_name: dict[tuple[int, str], int] = {}
        self._notes: dict[int, str] = {}
        self._stats: dict[int, TensorStats] = {}
        self._step = -1
        self._next_step = 0
        self._mask_ptr_cache: dict[int, tuple[int, set[int]]] = {}

    # -- building (called by the Tracer) ------------------------------------------
    def _set_modules(self, modules: list[ModuleInfo]) -> None:
        if self._modules and [m.path for m in self._modules] != [m.path for m in modules]:
            raise ValueError("this trace was recorded on a model with different modules")
        self._modules = modules

    def _next_index(self) -> int:
        return len(self._raw)

    def _begin_step(self) -> None:
        if self._raw and self._raw[-1][STEP] >= self._next_step:
            self.discard_from(self._next_step)  # leftovers of a failed attempt at this step
        self._step = self._next_step
        self.error = None
        self.exception = None

    def _end_step(self, seconds: float, failed: bool = False) -> None:
        if failed:
            return
        first = next((i for i in range(len(self._raw) - 1, -1, -1) if self._raw[i][STEP] != self._step), -1) + 1
        info = StepInfo(step=self._step, n=-1, t=-1, cache_length_before=-1, cache_length_after=-1,
                        use_cache=False, seconds=seconds, first_record=first, end_record=len(self._raw))
        self.steps.append(info)
        self._next_step += 1

    def discard_from(self, step: int) -> None:
        """Forget every record, op and value of ``step`` and later."""
        cut = next((i for i, r in enumerate(self._raw) if r[STEP] >= step), len(self._raw))
        for index in range(cut, len(self._raw)):
            self.values.drop(index, note=None)
            self._notes.pop(index, None)
            self._stats.pop(index, None)
        del self._raw[cut:]
        del self._records[cut:]
        self._by_name = {k: v for k, v in self._by_name.items() if v < cut}
        self._mask_ptr_cache.clear()
        self._raw_ops = [op for op in self._raw_ops if op[0] < step]
        self.steps = [s for s in self.steps if s.step < step]
        self._next_step = min(self._next_step, step)

    def _on_evict(self, index: int, tensor: torch.Tensor, note: str, stats: bool) -> None:
        if stats and index not in self._stats:
            self._stats[index] = tensor_stats(tensor)
        self._notes[index] = note

    # -- records -------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        return len(self.steps)

    def _materialize(self) -> None:
        modules = self._modules
        for row in self._raw[len(self._records) :]:
            raw = RawRecord._make(row)
            info = modules[raw.module]
            shape = tuple(raw.shape)
            numel = math.prod(shape)
            name = record_name(info.path, raw.kind, raw.slot, raw.call)
            rec = TensorRecord(
                index=raw.index, step=raw.step, name=name, module=info.path, module_type=info.type,
                kind=raw.kind, slot=raw.slot, call=raw.call, shape=shape, dtype=_dtype_str(raw.dtype),
                device=str(raw.device), numel=numel, nbytes=numel * _itemsize(raw.dtype),
                module_params=info.params, layer=layer_of(info.path),
            )
            self._records.append(rec)
            self._by_name.setdefault((raw.step, name), raw.index)

    def _refresh(self, rec: TensorRecord, stats: bool) -> TensorRecord:
        rec.has_value = rec.index in self.values
        rec.value_note = self._notes.get(rec.index, "")
        if stats and rec.index not in self._stats and rec.has_value:
            self._stats[rec.index] = tensor_stats(self.values.get(rec.index))
        rec.stats = self._stats.get(rec.index)
        return rec

    @property
    def records(self) -> list[TensorRecord]:
        self._materialize()
        return [self._refresh(r, stats=False) for r in self._records]

    def record(self, name: str, step: int | None = None) -> TensorRecord:
        """The record called ``name`` at ``step`` (default: the latest step that has it)."""
        self._materialize()
        index = self._find(name, step)
        return self._refresh(self._records[index], stats=True)

    def _find(self, name: str, step: int | None) -> int:
        candidates = [name, f"{name}:out"] if ":" not in name else [name]
        steps = [step] if step is not None else sorted({s for s, _ in self._by_name}, reverse=True)
        for s in steps:
            for n in candidates:
                if (s, n) in self._by_name:
                    return self._by_name[(s, n)]
        known = sorted({n for _, n in self._by_name})
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" at step {step}" if step is not None else ""
        raise KeyError(f"no record named {name!r}{where}{hint}")

    def get(self, name: str, step: int | None = None) -> torch.Tensor | None:
        """The tensor recorded as ``name`` at ``step`` (latest by default), or None when only its
        shape and statistics were kept. Raises KeyError for a name that was never recorded."""
        self._materialize()
        return self.values.get(self._find(name, step))

    def value_at(self, index: int) -> torch.Tensor | None:
        return self.values.get(index)

    def stats(self, name: str, step: int | None = None) -> TensorStats | None:
        return self.record(name, step).stats

    def summary(self, name: str, step: int | None = None) -> str:
        rec = self.record(name, step)
        return summarize(rec.shape, rec.dtype, rec.stats, self._neg_inf_ok(rec))

    def neg_inf_expected(self, name: str, step: int | None = None) -> bool:
        """Whether −∞ in this record is the causal/padding mask doing its job: the mask hooks,
        and any input that is the very same tensor as a mask hook's (a block's mask argument)."""
        self._materialize()
        try:
            return self._neg_inf_ok(self._records[self._find(name, step)])
        except KeyError:
            return name.rsplit(".", 1)[-1].split("#")[0] in NEG_INF_EXPECTED

    def _neg_inf_ok(self, rec: TensorRecord) -> bool:
        if rec.name.rsplit(".", 1)[-1].split("#")[0] in NEG_INF_EXPECTED:
            return True
        ptr = self._raw[rec.index][DATA_PTR]
        if not ptr:
            return False
        cached = self._mask_ptr_cache.get(rec.step)
        if cached is None or cached[0] != len(self._records):
            ptrs = {
                self._raw[i][DATA_PTR]
                for (s, n), i in self._by_name.items()
                if s == rec.step and n.rsplit(".", 1)[-1] in NEG_INF_EXPECTED
            }
            cached = self._mask_ptr_cache[rec.step] = (len(self._records), ptrs)
        return ptr in cached[1]

    def filter(
        self,
        *,
        step: int | None = None,
        layer: int | None = None,
        module: str | None = None,
        kind: str | None = None,
        name: str | None = None,
    ) -> list[TensorRecord]:
        """Records matching every given criterion. ``module`` matches that module and
        everything inside it; ``name`` is a substring or a glob pattern (``*hook_q``)."""
        self._materialize()
        out = []
        for rec in self._records:
            if step is not None and rec.step != step:
                continue
            if layer is not None and rec.layer != layer:
                continue
            if module is not None and not (rec.module == module or rec.module.startswith(module + ".")):
                continue
            if kind is not None and rec.kind != kind:
                continue
            if name is not None:
                if any(c in name for c in "*?[") and not fnmatch.fnmatchcase(rec.name, name):
                    continue
                if not any(c in name for c in "*?[") and name not in rec.name:
                    continue
            out.append(self._refresh(rec, stats=False))
        return out

    def first_anomaly(self, step: int | None = None) -> TensorRecord | None:
        """The first record (in call order) holding NaN, +∞, or a −∞ no mask explains."""
        self._materialize()
        for rec in self._records:
            if step is not None and rec.step != step:
                continue
            self._refresh(rec, stats=True)
            s = rec.stats
            if s is not None and (s.nan or s.pos_inf or (s.neg_inf and not self._neg_inf_ok(rec))):
                return rec
        return None

    # -- ops -----------------------------------------------------------------------
    @property
    def ops(self) -> list[OpRecord]:
        out = []
        for i, (step, op, module, ins, outs, dtype, error) in enumerate(self._raw_ops):
            path = self._modules[module].path if module >= 0 else "(outside modules)"
            out.append(OpRecord(i, step, op, path, ins, outs, _dtype_str(dtype) if dtype is not None else "", error))
        return out

    def ops_frame(self, step: int | None = None, module: str | None = None) -> pd.DataFrame:
        rows = []
        for op in self.ops:
            if step is not None and op.step != step:
                continue
            if module is not None and not (op.module == module or op.module.startswith(module + ".")):
                continue
            rows.append({
                "index": op.index, "step": op.step, "op": op.op, "module": op.module or "model",
                "input_shapes": op.input_shapes, "output_shapes": op.output_shapes,
                "dtype": op.output_dtype, "error": op.error,
            })
        return pd.DataFrame(rows, columns=["index", "step", "op", "module", "input_shapes", "output_shapes",
                                           "dtype", "error"])

    # -- tables --------------------------------------------------------------------
    FRAME_COLUMNS = (
        "index", "step", "name", "module", "module_type", "kind", "slot", "call", "layer", "shape", "dtype",
        "device", "numel", "nbytes", "params", "has_value", "value_note", "min", "max", "mean", "std", "nan",
        "pos_inf", "neg_inf", "summary",
    )

    def to_frame(
        self,
        step: int | None = None,
        *,
        layer: int | None = None,
        module: str | None = None,
        kind: str | None = None,
        name: str | None = None,
        stats: bool = True,
    ) -> pd.DataFrame:
        """One row per tensor record. ``stats=False`` skips computing statistics."""
        rows = []
        for rec in self.filter(step=step, layer=layer, module=module, kind=kind, name=name):
            self._refresh(rec, stats=stats)
            s = rec.stats
            rows.append({
                "index": rec.index, "step": rec.step, "name": rec.name, "module": rec.module or "model",
                "module_type": rec.module_type, "kind": rec.kind, "slot": rec.slot, "call": rec.call,
                "layer": rec.layer, "shape": rec.shape, "dtype": rec.dtype, "device": rec.device,
                "numel": rec.numel, "nbytes": rec.nbytes, "params": rec.module_params,
                "has_value": rec.has_value, "value_note": rec.value_note,
                "min": s.min if s else math.nan, "max": s.max if s else math.nan,
                "mean": s.mean if s else math.nan, "std": s.std if s else math.nan,
                "nan": s.nan if s else 0, "pos_inf": s.pos_inf if s else 0, "neg_inf": s.neg_inf if s else 0,
                "summary": summarize(rec.shape, rec.dtype, s, bool(s and s.neg_inf) and self._neg_inf_ok(rec)),
            })
        frame = pd.DataFrame(rows, columns=list(self.FRAME_COLUMNS))
        frame["layer"] = frame["layer"].astype("Int64")
        return frame

    def names(self, step: int | None = None) -> list[str]:
        self._materialize()
        return [r.name for r in self._records if step is None or r.step == step]

    @property
    def bytes_kept(self) -> int:
        return self.values.nbytes

    def bytes_kept_by_step(self) -> dict[int, int]:
        """Bytes of kept values per step (a storage shared across steps counts for the first)."""
        seen: set[int] = set()
        out: dict[int, int] = {}
        for index, value in self.values.items():
            storage = value.untyped_storage()
            key = storage.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            step = self._raw[index][STEP]
            out[step] = out.get(step, 0) + storage.nbytes()
        return out

    # -- files ---------------------------------------------------------------------
    def save(self, path) -> None:
        from tracer.io import save_trace

        save_trace(self, path)

    @classmethod
    def load(cls, path) -> Trace:
        from tracer.io import load_trace

        return load_trace(path)

    def __repr__(self) -> str:
        return (f"Trace(capture={self.capture!r}, steps={self.n_steps}, records={len(self._raw)}, "
                f"ops={len(self._raw_ops)}, bytes_kept={self.bytes_kept})")
