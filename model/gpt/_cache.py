"""The KV cache: per layer, the keys and values of every position seen so far.

Why a cache is exact: row i of K and V depends on tokens 0…i only (the causal
mask keeps every earlier row from seeing later tokens), so earlier rows never
change when new tokens arrive. A decode step computes K, V (and
Q) for the one new position, appends the new rows here, and attends with the
full K, V: ``[B,H,1,d_head] @ [B,H,d_head,t] -> [B,H,1,t]``. A grouped-query
model (Llama, Mistral, Qwen2) caches only its G key/value heads,
``[B,G,t,d_head]``, and its keys after the rotary embedding, as Hugging Face
does: G/H of GPT-2's cache for the same number of query heads.

Storage is append-only: each layer has a buffer ``[B, G, capacity, d_head]``
that doubles when full, new rows are written after the old ones, and the
model attends over the view ``buffer[:, :, :t]``. No step copies the whole
cache (``torch.cat`` would, every step), and a view handed out at step s stays
valid forever, because later steps only write rows ≥ t. The writes go through
an alias of the buffer with its own version counter, so that those earlier
views — whose elements really did not change — are not reported as modified
in place (a tracer keeping them checks that counter).

A cache can also *store* its rows at a lower precision (``storage``: bfloat16,
float16, or int8 with one absmax scale per row of each head, symmetric,
round-to-nearest): every row is rounded as it is written, and every read —
the step that wrote it included — sees the rounded values, as a quantized
cache that dequantizes on read would. ``stored_nbytes`` counts what such a
cache holds (int8: one byte per number plus the float32 scales). It is an
experiment, not a memory saving: the buffer itself stays in the model's dtype.

Updates are transactional: a forward stages its new length and the model
commits it only when the whole forward succeeded, so a forward that raises
leaves the cache's visible contents exactly as they were.

A layer with indexed (sparse) attention (DeepSeek-V3.2's DSA, GLM-5, …: a
learned indexer scores every key and each query attends to its top-k) keeps a
second cache beside K and V: the indexer's own keys ``[B, t, d_I]``, one row
per position, as transformers' ``DynamicIndexedLayer`` holds them. They live
here in one more buffer per such layer (``indexed``), written, committed,
rolled back, copied, reordered and cropped with K and V, never rounded by a
lower ``storage`` (a quantized cache keeps the indexer's keys as they are).
Qwen4-Exp's indexer keeps the position ids of every cached key as well
(``position_history``, ``[P, B, t]``): they follow the same transactions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

import torch

MIN_CAPACITY = 32


class _LayerBuffer:
    __slots__ = ("keys", "values", "_k_write", "_v_write")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        # .data: the same storage, a separate version counter (see the module docstring)
        self._k_write = self.keys.data
        self._v_write = self.values.data

    @classmethod
    def empty(cls, like_k: torch.Tensor, like_v: torch.Tensor, capacity: int) -> _LayerBuffer:
        """Room for ``capacity`` positions of rows shaped as ``like_k`` / ``like_v``."""
        # K and V may differ in width (and head count): latent attention (DeepSeek-V2/V3) caches its compressed
        # latent [B,1,t,r] and its rotated key [B,1,t,d_rope] in the two slots
        (B, G, _, d_k), (_, G_v, _, d_v) = like_k.shape, like_v.shape
        return cls(torch.empty(B, G, capacity, d_k, dtype=like_k.dtype, device=like_k.device),
                   torch.empty(B, G_v, capacity, d_v, dtype=like_v.dtype, device=like_v.device))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @classmethod
    def gathered(cls, buf: _LayerBuffer, rows: torch.Tensor, length: int) -> _LayerBuffer:
        """A new buffer whose batch row i holds ``buf``'s row ``rows[i]``: one gather of the first ``length``
        positions and the room after them (at most ``MIN_CAPACITY`` rows, so a reorder each step — beam search —
        keeps no more than a step's growth of unused rows: every old buffer a trace kept a view of is charged
        to its budget whole)."""
        capacity = min(buf.capacity, length + MIN_CAPACITY)
        return cls(buf.keys[:, :, :capacity].index_select(0, rows),  # [B,G,capacity,d_k], contiguous
                   buf.values[:, :, :capacity].index_select(0, rows))

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[2]
        self._k_write[:, :, start:end] = k
        self._v_write[:, :, start:end] = v


Storage = Literal["model", "float32", "bfloat16", "float16", "int8"]
STORAGES: tuple[str, ...] = get_args(Storage)
INT8_SCALE_BYTES = 4  # one float32 absmax scale per stored row of each head


def stored(x: torch.Tensor, storage: str) -> torch.Tensor:
    """``x`` ``[..., d_head]`` as a cache storing it as ``storage`` returns it when read (in ``x``'s dtype)."""
    if storage == "model":
        return x
    if storage in ("float32", "bfloat16", "float16"):
        return x.to(getattr(torch, storage)).to(x.dtype)
    if storage == "int8":  # symmetric, per row of each head: q = round(x / s), s = max|x| / 127
        scale = x.abs().amax(dim=-1, keepdim=True).float() / 127
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return ((x.float() / scale).round().clamp(-127, 127) * scale).to(x.dtype)
    raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")


class KVCache:
    """Keys and values ``[B, G, t, d_head]`` per layer (G = H for GPT-2), plus what padding they hold."""

    def __init__(self, n_layer: int, batch_size: int, storage: str = "model", indexed: tuple[int, ...] = ()) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        if any(not 0 <= layer < n_layer for layer in indexed) or len(set(indexed)) != len(indexed):
            raise ValueError(f"indexed must name distinct layers below {n_layer}, got {indexed!r}")
        self.storage = storage
        self.n_layer = n_layer
        self.batch_size = batch_size
        self.indexed = tuple(indexed)  # layers that keep an indexer key cache too: buffer n_layer + i for indexed[i]
        self._buffers: list[_LayerBuffer | None] = [None] * (n_layer + len(self.indexed))
        self.key_is_token: torch.Tensor | None = None  # [B, t] bool, None while nothing is padding
        self._length = 0
        self._staged: set[int] = set()
        self.position_history: torch.Tensor | None = None  # [P, B, t]: position ids a family keeps with its cache
        self._staged_positions: torch.Tensor | None = None  # what the forward in progress set it to

    @property
    def length(self) -> int:
        """t of the next forward before its new positions: how many positions are cached."""
        return self._length

    @property
    def keys(self) -> list[torch.Tensor | None]:
        """Per layer, the cached keys ``[B, G, t, d_head]`` (views of the buffers)."""
        return [b.keys[:, :, : self._length] if b is not None else None for b in self._buffers[: self.n_layer]]

    @property
    def values(self) -> list[torch.Tensor | None]:
        """Per layer, the cached values ``[B, G, t, d_head]`` (views of the buffers)."""
        return [b.values[:, :, : self._length] if b is not None else None for b in self._buffers[: self.n_layer]]

    @property
    def indexer_keys(self) -> dict[int, torch.Tensor | None]:
        """Per indexed layer, the indexer's cached keys ``[B, t, d_I]`` (views of the buffers)."""
        return {layer: (b.keys[:, 0, : self._length] if b is not None else None)
                for layer, b in zip(self.indexed, self._buffers[self.n_layer:])}

    def check_batch(self, batch: int) -> None:
        if batch != self.batch_size:
            raise ValueError(f"this cache holds {self.batch_size} sequence(s) but the tokens have batch size {batch}")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new rows ``[B,G,n,d_head]`` of ``layer`` after the cached ones; return the
        full ``[B,G,t,d_head]`` (views). The new length counts only once ``commit`` runs."""
        if self.storage != "model" and layer < self.n_layer:  # what a cache storing this precision would hand back
            k, v = stored(k, self.storage), stored(v, self.storage)
        return self._write(layer, k, v)

    def append_indexer(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Write the indexer's new keys ``[B,n,d_I]`` of indexed ``layer`` after the cached ones; return all
        ``[B,t,d_I]`` (a view). Transactional with K and V: counted at ``commit``, forgotten by ``rollback``."""
        if layer not in self.indexed:
            raise ValueError(f"layer {layer} keeps no indexer key cache (indexed layers: {list(self.indexed)})")
        keys, _ = self._write(self.n_layer + self.indexed.index(layer), k[:, None], k[:, None, :, :0])
        return keys[:, 0]  # [B,1,t,d_I] -> [B,t,d_I]

    def stage_positions(self, positions: torch.Tensor) -> None:
        """The position ids ``[P, B, t]`` of every key, cached and new, as the forward in progress keeps them:
        ``position_history`` once it commits."""
        self._staged_positions = positions

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._length
        end = start + k.shape[2]
        buf = self._buffers[layer]
        if buf is None or end > buf.capacity:
            grown = _LayerBuffer.empty(k, v, max(MIN_CAPACITY, end, 2 * (buf.capacity if buf else 0)))
            if buf is not None and start:
                grown.write(0, buf.keys[:, :, :start], buf.values[:, :, :start])
            self._buffers[layer] = buf = grown
        buf.write(start, k, v)
        self._staged.add(layer)
        return buf.keys[:, :, :end], buf.values[:, :, :end]

    def commit(self, n: int, key_is_token: torch.Tensor | None) -> None:
        """Make the rows a successful forward of ``n`` new positions wrote part of the cache."""
        if len(self._staged) != len(self._buffers):
            missing = sorted(L for L in range(self.n_layer) if L not in self._staged)
            indexer = [L for i, L in enumerate(self.indexed) if self.n_layer + i not in self._staged]
            self._staged.clear()
            raise RuntimeError(f"KV cache commit with layers {missing} not updated in this forward" if missing else
                               f"KV cache commit with the indexer keys of layers {indexer} not updated in this forward")
        self._staged.clear()
        self._length += n
        self.key_is_token = key_is_token
        if self._staged_positions is not None:
            self.position_history, self._staged_positions = self._staged_positions, None

    def copy(self, length: int | None = None) -> KVCache:
        """A separate cache holding the first ``length`` cached positions (all by default), so a
        step can be replayed from an earlier point without touching this cache."""
        length = self._length if length is None else length
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._length:
            raise ValueError(f"a copy can hold 0 … {self._length} positions, got {length!r}")
        twin = KVCache(self.n_layer, self.batch_size, self.storage, self.indexed)
        if length:
            for layer, buf in enumerate(self._buffers):
                if buf is None:  # a layer without attention (a hybrid model's state layer) holds no rows
                    continue
                own = _LayerBuffer.empty(buf.keys, buf.values, buf.capacity)
                own.write(0, buf.keys[:, :, :length], buf.values[:, :, :length])
                twin._buffers[layer] = own
        twin._length = length
        twin.key_is_token = self.key_is_token[:, :length].clone() if self.key_is_token is not None else None
        twin.position_history = self.position_history[..., :length] if self.position_history is not None else None
        return twin

    def reorder(self, rows: torch.Tensor) -> None:
        """Row ``i`` of every layer becomes what row ``rows[i]`` held (``[B]`` indices into the batch): beam
        search's reorder, where a surviving beam continues another beam's history (transformers'
        ``Cache.reorder_cache(beam_idx)``). The buffers are gathered into new ones; the old are left as they were,
        so a value a trace kept from them stays true."""
        if rows.shape != (self.batch_size,):
            raise ValueError(f"reorder takes one row index per sequence ({self.batch_size}), got {tuple(rows.shape)}")
        if self._staged:
            raise RuntimeError("reorder between forwards only: this cache has rows staged by an unfinished forward")
        for layer, buf in enumerate(self._buffers):
            if buf is None:
                continue
            self._buffers[layer] = _LayerBuffer.gathered(buf, rows.to(buf.keys.device), self._length)
        if self.key_is_token is not None:
            self.key_is_token = self.key_is_token[rows.to(self.key_is_token.device)]
        if self.position_history is not None:
            self.position_history = self.position_history[:, rows.to(self.position_history.device)]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions and drop the rows past them, in every layer (and their padding
        flags): speculative decoding's crop of the draft tokens the main model rejected (transformers'
        ``Cache.crop(-(t − length))``). The kept rows move to new buffers and the old are left as they were, so the
        next forward, writing where the dropped rows were, changes no value a trace kept from them."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._length:
            raise ValueError(f"crop keeps 0 … {self._length} positions (the cached ones), got {length!r}")
        if self._staged:
            raise RuntimeError("crop between forwards only: this cache has rows staged by an unfinished forward")
        if length == self._length:
            return
        for layer, buf in enumerate(self._buffers):
            if buf is None:
                continue
            kept = _LayerBuffer.empty(buf.keys, buf.values, buf.capacity)
            kept.write(0, buf.keys[:, :, :length], buf.values[:, :, :length])
            self._buffers[layer] = kept
        self._length = length
        if self.key_is_token is not None:
            self.key_is_token = self.key_is_token[:, :length].clone()
        if self.position_history is not None:
            self.position_history = self.position_history[..., :length]

    def rollback(self) -> None:
        """Forget a failed forward: rows it wrote past ``length`` are overwritten next time."""
        self._staged.clear()
        self._staged_positions = None

    @property
    def nbytes(self) -> int:
        """Bytes of the cached keys and values (the t rows in use, all layers; the indexer keys apart)."""
        return sum(int(t.numel() * t.element_size()) for t in (*self.keys, *self.values) if t is not None)

    @property
    def indexer_nbytes(self) -> int:
        """Bytes of the indexer key caches of the indexed layers (the t rows in use)."""
        return sum(int(t.numel() * t.element_size()) for t in self.indexer_keys.values() if t is not None)

    @property
    def stored_nbytes(self) -> int:
        """Bytes a cache storing ``storage`` would hold for the same rows: 2·L·B·G·t·d_head numbers at its size,
        plus, for int8, one float32 scale per row of each head."""
        if self.storage == "model":
            return self.nbytes
        held = [t for t in (*self.keys, *self.values) if t is not None]
        scales = INT8_SCALE_BYTES if self.storage == "int8" else 0  # per stored row of each head
        return sum(int(t.numel() * self.stored_number_bytes + t[..., 0].numel() * scales) for t in held)

    @property
    def stored_number_bytes(self) -> int:
        """Bytes per number as ``storage`` keeps it (int8: 1, its scales apart; "model": the buffer's own)."""
        if self.storage == "int8":
            return 1
        if self.storage == "model":
            keys = next((t for t in self.keys if t is not None), None)
            return keys.element_size() if keys is not None else 4
        return torch.empty(0, dtype=getattr(torch, self.storage)).element_size()

    def __repr__(self) -> str:
        keys = self.keys[0]
        shape = list(keys.shape) if keys is not None else None
        return f"KVCache(n_layer={self.n_layer}, length={self.length}, keys per layer {shape})"


@contextmanager
def transaction(cache: KVCache | None, n: int, key_is_token: torch.Tensor | None) -> Iterator[None]:
    """One forward's use of ``cache``: the ``n`` rows it appends become part of the cache only if the body
    finishes; if it raises, they are forgotten and the cache is exactly as before (no-op without a cache)."""
    try:
        yield
    except BaseException:
        if cache is not None:
            cache.rollback()
        raise
    if cache is not None:
        cache.commit(n, key_is_token)
