"""Saving a trace: its records and ops as Parquet tables, its kept values as one safetensors file, its manifest as
JSON (the format: tracer/files/_format.py), into a directory or one ``.zip`` — checked loadable before it is
written."""

from __future__ import annotations

import io
import json
import math
import struct
import tempfile
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import pandas as pd
import pyarrow.parquet as pq
import torch

from gpt_shape_tracer.tracer.files._format import _ST_NAMES, FORMAT, LIMITS, MANIFEST, OPS, RECORDS, VALUES, VERSION
from gpt_shape_tracer.tracer.files._schema import (
    TraceFileError,
)
from gpt_shape_tracer.tracer.reading import Trace
from gpt_shape_tracer.tracer.storage import storage_key
from gpt_shape_tracer.tracer.storage.records import (
    Finite,
)


# -- saving ---------------------------------------------------------------------------------------
class _OnDisk:
    """A value kept in the spill file, written into values.safetensors when its turn comes (read then, one at
    a time: exporting a run that spilled gigabytes does not hold them in memory)."""

    def __init__(self, trace: Trace, index: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.trace, self.index, self.dtype, self.shape = trace, index, dtype, shape

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def read(self) -> torch.Tensor:
        value = self.trace.log.value(self.index)
        if value is None:
            raise TraceFileError(f"record {self.index}'s value left the spill file while the trace was written")
        return value.reshape(-1)


def _storages(trace: Trace, after: TraceWritten | None = None) -> tuple[
        list[torch.Tensor | _OnDisk], dict[int, tuple[int, int, tuple[int, ...]]], dict[int, tuple[int, list[int]]],
        list[list], dict[tuple, tuple[int, int, int]]]:
    """Each kept storage of the records from ``after.records`` on (all, for a whole trace) once, as a flat tensor
    over the span its views use (a value on disk: read when it is written); per record index ``(storage number,
    offset in it, strides)``; per digested record ``(storage number, shape)``.

    For a part, a storage the files before it hold already — the KV cache's buffer, whose prefix each step's K and
    V view, one position longer each step — is not written again: where every new view of it is an earlier kept
    view grown along one axis (or lies inside one), only the grown slabs are written, and ``extends`` lists
    ``[a storage of no elements standing for the earlier one joined, the earlier storage's number counted over all
    the files, its length joined, [[slab storage, offset, shape, strides], …]]``; the reader copies each slab
    into the earlier storage at its place. (The slabs are not the span's tail: the buffer's unused rows of every
    head lie inside the span written before.) A new view of any other kind writes its storage's span whole. Also,
    per live storage, what the files hold of it (``TraceWritten.spans``)."""
    first_record = after.records if after is not None else 0
    before = after.storages if after is not None else 0
    written = after.spans if after is not None else {}
    log = trace.log
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for index, value in log.kept_values(first_record):
        groups.setdefault((storage_key(value), value.dtype), []).append((index, value))
    # the earlier records' views still kept, by storage: the same storage as when the files took it (a freed one's
    # address may come back for another), its numbers unchanged (a value changed in place is dropped when read)
    earlier = {key: held for key in groups if key in written
               and (held := [v for v in log.kept_views(key[0], first_record) if v.dtype == key[1]])}
    # what the files hold of the storages the last write's newest step viewed, carried on unchecked: a part adds to
    # one only where an earlier record still keeps a view of it (``earlier``), which proves it is the storage the
    # files took
    spans = dict(written)
    flats: list[torch.Tensor | _OnDisk] = []
    views: dict[int, tuple[int, int, tuple[int, ...]]] = {}
    extends: list[list] = []
    for key, members in groups.items():
        member_spans = [_span(v) for _, v in members]
        lo = min(s[0] for s in member_spans)
        hi = max(s[1] for s in member_spans)
        base = members[0][1]
        slabs = None
        if key in earlier and lo >= spans[key][1]:
            _, held_from, held_to = spans[key]
            # the earlier views whose numbers the files hold in that storage (one written whole since holds
            # only its own span)
            within = [o for o in earlier[key] if held_from <= (o_span := _span(o))[0] and o_span[1] <= held_to]
            slabs = _grown_slabs([v for _, v in members], within)
        if slabs is not None:
            root, lo, held_to = spans[key]
            hi = max(hi, held_to)
            number = len(flats)
            flats.append(base.new_empty(0))  # stands for the earlier storage, joined
            patches = []
            for slab in slabs:
                patches.append([len(flats), int(slab.storage_offset()) - lo, list(slab.shape), list(slab.stride())])
                flats.append(slab.contiguous().reshape(-1))
            extends.append([number, root, hi - lo, patches])
            spans[key] = (root, lo, hi)
        else:
            number = len(flats)
            flats.append(torch.as_strided(base, (hi - lo,), (1,), lo) if hi > lo else base.new_empty(0))
            spans[key] = (before + number, lo, hi)
        for index, value in members:
            views[index] = (number, int(value.storage_offset()) - lo, tuple(value.stride()))
    for index, dtype, shape in trace.log.spilled():
        if index < first_record:
            continue
        views[index] = (len(flats), 0, torch.empty(shape, device="meta").stride())  # spilled contiguous
        flats.append(_OnDisk(trace, index, dtype, shape))
    digests: dict[int, tuple[int, list[int]]] = {}
    for index in range(first_record, trace.log.n_records):
        digest = trace.log.digest(index)
        if digest is not None:
            digests[index] = (len(flats), list(digest.shape))
            flats.append(digest.contiguous().reshape(-1))
    # carried on to the next part: the storages the last step viewed (the KV cache's buffers among them), not every
    # storage ever written — what is kept per run stays one step's size however long the run
    last = log.steps[-1].first_record if log.steps else 0
    recent = {key for key, members in groups.items() if max(i for i, _ in members) >= last}
    return flats, views, digests, extends, {key: span for key, span in spans.items() if key in recent}


def _grown_slabs(new: list[torch.Tensor], old: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The elements of the views ``new`` that none of the views ``old`` (of the same storage) holds, as strided
    slabs of the storage — when each new view is an old one grown along one axis (same offset and strides), or
    lies inside an old one or inside such a grown view; None otherwise (the caller writes the span whole)."""
    grown: list[torch.Tensor] = []  # the new views that grew, whole: later members may lie inside them
    slabs: dict[tuple, torch.Tensor] = {}
    for v in sorted(new, key=lambda t: -t.numel()):
        if any(_inside(v, w) for w in (*old, *grown)):
            continue
        best = None
        for o in old:
            if o.stride() != v.stride() or o.storage_offset() != v.storage_offset() or o.dim() != v.dim():
                continue
            differ = [d for d in range(v.dim()) if o.shape[d] != v.shape[d]]
            if len(differ) == 1 and o.shape[differ[0]] < v.shape[differ[0]] and (
                    best is None or o.numel() > best[0].numel()):
                best = (o, differ[0])
        if best is None:
            return None
        o, axis = best
        slab = v.narrow(axis, o.shape[axis], v.shape[axis] - o.shape[axis])
        slabs.setdefault((int(slab.storage_offset()), tuple(slab.shape), slab.stride()), slab)
        grown.append(v)
    return list(slabs.values())


def _inside(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether every element the view ``a`` reads is one the view ``b`` reads (the same strides, ``a``'s box within
    ``b``'s: the offset between them spelt in ``b``'s strides, largest first, with nothing left over)."""
    if a.stride() != b.stride() or a.dim() != b.dim() or a.numel() == 0:
        return a.numel() == 0
    delta = int(a.storage_offset()) - int(b.storage_offset())
    if delta < 0:
        return False
    for d in sorted(range(b.dim()), key=lambda d: -b.stride()[d]):
        step = b.stride()[d]
        at = delta // step if step else 0
        if step and b.shape[d] > 1:
            at = min(at, b.shape[d] - 1)
        delta -= at * step
        if at + a.shape[d] > b.shape[d]:
            return False
    return delta == 0


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = int(t.storage_offset())  # an int (torch types it int | SymInt for traced graphs)
    if t.numel() == 0:
        return start, start
    end = start + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return start, end


def _records_table(trace: Trace, views: dict[int, tuple], digests: dict[int, tuple], first_step: int = 0
                   ) -> pd.DataFrame:
    log = trace.log
    if first_step:  # a part: its steps' records (and a failed attempt's after them), a frame per step
        tail = int(log.n_records > (log.steps[-1].end_record if log.steps else 0))
        frame = pd.concat([trace.to_frame(s, stats=True, recompute=False)
                           for s in range(first_step, len(log.steps) + tail)], ignore_index=True)
    else:
        frame = trace.to_frame(stats=True, recompute=False)  # a derived stage: its statistics if a reader took them
    raws = [log.raw(i) for i in frame["index"]]
    frame["module_index"] = [r.module for r in raws]
    # which records are one tensor (a module's output and the next one's input): a number per tensor, not its
    # address; 0 where unknown
    ids: dict[int, int] = {}
    frame["tensor_id"] = [ids.setdefault(int(r.data_ptr), len(ids) + 1) if r.data_ptr else 0 for r in raws]
    frame["finite"] = [Finite.WORDS[int(code)] for code in frame["finite"]]
    records = trace.records
    frame["axes"] = [list(records[i].axes or ()) for i in frame["index"]]
    frame["has_stats"] = [log.has_stats(i) for i in frame["index"]]
    # in the file: whether values.safetensors holds it (a derived stage is recomputed from Q and K instead)
    frame["has_value"] = [log.has_value(i) for i in frame["index"]]
    frame["shape"] = [list(s) for s in frame["shape"]]
    frame["storage"] = [views[i][0] if i in views else -1 for i in frame["index"]]
    frame["storage_offset"] = [views[i][1] if i in views else 0 for i in frame["index"]]
    frame["strides"] = [list(views[i][2]) if i in views else [] for i in frame["index"]]
    frame["digest_storage"] = [digests[i][0] if i in digests else -1 for i in frame["index"]]
    frame["digest_shape"] = [digests[i][1] if i in digests else [] for i in frame["index"]]
    derived = log.derived_records()  # a fused attention's n × t stages: how a reader recomputes them
    frame["derived"] = [json.dumps({"stage": derived[i][0], "mask": derived[i][1].to_json()}) if i in derived else ""
                        for i in frame["index"]]
    return frame


def _manifest(trace: Trace, n_records: int, n_ops: int, n_storages: int, after: TraceWritten | None = None,
              extends: list[list[int]] | None = None) -> dict:
    log = trace.log
    facts = trace.generation
    first = after.steps if after is not None else 0
    generation = None
    if facts is not None:
        info = asdict(facts.info)
        info.pop("model")
        generation = {"info": info, "steps": [asdict(s) for s in facts.steps[first:]],
                      "comparisons": [asdict(c) for c in sorted(facts.comparisons.values(), key=lambda c: c.step)
                                      if c.step >= first]}
    manifest = {
        "format": FORMAT, "version": VERSION, "capture": log.capture, "budget_bytes": log.budget_bytes,
        "modules": [asdict(m) for m in log.modules],
        "steps": [asdict(s) for s in log.steps[first:]],
        "model": asdict(log.model) if log.model is not None else None,
        "generation": generation,
        "error": asdict(log.error) if log.error is not None else None,
        "counts": {"records": n_records, "ops": n_ops, "storages": n_storages},
    }
    if after is not None:
        manifest["continues"] = {"steps": after.steps, "records": after.records, "ops": after.ops,
                                 "storages": after.storages, "extends": extends or []}
    return manifest


def _safetensors_header(flats: list[torch.Tensor | _OnDisk]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT, "version": str(VERSION)}}
    offset = 0
    for k, flat in enumerate(flats):
        size = flat.numel() * flat.element_size()
        header[f"s{k}"] = {"dtype": _ST_NAMES[flat.dtype], "shape": [flat.numel()],
                           "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    return blob + b" " * (-len(blob) % 8)  # the data starts 8-byte aligned


def _write_safetensors(out: IO[bytes], flats: list[torch.Tensor | _OnDisk]) -> None:
    """The safetensors format, written one storage at a time (never the whole file in memory)."""
    blob = _safetensors_header(flats)
    out.write(struct.pack("<Q", len(blob)))
    out.write(blob)
    for flat in flats:
        if flat.numel():
            tensor = flat.read() if isinstance(flat, _OnDisk) else flat
            out.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)


def _parquet(frame: pd.DataFrame) -> bytes:
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    return buf.getvalue()


def _members(trace: Trace, after: TraceWritten | None = None) -> tuple[list[tuple[str, Any]], TraceWritten]:
    """(member name, bytes or a writer of a file object), in archive order — once every member is known to be
    within what ``load_trace`` reads back (``_check_loadable``): nothing is written for a trace that would not
    load. With ``after``, the members of a part holding what the trace added since (``save_trace_part``). Also
    what the files hold once these members are written."""
    log = trace.log
    if after is not None and not after.continued_by(trace):
        raise TraceFileError("the trace no longer begins with the steps written before: write it whole")
    if after is not None and after.holds_all_of(trace):
        raise TraceFileError("nothing to write: the trace has added nothing since the files written before")
    first_step, first_op = (after.steps, after.ops) if after is not None else (0, 0)
    flats, views, digests, extends, spans = _storages(trace, after)
    records = _records_table(trace, views, digests, first_step)
    ops = trace.ops_frame().iloc[first_op:].reset_index(drop=True)
    ops["input_shapes"] = [[list(s) for s in shapes] for shapes in ops["input_shapes"]]
    ops["output_shapes"] = [[list(s) for s in shapes] for shapes in ops["output_shapes"]]
    raw_ops = log.ops[first_op:]
    ops["module_index"] = [op.module for op in raw_ops]
    ops["first_record"] = [op.first_record for op in raw_ops]
    manifest = _manifest(trace, len(records), len(ops), len(flats), after, extends)
    members = [(MANIFEST, json.dumps(_plain(manifest), indent=1, allow_nan=False).encode("utf-8")),
               (RECORDS, _parquet(records)), (OPS, _parquet(ops))]
    value_bytes = _check_loadable(trace, dict(members), len(records), len(ops), flats, after)
    written = TraceWritten(
        steps=len(log.steps), records=log.n_records, ops=len(log.ops),
        value_bytes=value_bytes + (after.value_bytes if after is not None else 0),
        parts=after.parts + 1 if after is not None else 1, epoch=log.epoch,
        comparisons=frozenset(log.comparisons.items()),
        ends_in_failure=log.n_records > (log.steps[-1].end_record if log.steps else 0) or log.error is not None,
        storages=(after.storages if after is not None else 0) + len(flats), spans=spans)
    return [*members, (VALUES, lambda out: _write_safetensors(out, flats))], written


def _check_loadable(trace: Trace, data: dict[str, bytes], n_records: int, n_ops: int,
                    flats: list[torch.Tensor | _OnDisk], after: TraceWritten | None = None) -> int:
    """The reader's limits (``LIMITS``, what ``load_trace`` uses unless told otherwise), checked by the writer
    with the same numbers the reader will compute: a trace that ``load_trace`` would refuse is refused here,
    before anything is written, saying which limit and by how much. A part is checked with the parts before it
    (``after``), as ``load_trace_parts`` reads them together. Returns the bytes of its values."""
    limits = LIMITS
    before = after or TraceWritten(0, 0, 0, 0, 0, 0, frozenset(), False, 0, {})
    per_step = max((s.end_record - s.first_record for s in trace.log.steps[before.steps:]), default=0)
    value_bytes = sum(f.numel() * f.element_size() for f in flats)
    checks = [("records", before.records + n_records, limits.records),
              ("records in one step", per_step, limits.records_per_step),
              ("ops", before.ops + n_ops, limits.ops), ("modules", len(trace.log.modules), limits.modules),
              ("steps", len(trace.log.steps), limits.steps),
              ("values bytes", before.value_bytes + value_bytes, limits.value_bytes),
              (f"{MANIFEST} bytes", len(data[MANIFEST]), limits.manifest_bytes),
              (f"{VALUES} header bytes", len(_safetensors_header(flats)), limits.manifest_bytes)]
    for name in (RECORDS, OPS):
        meta = pq.ParquetFile(io.BytesIO(data[name])).metadata
        inflated = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        checks += [(f"{name} bytes", len(data[name]), limits.table_bytes),
                   (f"{name} bytes once decoded", inflated, limits.table_bytes)]
    for what, number, limit in checks:
        if number > limit:
            raise TraceFileError(f"this trace cannot be saved as one that loads back: {number} {what}, over the "
                                 f"limit of {limit} (tracer.files.Limits) by {number - limit}; nothing was written "
                                 "(trace fewer steps, a lower capture level, or a smaller spill)")
    return value_bytes


def _plain(value: Any) -> Any:
    """JSON has no NaN or ∞: they are written as the strings "nan", "inf", "-inf" (``Float`` reads them back
    where a field allows them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` to a directory, or to a ``.zip`` archive when ``path`` ends in .zip. Members are
    streamed to disk: the values are never held twice."""
    path = Path(path)
    if str(path) in ("", "."):
        raise ValueError("give a file or directory name to save the trace to")
    members, _ = _members(trace)  # checked before the file is created
    if path.suffix == ".zip":
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(path, "w") as zf:
            _write_zip(zf, members)
    else:
        path.mkdir(parents=True, exist_ok=True)
        for name, data in members:
            with open(path / name, "wb") as f:
                f.write(data) if isinstance(data, bytes) else data(f)
    return path


def _write_zip(zf: zipfile.ZipFile, members: list[tuple[str, Any]]) -> None:
    for name, data in members:
        # Parquet and float tensors barely compress: store them, and deflate the JSON
        compress = zipfile.ZIP_DEFLATED if name == MANIFEST else zipfile.ZIP_STORED
        info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
        info.compress_type = compress
        with zf.open(info, "w", force_zip64=True) as out:
            out.write(data) if isinstance(data, bytes) else data(out)


def write_archive(trace: Trace, out: IO[bytes]) -> None:
    """The ``.zip`` archive into an open binary file (nothing written to it if the trace would not load back)."""
    members, _ = _members(trace)
    with zipfile.ZipFile(out, "w") as zf:
        _write_zip(zf, members)


def archive_bytes(trace: Trace) -> bytes:
    """The ``.zip`` archive as bytes (for a download button): built in a temporary file that spills to disk
    past 64 MiB, so the values are not held twice while it is written."""
    with tempfile.SpooledTemporaryFile(max_size=64 * 2**20) as f:
        write_archive(trace, f)
        f.seek(0)
        return f.read()


# -- a trace written in parts ---------------------------------------------------------------------
@dataclass(frozen=True)
class TraceWritten:
    """What a trace's files hold once written in parts (``save_trace_part``): steps, records, ops and value bytes
    in all, how many files, and what the log was then — its epoch (bumped whenever records are discarded) and the
    steps it held comparisons for. A next part continues them only while the trace still begins with exactly
    what they hold (``continued_by``)."""

    steps: int
    records: int
    ops: int
    value_bytes: int
    parts: int
    epoch: int
    comparisons: frozenset  # (step, RecomputeComparison) pairs: a step measured again is another pair
    ends_in_failure: bool  # the last part holds a failed attempt's records (the next step discards them)
    storages: int  # the values' storages the files hold (a part extending one adds a number, not a storage)
    # per live storage (its key and dtype) a part may extend: (its number over the files, first, end element)
    spans: dict = field(repr=False)

    def holds_all_of(self, trace: Trace) -> bool:
        """Whether the trace has added nothing since: no step, no record (a failed attempt's) to write."""
        return len(trace.log.steps) == self.steps and trace.log.n_records == self.records

    def continued_by(self, trace: Trace) -> bool:
        """Whether a part holding only what ``trace`` added since continues these files: they hold a step,
        nothing was discarded since, the last part ended with a step, and no comparison was added to (or made
        again for) a step written already."""
        log = trace.log
        return (self.steps > 0 and log.epoch == self.epoch and not self.ends_in_failure
                and log.step_in_progress is None and len(log.steps) >= self.steps and log.n_records >= self.records
                and len(log.ops) >= self.ops
                and frozenset((s, c) for s, c in log.comparisons.items() if s < self.steps) == self.comparisons)


def save_trace_part(trace: Trace, path: str | Path, after: TraceWritten | None = None) -> TraceWritten:
    """Write to the ``.zip`` ``path`` the whole trace (``after`` None: a file ``load_trace`` reads), or, after the
    files ``after`` describes, a *part*: the steps, records, ops and values the trace added since, with a
    manifest saying where it continues (``continues``). ``load_trace_parts`` reads the first file and its parts
    back as one trace. A run written after every step writes each step once instead of the whole trace again.
    Returns what the files hold now (pass it to the next part)."""
    path = Path(path)
    if path.suffix != ".zip":
        raise ValueError(f"a trace part is one .zip file; got {str(path)[:200]!r}")
    members, written = _members(trace, after)
    with zipfile.ZipFile(path, "w") as zf:
        _write_zip(zf, members)
    return written
