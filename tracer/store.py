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
        self._storages: dict[tuple[int, int], set[int]] = {}  # storage → the kept values viewing it
        self.nbytes = 0
        self.peak_nbytes = 0
        self.evicted_count = 0
        self.on_evict: Callable[[int, torch.Tensor, str], None] | None = None

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, index: int) -> bool:
        return index in self._values

    def get(self, index: int) -> torch.Tensor | None:
        return self._values.get(index)

    def items(self):
        return self._values.items()

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
        return ""

    def replace(self, index: int, tensor: torch.Tensor) -> None:
        """Swap a kept value for a private copy (before an in-place op changes the original)."""
        if index not in self._values:
            return
        step = self._step[index]
        self.drop(index, note=None)
        reason = self.put(index, step, tensor)
        if reason and self.on_evict is not None:
            self.on_evict(index, tensor, reason)

    def drop(self, index: int, note: str | None = "dropped") -> None:
        tensor = self._values.pop(index, None)
        if tensor is None:
            return
        self._step.pop(index)
        key = self._key.pop(index)
        self._storages[key].discard(index)
        if not self._storages[key]:
            del self._storages[key]
            self.nbytes -= key[1]
        if note is not None and self.on_evict is not None:
            self.on_evict(index, tensor, note)

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
