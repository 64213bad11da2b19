"""Saving and loading traces: files other tools can open, checked before they are trusted.

A trace is a directory, or the same files in one ``.zip`` archive:

* ``manifest.json`` — format name and version, capture level, steps, modules,
  the error (if a forward failed), metadata such as prompts and token labels;
* ``records.parquet`` — the record table (``Trace.to_frame()`` plus the columns
  needed to rebuild the trace); pandas, DuckDB or Polars read it as is;
* ``ops.parquet`` — op-level records, when captured;
* ``values.safetensors`` — the kept tensor values, keyed ``r<record index>``.

Loading never unpickles anything: JSON, Parquet and safetensors only. Sizes
declared by a file (zip members, the safetensors header) are checked against
limits before anything is read or allocated, and every value must agree with
the shape and dtype its record declares.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from tracer.records import StepInfo, TensorStats, TraceErrorInfo
from tracer.trace import DATA_PTR, MODULE, ModuleInfo, Trace, raw_record

FORMAT = "gpt-shape-trace"
VERSION = 1
MANIFEST, RECORDS, OPS, VALUES = "manifest.json", "records.parquet", "ops.parquet", "values.safetensors"
MEMBERS = (MANIFEST, RECORDS, OPS, VALUES)
MAX_MANIFEST_BYTES = 64 * 2**20
MAX_TABLE_BYTES = 512 * 2**20
DEFAULT_MAX_VALUE_BYTES = 2 * 2**30  # refuse traces whose values declare more than this
MAX_ST_HEADER = 64 * 2**20
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


class TraceFileError(ValueError):
    """A trace file that is malformed, inconsistent, too large, or of an unknown version."""


# -- saving ------------------------------------------------------------------------
def _values_for_file(trace: Trace) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Kept values as safetensors entries; a record that is exactly another's tensor is an alias."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, int] = {}
    seen_views: dict[tuple, int] = {}
    storages_used: set[int] = set()
    for index, value in trace.values.items():
        view = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
        if value.numel() and view in seen_views:
            aliases[str(index)] = seen_views[view]
            continue
        seen_views[view] = index
        storage = value.untyped_storage()
        whole = value.is_contiguous() and value.numel() * value.element_size() == storage.nbytes()
        if not whole or storage.data_ptr() in storages_used:
            value = value.contiguous().clone()
        storages_used.add(value.untyped_storage().data_ptr())
        tensors[f"r{index}"] = value
    return tensors, aliases


def _records_table(trace: Trace) -> pd.DataFrame:
    frame = trace.to_frame(stats=True)
    raws = trace._raw
    frame["module_index"] = [raws[i][MODULE] for i in frame["index"]]
    frame["data_ptr"] = [int(raws[i][DATA_PTR]) for i in frame["index"]]
    frame["zeros"] = [trace._stats[i].zeros if i in trace._stats else 0 for i in frame["index"]]
    frame["has_stats"] = [i in trace._stats for i in frame["index"]]
    frame["shape"] = [list(s) for s in frame["shape"]]
    return frame


def trace_files(trace: Trace) -> dict[str, bytes]:
    """The trace as ``{file name: bytes}``."""
    tensors, aliases = _values_for_file(trace)
    records = _records_table(trace)
    ops = trace.ops_frame()
    ops["input_shapes"] = [[list(s) for s in shapes] for shapes in ops["input_shapes"]]
    ops["output_shapes"] = [[list(s) for s in shapes] for shapes in ops["output_shapes"]]
    ops["module_index"] = [op[2] for op in trace._raw_ops]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "capture": trace.capture,
        "budget_bytes": trace.values.budget_bytes,
        "meta": trace.meta,
        "steps": [asdict(s) for s in trace.steps],
        "error": asdict(trace.error) if trace.error else None,
        "modules": [[m.path, m.type, m.params, m.is_hook] for m in trace._modules],
        "records": len(records),
        "ops": len(ops),
        "values": {"count": len(tensors), "aliases": aliases},
    }
    out = {MANIFEST: json.dumps(manifest, indent=1, default=str).encode("utf-8")}
    buf = io.BytesIO()
    records.to_parquet(buf, index=False)
    out[RECORDS] = buf.getvalue()
    buf = io.BytesIO()
    ops.to_parquet(buf, index=False)
    out[OPS] = buf.getvalue()
    out[VALUES] = st_save(tensors, metadata={"format": FORMAT, "version": str(VERSION)})
    return out


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` to a directory, or to a ``.zip`` archive when ``path`` ends in .zip."""
    path = Path(path)
    files = trace_files(trace)
    if path.suffix == ".zip":
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for name, data in files.items():
                zf.writestr(name, data)
    else:
        path.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (path / name).write_bytes(data)
    return path


