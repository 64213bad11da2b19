"""The read side of a trace: records, values, statistics and tables, built on demand from a ``TraceLog``.

Records are materialised a step at a time (``TensorRecord``, frozen), with
their symbolic axes resolved once from the hook table. Whether a value is
still kept and its statistics are asked of the trace when needed, because they
change after a record exists (the budget evicts, statistics are lazy).
"""

from __future__ import annotations

import bisect
import difflib
import fnmatch
import math
import weakref
from collections import OrderedDict
from typing import Any, ClassVar

import pandas as pd
import torch

from gpt_shape_tracer.tracer.reading._axes import AxisResolver
from gpt_shape_tracer.tracer.reading._facts import GenerationFacts
from gpt_shape_tracer.tracer.storage import RawRecord, TraceLog, summarize
from gpt_shape_tracer.tracer.storage.records import (
    Finite,
    ModelIdentity,
    OpRecord,
    StepRecord,
    TensorRecord,
    TensorStats,
    TraceErrorInfo,
)

# hook names whose −∞ entries are the mask's work (compressed attention's block bias over its entries, and its
# indexer's scores of entries not yet complete: model/sources/_hf_compressed.py)
NEG_INF_EXPECTED = ("hook_mask", "hook_masked_scores", "hook_compressed_mask", "hook_index_scores")
# the mask a transformers model hands its layers (an additive mask: −∞ where a key is hidden). Also known as the
# tensor our hook_mask recorded, by its address, where that layer ran eager; a fused layer's hook_mask is derived
# (no tensor), so the argument is known by its name too
MASK_ARGUMENT = "attention_mask"
FRAME_COLUMNS = (
    "index", "step", "index_in_step", "name", "module", "module_type", "kind", "slot", "call", "layer", "shape",
    "axes", "dtype", "device", "numel", "nbytes", "params", "has_value", "value_note", "finite", "min", "max",
    "mean", "std", "nan", "pos_inf", "neg_inf", "summary",
)


HOOK_VALUED = ("hook", "grad")  # records of a hook point's value x, or of ∂L/∂x: named and shaped like x


def record_name(path: str, kind: str, slot: str, call: int) -> str:
    base = path or "model"
    if call:
        base = f"{base}#{call}"
    if kind in HOOK_VALUED:
        return base + slot
    return f"{base}:{'in' if kind == 'input' else 'out'}{slot}"


def hook_of(name: str) -> str:
    """``blocks.3.attn.hook_mask#1`` → ``hook_mask``: the hook point's own name, without path or call."""
    return name.rsplit(".", 1)[-1].split("#")[0].split(":")[0]


def block_of(path: str) -> int | None:
    """The layer index in a module path: the first number in it (``blocks.3.attn`` → 3, Hugging Face's
    ``transformer.h.0.mlp`` → 0); None outside the repeated blocks."""
    return next((int(part) for part in path.split(".") if part.isdigit()), None)


