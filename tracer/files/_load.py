"""Loading a trace file (the format: tracer/files/_format.py): each member read within its limits, the manifest
checked against its schema, the tables and values checked against the manifest, and only then the trace built.
Nothing is unpickled."""

from __future__ import annotations

import io
import json
import math
import os
import struct
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch

from gpt_shape_tracer.model.gpt import MaskSpec, ModelIdentity
from gpt_shape_tracer.tracer.files._format import (
    _CHUNK,
    _DTYPES,
    _ST_DTYPES,
    FORMAT,
    LIMITS,
    MANIFEST,
    MEMBERS,
    OPS,
    READABLE_VERSIONS,
    RECORDS,
    VALUES,
    VERSION,
    Limits,
    _schemas,
)
from gpt_shape_tracer.tracer.files._schema import (
    TraceFileError,
)
from gpt_shape_tracer.tracer.reading import Trace
from gpt_shape_tracer.tracer.storage import RawOp, RawRecord, TraceLog, dtype_name
from gpt_shape_tracer.tracer.storage.records import (
    TENSOR_KINDS,
    Finite,
    GenerationInfo,
    InterventionRecord,
    ModuleInfo,
    StepRecord,
    TensorStats,
)


# -- loading: the members, within their limits ---------------------------------------------------
def _member_limits(limits: Limits) -> dict[str, int]:
    return {MANIFEST: limits.manifest_bytes, RECORDS: limits.table_bytes, OPS: limits.table_bytes,
            VALUES: limits.value_bytes + limits.manifest_bytes}


def _read_stream(f: IO[bytes], name: str, declared: int, limit: int) -> bytearray:
    data = bytearray()
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        data += chunk
        if len(data) > min(declared, limit):
            raise TraceFileError(f"{name} holds more than it declares ({declared} bytes): refused")
    return data


def read_zip_members(source: Path | bytes, allowed: dict[str, int], limits: Limits = LIMITS,
                     kind: str = "trace archive") -> dict[str, bytearray]:
    """The members of the zip archive ``source`` (a path or its bytes), each one a name of ``allowed`` and within
    its limit there: checked from the archive's directory before anything is inflated (no other member, none twice,
    none encrypted, none over its limit or over ``limits.ratio`` compressed), then read no further than it declares.
    A ``TraceFileError`` (naming ``kind``) for anything else. Trace files and engine runs (``tracer.engine``) both
    read their archives through this."""
    files: dict[str, bytearray] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as zf:
            infos = zf.infolist()
            names = [i.filename for i in infos]
            for info in infos:
                _check_member(info, allowed, limits, names)
            for info in infos:
                with zf.open(info) as f:
                    files[info.filename] = _read_stream(f, info.filename, info.file_size, allowed[info.filename])
    except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile, NotImplementedError) as e:
        raise TraceFileError(f"not a readable {kind} ({e})") from None
    except RuntimeError as e:  # zipfile raises RuntimeError for an encrypted member
        raise TraceFileError(f"the archive cannot be read ({e})") from None
    except (OSError, ValueError) as e:
        if isinstance(e, TraceFileError):
            raise
        raise TraceFileError(f"the {kind} is damaged ({e})") from None
    return files


def _read_members(source: Path | bytes, limits: Limits) -> dict[str, bytearray]:
    allowed = _member_limits(limits)
    files: dict[str, bytearray] = {}
    if isinstance(source, (bytes, bytearray)) or source.is_file():
        files = read_zip_members(source, allowed, limits)
    elif source.is_dir():
        for name in MEMBERS:
            member = source / name
            if member.is_file():
                size = member.stat().st_size
                if size > allowed[name]:
                    raise TraceFileError(f"{name}: {size} bytes, over the limit of {allowed[name]} by "
                                         f"{size - allowed[name]}")
                with open(member, "rb") as f:
                    files[name] = _read_stream(f, name, size, allowed[name])
    else:
        raise TraceFileError(f"{source}: no such trace file or directory")
    for required in (MANIFEST, RECORDS):
        if required not in files:
            raise TraceFileError(f"the trace has no {required}")
    return files


