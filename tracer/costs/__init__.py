"""Costs: what every op of a forward costs (multiply-adds, bytes of weights read, bytes written), counted as it
runs — on the meta device too — per op, module and step; the peak activation memory of a step; where a model would
run (an accelerator's roofline, accelerate's device map).

Private: ``_counter`` (the op counter), ``_steps`` (steps, modules, a costed dry run)."""

from tracer.costs._counter import OpCost, OpCounter
from tracer.costs._steps import StepCosts, costed_dry_run, costs_frame, count_forward, kv_cache_bytes

__all__ = ["OpCost", "OpCounter", "StepCosts", "costed_dry_run", "costs_frame", "count_forward", "kv_cache_bytes"]
