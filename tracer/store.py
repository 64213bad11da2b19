"""Captured tensor values under a byte budget.

Bytes are counted per underlying storage, once, however many records view it
(a hook point's output and the next module's input are the same tensor; ``q``
is a view of the ``qkv`` projection). Adding a value that would pass the budget
first drops the values of the oldest steps; their records keep shape and stats.
The budget is checked on every insert, so it is never exceeded, not even in the
middle of a step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

DEFAULT_BUDGET_BYTES = 512 * 2**20  # 512 MiB
MUTATED = "dropped: changed in place after it was recorded (trace with copy='all' to keep it)"


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    return (ptr, storage.nbytes()) if ptr else (id(storage), 0)


class ValueStore:
    """Record index → detached CPU tensor, oldest first, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be ≥ 0, got {budget_bytes}")
        self.budget_bytes = int(budget_bytes)
        self._values: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._step: dict[int, int] = {}
        self._key: dict[int, tuple[int, int]] = {}
        self._version: dict[int, int] = {}  # the tensor's version counter when it was kept (-1: untracked)
        self._storages: dict[tuple[int, int], set[int]] = {}  # storage → the kept values viewing it
        self.nbytes = 0
        self.peak_nbytes = 0
        self.evicted_count = 0
        self.on_evict: Callable[[int, torch.Tensor, str, bool], None] | None = None

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, index: int) -> bool:
        return self._verified(index)

    def get(self, index: int) -> torch.Tensor | None:
        return self._values[index] if self._verified(index) else None

    def items(self):
        for index in [i for i in self._values if self._verified(i)]:
            yield index, self._values[index]

    def _verified(self, index: int) -> bool:
        """Kept, and not changed in place since (checked by the version counter when read)."""
        value = self._values.get(index)
        if value is None:
            return False
        version = self._version[index]
        if version >= 0 and value._version != version:
            self.drop(index, note=MUTATED, stats=False)
            return False
        return True

    def put(self, index: int, step: int, tensor: torch.Tensor) -> str:
        """Keep ``tensor`` for record ``index``; returns "" if kept, else why not."""
        key = storage_key(tensor)
        if key in self._storages:
            self._storages[key].add(index)
        else:
            size = key[1]
            if size > self.budget_bytes:
                return f"not kept: its storage ({size} B) is larger than the whole budget ({self.budget_bytes} B)"
            while self.nbytes + size > self.budget_bytes and self._values:
                self._evict_oldest_step()
            self._storages[key] = {index}
            self.nbytes += size
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes)
        self._values[index] = tensor
        self._step[index] = step
        self._key[index] = key
        self._version[index] = -1 if tensor.is_inference() else tensor._version
        return ""

    def replace(self, index: int, tensor: torch.Tensor) -> None:
        """Swap a kept value for a private copy (before an in-place op changes the original)."""
        if index not in self._values:
            return
        step = self._step[index]
        self.drop(index, note=None)
        reason = self.put(index, step, tensor)
        if reason and self.on_evict is not None:
            self.on_evict(index, tensor, reason, True)

    def drop(self, index: int, note: str | None = "dropped", stats: bool = True) -> None:
        """Forget a value; ``note`` (if any) tells the trace why, and whether its stats can still be taken."""
        tensor = self._values.pop(index, None)
        if tensor is None:
            return
        self._step.pop(index)
        version = self._version.pop(index)
        if stats and version >= 0 and tensor._version != version:
            note, stats = MUTATED, False  # its statistics would describe the wrong values
        key = self._key.pop(index)
        self._storages[key].discard(index)
        if not self._storages[key]:
            del self._storages[key]
            self.nbytes -= key[1]
        if note is not None and self.on_evict is not None:
            self.on_evict(index, tensor, note, stats)

    def _evict_oldest_step(self) -> None:
        oldest_index = next(iter(self._values))
        oldest_step = self._step[oldest_index]
        victims = [i for i, s in self._step.items() if s == oldest_step]
        newest_step = max(self._step.values())
        if oldest_step == newest_step:
            victims = victims[:1]  # the current step alone is over budget: drop its oldest value only
        for i in victims:
            self.evicted_count += 1
            self.drop(i, note=f"evicted: over the {self.budget_bytes} B budget")

    def sharing_storage(self, tensor: torch.Tensor) -> list[int]:
        """Indices of kept values that view the same storage as ``tensor``."""
        return sorted(self._storages.get(storage_key(tensor), ()))

    def steps_held(self) -> list[int]:
        return sorted(set(self._step.values()))
