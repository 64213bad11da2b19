"""Plain records: one per tensor seen, one per op, one per step. No torch logic here."""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("hook", "input", "output")  # kinds of TensorRecord; op records live in their own table


@dataclass(slots=True)
class TensorStats:
    """Summary numbers of a tensor, over its finite elements; counts of the others."""

    min: float
    max: float
    mean: float
    std: float
    nan: int = 0
    pos_inf: int = 0
    neg_inf: int = 0
    zeros: int = 0

    @property
    def inf(self) -> int:
        return self.pos_inf + self.neg_inf


@dataclass(slots=True)
class TensorRecord:
    """One tensor one module saw: an input, an output, or a hook point's value."""

    index: int  # position in the trace, in call order
    step: int  # generation step (one forward pass per step)
    name: str  # hook path, or "<module path>:in[0]" / ":out" / ":out.logits"
    module: str  # module path ("" for the root model)
    module_type: str
    kind: str  # "hook" | "input" | "output"
    slot: str  # where in the module's arguments/outputs: "", "[0]", ".attention_mask", "[1][0]"
    call: int  # n-th call of this module within the step (0 unless a module is reused)
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    device: str
    numel: int
    nbytes: int  # bytes of this tensor's elements (numel · element size)
    module_params: int  # parameters of the module, children included
    layer: int | None = None  # block index parsed from the module path
    stats: TensorStats | None = None
    has_value: bool = False  # whether the trace still holds the values (within the byte budget)
    value_note: str = ""  # why values are missing or doubtful (evicted, mutated in place, …)


@dataclass(slots=True)
class OpRecord:
    """One torch function or tensor method called inside a forward."""

    index: int  # call order within the trace
    step: int
    op: str  # "torch.matmul", "Tensor.view", "F.softmax", …
    module: str  # innermost module it ran in
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    output_dtype: str = ""
    error: str = ""  # the exception message when this op raised


@dataclass
class StepInfo:
    """What one generation step (one forward pass) did."""

    step: int
    n: int  # new positions fed (queries)
    t: int  # key positions attended over, cache included
    cache_length_before: int
    cache_length_after: int
    use_cache: bool
    seconds: float = 0.0  # wall time of the traced forward
    fed_tokens: list[list[int]] = field(default_factory=list)  # [B][n]
    sampled: list[int] = field(default_factory=list)  # [B]
    sampled_prob: list[float] = field(default_factory=list)  # [B], under the final distribution
    candidates: list[list[int]] = field(default_factory=list)  # [B][K] token ids
    candidate_labels: list[list[str]] = field(default_factory=list)  # [B][K] their display text
    stage_probs: list[list[list[float]]] = field(default_factory=list)  # [B][stage][K]
    kept: list[list[int]] = field(default_factory=list)  # [B][stage] tokens left after each filter
    first_record: int = 0  # index range of this step's tensor records
    end_record: int = 0

    @property
    def rows_computed(self) -> int:
        """Query rows of attention computed per sequence: n (1 with the cache, all without)."""
        return self.n


@dataclass
class TraceErrorInfo:
    """Where a traced forward failed."""

    step: int
    exception_type: str
    message: str
    module: str  # innermost module that had started and not finished
    module_type: str
    module_stack: list[str]
    input_shapes: list[tuple[str, tuple[int, ...]]]  # (slot, shape) of that module's inputs
    op: str = ""  # the failing op, when op-level capture was on
    op_input_shapes: list[tuple[int, ...]] = field(default_factory=list)
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
