"""What one rank of a tensor-parallel dry run sends: each module the plan ends in a collective (an all-reduce
after a rowwise split, an all-gather of the logits), with the bytes of the tensor it is applied to at a step —
read from the trace's own records, so the numbers are this step's shapes (n rows at a decode step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpt_shape_tracer.model.sources import TensorParallelPlan
from gpt_shape_tracer.tracer.reading import Trace


@dataclass(frozen=True)
class Collective:
    module: str
    kind: str  # "all-reduce" | "all-gather"
    shape: tuple[int, ...]
    bytes: int  # of the tensor the collective is applied to (each rank's copy of the result)


def collectives(trace: Trace, step: int, plan: TensorParallelPlan) -> list[Collective]:
    """Every collective of ``step``'s forward, in the order the plan lists its modules."""
    out = []
    names = set(trace.names())
    for module in plan.modules:
        if module.collective == "none":
            continue
        name = f"hf.{module.path}:out"
        if name not in names:
            continue
        record = trace.record(name, step)
        shape = tuple(int(s) for s in record.shape)
        dtype = getattr(torch, record.dtype.removeprefix("torch."))
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        numel = 1
        for s in shape:
            numel *= s
        out.append(Collective(module.path, module.collective, shape, numel * itemsize))
    return out


def collectives_sentence(plan: TensorParallelPlan, found: list[Collective]) -> str:
    """One line: how the k ranks split the model and what one forward sends, from the numbers above."""
    kinds: dict[str, tuple[int, int]] = {}
    for c in found:
        count, total = kinds.get(c.kind, (0, 0))
        kinds[c.kind] = (count + 1, total + c.bytes)
    parts = [f"{count} {kind}{'s' if count != 1 else ''} of {total:,} B in all" for kind, (count, total)
             in kinds.items()]
    sent = "; ".join(parts) if parts else "no collective"
    return (f"one rank of {plan.ranks} ({plan.source}): every record has this rank's shape; this forward ends "
            f"{sent}")