class Trace:
    """Every tensor record of one or more forward passes (steps), and their kept values."""

    # tracer.reading._derived, which reads a derived attention stage (value, statistics, flag) from the kept Q and K:
    # set by tracer/reading/__init__.py, since it reads through tracer.reading._regions, which imports this module
    derived_reader: ClassVar[Any] = None

    def __init__(self, log: TraceLog) -> None:
        self._log = log
        self._records: list[TensorRecord] = []
        self._by_name: dict[tuple[int, str], int] = {}
        # tracer.reading._regions' memo of derived patterns: each row's softmax normaliser (n numbers per head,
        # so that a second view of a head reads only the cells it shows), overviews and statistics; bounded
        self.attention_memo: OrderedDict[tuple, object] = OrderedDict()
        # tracer.reading._derived's whole recomputed values, by (epoch, record); bounded by bytes
        self.derived_memo: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._epoch = log.epoch
        self._config = None
        self._config_for: ModelIdentity | None = None
        self._live_model: weakref.ref | None = None

    def attach_model(self, model) -> None:
        """The live model this trace belongs to (not saved): lets the logit lens and attribution use its
        weights. The tracer attaches its model; a loaded trace gets one only when its digest matches."""
        self._live_model = weakref.ref(model)

    @property
    def live_model(self):
        return self._live_model() if self._live_model is not None else None

    @property
    def log(self) -> TraceLog:
        """The write side (for the tracer that continues this trace, and for io)."""
        return self._log

    # -- what the trace is ----------------------------------------------------------------------
    @property
    def capture(self) -> str:
        return self._log.capture

    @property
    def dry_run(self) -> bool:
        """Whether this trace was recorded on the meta device (a dry run): shapes and dtypes, no values."""
        return self._log.n_records > 0 and self._log.raw(0).device == "meta"

    @property
    def budget_bytes(self) -> int:
        return self._log.budget_bytes

    @property
    def bytes_kept(self) -> int:
        return self._log.bytes_kept

    @property
    def model(self) -> ModelIdentity | None:
        return self._log.model

    @property
    def steps(self) -> tuple[StepRecord, ...]:
        return self._log.steps

    @property
    def n_steps(self) -> int:
        return len(self._log.steps)

    @property
    def error(self) -> TraceErrorInfo | None:
        return self._log.error

    @property
    def exception(self) -> BaseException | None:
        return self._log.exception

    @property
    def generation(self) -> GenerationFacts | None:
        """The generation this trace records (prompts, tokens, sampling, each step's facts), if any."""
        info = self._log.generation
        if info is None:
            return None
        return GenerationFacts(info, self._log.generation_steps, self._log.comparisons)

    @property
    def config(self):
        """The model's config (a ``GPTConfig``) when the trace knows the model, else None."""
        identity = self._log.model
        if identity is not self._config_for:
            self._config_for, self._config = identity, _config_from(identity)
        return self._config

    # -- records -----------------------------------------------------------------------------------
    def _materialize(self) -> None:
        log = self._log
        if self._epoch != log.epoch:
            self._records, self._by_name, self._epoch = [], {}, log.epoch
        if len(self._records) >= log.n_records:
            return
        bounds = [(s.first_record, s.end_record) for s in log.steps]
        done = bounds[-1][1] if bounds else 0
        if done < log.n_records:
            bounds.append((done, log.n_records))  # a failed attempt's leftovers (or a step in progress)
        for first, end in bounds:
            if end <= len(self._records):
                continue
            if first < len(self._records):  # a step in progress, partly materialised: redo it whole
                for rec in self._records[first:]:
                    self._by_name.pop((rec.step, rec.name), None)
                del self._records[first:]
            self._materialize_step(log.raw_rows(first, end), first)

    def _materialize_step(self, rows: list[tuple], first: int) -> None:
        modules = self._log.modules
        raws = [RawRecord._make(row) for row in rows]
        names = [record_name(modules[r.module].path, r.kind, r.slot, r.call) for r in raws]
        masks = {r.data_ptr for r, n in zip(raws, names) if r.data_ptr and hook_of(n) in NEG_INF_EXPECTED}
        resolver = AxisResolver(self.config)
        axes = [resolver.axes(n, tuple(r.shape)) if r.kind in HOOK_VALUED or n.endswith("in[0]") else (None, "")
                for r, n in zip(raws, names)]
        # a module's input or output is usually the very tensor a hook point beside it saw: it has that tensor's
        # axes. The nearest such record, not any: the allocator hands a freed tensor's memory to a later one within
        # a step, so the same address and shape further on may be another tensor (a layer's [B,n,d_qkv] and the
        # logits' [B,n,V] where V = d_qkv)
        by_tensor: dict[tuple[int, tuple[int, ...]], list[int]] = {}
        for i, (r, a) in enumerate(zip(raws, axes)):
            if a[0] is not None and r.data_ptr:
                by_tensor.setdefault((r.data_ptr, tuple(r.shape)), []).append(i)
        for i, (raw, name, (rec_axes, note)) in enumerate(zip(raws, names, axes)):
            if rec_axes is None and (near := by_tensor.get((raw.data_ptr, tuple(raw.shape)))):
                at = bisect.bisect(near, i)  # near is in record order: the closest is just before or at ``at``
                j = near[at - 1] if at == len(near) or (at > 0 and i - near[at - 1] <= near[at] - i) else near[at]
                rec_axes, note = axes[j]
            info = modules[raw.module]
            rec = TensorRecord(
                index=raw.number, step=raw.step, name=name, module=info.path, module_type=info.type, kind=raw.kind,
                slot=raw.slot, call=raw.call, shape=tuple(raw.shape), dtype=str(raw.dtype), device=str(raw.device),
                layer=block_of(info.path), module_params=info.params, axes=rec_axes, axes_note=note,
                neg_inf_expected=hook_of(name) in NEG_INF_EXPECTED or (raw.data_ptr != 0 and raw.data_ptr in masks)
                or (raw.kind == "input" and raw.slot.endswith(MASK_ARGUMENT)),
                index_in_step=raw.number - first,
            )
            self._records.append(rec)
            self._by_name.setdefault((raw.step, name), raw.number)

    @property
    def records(self) -> list[TensorRecord]:
        self._materialize()
        return list(self._records)

    def record(self, name: str, step: int | None = None) -> TensorRecord:
        """The record called ``name`` at ``step`` (default: the latest step that has it): shape, dtype,
        bytes, axes. Statistics are a separate call (``stats``), computed only when asked for."""
        self._materialize()
        return self._records[self._find(name, step)]

    def _lookup(self, name: str, step: int | None) -> int | None:
        candidates = [name, f"{name}:out"] if ":" not in name else [name]
        steps = [step] if step is not None else sorted({s for s, _ in self._by_name}, reverse=True)
        for s in steps:
            for n in candidates:
                if (s, n) in self._by_name:
                    return self._by_name[(s, n)]
        return None

    def _find(self, name: str, step: int | None) -> int:
        index = self._lookup(name, step)
        if index is not None:
            return index
        known = sorted({n for _, n in self._by_name})
        close = difflib.get_close_matches(name, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        where = f" at step {step}" if step is not None else ""
        raise KeyError(f"no record named {name!r}{where}{hint}")

    def has(self, name: str, step: int | None = None) -> bool:
        self._materialize()
        return self._lookup(name, step) is not None

    def get(self, name: str, step: int | None = None) -> torch.Tensor | None:
        """The tensor recorded as ``name`` at ``step`` (latest by default), or None when only its
        shape and statistics were kept. Raises KeyError for a name that was never recorded."""
        return self.value(self.record(name, step))

    def to_activation_dict(self, step: int = 0) -> dict[str, torch.Tensor]:
        """Every hook point's kept value of ``step`` by its name, in the order the forward reached them (a
        gradients trace: every ∂L/∂x). Values evicted past the budget are left out: ``get`` says None for them."""
        out: dict[str, torch.Tensor] = {}
        for rec in self.filter(step=step):
            if rec.kind in HOOK_VALUED:
                value = self.value(rec)
                if value is not None:
                    out[rec.name] = value
        return out

    @property
    def recomputed_bytes(self) -> int:
        """Bytes of the derived stages' whole values readers recomputed and this trace remembers (``derived_memo``,
        bounded by tracer.reading._derived.WHOLE_MEMO_BYTES): memory beside the values budget."""
        return sum(v.numel() * v.element_size() for v in self.derived_memo.values())

    def value(self, rec: TensorRecord) -> torch.Tensor | None:
        """The record's kept value; for a derived attention stage (the fused kernel ran) the whole tensor recomputed
        from the layer's kept Q and K up to ``model.gpt.WHOLE_DERIVED`` elements (tracer.reading._derived)."""
        value = self._log.value(rec.index)
        if value is None and self._log.derived(rec.index) is not None:
            return self.derived_reader.whole_value(self, rec)
        return value

    def has_value(self, rec: TensorRecord) -> bool:
        if self._log.derived(rec.index) is not None:
            return self.derived_reader.recomputable(self, rec)
        return self._log.has_value(rec.index)

    def value_note(self, rec: TensorRecord) -> str:
        self._log.has_value(rec.index)  # looking checks the version counter: a mutated value gets its note now
        return self._log.note(rec.index)

    def stats(self, name_or_record: str | TensorRecord, step: int | None = None) -> TensorStats | None:
        """Statistics of a record (computed once, when first asked for), or None without values."""
        rec = name_or_record if isinstance(name_or_record, TensorRecord) else self.record(name_or_record, step)
        stats = self._log.stats(rec.index)
        if stats is None and self._log.derived(rec.index) is not None:
            return self.derived_reader.derived_stats(self, rec)
        return stats

    def finite_flag(self, rec: TensorRecord) -> int:
        flag = self._log.finite_flag(rec.index)
        if flag == Finite.UNKNOWN and self._log.derived(rec.index) is not None:
            return self.derived_reader.derived_flag(self, rec)
        return flag

    def summary(self, name_or_record: str | TensorRecord, step: int | None = None) -> str:
        rec = name_or_record if isinstance(name_or_record, TensorRecord) else self.record(name_or_record, step)
        return summarize(rec.shape, rec.dtype, self.stats(rec), rec.neg_inf_expected, self.finite_flag(rec),
                         dry_run=rec.device == "meta")

    def filter(self, *, step: int | None = None, layer: int | None = None, module: str | None = None,
               kind: str | None = None, name: str | None = None) -> list[TensorRecord]:
        """Records matching every given criterion. ``module`` matches that module and
        everything inside it; ``name`` is a substring or a glob pattern (``*hook_q``)."""
        self._materialize()
        records = self._records
        if step is not None:
            bounds = self._step_bounds(step)
            records = records[bounds[0]:bounds[1]] if bounds else []
        glob = name is not None and any(c in name for c in "*?[")
        out = []
        for rec in records:
            if layer is not None and rec.layer != layer:
                continue
            if module is not None and not (rec.module == module or rec.module.startswith(module + ".")):
                continue
            if kind is not None and rec.kind != kind:
                continue
            if name is not None and not (fnmatch.fnmatchcase(rec.name, name) if glob else name in rec.name):
                continue
            out.append(rec)
        return out

    def _step_bounds(self, step: int) -> tuple[int, int] | None:
        steps = self._log.steps
        if 0 <= step < len(steps):
            return steps[step].first_record, steps[step].end_record
        done = steps[-1].end_record if steps else 0
        if step == len(steps) and done < self._log.n_records:
            return done, self._log.n_records  # the failed attempt at the next step
        return None

    def names(self, step: int | None = None) -> list[str]:
        return [r.name for r in self.filter(step=step)]

    def first_anomaly(self, step: int | None = None) -> TensorRecord | None:
        """The first record (in call order) holding NaN, +∞, or a −∞ no mask explains — found from the
        finiteness flags (statistics where values are kept; the one-reduction check otherwise)."""
        for rec in self.filter(step=step):
            flag = self.finite_flag(rec)
            if flag == Finite.BAD or (flag == Finite.NEG_INF and not rec.neg_inf_expected):
                return rec
        return None

    def checked_everywhere(self, step: int) -> bool:
        """Whether every record of ``step`` has a known finiteness flag (shapes capture checks only the
        residual stream and the logits)."""
        return all(self.finite_flag(rec) != Finite.UNKNOWN for rec in self.filter(step=step))

    # -- ops ---------------------------------------------------------------------------------------
    @property
    def ops(self) -> list[OpRecord]:
        modules = self._log.modules
        return [OpRecord(i, op.step, op.op, modules[op.module].path if op.module >= 0 else "(outside modules)",
                         op.input_shapes, op.output_shapes, op.dtype, op.error, op.first_record)
                for i, op in enumerate(self._log.ops)]

    def ops_frame(self, step: int | None = None, module: str | None = None) -> pd.DataFrame:
        rows = []
        for op in self.ops:
            if step is not None and op.step != step:
                continue
            if module is not None and not (op.module == module or op.module.startswith(module + ".")):
                continue
            rows.append({"index": op.index, "step": op.step, "op": op.op, "module": op.module or "model",
                         "input_shapes": op.input_shapes, "output_shapes": op.output_shapes,
                         "dtype": op.output_dtype, "error": op.error})
        return pd.DataFrame(rows, columns=["index", "step", "op", "module", "input_shapes", "output_shapes",
                                           "dtype", "error"])

    def op_before(self, rec: TensorRecord) -> OpRecord | None:
        """The last op that ran before ``rec`` was recorded (what produced it, with op capture)."""
        found = None
        for op in self.ops:
            if op.step == rec.step and 0 <= op.first_record <= rec.index and not op.error:
                found = op
        return found

    # -- tables ------------------------------------------------------------------------------------
    def to_frame(self, step: int | None = None, *, layer: int | None = None, module: str | None = None,
                 kind: str | None = None, name: str | None = None, stats: bool = True,
                 recompute: bool = True) -> pd.DataFrame:
        """One row per tensor record. ``stats=False`` leaves statistics out (no value is read).
        ``recompute=False``: a derived attention stage's statistics and flag only where a reader already worked
        them out — a saved file (tracer.files) does not recompute every stage of every step."""
        rows = []
        log = self._log
        for rec in self.filter(step=step, layer=layer, module=module, kind=kind, name=name):
            if stats and not recompute and log.derived(rec.index) is not None:
                s, flag = log.stats(rec.index), log.finite_flag(rec.index)
            else:
                s = self.stats(rec) if stats else None
                flag = self.finite_flag(rec) if stats else Finite.UNKNOWN
            rows.append({
                "index": rec.index, "step": rec.step, "index_in_step": rec.index_in_step, "name": rec.name,
                "module": rec.module or "model", "module_type": rec.module_type, "kind": rec.kind,
                "slot": rec.slot, "call": rec.call, "layer": rec.layer, "shape": rec.shape,
                "axes": "[" + ", ".join(rec.axes) + "]" if rec.axes else "", "dtype": rec.dtype,
                "device": rec.device, "numel": rec.numel, "nbytes": rec.nbytes, "params": rec.module_params,
                "has_value": self.has_value(rec), "value_note": self.value_note(rec), "finite": flag,
                "min": s.min if s else math.nan, "max": s.max if s else math.nan,
                "mean": s.mean if s else math.nan, "std": s.std if s else math.nan,
                "nan": s.nan if s else 0, "pos_inf": s.pos_inf if s else 0, "neg_inf": s.neg_inf if s else 0,
                "summary": summarize(rec.shape, rec.dtype, s, rec.neg_inf_expected, flag, dry_run=rec.device == "meta"),
            })
        frame = pd.DataFrame(rows, columns=list(FRAME_COLUMNS))
        frame["layer"] = frame["layer"].astype("Int64")
        return frame

    def __repr__(self) -> str:
        return (f"Trace(capture={self.capture!r}, steps={self.n_steps}, records={self._log.n_records}, "
                f"ops={len(self._log.ops)}, bytes_kept={self.bytes_kept})")

    def _repr_html_(self) -> str:
        return self.html_summary()

    def html_summary(self) -> str:
        """What a notebook shows: the one-line summary, the model, and the hook points of the latest step as a
        table; every text the model or a file wrote is escaped."""
        import html

        model = f"<br>model: {html.escape(self.model.describe())}" if self.model is not None else ""
        head = f"<b>{html.escape(repr(self))}</b>{model}"
        if not self.n_steps:
            return head
        return f"{head}<br>hook points of step {self.n_steps - 1}:{self.html_table(self.n_steps - 1)}"

    def html_table(self, step: int) -> str:
        """The hook points of ``step`` as an HTML table — name, shape, symbolic axes, dtype and the values'
        summary — every text escaped."""
        import html

        rows = "".join(
            f"<tr><td><code>{html.escape(r.name)}</code></td><td>{list(r.shape)}</td>"
            f"<td>{html.escape('[' + ', '.join(r.axes) + ']') if r.axes else ''}</td><td>{html.escape(r.dtype)}</td>"
            f"<td>{html.escape(self.summary(r))}</td></tr>"
            for r in self.filter(step=step, kind="hook"))
        return ("<table><tr><th>name</th><th>shape</th><th>axes</th><th>dtype</th><th>summary</th></tr>"
                f"{rows}</table>")


def _config_from(identity: ModelIdentity | None):
    """A ``GPTConfig`` from an identity's plain config, or None when it does not describe our GPT."""
    if identity is None or not identity.config:
        return None
    from gpt_shape_tracer.model.gpt import GPTConfig

    try:
        fields = set(GPTConfig.__dataclass_fields__)
        return GPTConfig(**{k: v for k, v in identity.config.items() if k in fields})
    except (TypeError, ValueError):
        return None
