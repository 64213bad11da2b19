"""Costs: what every op of a forward costs (multiply-adds, bytes of weights read, bytes written), counted as it
runs — on the meta device too — per op, module and step; the peak activation memory of a step; where a model would
run (an accelerator's roofline, accelerate's device map).

Private: ``_counter`` (the op counter), ``_blocks`` (a dry run's identical blocks costed once), ``_steps`` (steps,
modules, a costed dry run), ``_roofline`` (the
accelerator table, time floors), ``_placement`` (accelerate's device map, the KV cache's room),
``_parallel`` (what one rank of a tensor-parallel dry run sends)."""

from gpt_shape_tracer.tracer.costs._blocks import Blocks, ReplicationMismatch
from gpt_shape_tracer.tracer.costs._counter import OpCost, OpCounter
from gpt_shape_tracer.tracer.costs._parallel import Collective, collectives, collectives_sentence
from gpt_shape_tracer.tracer.costs._placement import Placement, place
from gpt_shape_tracer.tracer.costs._roofline import (
    ACCELERATORS,
    Accelerator,
    OpFloor,
    StepFloor,
    measure_this_cpu,
    op_floors,
    step_floor,
)
from gpt_shape_tracer.tracer.costs._steps import StepCosts, costed_dry_run, costs_frame, count_forward, kv_cache_bytes

__all__ = ["ACCELERATORS", "Accelerator", "Blocks", "Collective", "ReplicationMismatch", "collectives",
           "collectives_sentence",
            "OpCost", "OpCounter", "OpFloor", "Placement", "StepCosts", "StepFloor",
           "costed_dry_run", "costs_frame", "count_forward", "kv_cache_bytes", "measure_this_cpu", "op_floors",
           "place", "step_floor"]
