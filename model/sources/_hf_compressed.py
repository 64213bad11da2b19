"""Compressed attention (DeepSeek-V4), traced: the family's own cache layers kept in our cache, and what they hold
recorded at every step.

What V4 keeps (transformers' ``DeepseekV4HCACache`` / ``DeepseekV4CSACache``, one per layer; DeepSeek-V4 paper
§2.3, https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash):

* every layer — sliding-window, CSA and HCA alike — keeps the last ``sliding_window − 1`` rows of its one
  key/value head (K = V: one tensor read as both), ``[B, 1, w, d_head]``;
* a compressed layer also keeps its **compressed entries**, ``[B, T, d_head]``: one per window of ``m`` source
  positions (HCA: m = 128 in the real checkpoints, non-overlapping windows; CSA: m = 4, each entry pooling its own
  window and the previous one's other half), the softmax-gated sum of the window's projected rows, normed and
  rotated at the window's first position. T = ⌊t / m⌋ grows by one every m positions;
* the source rows of a window not yet full (``buffer_kv`` / ``buffer_gate``, t mod m rows) and, for CSA, the last
  full window's half that the next entry pools (``overlap_kv`` / ``overlap_gate``, m rows of d_head);
* a CSA layer's **indexer** (``DeepseekV4Indexer``) keeps the same three at its own width (``index_head_dim``):
  compressed keys ``[B, T, d_I]``, buffer and overlap. Each query scores those keys
  (Σ_h w_h · ReLU(q_h · k) / √d_I) and attends only to the ``index_topk`` best of the entries already complete.

The attention then receives Q ``[B, H, n, d_head]`` and, as both K and V, the window's rows + the n new rows + the
T compressed entries ``[B, 1, w + n + T, d_head]``, with transformers' sliding-window mask extended by the
compressor's block bias (0 where a query may see an entry: HCA, a window that ended at or before it; CSA, one the
indexer chose), and a learned sink logit per head. So it goes through the traced attention as any layer's, the
pattern over window and compressed entries alike.

Our cache (``CompressedCache``) keeps transformers' own cache layer objects, unchanged, as ``StateCache`` keeps
``LinearAttentionLayer``: nothing of V4's compression is reimplemented, so what the cache holds is what V4's cache
holds. Every update of those layers makes new tensors (``torch.cat``, slices of them, clones) and none is written in
place, so a snapshot after each committed step holds references to them, not copies — the compressed entries as a
count only (they only grow by appending, so the entries of an earlier step are a prefix of the current ones): a
failed forward rolls back to the snapshot, ``copy(length)`` and ``crop(length)`` start from the snapshot at
``length`` (a length some committed step ended at: the compression of a window cannot be cut inside a step), and
``reorder`` gathers the batch rows of the layers and of every snapshot.

Records (``blocks.{L}.attn.…``, beside hook_q, hook_k_all, hook_mask, hook_pattern … of every layer):

* ``hook_compressed_kv_all`` ``[B, 1, T, d_head]``: the compressed entries the attention appends after the window's
  rows (cache + new), as the compressor hands them; ``hook_k_all`` / ``hook_v_all`` hold them as their last T rows,
  and ``hook_k`` / ``hook_v`` the n new rows before them.
* ``hook_compressed_mask`` ``[B, 1, n, T]``: the compressor's block bias, 0 where a query may see an entry, −∞
  elsewhere — the last T columns of ``hook_mask`` (HCA hands none for a one-query step: every entry ended before
  it).
* ``hook_index_keys_all`` ``[B, T, d_I]`` (CSA): the indexer's compressed keys; ``hook_index_scores`` ``[B, n, T]``:
  its score of each key for each query, −∞ where the key's window is not complete at the query (what its top-k
  reads); ``hook_index_selected`` ``[B, n, T]`` (bool): the keys each query chose. (DSA indexers are recorded under
  the same names, over all t keys; a V4 indexer's keys are the compressed entries, the last T columns of the
  pattern.)
* after each cached step, what the cache layer holds besides the compressed entries: ``hook_window_kv``
  ``[B, 1, w, d_head]`` (and ``hook_window_v``, equal, for a sliding-window layer, whose transformers cache layer
  keeps V as a tensor of its own); ``hook_compress_buffer`` ``[B, r, 2·c]`` (kv ‖ gate of the r = t mod m rows of
  the window not yet full, c = d_head for HCA, 2·d_head for CSA); ``hook_compress_overlap`` ``[B, m, 2·d_head]``
  (CSA: kv ‖ gate
  of the half the next entry pools); ``hook_index_buffer``, ``hook_index_overlap`` (CSA, at d_I). Their bytes and the
  compressed entries' are the cache's (``held_bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import HookPoint, KVCache

COMPRESSOR = "compressor"  # the names transformers' V4 cache layers key their state by
INDEXER = "indexer"
# the hook names a compressed layer adds, in the order a step records them
COMPRESSED_FORWARD_RECORDS = ("hook_compressed_kv_all", "hook_index_keys_all", "hook_index_scores",
                              "hook_index_selected", "hook_compressed_mask")
COMPRESSED_HELD_RECORDS = ("hook_window_kv", "hook_window_v", "hook_compress_buffer", "hook_compress_overlap",
                           "hook_index_buffer",
                "hook_index_overlap")


def compresses(layer: Any) -> bool:
    """Whether a cache layer keeps compressed K/V the way DeepSeek-V4's do: compressed entries by name beside its
    window, written through ``store_compression_weights`` / ``update_compressor_states``."""
    return isinstance(getattr(layer, "compressed_kv", None), dict) and all(
        callable(getattr(layer, name, None)) for name in ("store_compression_weights", "update_compressor_states"))


def compressed_config(config: Any) -> bool:
    """Whether a transformers config builds cache layers that compress (``compresses``)."""
    if not isinstance(getattr(config, "compress_rates", None), dict):  # cheap: no cache built for other configs
        return False
    return any(compresses(layer) for layer in _fresh_layers(config))


def _fresh_layers(config: Any) -> list[Any]:
    """transformers' own cache layers for ``config``, empty: what its ``DynamicCache`` builds."""
    from transformers.cache_utils import DynamicCache

    return list(DynamicCache(config=config).layers)


