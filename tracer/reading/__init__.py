"""Reading: ``Trace``, the read side — records, values, statistics and tables built on demand — and
``GenerationFacts``, a generation as the views read it.

Private: ``_trace``, ``_regions`` (attention regions at any length), ``_derived`` (a derived attention stage read
whole, with its statistics and flag), ``_facts``, ``_axes`` (symbolic axes checked against the numbers)."""

from gpt_shape_tracer.tracer.reading import _derived
from gpt_shape_tracer.tracer.reading._facts import GenerationFacts
from gpt_shape_tracer.tracer.reading._regions import (
    HeadStatistics,
    Overview,
    RegionError,
    attention_overview,
    attention_region,
    attention_source,
    can_recompute,
    check_output,
    head_statistics,
    is_derived,
    pattern_digest,
    query_row,
)
from gpt_shape_tracer.tracer.reading._trace import Trace

Trace.derived_reader = _derived  # Trace reads derived stages through it (see Trace.derived_reader)

__all__ = ["GenerationFacts", "HeadStatistics", "Overview", "RegionError", "Trace", "attention_overview",
           "attention_region", "attention_source", "can_recompute", "check_output", "head_statistics", "is_derived",
           "pattern_digest", "query_row"]
