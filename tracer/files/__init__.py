"""Files: ``save_trace`` / ``load_trace`` write and check trace archives (``save_trace_part`` /
``load_trace_parts``: one written in parts, a step at a time); ``Limits`` bounds what a file may
claim before anything is read or allocated. ``read_zip_members`` and the declared checks (``Obj``, ``ListOf``,
``Int`` …, the manifest's schema language) are what ``tracer.engine`` reads its engine-run files with too.

Private: ``_format`` (the format, its limits and the manifest's schema), ``_save``, ``_load``, ``_schema`` (the
declared checks the manifest's schema is written in)."""

from gpt_shape_tracer.tracer.files._format import FORMAT, LIMITS, VERSION, Limits
from gpt_shape_tracer.tracer.files._load import load_trace, load_trace_parts, read_zip_members
from gpt_shape_tracer.tracer.files._save import TraceWritten, archive_bytes, save_trace, save_trace_part
from gpt_shape_tracer.tracer.files._schema import (
    Bool,
    Check,
    Int,
    ListOf,
    Maybe,
    Obj,
    OneOf,
    Str,
    Then,
    TraceFileError,
    TupleOf,
)

__all__ = ["FORMAT", "LIMITS", "VERSION", "Bool", "Check", "Int", "Limits", "ListOf", "Maybe", "Obj", "OneOf", "Str",
           "Then", "TraceFileError", "TraceWritten", "TupleOf", "archive_bytes", "load_trace", "load_trace_parts",
           "read_zip_members", "save_trace", "save_trace_part"]
