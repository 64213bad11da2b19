"""Plain records, all frozen: one per tensor seen, one per op, one per step, and the facts of a generation.

No torch logic here. Facts that change after a record exists (whether its value
is still kept, its statistics once computed) are asked of the trace, not stored
in the record: a record never goes stale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

from gpt_shape_tracer.model.gpt import ModelIdentity
from gpt_shape_tracer.model.sampling import SamplingConfig

# The allowed values, declared once as types; the tuples (what code and the file schema check against) are
# derived from them.
# what a TensorRecord is: a hook point's value, a module's input or output, or ∂L/∂x of a hook point's value
# (a gradients trace); ops live in their own table
TensorKind = Literal["hook", "input", "output", "grad"]
ForwardCapture = Literal["shapes", "values", "ops"]  # what a Tracer keeps of a forward: shapes, + values, + every op
# what a trace keeps: a forward's capture, or "gradients": ∂L/∂x at every hook point from a backward pass
# (tracer.gradient_trace), kept within the same budget and saved in the same format as values
CaptureLevel = Literal[ForwardCapture, "gradients"]
PaddingSide = Literal["left", "right"]  # where a batch's shorter prompts are padded
How = Literal["zero", "mean", "patch"]  # what an intervention puts in place of a value
TENSOR_KINDS: tuple[TensorKind, ...] = get_args(TensorKind)
CAPTURE_LEVELS: tuple[CaptureLevel, ...] = get_args(CaptureLevel)
FORWARD_CAPTURES: tuple[ForwardCapture, ...] = get_args(ForwardCapture)
PADDING_SIDES: tuple[PaddingSide, ...] = get_args(PaddingSide)
HOWS: tuple[How, ...] = get_args(How)
ABLATIONS: tuple[How, ...] = ("zero", "mean")  # the hows of ablate(); "patch" is patch()'s
PAD_LABEL = "⟨pad⟩"


@dataclass(frozen=True, slots=True)
class TensorStats:
    """Summary numbers of a tensor over its finite elements, and counts of the others."""

    min: float
    max: float
    mean: float
    std: float
    nan: int = 0
    pos_inf: int = 0
    neg_inf: int = 0

    @property
    def inf(self) -> int:
        return self.pos_inf + self.neg_inf

    @property
    def all_zero(self) -> bool:
        return self.min == 0 and self.max == 0 and not (self.nan or self.inf)


class Finite:
    """What a record holds besides finite numbers: the cheap flag every capture level keeps."""

    CLEAN = 0  # only finite values
    NEG_INF = 1  # −∞ and finite values only (what a mask holds on purpose)
    BAD = 2  # NaN or +∞ (or both signs of ∞)
    UNKNOWN = -1  # not checked (shapes capture checks the residual stream and the logits only)
    # the same, as words, in a trace file (format version 3 on)
    WORDS = {CLEAN: "finite", NEG_INF: "finite and -inf", BAD: "nan or +inf", UNKNOWN: "unchecked"}

    @staticmethod
    def from_stats(stats: TensorStats) -> int:
        if stats.nan or stats.pos_inf:
            return Finite.BAD
        return Finite.NEG_INF if stats.neg_inf else Finite.CLEAN


@dataclass(frozen=True, slots=True)
class ModuleInfo:
    path: str  # "" for the root model
    type: str
    params: int  # parameters, children included
    is_hook: bool


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor one module saw: an input, an output, or a hook point's value."""

    index: int  # position in the trace, in call order
    step: int  # generation step (one forward pass per step)
    name: str  # hook path, or "<module path>:in[0]" / ":out" / ":out.logits"
    module: str  # module path ("" for the root model)
    module_type: str
    kind: str  # one of TENSOR_KINDS
    slot: str  # where in the module's arguments/outputs: "", "[0]", ".attention_mask", "[1][0]"
    call: int  # n-th call of this module within the step (0 unless a module is reused)
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    device: str
    layer: int | None  # block index, from the module path
    module_params: int
    axes: tuple[str, ...] | None = None  # symbolic axes from the hook table, e.g. ("B", "H", "n", "t")
    axes_note: str = ""  # what the table says about the axes (e.g. keys shared by several query heads)
    neg_inf_expected: bool = False  # −∞ here is a mask doing its job, not an anomaly
    index_in_step: int = 0  # position within its step, for people ("record 12 of step 3")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)

    def describe(self) -> str:
        """``blocks.1.attn.hook_pattern [1, 4, 7, 7] = [B, H, n, t] float32 (hook, step 0, record 71)``."""
        shape = "[" + ", ".join(map(str, self.shape)) + "]"
        axes = " = [" + ", ".join(self.axes) + "]" if self.axes else ""
        return f"{self.name} {shape}{axes} {self.dtype} ({self.kind}, step {self.step}, record {self.index_in_step})"

    def _repr_html_(self) -> str:
        """A notebook shows the record as a one-row table: its name, kind, shape with axes, dtype, device and step
        (its values are the trace's: ``trace.summary(name)``, ``trace.value(record)``)."""
        from html import escape

        cells = (self.name, self.kind, "[" + ", ".join(map(str, self.shape)) + "]",
                 "[" + ", ".join(self.axes) + "]" if self.axes else "", self.dtype, self.device, str(self.step),
                 self.module_type)
        head = "".join(f"<th>{h}</th>" for h in ("name", "kind", "shape", "axes", "dtype", "device", "step", "module"))
        return f"<table><tr>{head}</tr><tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr></table>"


