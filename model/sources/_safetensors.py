"""Reading weight files by hand: a directory's safetensors files (``safetensors_files``: the index's shards,
each inside the directory), one safetensors file header first and data mapped, not read (``SafetensorsFile``),
and ``pytorch_model.bin`` unpickled with ``weights_only=True`` only (``read_bin``)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import mmap
import os
from pathlib import Path

import torch

from gpt_shape_tracer.model.sources._common import (
    READ_CHUNK,
    ModelLoadError,
    check_link,
    check_tensors_fit,
    read_json,
    unpickling_error,
)

MAX_HEADER_BYTES = 100 << 20  # a safetensors header is JSON names and shapes: 100 MB is far beyond any real one
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _inside(directory: Path, name: str) -> bool:
    """Whether ``name`` names a path inside ``directory`` *as written*: no absolute path, no ``..``.

    The link path is what counts, not where a symlink points: in a Hugging Face cache snapshot every
    file is a symlink into ``../../blobs/``, and that is fine; an index naming ``../../etc/passwd`` is not."""
    if not name or "\x00" in name or os.path.isabs(name):
        return False
    normal = os.path.normpath(name)
    return not (normal == ".." or normal.startswith(".." + os.sep) or normal == ".")



def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of ``directory``: the index's shards (sorted) or ``model.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        raw = read_json(index, "a safetensors index")
        weight_map = raw.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: not a valid safetensors index (no \"weight_map\" object)")
        bad = [v for v in weight_map.values() if not isinstance(v, str)]
        if bad:
            raise ModelLoadError(
                f"{index}: not a valid safetensors index (shard names must be strings, got {bad[0]!r})")
        files = []
        for name in sorted(set(weight_map.values())):
            if not _inside(directory, name):
                raise ModelLoadError(f"{index}: shard {name!r} lies outside the checkpoint directory")
            check_link(directory, directory / name)
            files.append(directory / name)
        return files
    single = directory / "model.safetensors"
    return [single] if single.exists() or single.is_symlink() else []


class SafetensorsFile:
    """One safetensors file, read by hand: the header first (names, dtypes, shapes — checkable before any
    allocation), then the data mapped, not read: ``tensor(name)`` is a view of the file's pages (the page
    cache, shared with the identity's hash on its own thread, ``model.gpt.BackgroundDigest``), copied
    once into our layout (``hf_to_state``), after which ``release(name)`` lets those pages go. (As with any
    memory-mapped load, transformers' included, a file cut short by another process *while* it is being
    copied would stop the process with SIGBUS; the sizes are checked against the header before.)

    Format: 8 bytes little-endian header length N, N bytes of JSON ``{name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data (offsets relative to its start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                first = f.read(8)
                if len(first) < 8:
                    self._fail("shorter than the 8-byte header length")
                n = int.from_bytes(first, "little")
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    self._fail(f"the header claims {n:,} bytes but the file has {size:,}")
                header_bytes = f.read(n)
                # copy-on-write: torch.frombuffer wants a writable buffer, and nothing is ever written. Never
                # mmap.close()d: that unmaps at once even while views made by torch.frombuffer live on (they
                # keep the object, not its buffer, alive), and a view left in an error's traceback would then
                # read unmapped memory and crash; the file is unmapped when the last view of it goes
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot be read ({e})") from None
        try:
            header = json.loads(header_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self._fail(f"the header is not JSON ({e})")
        except RecursionError:  # nested deeper than Python's recursion limit
            self._fail("the header's JSON is nested too deeply to be one")
        if not isinstance(header, dict):
            self._fail("the header is not a JSON object")
        self._data_start = 8 + n
        self.data_size = size - 8 - n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = SAFETENSORS_DTYPES[info["dtype"]]
                shape = tuple(info["shape"])
                begin, end = info["data_offsets"]
                if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (*shape, begin, end)):
                    raise ValueError("negative or non-integer numbers")
            except (KeyError, TypeError, ValueError) as e:
                self._fail(f"tensor {name!r} has a malformed entry ({type(e).__name__}: {e})")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if not begin <= end <= self.data_size or end - begin != nbytes:
                self._fail(f"tensor {name!r} declares bytes {begin}–{end} for {nbytes:,} bytes of data, "
                           f"in {self.data_size:,} bytes")
            self.entries[name] = (dtype, shape, begin, end)
        pos = 0
        for name, (_, _, begin, end) in sorted(self.entries.items(), key=lambda kv: kv[1][2]):
            if begin < pos:
                self._fail(f"tensor {name!r} overlaps the one before it")
            pos = end

    def _fail(self, problem: str):
        raise ModelLoadError(f"{self.path}: not a readable safetensors file ({problem})")

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, a view of the mapped file (no copy; its pages are read when first touched)."""
        dtype, shape, begin, end = self.entries[name]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=self._data_start + begin)
        return raw.view(dtype).view(shape)

    def release(self, name: str) -> None:
        """Unmap tensor ``name``'s pages once its copy exists, so that the process holds the weights once, not
        twice. The mapping is private and never written, so a page touched again is read again from the file:
        releasing is always safe, only ever slower."""
        _, _, begin, end = self.entries[name]
        if end == begin or not hasattr(self._map, "madvise"):  # madvise: not on Windows
            return
        start = (self._data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        with contextlib.suppress(OSError):  # e.g. locked pages: they stay, and only memory is spent
            self._map.madvise(mmap.MADV_DONTNEED, start, self._data_start + end - start)


def read_bin(file: Path) -> dict[str, torch.Tensor]:
    """``pytorch_model.bin``: read once into memory, unpickled with ``weights_only=True``."""
    try:
        data = io.BytesIO()
        with open(file, "rb") as f:
            while chunk := f.read(READ_CHUNK):
                data.write(chunk)
        data.seek(0)
        state = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only runs no code of the file's: any error is a malformed file
        raise unpickling_error(file, e, "PyTorch weights file") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ModelLoadError(f"{file}: expected a dictionary of tensors")
    check_tensors_fit(state, file)
    return state
