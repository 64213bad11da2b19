"""Captured tensor values under a byte budget.

Summaries of evicted values (the pooled digests of attention weights) live under the same budget: the
oldest thing goes first, value or summary, by the step it belongs to (a value before a summary of the same
step, since dropping the value leaves the summary).

Bytes are counted per underlying storage, once, however many records view it
(a hook point's output and the next module's input are the same tensor; ``q``
is a view of the ``qkv`` projection). Adding a value that would pass the budget
first drops the values of the oldest steps; their records keep shape and stats.
The budget is checked on every insert, so it is never exceeded, not even in the
middle of a step.

A kept value is the model's own tensor, not a copy. Its version counter is
noted when it is kept and compared whenever it is read: a tensor changed in
place afterwards (in this step or a later one) is dropped with a note, never
shown with the wrong numbers. Tensors made under ``torch.inference_mode`` have
no version counter; the tracer copies those when it keeps them (see capture).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

DEFAULT_BUDGET_BYTES = 512 * 2**20  # 512 MiB
MUTATED = "dropped: changed in place after it was recorded (trace with copy='all' to keep it)"
NO_VERSION = -1

EvictCallback = Callable[[int, torch.Tensor, str, bool], None]  # (index, value, note, stats still valid)
ReleaseCallback = Callable[[tuple[int, int]], None]  # (storage key): the store holds no view of it any more


def version_of(t: torch.Tensor) -> int:
    """The tensor's in-place version counter (PyTorch bumps it on every in-place write); tensors
    made under inference mode have none."""
    return NO_VERSION if t.is_inference() else t._version


def extent(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) element offsets of ``t`` within its storage (an interval covering it)."""
    if t.numel() == 0:
        return (0, 0)
    start = int(t.storage_offset())  # an int (torch types it int | SymInt for traced graphs)
    return start, start + 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if stride > 0)


def _box(t: torch.Tensor) -> list[tuple[int, int]] | None:
    """Per-dimension index ranges of ``t`` in a buffer laid out with ``t``'s strides, or None."""
    offset = int(t.storage_offset())
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    box: list[tuple[int, int]] = [(0, 0)] * t.dim()
    for d in order:
        stride = strides[d]
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
    """(identity, bytes) of the storage behind ``t``: the one definition every part uses."""
    storage = t.untyped_storage()
    ptr = storage.data_ptr()
    return (ptr, storage.nbytes()) if ptr else (id(storage), 0)


