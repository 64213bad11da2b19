"""One model of what a decoding strategy does to the KV cache: each change is a ``CacheEvent`` on the run's cache
timeline, whatever strategy made it, so that one view can draw them all.

- ``grow``: a forward appended positions ``rows_before … rows_after − 1`` (``indices``: those positions);
- ``reorder``: beam search copied whole sequences: batch row ``i`` now holds what row ``indices[i]`` held
  (``Cache.reorder_cache(beam_idx)``); the number of positions does not change;
- ``crop``: speculative decoding dropped the positions ``indices`` (the rejected draft tokens' rows,
  ``Cache.crop``), so ``rows_after`` < ``rows_before``.

What a cache class does (tracer/experiments/_cache_classes.py, transformers' own cache classes):

- ``drop``: a dynamic sliding-window layer let go of the positions ``indices`` (they left its window);
- ``overwrite``: a static sliding-window layer wrote new rows over the slots that held positions ``indices``;
- ``quantize``: an fp8 layer stored positions ``indices`` in 8 bits (``detail``: the format and scale);
- ``move``: an offloaded layer's rows went to another device between uses (``detail``: "cuda:0 → cpu").

The indices name positions or batch rows, never a layer. ``layer`` is None when every layer's K and V changed
alike (grow, reorder, crop always; a class's event when all its layers did the same), else the one layer it
names."""

from __future__ import annotations

from dataclasses import dataclass

CACHE_EVENT_KINDS = ("grow", "reorder", "crop", "drop", "overwrite", "quantize", "move")


@dataclass(frozen=True)
class CacheEvent:
    """What one change did to a cache: its ``kind`` (``CACHE_EVENT_KINDS``), the ``step`` of the run it belongs
    to, the cached positions before and after, the positions (grow, crop) or batch rows (reorder) it touched,
    which cache (``"main"``, or ``"draft"``: a speculative run's assistant), the ``layer`` it names (None: all
    alike) and a ``detail`` in words (a move's devices, a quantized store's format)."""

    kind: str
    step: int
    rows_before: int
    rows_after: int
    indices: tuple[int, ...] = ()
    cache: str = "main"
    layer: int | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CACHE_EVENT_KINDS:
            raise ValueError(f"a cache event's kind is one of {CACHE_EVENT_KINDS}, got {self.kind!r}")

    @classmethod
    def grow(cls, step: int, before: int, after: int, cache: str = "main") -> CacheEvent:
        return cls("grow", step, before, after, tuple(range(before, after)), cache)

    @classmethod
    def crop(cls, step: int, before: int, after: int, cache: str = "main") -> CacheEvent:
        return cls("crop", step, before, after, tuple(range(after, before)), cache)

    @classmethod
    def reorder(cls, step: int, rows: int, sources: tuple[int, ...], cache: str = "main") -> CacheEvent:
        return cls("reorder", step, rows, rows, tuple(sources), cache)

    @property
    def changed(self) -> int:
        """Positions added (grow) or dropped (crop), batch rows that now hold another row's history (reorder),
        positions dropped, overwritten or quantized, or positions carried to another device (move)."""
        if self.kind == "reorder":
            return sum(1 for i, src in enumerate(self.indices) if src != i)
        if self.kind in ("drop", "overwrite", "quantize"):
            return len(self.indices)
        if self.kind == "move":
            return self.rows_after
        return abs(self.rows_after - self.rows_before)

    def sentence(self) -> str:
        """The event in words, with its numbers."""
        where = f"step {self.step}, {self.cache} cache" + ("" if self.layer is None else f", layer {self.layer}")
        span = f"{self.indices[0]} … {self.indices[-1]}" if self.indices else "none"
        if self.kind == "drop":
            why = self.detail or "they left the window"
            return f"{where}: dropped {self.changed} position(s) ({span}): {why}; {self.rows_after} kept"
        if self.kind == "overwrite":
            return (f"{where}: overwrote the slots of {self.changed} position(s) ({span}); {self.rows_after} slots "
                    "hold the window")
        if self.kind == "quantize":
            return f"{where}: stored {self.changed} position(s) ({span}) quantized" + (
                f" ({self.detail})" if self.detail else "")
        if self.kind == "move":
            return f"{where}: moved {self.rows_after} position(s) of K and V" + (
                f", {self.detail}" if self.detail else "")
        if self.kind == "grow":
            return f"{where}: grew from {self.rows_before} to {self.rows_after} positions (+{self.changed})"
        if self.kind == "crop":
            if not self.changed:
                return f"{where}: crop dropped nothing ({self.rows_before} positions kept)"
            return (f"{where}: cropped {self.changed} position(s), {self.rows_after} … {self.rows_before - 1}, "
                    f"back to {self.rows_after}")
        return (f"{where}: reordered: {self.changed} of {len(self.indices)} sequence row(s) now hold another row's "
                f"history ({self.rows_after} positions each)")