_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16}


def dtype_itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 4)


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One torch function or tensor method called inside a forward."""

    index: int  # call order within the trace
    step: int
    op: str  # "torch.matmul", "Tensor.view", "F.softmax", …
    module: str  # innermost module it ran in ("(outside modules)" when none)
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtype: str = ""
    error: str = ""  # the exception message when this op raised
    first_record: int = -1  # the trace's record count when the op ran: it precedes that record


@dataclass(frozen=True, slots=True)
class InterventionRecord:
    """One change made to a hook point during a forward (see ``tracer.capture``), as plain facts."""

    name: str  # the hook point
    how: str  # "zero" | "mean" | "patch"
    head: int | None  # one head's slice, or the whole tensor
    positions: tuple[int, ...] | None  # some of the new positions, or all
    source: str  # for a patch: where its value came from

    def describe(self) -> str:
        what = {"zero": "zeroed", "mean": "mean-ablated", "patch": "patched"}.get(self.how, self.how)
        where = self.name + (f" head {self.head}" if self.head is not None else "")
        if self.positions is not None:
            where += f" at position{'s' if len(self.positions) != 1 else ''} {', '.join(map(str, self.positions))}"
        return f"{where} {what}" + (f" ({self.source})" if self.source else "")


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What the tracer itself knows of one forward pass."""

    step: int
    first_record: int  # this step's tensor records are [first_record, end_record)
    end_record: int
    seconds: float  # wall time of the traced forward (an estimate on a shared machine)
    interventions: tuple[InterventionRecord, ...] = ()  # what was switched off or patched during it


@dataclass(frozen=True)
class TraceErrorInfo:
    """Where a traced forward failed."""

    step: int
    exception_type: str
    message: str
    module: str  # innermost module that had started and not finished
    module_type: str
    module_stack: tuple[str, ...]
    input_shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (slot, shape) of that module's inputs
    op: str = ""  # the failing op, when op-level capture was on
    op_input_shapes: tuple[tuple[int, ...], ...] = ()
    source: str = ""  # "file:line: code" of the innermost frame inside that module's forward

    def describe(self) -> str:
        where = f"in module '{self.module or 'model'}' ({self.module_type})"
        ins = ", ".join(f"{slot or 'x'} {list(shape)}" for slot, shape in self.input_shapes) or "no tensor inputs"
        text = f"[tracer] step {self.step}: {self.exception_type} {where} with inputs {ins}"
        if self.op:
            text += f"; failing op {self.op}({', '.join(str(list(s)) for s in self.op_input_shapes)})"
        if self.source:
            text += f"; at {self.source}"
        return text


