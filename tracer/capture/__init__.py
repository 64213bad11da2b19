"""Capture: the ``Tracer`` records every tensor a model's modules produce, one forward (step) at a time,
with the interventions (``ablate``, ``patch``) it applies during a forward.

Private: ``_hooks`` (the process-wide hook registry), ``_ops`` (op-level capture), ``_forensics``
(where a forward failed), ``_nested`` (tensors inside nested arguments), ``_tracer`` (the Tracer),
``_interventions``."""

from gpt_shape_tracer.tracer.capture._hooks import hooks_installed
from gpt_shape_tracer.tracer.capture._interventions import Intervention, InterventionError, ablate, patch
from gpt_shape_tracer.tracer.capture._tracer import Tracer
from gpt_shape_tracer.tracer.storage.records import HOWS

__all__ = ["HOWS", "Intervention", "InterventionError", "Tracer", "ablate", "hooks_installed", "patch"]