# -- sizes from the config ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CompressedLayout:
    """What one layer's cache holds per position, from a V4 config: ``rate`` m (0: a sliding-window layer, no
    compression), whether its windows overlap (CSA) and it has an indexer (CSA), and the widths."""

    rate: int
    overlapping: bool
    d_head: int
    d_index: int
    window: int  # the config's sliding_window: the cache keeps window − 1 rows


def layouts(config: Any) -> list[CompressedLayout]:
    """Per layer of a V4 config, its ``CompressedLayout`` (from ``layer_types`` and ``compress_rates``)."""
    rates = dict(config.compress_rates)
    out = []
    for kind in config.layer_types:
        rate = int(rates.get(kind, 0)) if kind != "sliding_attention" else 0
        out.append(CompressedLayout(rate=rate, overlapping=kind == "compressed_sparse_attention",
                                    d_head=int(config.head_dim), d_index=int(config.index_head_dim),
                                    window=int(config.sliding_window)))
    return out


def layer_held_numbers(layout: CompressedLayout, t: int) -> dict[str, int]:
    """Numbers one sequence's cache layer holds after t positions, by part (as ``CompressedCache.held`` counts
    them): the window's rows (K = V, held once), the compressed entries, the rows of the window not yet full
    (kv and gate, each as wide as the compressor's projection: d_head, or 2·d_head where windows overlap) and,
    where windows overlap, the last full window's other half (m rows of kv and gate, d_head each); an indexer the
    same at d_I."""
    window = min(t, layout.window - 1) * layout.d_head
    if not layout.rate:  # a sliding-window layer: transformers' DynamicSlidingWindowLayer keeps K and V apart
        return {"window": window, "window values": window}
    parts = {"window": window}
    m = layout.rate
    entries, pending = t // m, t % m
    widths = [("", layout.d_head)] + ([("index ", layout.d_index)] if layout.overlapping else [])
    for prefix, d in widths:
        projected = 2 * d if layout.overlapping else d  # what kv_proj / gate_proj give per position
        parts[f"{prefix}compressed"] = entries * d
        parts[f"{prefix}buffer"] = pending * 2 * projected
        if layout.overlapping:
            parts[f"{prefix}overlap"] = (m * 2 * d) if entries else 0
    return parts


def compressed_cache_bytes(config: Any, t: int, batch: int = 1, itemsize: int = 4) -> int:
    """Bytes V4's cache holds after t positions (every layer, ``layer_held_numbers``)."""
    return batch * itemsize * sum(sum(layer_held_numbers(layout, t).values()) for layout in layouts(config))


def uncompressed_cache_bytes(n_layer: int, n_kv_head: int, d_head: int, d_v: int, t: int, batch: int = 1,
                             itemsize: int = 4) -> int:
    """Bytes an uncompressed KV cache of the same heads holds after t positions: K and V of every position, every
    layer, 2·L·B·G·t·d_head numbers (G·(d_head + d_v) per position where the value heads differ)."""
    return n_layer * batch * n_kv_head * (d_head + d_v) * t * itemsize


