"""Capture: the ``Tracer`` records every tensor a model's modules produce, one forward (step) at a time,
with the interventions (``ablate``, ``patch``) it applies during a forward.

For the sibling rooms (generation, experiments): ``module_table`` (a model's modules, as records index them),
``check`` / ``check_shapes`` (refuse interventions that cannot apply, before and during a forward), ``applied``
(interventions active while a block runs) and ``running_means_before`` (a "mean" ablation's sums entering a step).

Private: ``_hooks`` (the process-wide hook registry), ``_ops`` (op-level capture), ``_forensics``
(where a forward failed), ``_nested`` (tensors inside nested arguments), ``_tracer`` (the Tracer),
``_interventions``."""

from gpt_shape_tracer.tracer.capture._hooks import hooks_installed, module_table
from gpt_shape_tracer.tracer.capture._interventions import (
    Intervention,
    InterventionError,
    ablate,
    applied,
    check,
    check_shapes,
    patch,
    running_means_before,
)
from gpt_shape_tracer.tracer.capture._tracer import Tracer
from gpt_shape_tracer.tracer.storage.records import HOWS

__all__ = ["HOWS", "Intervention", "InterventionError", "Tracer", "ablate", "applied", "check", "check_shapes",
           "hooks_installed", "module_table", "patch", "running_means_before"]
