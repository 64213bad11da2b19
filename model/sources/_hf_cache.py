"""Our ``KVCache`` as transformers' ``Cache`` (``_cache_view``), and ``StateCache``: the convolution /
state-space state a hybrid or state-space model keeps, in transformers' own cache layers, kept transactionally.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import (
    KVCache,
)
from gpt_shape_tracer.model.sources._hf_attention import _AttentionHooks

if TYPE_CHECKING:  # transformers is imported where it is used: loading our own models never needs it
    pass
# -- the KV cache -----------------------------------------------------------------------------------------
def _cache_view(cache: KVCache, n_layer: int, latent: list[_AttentionHooks | None] | None = None,
                own: type | None = None, attention: list[_AttentionHooks | None] | None = None):
    """transformers' ``Cache`` over our ``KVCache``: ``update`` appends to our buffers (transactionally:
    our model commits after the forward), sizes come from our length.

    ``own``: the family's own cache class where its forward accepts no other (MiniMax's ``MiniMaxCache``, whose
    lightning-attention layers read and write their state through ``get_linear_cache`` / ``set_linear_cache``):
    the view is then an instance of it, that state kept in the layer's ``StateCache`` state layer.

    A latent-attention layer (DeepSeek-V2/V3: ``latent[layer]`` holds its hooks) hands ``update`` its compressed
    latent c_KV ``[B,1,n,d_c]`` and its rotary key k_R ``[B,1,n,d_R]`` in place of K and V — transformers' own
    cache holds those too — and expands K and V from what comes back: both go through the layer's
    ``hook_kv_latent_all`` / ``hook_k_rope_all`` on the way.

    ``attention``: every layer's attention hooks (None where it has none), for the indexed layers' indexer keys."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class _CacheLayer(CacheLayerMixin):
        is_sliding = False

        def __init__(self, layer: int) -> None:
            super().__init__()
            self.layer = layer
            self.is_initialized = True
            self.latent = latent[layer] if latent is not None else None

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            keys, values = cache.append(self.layer, key_states, value_states)  # -> [B,G,t,d_qk], [B,G,t,d_v]
            if self.latent is not None:  # -> c_KV [B,1,t,d_c], k_R [B,1,t,d_R]
                return self.latent.hook_kv_latent_all(keys), self.latent.hook_k_rope_all(values)
            return keys, values

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return cache.length + query_length, 0

        def get_seq_length(self) -> int:
            return cache.length

        def get_max_length(self) -> int:
            return -1

        @property
        def indexer_position_ids(self) -> torch.Tensor | None:  # Qwen4-Exp's indexer: the keys' position ids
            return cache.position_history

        @indexer_position_ids.setter
        def indexer_position_ids(self, positions: torch.Tensor) -> None:
            cache.stage_positions(positions)

        def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
            """An indexed layer's indexer keys ``[B,n,d_I]`` (DeepSeek-V3.2's DSA, …) appended to its own cache
            beside K and V; returns all of them ``[B,t,d_I]`` through the layer's ``hook_index_keys`` /
            ``hook_index_keys_all``, as transformers' ``DynamicIndexedLayer.update_indexer`` returns them."""
            all_keys = cache.append_indexer(self.layer, indexer_key_states)
            hooks = attention[self.layer] if attention is not None else None
            if hooks is not None and hasattr(hooks, "hook_index_keys"):
                hooks.hook_index_keys(indexer_key_states)
                all_keys = hooks.hook_index_keys_all(all_keys)
            return all_keys

    states = cache.states if isinstance(cache, StateCache) else {}  # a hybrid model's persistent state layers
    layers = [states.get(i) or _CacheLayer(i) for i in range(n_layer)]
    if own is None:
        return Cache(layers=layers)

    class _OwnCacheView(own):  # type: ignore[misc, valid-type]
        """The family's cache class over our cache: its linear-attention state ([B, H, d_head, d_head], the
        decayed sum of K^T V) lives in the layer's state layer, so that StateCache copies and rolls it back."""

        def __init__(self) -> None:
            Cache.__init__(self, layers=layers)
            self.linear_cache: list = []  # the class's own list, unused: the state is in the state layers

        def __len__(self) -> int:
            return n_layer

        def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
            state = states.get(layer_idx)
            return state.recurrent_states.get(0) if state is not None and state.has_previous_state[0] else None

        def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
            state = states[layer_idx]
            state.recurrent_states[0] = linear_cache
            state.is_recurrent_states_initialized[0] = state.has_previous_state[0] = True

    return _OwnCacheView()