# -- the cache -----------------------------------------------------------------------------------------------------
def held(layer: Any) -> dict[str, torch.Tensor]:
    """What a V4 cache layer holds, by part (the records of ``COMPRESSED_HELD_RECORDS`` and the compressed entries):
    ``window`` ``[B, 1, w, d_head]``; ``compressed`` ``[B, T, d_head]``; ``buffer`` kv ‖ gate ``[B, r, 2·c]``;
    ``overlap`` kv ‖ gate ``[B, m, 2·d_head]``; the indexer's as ``index …``. Parts not (yet) held are left out."""
    out: dict[str, torch.Tensor] = {}
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if isinstance(keys, torch.Tensor) and keys.numel():
        out["window"] = keys  # a compressed layer's K = V: transformers keeps one tensor under both names
        if isinstance(values, torch.Tensor) and values is not keys:  # a sliding-window layer keeps two (equal)
            out["window values"] = values
    if not compresses(layer):
        return out
    overlap_kv, overlap_gate = getattr(layer, "overlap_kv", {}), getattr(layer, "overlap_gate", {})
    for name, prefix in ((COMPRESSOR, ""), (INDEXER, "index ")):
        if name not in layer.compressed_kv:
            continue
        compressed = layer.compressed_kv[name]
        if isinstance(compressed, torch.Tensor):
            out[f"{prefix}compressed"] = compressed
        kv, gate = layer.buffer_kv.get(name), layer.buffer_gate.get(name)
        if isinstance(kv, torch.Tensor) and isinstance(gate, torch.Tensor) and kv.shape[1]:
            out[f"{prefix}buffer"] = torch.cat([kv, gate], dim=-1)
        kv, gate = overlap_kv.get(name), overlap_gate.get(name)
        if isinstance(kv, torch.Tensor) and isinstance(gate, torch.Tensor):
            out[f"{prefix}overlap"] = torch.cat([kv, gate], dim=-1)
    return out