# -- a generation ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerationInfo:
    """What a generation is, fixed when it starts. Per-step facts are ``GenerationStep``s."""

    model: ModelIdentity
    prompts: tuple[str, ...]
    prompt_tokens: tuple[tuple[int, ...], ...]  # per sequence, after any truncation, unpadded
    prompt_labels: tuple[tuple[str, ...], ...]  # the display label of each of those tokens
    padding_side: str  # "left" | "right"
    pad_id: int
    use_cache: bool
    sampling: SamplingConfig
    n_ctx: int
    warnings: tuple[str, ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.prompt_tokens)

    @property
    def prompt_lengths(self) -> tuple[int, ...]:
        return tuple(len(row) for row in self.prompt_tokens)

    @property
    def prompt_width(self) -> int:
        """Columns of the padded prompt matrix."""
        return max(len(row) for row in self.prompt_tokens)

    def padded_prompt(self, row: int) -> tuple[tuple[int, ...], tuple[bool, ...], tuple[str, ...]]:
        """(token ids, is-a-token, labels) of one sequence's prompt columns, padding included."""
        ids, labels = self.prompt_tokens[row], self.prompt_labels[row]
        pad = self.prompt_width - len(ids)
        if self.padding_side == "left":
            return ((self.pad_id,) * pad + ids, (False,) * pad + (True,) * len(ids), (PAD_LABEL,) * pad + labels)
        return ids + (self.pad_id,) * pad, (True,) * len(ids) + (False,) * pad, labels + (PAD_LABEL,) * pad

    @property
    def padded(self) -> bool:
        return any(len(row) != self.prompt_width for row in self.prompt_tokens)


@dataclass(frozen=True)
class ForwardFacts:
    """What one step fed the model."""

    n: int  # new positions fed (query rows)
    t: int  # key positions attended over, cache included
    cache_before: int  # positions in the KV cache before the step (0 without a cache)
    cache_after: int
    fed_tokens: tuple[tuple[int, ...], ...]  # [B][n]


@dataclass(frozen=True)
class SamplingRecord:
    """How one step chose its tokens (one per sequence)."""

    tokens: tuple[int, ...]  # [B] the chosen ids
    labels: tuple[str, ...]  # [B] their display text
    probs: tuple[float, ...]  # [B] probability under the final distribution
    candidates: tuple[tuple[int, ...], ...]  # [B][K] the most probable ids; the chosen one always among them
    candidate_labels: tuple[tuple[str, ...], ...]  # [B][K]
    stage_probs: tuple[tuple[tuple[float, ...], ...], ...]  # [B][stage][K]
    kept: tuple[tuple[int, ...], ...]  # [B][stage] tokens left after each filter


@dataclass(frozen=True)
class GenerationStep:
    step: int
    forward: ForwardFacts
    sampling: SamplingRecord | None  # None: the logits held NaN/+∞ and no token could be chosen


@dataclass(frozen=True)
class PathCost:
    """The work of one way to compute a step, counted from the model's shapes (not timed)."""

    query_rows: int  # attention query rows computed per sequence
    macs: int  # multiply-adds of the whole forward
    weight_bytes: int  # bytes of weights the forward reads
    kv_bytes: int  # bytes of cached keys and values it reads
    seconds: float | None = None  # one untraced wall-clock timing: an estimate, never the evidence

@dataclass(frozen=True)
class RecomputeComparison:
    """A step done both ways: the cached path (new rows over cached K, V) and a full recompute."""

    step: int
    cached: PathCost
    full: PathCost
    max_abs_delta: float  # max |Δ logits| over the rows sampled from
    tolerance: float  # what counts as equal for this dtype
    run_used_cache: bool  # whether the generation itself ran with the cache
    timing_repeats: int = 1  # timings are the fastest of this many runs
    note: str = field(default="")
    # per layer, (max |ΔK|, max |ΔV|) between the rows the cache held for the earlier positions (each made when
    # its own step ran, seeing only the tokens up to it) and the same rows recomputed from all t tokens; real
    # tokens only. Empty at the prefill (nothing was cached) and in files written before it was measured.
    cached_rows_delta: tuple[tuple[float, float], ...] = ()

    @property
    def equal(self) -> bool:
        return self.max_abs_delta <= self.tolerance

    @property
    def cached_rows_equal(self) -> bool:
        """Whether every cached K and V row equals its recomputation within the tolerance (vacuous when
        none was compared)."""
        return all(max(dk, dv) <= self.tolerance for dk, dv in self.cached_rows_delta)

    @property
    def nothing_cached(self) -> bool:
        """At the prefill both paths compute every row: their agreement shows nothing about the cache."""
        return self.cached.query_rows == self.full.query_rows

    @property
    def timing_contradicts_count(self) -> bool:
        c, f = self.cached.seconds, self.full.seconds
        return c is not None and f is not None and self.cached.macs < self.full.macs and c > f
