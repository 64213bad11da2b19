"""Evicted values kept on disk: the opt-in "keep every value" mode (``spill_bytes`` > 0).

A value the budget evicts is written, contiguous, to the end of one unnamed temporary file (created 0600 in
the system's temporary directory and unlinked at once: nothing else can open it, and it is gone when the
trace is closed or the process ends), up to ``cap_bytes``; it is read back one value at a time when asked
for, so the views and the Inspector show the real numbers of any step. Past the cap, values are evicted to
their statistics as without the spill, and the trace says from which record.

Views of one storage (the KV cache of step s is a prefix of step s + 1's) are written each on its own, so
what a long cached generation spills grows with the square of its steps: the cap bounds it.
"""

from __future__ import annotations

import os
import tempfile
from typing import IO

import torch


class SpillFile:
    def __init__(self, cap_bytes: int) -> None:
        if cap_bytes < 0:
            raise ValueError(f"spill_bytes must be ≥ 0, got {cap_bytes}")
        self.cap_bytes = cap_bytes
        self._file: IO[bytes] | None = None
        self._end = 0
        self._where: dict[int, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}  # index → offset, bytes, …
        self.first_refused: int | None = None  # the first record the cap turned away

    @property
    def bytes_used(self) -> int:
        return self._end

    def __contains__(self, index: int) -> bool:
        return index in self._where

    def indices(self) -> list[int]:
        return list(self._where)

    def layout(self, index: int) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) of a spilled value, without reading it."""
        _, _, dtype, shape = self._where[index]
        return dtype, shape

    def put(self, index: int, tensor: torch.Tensor) -> bool:
        """Write ``tensor``'s numbers for record ``index``; False (and nothing written) past the cap."""
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        if self._end + nbytes > self.cap_bytes:
            if self.first_refused is None:
                self.first_refused = index
            return False
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="gpt-shape-tracer-spill-")  # noqa: SIM115 - closed by close()
        if nbytes:
            written = os.pwrite(self._file.fileno(), flat.view(torch.uint8).numpy().data, self._end)
            if written != nbytes:
                raise OSError(f"the spill file took {written} of {nbytes} bytes (is the disk full?)")
        self._where[index] = (self._end, nbytes, tensor.dtype, tuple(tensor.shape))
        self._end += nbytes
        return True

    def get(self, index: int) -> torch.Tensor | None:
        """Record ``index``'s value read back from disk (a fresh tensor), or None when it was not spilled."""
        where = self._where.get(index)
        if where is None:
            return None
        offset, nbytes, dtype, shape = where
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        assert self._file is not None
        data = bytearray(nbytes)
        got = os.preadv(self._file.fileno(), [data], offset)
        if got != nbytes:
            raise OSError(f"the spill file returned {got} of {nbytes} bytes")
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)

    def forget(self, index: int) -> None:
        """A record discarded (a failed step's retry): its bytes stay in the file, unreachable."""
        self._where.pop(index, None)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._where.clear()