def _map_tensors(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


class CompressedCache(KVCache):
    """Our ``KVCache`` for a model whose attention compresses its K/V (DeepSeek-V4): per layer transformers' own cache
    layer (``layers``), which keeps the window, the compressed entries and what is pending; our buffers hold
    nothing. Transactional through a snapshot after each committed step (the module docstring says why references
    suffice)."""

    # no K, V row per position to hold against its recomputation (tracer/generation/_traced.py reads this): the
    # window keeps the last rows only, and the compressed entries pool several positions each
    rows_by_position = False

    def __init__(self, n_layer: int, batch_size: int, storage: str, config: Any) -> None:
        if storage != "model":
            raise ValueError(f"this model's cache keeps compressed keys and values in transformers' own cache layers, "
                             f"at the model's precision: storage {storage!r} is not offered for it")
        super().__init__(n_layer, batch_size, storage)
        self.config = config
        self.layers = _fresh_layers(config)
        if len(self.layers) != n_layer:
            raise ValueError(f"transformers builds {len(self.layers)} cache layers for this config, the model has "
                             f"{n_layer}")
        self._snapshots: dict[int, list[dict[str, Any]]] = {0: self._save()}

    # snapshots --------------------------------------------------------------------------------------------------
    def _save(self) -> list[dict[str, Any]]:
        saved = []
        for layer in self.layers:
            fields = {k: dict(v) if isinstance(v, dict) else v for k, v in vars(layer).items()}
            if compresses(layer):  # the entries as counts: a prefix of the current ones
                fields["compressed_kv"] = {name: None if x is None else int(x.shape[1])
                                           for name, x in layer.compressed_kv.items()}
            saved.append(fields)
        return saved

    def _restore(self, saved: list[dict[str, Any]], source: list[Any] | None = None) -> None:
        """The layers as ``saved`` holds them; their compressed entries cut from ``source``'s (default: these)."""
        source = self.layers if source is None else source
        for layer, fields, current in zip(self.layers, saved, source):
            entries = {name: None if count is None else current.compressed_kv[name][:, :count]
                       for name, count in fields.get("compressed_kv", {}).items()}
            for key, value in fields.items():
                setattr(layer, key, dict(value) if isinstance(value, dict) else value)
            if compresses(layer):
                layer.compressed_kv = entries

    # the KVCache protocol ---------------------------------------------------------------------------------------
    def view(self) -> Any:
        """transformers' ``Cache`` over these layers: a layer's update also marks it updated in this forward."""
        from transformers.cache_utils import Cache

        cache = self

        class _CompressedView(Cache):
            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                       *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
                cache.updated(layer_idx)
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)

        return _CompressedView(layers=self.layers)

    def updated(self, layer: int) -> None:
        """Mark ``layer`` updated by the forward running now (its commit checks every layer was)."""
        self._staged.add(layer)

    def commit(self, n: int, key_is_token: torch.Tensor | None) -> None:
        super().commit(n, key_is_token)
        self._snapshots[self.length] = self._save()

    def rollback(self) -> None:
        super().rollback()
        self._restore(self._snapshots[self.length])

    def _check_kept(self, length: int, what: str) -> None:
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"{what} can hold 0 … {self.length} positions, got {length!r}")
        if length not in self._snapshots:
            kept = ", ".join(map(str, sorted(self._snapshots)))
            raise ValueError(f"{what} at {length} positions is not offered: this cache compresses windows of "
                             f"positions, and its state is kept only where a committed step ended ({kept})")

    def copy(self, length: int | None = None) -> CompressedCache:
        length = self.length if length is None else length
        self._check_kept(length, "a copy")
        twin = CompressedCache(self.n_layer, self.batch_size, self.storage, self.config)
        twin._restore(self._snapshots[length], source=self.layers)
        twin._length = length
        twin.key_is_token = self.key_is_token[:, :length].clone() if self.key_is_token is not None else None
        twin._snapshots = {k: v for k, v in self._snapshots.items() if k <= length}
        return twin

    def crop(self, length: int) -> None:
        if self._staged:
            raise RuntimeError("crop between forwards only: this cache has rows staged by an unfinished forward")
        self._check_kept(length, "a crop")
        self._restore(self._snapshots[length])
        self._snapshots = {k: v for k, v in self._snapshots.items() if k <= length}
        self._length = length
        if self.key_is_token is not None:
            self.key_is_token = self.key_is_token[:, :length].clone()

    def reorder(self, rows: torch.Tensor) -> None:
        if rows.shape != (self.batch_size,):
            raise ValueError(f"reorder takes one row index per sequence ({self.batch_size}), got {tuple(rows.shape)}")
        if self._staged:
            raise RuntimeError("reorder between forwards only: this cache has rows staged by an unfinished forward")

        def gather(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, rows.to(x.device)) if x.dim() and x.shape[0] == self.batch_size else x

        for layer in self.layers:
            for key, value in vars(layer).items():
                if key != "_sliding_window_tensor":
                    setattr(layer, key, _map_tensors(value, gather))
            if compresses(layer):
                layer.values = layer.keys  # K = V, one tensor, as transformers keeps it
        self._snapshots = {length: [{k: _map_tensors(v, gather) if k != "_sliding_window_tensor" else v
                                     for k, v in fields.items()} for fields in saved]
                           for length, saved in self._snapshots.items()}
        if self.key_is_token is not None:
            self.key_is_token = self.key_is_token[rows.to(self.key_is_token.device)]

    @property
    def keys(self) -> list[torch.Tensor | None]:
        """Per layer, the window's rows the cache holds ``[B, 1, w, d_head]`` (the compressed entries are
        ``held``'s)."""
        return [held(layer).get("window") for layer in self.layers]

    @property
    def values(self) -> list[torch.Tensor | None]:
        return self.keys  # K = V

    @property
    def nbytes(self) -> int:
        """Bytes of everything the cache layers hold (``held``: the window once, K = V)."""
        return sum(int(x.numel() * x.element_size()) for layer in self.layers for x in held(layer).values())

    @property
    def stored_nbytes(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"CompressedCache(n_layer={self.n_layer}, length={self.length}, {self.nbytes} bytes held)"


# -- records ------------------------------------------------------------------------------------------------------
def add_hooks(hooks: nn.Module, attn: nn.Module) -> list[Any]:
    """Give a compressed layer's attention hooks their records (``COMPRESSED_FORWARD_RECORDS``,
    ``COMPRESSED_HELD_RECORDS``) and hook its
    compressor and indexer; returns the handles. A layer without a compressor (sliding-window only) gets
    ``hook_window_kv`` and ``hook_window_v`` only."""
    hooks.hook_window_kv = HookPoint()  # [B, 1, w, d_head], after each cached step
    compressor = getattr(attn, "compressor", None)
    if not isinstance(compressor, nn.Module):
        hooks.hook_window_v = HookPoint()  # [B, 1, w, d_head]: a sliding-window layer's cache keeps V apart
        return []
    hooks.hook_compressed_kv_all = HookPoint()  # [B, 1, T, d_head]
    hooks.hook_compress_buffer = HookPoint()  # [B, r, 2·c]
    hooks.hook_compressed_mask = HookPoint()  # [B, 1, n, T], 0 / −∞
    handles = [compressor.register_forward_hook(
        lambda m, args, out, h=hooks: _compressed_out(h, out))]
    indexer = getattr(compressor, "indexer", None)
    scorer = getattr(indexer, "scorer", None)
    if isinstance(indexer, nn.Module) and isinstance(scorer, nn.Module):
        hooks.hook_compress_overlap = HookPoint()  # [B, m, 2·d_head]
        hooks.hook_index_keys_all = HookPoint()  # [B, T, d_I]
        hooks.hook_index_scores = HookPoint()  # [B, n, T]
        hooks.hook_index_selected = HookPoint()  # [B, n, T] bool
        hooks.hook_index_buffer = HookPoint()
        hooks.hook_index_overlap = HookPoint()
        raw: dict[str, torch.Tensor] = {}  # the scorer's last scores, for the indexer's hook that follows it
        rate = int(cast(int, indexer.compress_rate))
        handles.append(scorer.register_forward_hook(lambda m, args, out, h=hooks: _scored(h, args, out, raw)))
        handles.append(indexer.register_forward_hook(
            lambda m, args, out, h=hooks: _selected(h, args, out, rate, raw)))
    return handles


def _compressed_out(hooks: nn.Module, out: Any) -> Any:
    """The compressor's ``(compressed_kv [B,1,T,d], block_bias)``: the entries through their hook point, and their
    count for the attention call that follows (they are the last T rows of its K and V)."""
    compressed, bias = out
    compressed = _point(hooks, "hook_compressed_kv_all")(compressed)
    if bias is not None:  # None: one query (a decode step) sees every entry, which all ended before it
        bias = _point(hooks, "hook_compressed_mask")(bias)
    cast(Any, hooks).tail = int(compressed.shape[2])  # _AttentionHooks.tail (model/sources/_hf_attention.py)
    return compressed, bias


def _point(hooks: nn.Module, name: str) -> HookPoint:
    return cast(HookPoint, getattr(hooks, name))


def _scored(hooks: nn.Module, args: tuple, out: torch.Tensor, raw: dict[str, torch.Tensor]) -> None:
    """The indexer's scorer: its keys (``args[1]``, ``[B, T, d_I]``) recorded, its raw scores ``[B, n, T]`` kept for
    the indexer's own hook, which masks them as its top-k does."""
    _point(hooks, "hook_index_keys_all")(args[1])
    raw["scores"] = out


def _selected(hooks: nn.Module, args: tuple, out: torch.Tensor, rate: int,
              pending: dict[str, torch.Tensor]) -> None:
    """The indexer's choice ``[B, n, k]`` (−1: no entry) as a ``[B, n, T]`` mask, and the scores its top-k read: the
    raw scores with −∞ where the entry's window is not complete at the query (entry w of a query at position p:
    w ≥ (p + 1) // m, as ``DeepseekV4Indexer`` masks them)."""
    raw = pending.pop("scores", None)
    if raw is None:
        return
    positions = args[2]  # [B, n]
    T = raw.shape[-1]
    entries = torch.arange(T, device=raw.device)
    future = entries.view(1, 1, -1) >= ((positions + 1) // rate).unsqueeze(-1)
    _point(hooks, "hook_index_scores")(raw.masked_fill(future, float("-inf")))
    chosen = torch.zeros(raw.shape[0], raw.shape[1], T + 1, dtype=torch.bool, device=raw.device)
    chosen.scatter_(-1, torch.where(out >= 0, out, torch.full_like(out, T)), True)
    _point(hooks, "hook_index_selected")(chosen[..., :T])


_HELD_HOOKS = {"window": "hook_window_kv", "window values": "hook_window_v", "buffer": "hook_compress_buffer",
               "overlap": "hook_compress_overlap",
               "index buffer": "hook_index_buffer", "index overlap": "hook_index_overlap"}


def record_held(blocks: Any, cache: CompressedCache) -> None:
    """After a cached forward: what each layer's cache holds besides the compressed entries (recorded as they were
    made), through the layer's hooks (``COMPRESSED_HELD_RECORDS``)."""
    for block, layer in zip(blocks, cache.layers):
        hooks = getattr(block, "attn", None)
        for part, tensor in held(layer).items():
            point = getattr(hooks, _HELD_HOOKS.get(part, ""), None)
            if isinstance(point, HookPoint):
                point(tensor)