def _check_member(info: zipfile.ZipInfo, allowed: dict[str, int], limits: Limits, names: list[str]) -> None:
    name = info.filename
    if name not in allowed:
        raise TraceFileError(f"unexpected member {name!r} in the trace archive")
    if names.count(name) > 1:
        raise TraceFileError(f"the archive holds {name} {names.count(name)} times")
    if info.flag_bits & 0x1:
        raise TraceFileError(f"{name} is encrypted: a trace file never is")
    if info.file_size > allowed[name]:
        raise TraceFileError(f"{name} declares {info.file_size} bytes, over the limit of {allowed[name]} by "
                             f"{info.file_size - allowed[name]}: refused before reading")
    if info.compress_type == zipfile.ZIP_STORED:
        if info.file_size != info.compress_size:
            raise TraceFileError(f"{name} is stored uncompressed but declares {info.file_size} bytes in "
                                 f"{info.compress_size}")
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        if info.file_size > limits.ratio * max(info.compress_size, 1) + 4096:
            raise TraceFileError(f"{name} would inflate {info.compress_size} bytes to {info.file_size}, over "
                                 f"{limits.ratio}× (a decompression bomb?): refused before inflating")
    else:
        raise TraceFileError(f"{name} uses compression method {info.compress_type}; traces use stored or deflated")



# -- loading: the tables ---------------------------------------------------------------------------
_RECORD_COLUMNS = ("index", "step", "kind", "slot", "call", "shape", "dtype", "device", "module_index",
                   "has_stats", "min", "max", "mean", "std", "nan", "pos_inf", "neg_inf", "finite", "value_note",
                   "storage", "storage_offset", "strides", "digest_storage", "digest_shape")
_OP_COLUMNS = ("step", "op", "module_index", "input_shapes", "output_shapes", "dtype", "error", "first_record")