def trace_archive_bytes(trace: Trace) -> bytes:
    """The ``.zip`` archive as bytes (for a download button)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in trace_files(trace).items():
            zf.writestr(name, data)
    return buf.getvalue()


# -- loading -----------------------------------------------------------------------
def _limits(max_value_bytes: int) -> dict[str, int]:
    return {MANIFEST: MAX_MANIFEST_BYTES, RECORDS: MAX_TABLE_BYTES, OPS: MAX_TABLE_BYTES,
            VALUES: max_value_bytes + MAX_ST_HEADER}


def _read_members(path: Path | bytes, max_value_bytes: int) -> dict[str, bytes]:
    limits = _limits(max_value_bytes)
    files: dict[str, bytes] = {}
    if isinstance(path, (bytes, bytearray)) or (isinstance(path, Path) and path.is_file()):
        source = io.BytesIO(path) if isinstance(path, (bytes, bytearray)) else path
        try:
            with zipfile.ZipFile(source) as zf:
                for info in zf.infolist():
                    if info.filename not in MEMBERS:
                        raise TraceFileError(f"unexpected member {info.filename!r} in the trace archive")
                    if info.file_size > limits[info.filename]:
                        raise TraceFileError(
                            f"{info.filename} declares {info.file_size} bytes, over the limit of "
                            f"{limits[info.filename]} bytes: refused before reading"
                        )
                for info in zf.infolist():
                    with zf.open(info) as f:
                        data = f.read(limits[info.filename] + 1)
                    if len(data) > limits[info.filename]:
                        raise TraceFileError(f"{info.filename} is larger than it declared: refused")
                    files[info.filename] = data
        except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile, NotImplementedError) as e:
            raise TraceFileError(f"not a readable trace archive ({e})") from None
        except (OSError, ValueError) as e:
            if isinstance(e, TraceFileError):
                raise
            raise TraceFileError(f"the trace archive is damaged ({e})") from None
    elif isinstance(path, Path) and path.is_dir():
        for name in MEMBERS:
            member = path / name
            if member.is_file():
                size = member.stat().st_size
                if size > limits[name]:
                    raise TraceFileError(f"{member}: {size} bytes, over the limit of {limits[name]} bytes")
                files[name] = member.read_bytes()
    else:
        raise TraceFileError(f"{path}: no such trace file or directory")
    for required in (MANIFEST, RECORDS):
        if required not in files:
            raise TraceFileError(f"the trace has no {required}")
    return files


def _check_safetensors_header(data: bytes, max_value_bytes: int) -> dict[str, Any]:
    """Validate the safetensors header (sizes, offsets, dtypes) before loading any tensor."""
    if len(data) < 8:
        raise TraceFileError(f"{VALUES}: truncated (no header)")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > MAX_ST_HEADER or 8 + header_len > len(data):
        raise TraceFileError(f"{VALUES}: declares a {header_len}-byte header but the file has {len(data)} bytes")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceFileError(f"{VALUES}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise TraceFileError(f"{VALUES}: header is not an object")
    body = len(data) - 8 - header_len
    total = 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[entry["dtype"]]
            shape = [int(s) for s in entry["shape"]]
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise TraceFileError(f"{VALUES}: malformed header entry for {key!r}") from None
        if any(s < 0 for s in shape):
            raise TraceFileError(f"{VALUES}: {key} has a negative dimension {shape}")
        nbytes = math.prod(shape) * dtype.itemsize
        if end - start != nbytes or start < 0 or end > body:
            raise TraceFileError(
                f"{VALUES}: {key} declares shape {shape} ({nbytes} bytes) but its data range is "
                f"[{start}, {end}) in a {body}-byte body"
            )
        total += nbytes
        if total > max_value_bytes:
            raise TraceFileError(
                f"{VALUES}: declares more than {max_value_bytes} bytes of values: refused before allocating"
            )
    return header


def load_trace(path: str | Path | bytes, *, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> Trace:
    """Read a trace written by ``save_trace`` (directory, .zip file, or .zip bytes), validating it."""
    files = _read_members(Path(path) if isinstance(path, str) else path, max_value_bytes)
    try:
        manifest = json.loads(files[MANIFEST])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceFileError(f"{MANIFEST}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise TraceFileError(f"{MANIFEST}: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise TraceFileError(
            f"{MANIFEST}: trace format version {manifest.get('version')!r}; this tracer reads version {VERSION}"
        )
    try:
        records = pd.read_parquet(io.BytesIO(files[RECORDS]))
        ops = pd.read_parquet(io.BytesIO(files[OPS])) if OPS in files else None
    except Exception as e:  # pyarrow raises several unrelated types for damaged files
        raise TraceFileError(f"{RECORDS}/{OPS}: not readable Parquet ({type(e).__name__}: {e})") from None
    try:
        return _build(manifest, records, ops, files.get(VALUES), max_value_bytes)
    except TraceFileError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise TraceFileError(f"the trace is inconsistent ({type(e).__name__}: {e})") from None


_REQUIRED = ("index", "step", "kind", "slot", "call", "shape", "dtype", "device", "module_index", "data_ptr",
             "has_stats", "min", "max", "mean", "std", "nan", "pos_inf", "neg_inf", "zeros", "value_note")


def _build(manifest: dict, records: pd.DataFrame, ops: pd.DataFrame | None, values: bytes | None,
           max_value_bytes: int) -> Trace:
    missing = [c for c in _REQUIRED if c not in records.columns]
    if missing:
        raise TraceFileError(f"{RECORDS}: missing columns {missing}")
    if len(records) != manifest["records"]:
        raise TraceFileError(f"{RECORDS}: {len(records)} rows, but the manifest says {manifest['records']}")
    if list(records["index"]) != list(range(len(records))):
        raise TraceFileError(f"{RECORDS}: record indices are not 0 … {len(records) - 1} in order")
    modules = [ModuleInfo(str(p), str(t), int(n), bool(h)) for p, t, n, h in manifest["modules"]]
    header = _check_safetensors_header(values, max_value_bytes) if values is not None else {}
    loaded_bytes = sum(
        math.prod(e["shape"]) * _ST_DTYPES[e["dtype"]].itemsize for k, e in header.items() if k != "__metadata__"
    )
    trace = Trace(capture=str(manifest["capture"]), budget_bytes=max(int(manifest["budget_bytes"]), loaded_bytes))
    trace._modules = modules
    trace.meta = manifest.get("meta") or {}
    for row in records.itertuples(index=False):
        module = int(row.module_index)
        if not 0 <= module < len(modules):
            raise TraceFileError(f"{RECORDS}: record {row.index} names module #{module}, which does not exist")
        if row.kind not in ("hook", "input", "output"):
            raise TraceFileError(f"{RECORDS}: record {row.index} has unknown kind {row.kind!r}")
        shape = tuple(int(s) for s in row.shape)
        if any(s < 0 for s in shape):
            raise TraceFileError(f"{RECORDS}: record {row.index} has a negative dimension {list(shape)}")
        if not hasattr(torch, str(row.dtype)) or not isinstance(getattr(torch, str(row.dtype)), torch.dtype):
            raise TraceFileError(f"{RECORDS}: record {row.index} has unknown dtype {row.dtype!r}")
        trace._raw.append((int(row.index), int(row.step), module, str(row.kind), str(row.slot),
                           int(row.call), shape, str(row.dtype), str(row.device), int(row.data_ptr)))
        if bool(row.has_stats):
            trace._stats[int(row.index)] = TensorStats(
                float(row.min), float(row.max), float(row.mean), float(row.std), int(row.nan), int(row.pos_inf),
                int(row.neg_inf), int(row.zeros),
            )
        if row.value_note:
            trace._notes[int(row.index)] = str(row.value_note)
    if values is not None:
        try:
            tensors = st_load(values)
        except Exception as e:  # safetensors raises its own error type from Rust
            raise TraceFileError(f"{VALUES}: not readable ({e})") from None
        for key, tensor in tensors.items():
            if not key.startswith("r") or not key[1:].isdigit() or int(key[1:]) >= len(trace._raw):
                raise TraceFileError(f"{VALUES}: entry {key!r} names no record")
            _put_checked(trace, int(key[1:]), tensor)
        for alias, target in manifest["values"].get("aliases", {}).items():
            source = trace.values.get(int(target))
            if source is None:
                raise TraceFileError(f"{MANIFEST}: value alias {alias} → {target} points at no stored value")
            _put_checked(trace, int(alias), source)
    if ops is not None and len(ops):
        for row in ops.itertuples(index=False):
            ins = tuple(tuple(int(d) for d in s) for s in row.input_shapes)
            outs = tuple(tuple(int(d) for d in s) for s in row.output_shapes)
            trace._raw_ops.append((int(row.step), str(row.op), int(row.module_index), ins, outs,
                                   str(row.dtype) or None, str(row.error)))
    trace.steps = [StepInfo(**s) for s in manifest.get("steps", [])]
    trace._next_step = (max(s.step for s in trace.steps) + 1) if trace.steps else 0
    trace._step = trace._next_step - 1
    if manifest.get("error"):
        err = manifest["error"]
        err["input_shapes"] = [(slot, tuple(shape)) for slot, shape in err.get("input_shapes", [])]
        err["op_input_shapes"] = [tuple(s) for s in err.get("op_input_shapes", [])]
        trace.error = TraceErrorInfo(**err)
    return trace


def _put_checked(trace: Trace, index: int, tensor: torch.Tensor) -> None:
    raw = raw_record(trace, index)
    if tuple(tensor.shape) != tuple(raw.shape):
        raise TraceFileError(
            f"record {index}: the table says shape {list(raw.shape)} but {VALUES} holds {list(tensor.shape)}"
        )
    if str(tensor.dtype).removeprefix("torch.") != raw.dtype:
        raise TraceFileError(f"record {index}: the table says dtype {raw.dtype} but {VALUES} holds {tensor.dtype}")
    reason = trace.values.put(index, raw.step, tensor)
    if reason:
        raise TraceFileError(f"record {index}: {reason}")
