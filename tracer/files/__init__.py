"""Files: ``save_trace`` / ``load_trace`` write and check trace archives; ``Limits`` bounds what a file may
claim before anything is read or allocated.

Private: ``_io`` (the format), ``_schema`` (the manifest's declared checks)."""

from gpt_shape_tracer.tracer.files._io import FORMAT, LIMITS, VERSION, Limits, archive_bytes, load_trace, save_trace
from gpt_shape_tracer.tracer.files._schema import TraceFileError

__all__ = ["FORMAT", "LIMITS", "VERSION", "Limits", "TraceFileError", "archive_bytes", "load_trace", "save_trace"]