def _read_table(data: bytearray, name: str, expected_rows: int, limits: Limits, columns: tuple[str, ...]
                ) -> pd.DataFrame:
    try:
        meta = pq.ParquetFile(io.BytesIO(data)).metadata
    except Exception as e:  # pyarrow raises several unrelated types for damaged files
        raise TraceFileError(f"{name}: not readable Parquet ({type(e).__name__}: {e})") from None
    if meta.num_rows != expected_rows:
        raise TraceFileError(f"{name}: {meta.num_rows} rows, but the manifest says {expected_rows}")
    inflated = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    if inflated > limits.table_bytes:
        raise TraceFileError(f"{name}: {inflated} bytes once decoded, over the limit of {limits.table_bytes} by "
                             f"{inflated - limits.table_bytes}: refused before decoding")
    try:
        frame = pd.read_parquet(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - as above
        raise TraceFileError(f"{name}: not readable Parquet ({type(e).__name__}: {e})") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise TraceFileError(f"{name}: missing columns {missing}")
    return frame


def _ints(frame: pd.DataFrame, column: str, name: str, lo: int, hi: int) -> np.ndarray:
    values = frame[column].to_numpy()
    if not len(values):
        return values.astype(np.int64)
    if values.dtype.kind not in "iu":
        raise TraceFileError(f"{name}: column {column} holds {values.dtype}, not whole numbers")
    if len(values) and (values.min() < lo or values.max() > hi):
        raise TraceFileError(f"{name}: column {column} has values outside [{lo}, {hi}]")
    return values.astype(np.int64)


def _codes(frame: pd.DataFrame, column: str, name: str, words: dict[int, str]) -> np.ndarray:
    """A column of words (``finite``: "finite", "nan or +inf", …) as the codes they stand for."""
    code_of = {word: code for code, word in words.items()}
    values = frame[column].tolist()
    unknown = next((v for v in values if v not in code_of), None)
    if unknown is not None:
        raise TraceFileError(f"{name}: column {column} holds {str(unknown)[:40]!r}, not one of "
                             f"{', '.join(map(repr, words.values()))}")
    return np.array([code_of[v] for v in values], dtype=np.int64)


def _shape_list(value: Any, where: str, limits: Limits) -> tuple[int, ...]:
    """A shape: at most ``tensor_dims`` sizes, each and their product at most ``tensor_elements``."""
    out = _whole_numbers(value, where, limits)
    if math.prod(out) > limits.tensor_elements:
        raise TraceFileError(f"{math.prod(out)} elements, over the limit of {limits.tensor_elements}", where)
    return out


def _whole_numbers(value: Any, where: str, limits: Limits) -> tuple[int, ...]:
    """At most ``tensor_dims`` whole numbers in [0, tensor_elements]: a shape's sizes or a view's strides.
    Strides are not multiplied together (that product means nothing: ``[1, H, n, n]``'s strides are
    ``[H·n², n², n, 1]``); where a view reaches is checked against its storage in ``_view``."""
    if value is None or isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
        raise TraceFileError("expected a list of sizes", where)
    if len(value) > limits.tensor_dims:
        raise TraceFileError(f"{len(value)} dimensions, over the limit of {limits.tensor_dims}", where)
    out = []
    for v in value:
        whole = isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
        if not whole or not 0 <= v <= limits.tensor_elements:
            raise TraceFileError(f"size {v!r} is not a whole number in [0, {limits.tensor_elements}]", where)
        out.append(int(v))
    return tuple(out)


# -- loading: the values -----------------------------------------------------------------------------
def _storages_from(data: bytearray, expected: int, limits: Limits) -> list[torch.Tensor]:
    """The flat storages of ``values.safetensors``, as views into ``data`` (read once, never copied)."""
    if len(data) < 8:
        raise TraceFileError(f"{VALUES}: truncated (no header)")
    (header_len,) = struct.unpack("<Q", bytes(data[:8]))
    if header_len > limits.manifest_bytes or 8 + header_len > len(data):
        raise TraceFileError(f"{VALUES}: declares a {header_len}-byte header but the file has {len(data)} bytes")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TraceFileError(f"{VALUES}: header is not JSON ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise TraceFileError(f"{VALUES}: header is not an object")
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    if len(entries) != expected or set(entries) != {f"s{k}" for k in range(expected)}:
        raise TraceFileError(f"{VALUES}: holds {len(entries)} storage(s) named {sorted(entries)[:4]}…, but the "
                             f"manifest says s0 … s{expected - 1}")
    body = len(data) - 8 - header_len
    flats: list[torch.Tensor] = []
    total = 0
    for k in range(expected):
        key, entry = f"s{k}", entries[f"s{k}"]
        try:
            dtype = _ST_DTYPES[entry["dtype"]]
            (length,) = (int(s) for s in entry["shape"])
            start, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise TraceFileError(f"{VALUES}: malformed header entry for {key!r} (a flat storage has one size, a "
                                 "known dtype and two offsets)") from None
        nbytes = length * dtype.itemsize
        if length < 0 or start < 0 or end - start != nbytes or end > body:
            raise TraceFileError(f"{VALUES}: {key} declares {length} elements ({nbytes} bytes) at [{start}, {end}) "
                                 f"in a {body}-byte body")
        total += nbytes
        if total > limits.value_bytes:
            raise TraceFileError(f"{VALUES}: declares more than {limits.value_bytes} bytes of values: refused")
        offset = 8 + header_len + start
        flats.append(torch.frombuffer(data, dtype=dtype, count=length, offset=offset) if length else
                     torch.empty(0, dtype=dtype))
    return flats


# -- loading: all of it --------------------------------------------------------------------------------
def load_trace(path: str | Path | bytes, *, limits: Limits = LIMITS) -> Trace:
    """Read a trace written by ``save_trace`` (directory, .zip file, or .zip bytes), validating it whole."""
    manifest, records, ops, flats, version = _read_file(path, limits)
    if manifest.get("continues") is not None:
        c = manifest["continues"]
        raise TraceFileError(f"this file is a part of a trace written in parts: it continues one from step "
                             f"{c['steps']}; read it with the files before it (tracer.files.load_trace_parts)")
    return _build(manifest, records, ops, flats, limits, version)


def load_trace_parts(paths: Sequence[str | Path], *, limits: Limits = LIMITS) -> Trace:
    """Read a trace written in parts (``save_trace_part``): the first file, then each part in order, each checked
    as ``load_trace`` checks a file, each continuing exactly where the files before it end (steps, records, ops),
    all of one model, capture and generation — and then the whole checked again as one trace."""
    if not paths:
        raise TraceFileError("no trace files given")
    parts = []
    for path in paths:
        try:
            parts.append(_read_file(path, limits))
        except TraceFileError as e:  # which of the files: each says the same things about itself
            raise TraceFileError(str(e), _file_name(path)) from None
    manifest, records, ops, flats, version = parts[0]
    if manifest.get("continues") is not None:
        raise TraceFileError(f"{_file_name(paths[0])}: the first file continues another (from step "
                             f"{manifest['continues']['steps']}); its first part is missing")
    manifest = {**manifest, "steps": list(manifest["steps"]), "counts": dict(manifest["counts"])}
    if manifest["generation"] is not None:
        manifest["generation"] = {**manifest["generation"], "steps": list(manifest["generation"]["steps"]),
                                  "comparisons": list(manifest["generation"]["comparisons"])}
    for column in ("storage", "digest_storage"):  # the first file's storages are its own too
        _ints(records, column, f"{_file_name(paths[0])} {RECORDS}", -1, len(flats) - 1)
    tables, op_tables, all_flats = [records], [ops] if ops is not None else [], list(flats)
    value_bytes = sum(f.numel() * f.element_size() for f in flats)
    # a storage later parts add to → per part, its slabs (storage number over the files, offset, shape, strides)
    joins: dict[int, list[list[tuple]]] = {}
    length: dict[int, int] = {}  # … and its length joined
    stands_for: dict[int, int] = {}  # a part's empty storage → the earlier storage it stands for, joined
    for path, (part, part_records, part_ops, part_flats, part_version) in zip(paths[1:], parts[1:]):
        where = _file_name(path)
        counts = manifest["counts"]
        expected = {"steps": len(manifest["steps"]), "records": counts["records"], "ops": counts["ops"],
                    "storages": len(all_flats)}
        said = part.get("continues")
        if said is None or {k: said[k] for k in expected} != expected:
            raise TraceFileError(f"it continues {said or 'nothing (a whole trace)'}, but the files before it end at "
                                 f"{expected}", where)
        end = manifest["steps"][-1].end_record if manifest["steps"] else 0
        if manifest["error"] is not None or end != counts["records"]:
            raise TraceFileError("the files before it end in a failed step: nothing continues them", where)
        for key in ("capture", "budget_bytes", "modules", "model"):
            if part[key] != manifest[key]:
                raise TraceFileError(f"its {key} differs from the first file's: not a part of the same trace", where)
        if (part["generation"] is None) != (manifest["generation"] is None) or (
                part["generation"] is not None and part["generation"]["info"] != manifest["generation"]["info"]):
            raise TraceFileError("its generation differs from the first file's: not a part of the same trace", where)
        if part_version != version:
            raise TraceFileError(f"format version {part_version}, the first file's {version}", where)
        shift = len(all_flats)
        standing = set()
        for own, earlier, joined_length, patches in said["extends"]:
            if own >= len(part_flats) or part_flats[own].numel() or own in standing or earlier >= shift \
                    or earlier in stands_for:
                raise TraceFileError(f"extends storage {earlier} with its storage {own}: one of them is not there, "
                                     "holds numbers, or is named twice", where)
            base = all_flats[earlier]
            if joined_length < length.get(earlier, base.numel()) or part_flats[own].dtype != base.dtype:
                raise TraceFileError(f"storage {earlier} joined would be shorter than it is, or of another dtype",
                                     where)
            for slab, offset, shape, strides in patches:
                if slab >= len(part_flats) or slab in standing or part_flats[slab].dtype != base.dtype \
                        or part_flats[slab].numel() != math.prod(shape) or len(shape) != len(strides) or (
                        math.prod(shape) and offset + sum((n - 1) * st for n, st in zip(shape, strides))
                        >= joined_length):
                    raise TraceFileError(f"a slab of storage {earlier} ({list(shape)} at {offset}) does not fit "
                                         f"its {joined_length} elements, or its storage {slab} does not hold it", where)
            standing.add(own)
            stands_for[shift + own] = earlier
            length[earlier] = joined_length
            joins.setdefault(earlier, []).append([(shift + slab, offset, tuple(shape), tuple(strides))
                                                  for slab, offset, shape, strides in patches])
        part_records = part_records.copy()
        for column in ("storage", "digest_storage"):
            # each part numbers its own storages (checked within them): they follow those of the files before it
            numbers = _ints(part_records, column, f"{where} {RECORDS}", -1, len(part_flats) - 1)
            part_records[column] = np.where(numbers >= 0, numbers + shift, numbers)
        tables.append(part_records)
        if part_ops is not None:
            op_tables.append(part_ops)
        all_flats += part_flats
        value_bytes += sum(f.numel() * f.element_size() for f in part_flats)
        if value_bytes > limits.value_bytes:
            raise TraceFileError(f"the files hold more than {limits.value_bytes} bytes of values together: refused",
                                 where)
        manifest["steps"] += part["steps"]
        if manifest["generation"] is not None:
            manifest["generation"]["steps"] += part["generation"]["steps"]
            manifest["generation"]["comparisons"] += part["generation"]["comparisons"]
        manifest["error"] = part["error"]
        counts["records"] += part["counts"]["records"]
        counts["ops"] += part["counts"]["ops"]
        counts["storages"] += part["counts"]["storages"]
    for earlier, parts_slabs in joins.items():  # a storage and what the parts added to it, one tensor
        base = all_flats[earlier]
        whole = torch.zeros(length[earlier], dtype=base.dtype)
        whole[:base.numel()] = base
        for slabs in parts_slabs:
            for number, offset, shape, strides in slabs:
                torch.as_strided(whole, shape, strides, offset).copy_(all_flats[number].view(shape))
        all_flats[earlier] = whole
    for number, earlier in stands_for.items():
        all_flats[number] = all_flats[earlier]
    merged_records = pd.concat(tables, ignore_index=True) if len(tables) > 1 else records
    merged_ops = (pd.concat(op_tables, ignore_index=True) if len(op_tables) > 1 else ops) if op_tables else None
    return _build(manifest, merged_records, merged_ops, all_flats, limits, version)


def _file_name(path: object) -> str:
    return Path(path).name if isinstance(path, (str, os.PathLike)) else type(path).__name__


def _read_file(path: str | Path | bytes, limits: Limits) -> tuple[dict, pd.DataFrame, pd.DataFrame | None,
                                                                   list[torch.Tensor], int]:
    """One trace file read and checked on its own: its manifest against the schema, its tables against the
    manifest's counts, its values' header. A part (``continues``) holds steps and records numbered on from the
    files before it."""
    if not isinstance(path, (str, Path, bytes, bytearray, os.PathLike)):
        raise TraceFileError(f"load_trace takes a path or the bytes of a .zip, not {type(path).__name__}")
    if isinstance(path, os.PathLike) and not isinstance(path, Path):
        path = Path(os.fspath(path))
    if isinstance(path, str):
        if "\x00" in path:
            raise TraceFileError("the path holds a NUL character")
        path = Path(path)
    files = _read_members(path, limits)
    try:
        raw = json.loads(bytes(files[MANIFEST]))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise TraceFileError(f"{MANIFEST}: not valid JSON ({type(e).__name__})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise TraceFileError(f"{MANIFEST}: not a {FORMAT} manifest")
    version = raw.get("version")
    if version not in READABLE_VERSIONS:
        raise TraceFileError(f"{MANIFEST}: trace format version {version!r}; this tracer reads versions "
                             f"{', '.join(map(str, READABLE_VERSIONS))}")
    manifest = _schemas(limits, version)(raw, "")
    counts = manifest["counts"]
    after = manifest.get("continues") or {"steps": 0, "records": 0, "ops": 0}
    # the steps' record ranges against the counted records, before the table is decoded: a file of a few hundred
    # KiB declaring a million records in one step once inflated its whole table (+1.2 GiB) to be refused after
    _check_steps(manifest["steps"], counts["records"], limits, after["steps"], after["records"])
    columns = _RECORD_COLUMNS + (("data_ptr",) if version == 2 else ("tensor_id",))
    records = _read_table(files[RECORDS], RECORDS, counts["records"], limits, columns)
    ops = _read_table(files[OPS], OPS, counts["ops"], limits, _OP_COLUMNS) if OPS in files else None
    if ops is None and counts["ops"]:
        raise TraceFileError(f"the manifest counts {counts['ops']} ops but the trace has no {OPS}")
    flats = _storages_from(files[VALUES], counts["storages"], limits) if VALUES in files else []
    if not flats and counts["storages"]:
        raise TraceFileError(f"the manifest counts {counts['storages']} storages but the trace has no {VALUES}")
    return manifest, records, ops, flats, version


def _build(manifest: dict, records: pd.DataFrame, ops: pd.DataFrame | None, flats: list[torch.Tensor],
           limits: Limits, version: int = VERSION) -> Trace:
    modules: tuple[ModuleInfo, ...] = manifest["modules"]
    steps: tuple[StepRecord, ...] = manifest["steps"]
    n = len(records)
    _check_steps(steps, n, limits)
    index = _ints(records, "index", RECORDS, 0, n)
    if not np.array_equal(index, np.arange(n)):
        raise TraceFileError(f"{RECORDS}: record indices are not 0 … {n - 1} in order")
    step_of = _ints(records, "step", RECORDS, 0, len(steps))
    module_of = _ints(records, "module_index", RECORDS, 0, max(len(modules) - 1, 0))
    call_of = _ints(records, "call", RECORDS, 0, 2**31)
    storage_of = _ints(records, "storage", RECORDS, -1, len(flats) - 1)
    offset_of = _ints(records, "storage_offset", RECORDS, 0, 2**62)
    flag_of = (_ints(records, "finite", RECORDS, Finite.UNKNOWN, Finite.BAD) if version == 2
               else _codes(records, "finite", RECORDS, Finite.WORDS))
    digest_of = _ints(records, "digest_storage", RECORDS, -1, len(flats) - 1)
    ptr_of = (_ints(records, "data_ptr", RECORDS, 0, 2**63 - 1) if version == 2
              else _ints(records, "tensor_id", RECORDS, 0, max(n, 1)))
    for s in steps:
        if (step_of[s.first_record:s.end_record] != s.step).any():
            raise TraceFileError(f"{RECORDS}: step {s.step}'s records [{s.first_record}, {s.end_record}) are not all "
                                 f"of step {s.step}")
    tail = steps[-1].end_record if steps else 0
    if tail < n and (step_of[tail:] != len(steps)).any():
        raise TraceFileError(f"{RECORDS}: records after the last step must belong to one failed attempt")
    log = TraceLog(manifest["capture"], max(manifest["budget_bytes"], sum(f.numel() * f.element_size() for f in flats)))
    log.set_modules(modules)
    if manifest["model"] is not None:
        _check_model(manifest["model"], modules)
        log.set_model(manifest["model"])
    kinds, slots, dtypes, devices = (records[c].tolist() for c in ("kind", "slot", "dtype", "device"))
    notes, shapes, strides = records["value_note"].tolist(), records["shape"].tolist(), records["strides"].tolist()
    stat_cols = [records[c].tolist() for c in ("has_stats", "min", "max", "mean", "std", "nan", "pos_inf", "neg_inf")]
    bounds: list[tuple[int, int, float | None, tuple[InterventionRecord, ...]]] = [
        (s.first_record, s.end_record, s.seconds, s.interventions) for s in steps]
    if tail < n:
        bounds.append((tail, n, None, ()))  # the records of a failed attempt at the next step
    values = []
    for first, end, seconds, interventions in bounds:
        log.begin_step()
        for i in range(first, end):
            where = f"{RECORDS} record {i}"
            if kinds[i] not in TENSOR_KINDS:
                raise TraceFileError(f"unknown kind {str(kinds[i])[:20]!r}", where)
            if dtypes[i] not in _DTYPES:
                raise TraceFileError(f"unknown dtype {str(dtypes[i])[:20]!r}", where)
            shape = _shape_list(shapes[i], where + " shape", limits)
            raw = RawRecord(i, int(step_of[i]), int(module_of[i]), kinds[i], str(slots[i])[:200], int(call_of[i]),
                            shape, dtypes[i], str(devices[i])[:50], int(ptr_of[i]))
            try:
                log.restore_record(raw, _stats_row(stat_cols, i, where), str(notes[i] or "")[:2000], int(flag_of[i]))
            except ValueError as e:
                raise TraceFileError(str(e), where) from None
            if storage_of[i] >= 0:
                values.append((i, raw, int(storage_of[i]), int(offset_of[i]), strides[i]))
        if seconds is not None:
            log.end_step(seconds, interventions)
        else:
            log.fail_step(None, None)
    for i, raw, storage, offset, stride in values:
        try:
            log.restore_value(i, _view(flats[storage], raw, offset, stride, f"{RECORDS} record {i}", limits))
        except ValueError as e:
            if isinstance(e, TraceFileError):
                raise
            raise TraceFileError(str(e), f"{RECORDS} record {i}") from None
    if "derived" in records.columns:  # optional: files written before derived records load as they were
        for i, text in enumerate(records["derived"].tolist()):
            if text:
                _restore_derived(log, i, text)
    digest_shapes = records["digest_shape"].tolist()
    for rec in np.flatnonzero(digest_of >= 0):
        where = f"{RECORDS} record {rec} digest"
        shape = _shape_list(digest_shapes[rec], where, limits)
        flat = flats[int(digest_of[rec])]
        if math.prod(shape) != flat.numel() or flat.dtype != torch.float32:
            raise TraceFileError(f"shape {list(shape)} does not fit its storage of {flat.numel()} elements", where)
        try:
            log.restore_digest(int(rec), flat.view(shape))
        except ValueError as e:
            raise TraceFileError(str(e), where) from None
    if ops is not None:
        _restore_ops(log, ops, limits)
    if manifest["generation"] is not None:
        _restore_generation(log, manifest["generation"], manifest["model"])
    if manifest["error"] is not None:
        log.restore_failure(manifest["error"])
    return Trace(log)


MAX_DERIVED_CHARS = 1 << 20  # one record's mask description (its key padding as run lengths)


def _restore_derived(log: TraceLog, index: int, text: object) -> None:
    where = f"{RECORDS} record {index} derived"
    if not isinstance(text, str) or len(text) > MAX_DERIVED_CHARS:
        raise TraceFileError(f"a mask description must be a JSON string of at most {MAX_DERIVED_CHARS:,} characters",
                             where)
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("stage"), str):
            raise ValueError("expected {\"stage\": …, \"mask\": {…}}")
        log.restore_derived(index, data["stage"], MaskSpec.from_json(data.get("mask")))
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError; too deep a nesting
        raise TraceFileError(str(e)[:300], where) from None


def _check_steps(steps: tuple[StepRecord, ...], n: int, limits: Limits, first_step: int = 0,
                 first_record: int = 0) -> None:
    """The steps' record ranges: ``n`` records numbered from ``first_record``, steps from ``first_step`` (a part
    continues the files before it)."""
    expected, n = first_record, first_record + n
    for i, s in enumerate(steps, start=first_step):
        if s.step != i:
            raise TraceFileError(f"step numbers must run {first_step}, {first_step + 1}, … without gaps; found "
                                 f"{s.step} at position {i - first_step}", f"steps[{i - first_step}]")
        if s.first_record != expected or not s.first_record <= s.end_record <= n:
            raise TraceFileError(f"records [{s.first_record}, {s.end_record}) do not continue where step {i - 1} "
                                 f"ended ({expected}) within {n} records", f"steps[{i - first_step}]")
        if s.end_record - s.first_record > limits.records_per_step:
            raise TraceFileError(f"{s.end_record - s.first_record} records, over the limit of "
                                 f"{limits.records_per_step} per step", f"steps[{i}]")
        expected = s.end_record
    if n - expected > limits.records_per_step:  # the records of a failed attempt at the next step, one step's worth
        raise TraceFileError(f"{n - expected} records after the last step, over the limit of "
                             f"{limits.records_per_step} per step", "counts.records")


def _stats_row(cols: list[list], i: int, where: str) -> TensorStats | None:
    has, lo, hi, mean, std, nan, pos, neg = (c[i] for c in cols)
    if not has:
        return None
    counts = []
    for label, v in (("nan", nan), ("pos_inf", pos), ("neg_inf", neg)):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < 0:
            raise TraceFileError(f"{label} count {v!r} is not a whole number ≥ 0", where)
        counts.append(int(v))
    try:
        low, high, mu, sigma = (float(v) for v in (lo, hi, mean, std))
    except (TypeError, ValueError):
        raise TraceFileError("statistics are not numbers", where) from None
    n_nan, n_pos_inf, n_neg_inf = counts
    return TensorStats(low, high, mu, sigma, n_nan, n_pos_inf, n_neg_inf)


def _view(flat: torch.Tensor, raw: RawRecord, offset: int, stride: Any, where: str, limits: Limits) -> torch.Tensor:
    strides = _whole_numbers(stride, where + " strides", limits)
    if len(strides) != len(raw.shape):
        raise TraceFileError(f"{len(strides)} strides for a {len(raw.shape)}-dimensional value", where)
    if dtype_name(flat.dtype) != raw.dtype:
        raise TraceFileError(f"declares dtype {raw.dtype} but its storage holds {dtype_name(flat.dtype)}", where)
    if math.prod(raw.shape):
        end = offset + 1 + sum((size - 1) * st for size, st in zip(raw.shape, strides))
        if end > flat.numel():
            raise TraceFileError(f"its view reaches element {end} of a storage of {flat.numel()}", where)
    return torch.as_strided(flat, raw.shape, strides, flat.storage_offset() + offset)


def _check_model(identity: ModelIdentity, modules: tuple[ModuleInfo, ...]) -> None:
    """The config's layer count must be what the module list holds (views size their pickers by it)."""
    n_layer = identity.config.get("n_layer")
    blocks = {m.path.split(".")[1] for m in modules if m.path.startswith("blocks.") and m.path.count(".") >= 1}
    if n_layer is not None and blocks and n_layer != len(blocks):
        raise TraceFileError(f"says {n_layer} layers but the modules hold {len(blocks)} blocks", "model.config.n_layer")


def _restore_ops(log: TraceLog, ops: pd.DataFrame, limits: Limits) -> None:
    steps = _ints(ops, "step", OPS, 0, len(log.steps))
    modules = _ints(ops, "module_index", OPS, -1, len(log.modules) - 1)
    firsts = _ints(ops, "first_record", OPS, -1, log.n_records)
    names, dtypes, errors = ops["op"].tolist(), ops["dtype"].tolist(), ops["error"].tolist()
    ins, outs = ops["input_shapes"].tolist(), ops["output_shapes"].tolist()
    for i in range(len(ops)):
        where = f"{OPS} row {i}"
        if not isinstance(ins[i], (list, np.ndarray)) or not isinstance(outs[i], (list, np.ndarray)) or \
                len(ins[i]) > 64 or len(outs[i]) > 64:
            raise TraceFileError("shapes must be lists of at most 64 shapes", where)
        op = RawOp(int(steps[i]), str(names[i])[:200], int(modules[i]),
                   tuple(_shape_list(s, where, limits) for s in ins[i]),
                   tuple(_shape_list(s, where, limits) for s in outs[i]),
                   str(dtypes[i] or "")[:50], str(errors[i] or "")[:5000], int(firsts[i]))
        try:
            log.restore_op(op)
        except ValueError as e:
            raise TraceFileError(str(e), where) from None


def _restore_generation(log: TraceLog, generation: dict, identity: ModelIdentity | None) -> None:
    if identity is None:
        raise TraceFileError("a generation needs the model that made it", "model")
    info_raw = generation["info"]
    try:
        info = GenerationInfo(model=identity, **info_raw)
    except (TypeError, ValueError) as e:
        raise TraceFileError(str(e), "generation.info") from None
    batch = len(info.prompt_tokens)
    if not batch or len(info.prompts) != batch or any(
            len(t) != len(lab) or not t for t, lab in zip(info.prompt_tokens, info.prompt_labels)):
        raise TraceFileError("prompts, their tokens and their labels must be as many, each sequence non-empty",
                             "generation.info")
    vocab = identity.config.get("vocab_size", 2**31)
    if any(t >= vocab for row in info.prompt_tokens for t in row):
        raise TraceFileError(f"a prompt token is outside the vocabulary of {vocab}", "generation.info.prompt_tokens")
    if info.prompt_width + len(generation["steps"]) > info.n_ctx or info.n_ctx > identity.config.get("n_ctx", 2**31):
        raise TraceFileError("more positions than the model's n_ctx", "generation.info.n_ctx")
    log.begin_generation(info)
    shapes_at = _attention_shapes(log)
    prompt = identity.config.get("prompt_positions", 0)  # CPM-Ant: its attention runs over P more positions
    prompt = prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else 0
    for i, step in enumerate(generation["steps"]):
        where = f"generation.steps[{i}]"
        f = step.forward
        expected_t = info.prompt_width + i if info.use_cache else f.n
        if f.t != expected_t or f.n > f.t or len(f.fed_tokens) != batch or any(len(r) != f.n for r in f.fed_tokens):
            raise TraceFileError(f"n = {f.n}, t = {f.t} and the tokens fed do not fit a batch of {batch} at step {i}",
                                 where)
        cache_before, cache_after = (f.t - f.n, f.t) if info.use_cache else (0, 0)
        if (f.cache_before, f.cache_after) != (cache_before, cache_after):
            raise TraceFileError(f"the cache holds {f.cache_before} → {f.cache_after} positions, but n = {f.n} and "
                                 f"t = {f.t} {'with' if info.use_cache else 'without'} a cache make that "
                                 f"{cache_before} → {cache_after}", where + ".forward")
        if i in shapes_at and shapes_at[i] != (batch, f.n + prompt, f.t + prompt):
            raise TraceFileError(f"says [B, n, t] = [{batch}, {f.n}, {f.t}]" + (f" after {prompt} prompt positions"
                                                                               if prompt else "")
                                 + " but its attention records are "
                                 f"{list(shapes_at[i])}", where)
        choice = step.sampling
        if choice is not None and not (len(choice.tokens) == len(choice.labels) == len(choice.probs) == batch
                                       and all(t < vocab for t in choice.tokens)):
            raise TraceFileError("the chosen tokens do not fit the batch or the vocabulary", where + ".sampling")
        if choice is None and i != len(generation["steps"]) - 1:
            raise TraceFileError("only the last step may have chosen no token", where + ".sampling")
        try:
            log.add_generation_step(step)
        except ValueError as e:
            raise TraceFileError(str(e), where) from None
    for i, comparison in enumerate(generation["comparisons"]):
        try:
            log.add_comparison(comparison)
        except ValueError as e:
            raise TraceFileError(str(e), f"generation.comparisons[{i}]") from None


def _attention_shapes(log: TraceLog) -> dict[int, tuple[int, int, int]]:
    """Per step, (B, n, t) read off the first attention-weights record, where the trace has one."""
    out: dict[int, tuple[int, int, int]] = {}
    modules = log.modules
    for i in range(log.n_records):
        raw = log.raw(i)
        if raw.kind == "hook" and modules[raw.module].path.endswith("attn.hook_pattern") and raw.step not in out \
                and len(raw.shape) == 4:
            out[raw.step] = (raw.shape[0], raw.shape[2], raw.shape[3])
    return out