def view_key(t: torch.Tensor) -> tuple:
    """Two kept values with equal view keys are the same numbers (same storage, offset, shape, strides)."""
    return (storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class ValueStore:
    """Record index → tensor, oldest first, within ``budget_bytes``."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES, on_evict: EvictCallback | None = None,
                 on_release: ReleaseCallback | None = None) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a whole number ≥ 0, got {budget_bytes!r}")
        self.budget_bytes = budget_bytes
        # index → tensor, and index → step, storage key and version when kept, one dict each; dicts keep insertion
        # order. Not one dict of (tensor, …) tuples: one holding a tensor is walked by every full collection for as
        # long as the value is kept (160 GPT-2-small steps of a values trace held 17,900: 0.10–0.15 s collections in
        # 5 of 8 runs, then 3); and not (step, key, version) tuples either: each is one more object for the young
        # collections to walk (456 a GPT-2-small decode step, a quarter of what the step left them)
        self._entries: dict[int, torch.Tensor] = {}
        self._kept_step: dict[int, int] = {}
        self._kept_key: dict[int, tuple[int, int]] = {}
        self._kept_version: dict[int, int] = {}
        # storage → the kept values viewing it, as a dict used as a set: a dict of ints is not tracked by Python's
        # cyclic collector, a set always is (127 a GPT-2-small decode step, each walked by every full collection
        # for as long as the values are kept)
        self._storages: dict[tuple[int, int], dict[int, None]] = {}
        # index → (summary, step, bytes): pooled digests of evicted values, charged to the same budget
        self._digests: dict[int, tuple[torch.Tensor, int, int]] = {}
        # the preferred values (a fused layer's Q, K, V, O), moved here from ``_entries`` by ``prefer``: evicted only
        # when nothing else is left, so the next value to evict is ``_entries``' first, found at once. Two dicts
        # rather than an ordered set of the plain ones beside ``_entries``: a decode step puts ~450 values and
        # prefers ~50, and each put paid that set's insert
        self._preferred: dict[int, torch.Tensor] = {}
        # the last value put and its storage key (the key already held for its storage): a module's input is most
        # often the tensor recorded just before (the previous module's output, a hook point's value), and asking a
        # tensor for its storage makes an object. Cleared when that value is dropped, so a held one is still kept
        self._last_tensor: torch.Tensor | None = None
        self._last_key: tuple[int, int] = (0, 0)
        self._nbytes = 0
        self._peak_nbytes = 0
        self._evicted = 0
        self._on_evict = on_evict
        # after the last kept view of a storage goes: its memory may be freed and reused by a new tensor at
        # the same address, so anything known by storage key must be forgotten
        self._on_release = on_release

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def peak_nbytes(self) -> int:
        return self._peak_nbytes

    @property
    def evicted_count(self) -> int:
        return self._evicted

    def __len__(self) -> int:
        return len(self._kept_step)

    def __contains__(self, index: int) -> bool:
        return self._verified(index) is not None

    def get(self, index: int) -> torch.Tensor | None:
        return self._verified(index)

    def items(self) -> Iterator[tuple[int, torch.Tensor]]:
        for index in list(self._kept_step):  # a copy, oldest first: _verified drops a mutated one
            tensor = self._verified(index)
            if tensor is not None:
                yield index, tensor

    def viewers(self, key: tuple[int, int]) -> list[int]:
        """The records whose kept values view the storage ``key`` (``storage_key``), in order (unverified)."""
        return sorted(self._storages.get(key, ()))

    def _held(self, index: int) -> torch.Tensor | None:
        """The value kept for ``index``, preferred or not, unchecked."""
        tensor = self._entries.get(index)
        return tensor if tensor is not None else self._preferred.get(index)

    def _verified(self, index: int) -> torch.Tensor | None:
        """The kept value of ``index`` if it is unchanged since it was kept (a changed one is dropped)."""
        tensor = self._held(index)
        if tensor is None:
            return None
        version = self._kept_version[index]
        if version != NO_VERSION and version_of(tensor) != version:
            self.drop(index, note=MUTATED, stats=False)
            return None
        return tensor

    def put(self, index: int, step: int, tensor: torch.Tensor, version: int | None = None) -> str:
        """Keep ``tensor`` for record ``index``; returns "" if kept, else why not. ``version``: its version counter
        as the caller read it (read here when not given). The tracer's hot path at "values": ~450 calls a GPT-2-small
        decode step, so the last value's key is reused."""
        if tensor is self._last_tensor:  # still kept (a dropped one is forgotten), so its storage is held
            key = self._last_key
            self._storages[key][index] = None
        else:
            key = storage_key(tensor)
            viewers = self._storages.get(key)
            if viewers is not None:
                key = self._kept_key[next(iter(viewers))]  # the equal key already held: one object fewer kept
                viewers[index] = None
            else:
                size = key[1]
                if size > self.budget_bytes:
                    return f"not kept: its storage ({size} B) is larger than the whole budget ({self.budget_bytes} B)"
                while self._nbytes + size > self.budget_bytes and (self._kept_step or self._digests):
                    self._evict_oldest()
                self._storages[key] = {index: None}
                self._nbytes += size
                if self._nbytes > self._peak_nbytes:
                    self._peak_nbytes = self._nbytes
            self._last_tensor, self._last_key = tensor, key
        self._entries[index] = tensor  # a new value (or one just dropped and put back) is not preferred
        self._kept_step[index] = step
        self._kept_key[index] = key
        self._kept_version[index] = version_of(tensor) if version is None else version
        return ""

    def replace(self, index: int, tensor: torch.Tensor) -> None:
        """Swap a kept value for a private copy (before an in-place op changes the original)."""
        step = self._kept_step.get(index)
        if step is None:
            return
        self.drop(index, note=None)
        reason = self.put(index, step, tensor)
        if reason and self._on_evict is not None:
            self._on_evict(index, tensor, reason, True)

    def prefer(self, index: int) -> None:
        """Evict ``index`` only after every value not so preferred: a derived attention record is recomputed from
        it (a fused layer's Q, K, V and O), so the budget holds those first."""
        tensor = self._entries.pop(index, None)
        if tensor is not None:
            self._preferred[index] = tensor

    def drop(self, index: int, *, note: str | None, stats: bool = True) -> None:
        """Forget a value; ``note`` (if any) tells the owner why, and whether its stats can still be taken."""
        tensor = self._entries.pop(index, None)
        if tensor is None:
            tensor = self._preferred.pop(index, None)
            if tensor is None:
                return
        if tensor is self._last_tensor:
            self._last_tensor = None  # not held past its value
        del self._kept_step[index]
        key, version = self._kept_key.pop(index), self._kept_version.pop(index)
        if stats and version != NO_VERSION and version_of(tensor) != version:
            note, stats = MUTATED, False  # its statistics would describe the wrong values
        viewers = self._storages[key]
        viewers.pop(index, None)
        released = not viewers
        if released:
            del self._storages[key]
            self._nbytes -= key[1]
        if note is not None and self._on_evict is not None:
            self._on_evict(index, tensor, note, stats)
        if released and self._on_release is not None:
            self._on_release(key)

    def _evict_oldest(self) -> None:
        """Drop the oldest kept value, or the oldest summary when it belongs to an earlier step. Value by value
        rather than whole steps: a decode step needs a few MB, and making room by dropping the whole prefill
        would cost the statistics of all of it and leave nothing of it to look at."""
        # the oldest value not preferred; with none left, the oldest of all (every one kept is then preferred)
        oldest = next(iter(self._entries), None)
        if oldest is None:
            oldest = next(iter(self._kept_step), None)
        oldest_digest = next(iter(self._digests.items()), None)
        if oldest_digest is not None and (oldest is None or oldest_digest[1][1] < self._kept_step[oldest]):
            self.drop_digest(oldest_digest[0])
            return
        assert oldest is not None  # called only while something is held
        self._evicted += 1
        self.drop(oldest, note=f"evicted: over the {self.budget_bytes} B budget")

    # -- summaries of evicted values, under the same budget ---------------------------------------------
    def put_digest(self, index: int, step: int, summary: torch.Tensor) -> bool:
        """Keep ``summary`` for record ``index`` if it fits the budget (making room as a value does, never by
        dropping it); False when it alone is larger than the budget."""
        size = summary.numel() * summary.element_size()
        if size > self.budget_bytes:
            return False
        self.drop_digest(index)
        while self._nbytes + size > self.budget_bytes and (self._kept_step or self._digests):
            self._evict_oldest()
        self._digests[index] = (summary, step, size)
        self._nbytes += size
        self._peak_nbytes = max(self._peak_nbytes, self._nbytes)
        return True

    def digest(self, index: int) -> torch.Tensor | None:
        entry = self._digests.get(index)
        return entry[0] if entry is not None else None

    def drop_digest(self, index: int) -> None:
        entry = self._digests.pop(index, None)
        if entry is not None:
            self._nbytes -= entry[2]

    @property
    def digest_nbytes(self) -> int:
        return sum(size for _, _, size in self._digests.values())

    def overlapping(self, tensor: torch.Tensor) -> list[int]:
        """Indices of kept values whose elements ``tensor`` covers (so writing it would change them)."""
        viewers = self._storages.get(storage_key(tensor))
        if not viewers:
            return []
        found = []
        for i in viewers:
            held = self._held(i)
            assert held is not None  # a storage's viewers are exactly the values kept of it
            if overlaps(tensor, held):
                found.append(i)
        return sorted(found)

    def steps_held(self) -> list[int]:
        return sorted(set(self._kept_step.values()))
