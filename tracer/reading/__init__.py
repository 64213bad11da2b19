"""Reading: ``Trace``, the read side — records, values, statistics and tables built on demand — and
``GenerationFacts``, a generation as the views read it.

Private: ``_trace``, ``_facts``, ``_axes`` (symbolic axes checked against the numbers)."""

from tracer.reading._facts import GenerationFacts
from tracer.reading._trace import Trace

__all__ = ["GenerationFacts", "Trace"]