def state_templates(hf: nn.Module) -> list[Any]:
    """Per decoder layer, transformers' own cache layer where that layer keeps convolution / state-space state
    (a hybrid model: Falcon-H1's Mamba-2 mixer beside its attention, …), else None — read from the
    ``DynamicCache`` transformers builds for the model's config."""
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    try:
        layers = DynamicCache(config=getattr(hf, "config", None)).layers
    except (ValueError, KeyError, TypeError, AttributeError):  # a config whose cache transformers builds lazily
        return []
    return [layer if isinstance(layer, LinearAttentionCacheLayerMixin) else None for layer in layers]


_STATE_FIELDS = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
                 "is_recurrent_states_initialized", "conv_kernel_size")


class StateCache(KVCache):
    """Our ``KVCache`` for the attention, plus — for the layers of a hybrid model that keep convolution /
    state-space state — transformers' own cache layer for that state, unchanged (``state_layer``): our cache does
    not reimplement it. The state does not grow with t and is overwritten in place at every step, so a copy of it
    is kept after every committed step: a failed forward rolls it back, and ``copy(length)`` starts from the
    state as it was at ``length`` positions."""

    def __init__(self, n_layer: int, batch_size: int, storage: str, templates: list[Any],
                 attention_layers: set[int] | None = None, indexed: tuple[int, ...] = ()) -> None:
        super().__init__(n_layer, batch_size, storage, indexed)
        self.templates = templates
        self.attention_layers = set(range(n_layer)) if attention_layers is None else set(attention_layers)
        self.states = {layer: _state_layer(self, layer, template) for layer, template in enumerate(templates)
                       if template is not None}
        # layers without attention (a Gated DeltaNet, a Mamba layer, an MLP-only block) append no K, V: they count
        # as updated
        self._stateless_attention = set(range(n_layer)) - self.attention_layers
        # the state a forward hands back and takes again (RWKV's ``state``: tensors with one slice per layer in their
        # last axis, updated in place), None before the first forward; kept, copied and rolled back with the rest
        self.carried: list[torch.Tensor] | None = None
        self._snapshots: dict[int, dict[int, dict[str, dict]]] = {0: self._save()}

    def _save(self) -> dict[int, dict[str, dict]]:
        saved = {layer: {name: {i: v.clone() if isinstance(v, torch.Tensor) else v
                                for i, v in getattr(state, name).items()} for name in _STATE_FIELDS}
                 for layer, state in self.states.items()}
        if self.carried is not None:
            saved[-1] = {"carried": dict(enumerate(x.clone() for x in self.carried))}
        return saved

    def _restore(self, saved: dict[int, dict[str, dict]]) -> None:
        carried = saved.get(-1)
        self.carried = [x.clone() for x in carried["carried"].values()] if carried is not None else None
        for layer, fields in saved.items():  # clones again: the state is updated in place (copy_) by transformers
            if layer == -1:
                continue
            for name, values in fields.items():
                setattr(self.states[layer], name, {i: v.clone() if isinstance(v, torch.Tensor) else v
                                                   for i, v in values.items()})

    def commit(self, n: int, key_is_token: torch.Tensor | None) -> None:
        self._staged |= self._stateless_attention
        super().commit(n, key_is_token)
        self._snapshots[self.length] = self._save()

    def rollback(self) -> None:
        super().rollback()
        self._restore(self._snapshots[self.length])

    def copy(self, length: int | None = None) -> StateCache:
        length = self.length if length is None else length
        held = KVCache.copy(self, length)  # checks length
        if length not in self._snapshots:
            raise ValueError(f"the convolution / state-space state at {length} positions was not kept")
        twin = StateCache(self.n_layer, self.batch_size, self.storage, self.templates, self.attention_layers,
                          self.indexed)
        twin._buffers, twin._length, twin.key_is_token = held._buffers, held._length, held.key_is_token
        twin.position_history = held.position_history
        twin._snapshots = {k: v for k, v in self._snapshots.items() if k <= length}
        twin._restore(self._snapshots[length])
        return twin

    @property
    def state_nbytes(self) -> int:
        """Bytes of the convolution and state-space state of every layer that keeps one (fixed: it does not grow)."""
        return sum(int(v.numel() * v.element_size()) for state in self.states.values()
                   for name in ("conv_states", "recurrent_states") for v in getattr(state, name).values()
                   if isinstance(v, torch.Tensor)) + sum(int(x.numel() * x.element_size()) for x in self.carried or ())


def _state_layer(cache: StateCache, layer: int, template: Any) -> Any:
    """transformers' ``LinearAttentionLayer`` (its conv / recurrent state machinery, unchanged) whose attention
    part, where the layer has one (``template`` is then an attention cache layer too), is our ``cache``."""
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionLayer

    class _StateLayer(LinearAttentionLayer):
        is_sliding = False

        def __init__(self) -> None:
            LinearAttentionLayer.__init__(self, number_of_states=template.number_of_states)
            self.keys = self.values = None
            self.is_initialized = True

        def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
            if kwargs:  # the state's own initialisation (conv_states= / recurrent_states=); K, V need none
                LinearAttentionLayer.lazy_initialization(self, **kwargs)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            return cache.append(layer, key_states, value_states)  # -> [B,G,t,d_head] twice

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return cache.length + query_length, 0

        def get_seq_length(self) -> int:
            return cache.length

    if isinstance(template, CacheLayerMixin):  # attention beside the state (Falcon-H1): transformers asks it for t
        return type("_StateAttentionLayer", (_StateLayer, CacheLayerMixin), {})()
    return _StateLayer()


