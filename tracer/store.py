"""Captured tensor values under a byte budget.

Bytes are counted per underlying storage, once, however many records view it
(a hook point's output and the next module's input are the same tensor; ``q``
is a view of the ``qkv`` projection). Adding a value that would pass the budget
first drops the values of the oldest steps; their records keep shape and stats.
The budget is checked on every insert, so it is never exceeded, not even in the
middle of a step.

A kept value is the model's own tensor, not a copy. Its version counter is
noted when it is kept and compared whenever it is read: a tensor changed in
place afterwards (in this step or a later one) is dropped with a note, never
shown with the wrong numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

DEFAULT_BUDGET_BYTES = 512 * 2**20  # 512 MiB
MUTATED = "dropped: changed in place after it was recorded (trace with copy='all' to keep it)"


def extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) element offsets of ``t`` within its storage (an interval covering it)."""
    if t.numel() == 0:
        return (0, 0)
    start = t.storage_offset()
    return start, start + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride > 0)


def _box(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """Per-dimension index ranges of ``t`` in a buffer laid out with ``t``'s strides, or None."""
    offset = t.storage_offset()
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    box: list[tuple[int, int]] = [(0, 0)] * t.dim()
    for d in order:
        stride = t.stride(d)
        if stride <= 0:
            return None
        start, offset = divmod(offset, stride)
        box[d] = (start, start + t.shape[d])
    return box if offset == 0 else None


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether writing ``a`` can change elements of ``b`` (both in one storage).

    Views of one buffer with the same strides — a KV cache's rows written after
    the rows an earlier step kept — are compared exactly, as boxes of indices;
    anything else by the interval of storage they span (which may say yes when
    strided views interleave without touching)."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    if a.stride() == b.stride() and a.dim() == b.dim():
        box_a, box_b = _box(a), _box(b)
        if box_a is not None and box_b is not None:
            return all(x0 < y1 and y0 < x1 for (x0, x1), (y0, y1) in zip(box_a, box_b))
    a0, a1 = extent(a)
    b0, b1 = extent(b)
    return a0 < b1 and b0 < a1


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of the storage behind ``t``."""
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    return (ptr, storage.nbytes()) if ptr else (id(storage), 0)


class ValueStore:
    """Record index → CPU tensor, oldest first, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be ≥ 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        # index → (tensor, step, storage key, version when kept or -1); dicts keep insertion order
        self._entries: dict[int, tuple[torch.Tensor, int, tuple[int, int], int]] = {}
        self._storages: dict[tuple[int, int], set[int]] = {}  # storage → the kept values viewing it
        self.nbytes = 0
        self.peak_nbytes = 0
        self.evicted_count = 0
        self.on_evict: Callable[[int, torch.Tensor, str, bool], None] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, index: int) -> bool:
        return self._verified(index)

    def get(self, index: int) -> torch.Tensor | None:
        return self._entries[index][0] if self._verified(index) else None

    def items(self) -> Iterator[tuple[int, torch.Tensor]]:
        for index in [i for i in self._entries if self._verified(i)]:
            yield index, self._entries[index][0]

    def step_of(self, index: int) -> int:
        return self._entries[index][1]

    def _verified(self, index: int) -> bool:
        entry = self._entries.get(index)
        if entry is None:
            return False
        if entry[3] >= 0 and entry[0]._version != entry[3]:
            self.drop(index, note=MUTATED, stats=False)
            return False
        return True

    def put(self, index: int, step: int, tensor: torch.Tensor) -> str:
        """Keep ``tensor`` for record ``index``; returns "" if kept, else why not."""
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        key = (ptr, storage.nbytes()) if ptr else (id(storage), 0)
        viewers = self._storages.get(key)
        if viewers is not None:
            viewers.add(index)
        else:
            size = key[1]
            if size > self.budget_bytes:
                return f"not kept: its storage ({size} B) is larger than the whole budget ({self.budget_bytes} B)"
            while self.nbytes + size > self.budget_bytes and self._entries:
                self._evict_oldest_step()
            self._storages[key] = {index}
            self.nbytes += size
            if self.nbytes > self.peak_nbytes:
                self.peak_nbytes = self.nbytes
        self._entries[index] = (tensor, step, key, -1 if tensor.is_inference() else tensor._version)
        return ""

    def replace(self, index: int, tensor: torch.Tensor) -> None:
        """Swap a kept value for a private copy (before an in-place op changes the original)."""
        entry = self._entries.get(index)
        if entry is None:
            return
        self.drop(index, note=None)
        reason = self.put(index, entry[1], tensor)
        if reason and self.on_evict is not None:
            self.on_evict(index, tensor, reason, True)

    def drop(self, index: int, note: str | None = "dropped", stats: bool = True) -> None:
        """Forget a value; ``note`` (if any) tells the trace why, and whether its stats can still be taken."""
        entry = self._entries.pop(index, None)
        if entry is None:
            return
        tensor, _, key, version = entry
        if stats and version >= 0 and tensor._version != version:
            note, stats = MUTATED, False  # its statistics would describe the wrong values
        viewers = self._storages[key]
        viewers.discard(index)
        if not viewers:
            del self._storages[key]
            self.nbytes -= key[1]
        if note is not None and self.on_evict is not None:
            self.on_evict(index, tensor, note, stats)

    def _evict_oldest_step(self) -> None:
        oldest_step = self._entries[next(iter(self._entries))][1]
        victims = [i for i, e in self._entries.items() if e[1] == oldest_step]
        newest_step = self._entries[next(reversed(self._entries))][1]
        if oldest_step == newest_step:
            victims = victims[:1]  # the current step alone is over budget: drop its oldest value only
        for i in victims:
            self.evicted_count += 1
            self.drop(i, note=f"evicted: over the {self.budget_bytes} B budget")

    def sharing_storage(self, tensor: torch.Tensor) -> list[int]:
        """Indices of kept values that view the same storage as ``tensor``."""
        return sorted(self._storages.get(storage_key(tensor), ()))

    def overlapping(self, tensor: torch.Tensor) -> list[int]:
        """Indices of kept values whose elements ``tensor`` covers (so writing it would change them)."""
        viewers = self._storages.get(storage_key(tensor))
        if not viewers:
            return []
        out = []
        for index in viewers:
            if overlaps(tensor, self._entries[index][0]):
                out.append(index)
        return sorted(out)

    def steps_held(self) -> list[int]:
        return sorted({e[1] for e in self._entries.values()})