def latent_widths(attn: nn.Module) -> tuple[int, int] | None:
    """``(d_c, d_R)`` of a latent-attention module (DeepSeek-V2/V3, MiniCPM3 …: it compresses K and V into a
    latent of ``kv_lora_rank`` numbers per position, which the cache holds with a rotary key of
    ``qk_rope_head_dim``), None for any other attention."""
    d_c, d_r = getattr(attn, "kv_lora_rank", None), getattr(attn, "qk_rope_head_dim", None)
    if isinstance(d_c, int) and isinstance(d_r, int) and isinstance(getattr(attn, "kv_b_proj", None), nn.Module):
        return d_c, d_r
    return None




class HeldHidden:
    """A model whose cache holds each layer's input hidden states, from which every step computes K and V of every
    position again — XLNet's ``mems`` (``[m, B, d]`` per layer, handed in and back), Reformer's
    ``past_buckets_states`` (an object of its own: ``states_cache`` ``[B, m, d]`` per layer, beside the LSH buckets
    ``buckets_cache``, empty until a layer hashes). Our cache holds them as ``StateCache.carried`` (one tensor per
    layer, then Reformer's buckets) and appends no K, V rows; after each step ``hook_mems`` records each layer's as
    ``[B, m, d]``. A padded batch is refused: XLNet's mems keep no padding mask (transformers lets every later step
    attend to the padded positions held in them), and Reformer's padded cached steps were not checked."""

    def __init__(self, config: Any, keyword: str) -> None:
        self.keyword = keyword
        self.family = "XLNet" if keyword == "mems" else "Reformer"
        self._class: type | None = None  # Reformer's cache class, read from its first output
        # XLNet: relative positions set no limit (max_position_embeddings −1), but the mems keep only the last mem_len
        # hidden states, past which a step would no longer see the whole text. Reformer: up to its shortest chunk
        # length less one, both its layer kinds compute plain causal attention over every position; from there its
        # local layers attend within chunks and its LSH layers hash keys into buckets
        if keyword == "mems":
            limit = getattr(config, "mem_len", None)
        else:
            chunks = [getattr(config, k, None) for k in ("local_attn_chunk_length", "lsh_attn_chunk_length")]
            limit = min(c for c in chunks if isinstance(c, int)) - 1 if any(isinstance(c, int) for c in chunks) \
                else None
        self.n_ctx = int(limit) if isinstance(limit, int) and limit > 0 else None

    @staticmethod
    def new_cache(n_layer: int, batch_size: int, storage: str, templates: list[Any],
                  indexed: tuple[int, ...]) -> StateCache:
        return StateCache(n_layer, batch_size, storage, templates, set(), indexed)

    def check(self, key_is_token: torch.Tensor | None) -> None:
        from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError

        if key_is_token is not None and not bool(key_is_token.all()):
            why = ("XLNet's cache (its mems, each layer's hidden states) keeps no padding mask: transformers lets "
                   "every later step attend to the padded positions held in it" if self.keyword == "mems" else
                   "Reformer's cached steps with padding were not checked against transformers' own")
            raise HFDecoderError(f"{why}, so a padded batch is not traced; give prompts of equal length, or one at a "
                                 "time")

    def passed(self, cache: StateCache) -> Any:
        if not cache.carried:
            return None  # before the first step: nothing kept yet
        if self.keyword == "mems":
            return list(cache.carried)
        assert self._class is not None
        n = len(cache.carried) // 2
        return self._class(list(zip(cache.carried[n:], cache.carried[:n])))  # (buckets, states) per layer

    def kept(self, cache: StateCache, out: Any) -> None:
        held = getattr(out, self.keyword, None)
        if self.keyword == "mems" or held is None:
            cache.carried = list(held or [])
            return
        self._class = type(held)
        cache.carried = [*held.states_cache, *held.buckets_cache]

    def states(self, cache: StateCache) -> list[torch.Tensor]:
        """Each layer's held hidden states, ``[B, m, d]``."""
        carried = cache.carried or []
        if self.keyword == "mems":
            return [x.transpose(0, 1) for x in carried]
        return list(carried[:len(carried) // 2])

    def record(self, cache: StateCache, blocks: nn.ModuleList) -> None:
        for block, held in zip(blocks, self.states(cache)):
            point = block.hook_mems
            assert isinstance(point, nn.Module)
            point(held.clone())
