"""transformers' attention interface, computed stage by stage through our hook points: the function
``HFDecoder`` registers (``traced_attention``), its mask (``traced_mask``), and the variants it stages —
attention sinks (gpt-oss) and differential attention (DiffLlama).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import (
    WHOLE_DERIVED,
    HookPoint,
    MaskSpec,
    attention,
    attention_path_settings,
    run_attention,
)
from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError
from gpt_shape_tracer.model.sources._hf_variants import attention_with_extras

if TYPE_CHECKING:  # transformers is imported where it is used: loading our own models never needs it
    pass
ATTENTION = "shape_tracer"  # the name our attention function is registered under
# the attention modules of every wrapped model, each mapped to its layer's hook points
_HOOKS: weakref.WeakKeyDictionary[nn.Module, _AttentionHooks] = weakref.WeakKeyDictionary()

# -- the attention function -----------------------------------------------------------------------------
class _AttentionHooks(nn.Module):
    """One layer's attention hook points, under ``blocks.{L}.attn`` (shapes as in model/gpt/_gpt.py)."""

    def __init__(self, softcap: bool, latent: bool = False, sinks: bool = False, differential: bool = False,
                 indexed: bool = False, score_bias: bool = False) -> None:
        super().__init__()
        self.hook_q = HookPoint()  # [B, H, n, d_qk], as the attention receives it (position-encoded)
        self.hook_k = HookPoint()  # [B, G, n, d_qk], the new keys
        self.hook_v = HookPoint()  # [B, G, n, d_v], the new values
        if latent:  # latent attention: what the cache holds, from which K and V are expanded at every step
            self.hook_kv_latent_all = HookPoint()  # [B, 1, t, d_c], c_KV: cache + new
            self.hook_k_rope_all = HookPoint()  # [B, 1, t, d_R], k_R after RoPE: cache + new
        self.hook_k_all = HookPoint()  # [B, G, t, d_qk], cache + new
        self.hook_v_all = HookPoint()  # [B, G, t, d_v], cache + new
        self.hook_qk = HookPoint()  # [B, H, n, t]
        self.hook_attn_scores = HookPoint()  # [B, H, n, t], QKᵀ × scale
        if softcap:
            self.hook_softcapped = HookPoint()  # [B, H, n, t], c·tanh(scores / c)
        if score_bias:  # a bias the layer hands the attention function beside the mask (Inkling: _hf_variants.py)
            self.hook_score_bias = HookPoint()  # [B|1, H, n, t]; masked scores = scores + bias + M
        self.hook_mask = HookPoint()  # [B|1, 1, n, t], additive 0 / −∞
        self.hook_masked_scores = HookPoint()  # [B, H, n, t]
        if sinks:  # gpt-oss: one learned logit per head joins every row's softmax as an extra column
            self.hook_sink_logits = HookPoint()  # [B, H, n, 1], s_h beside the t scores + M
        self.hook_pattern = HookPoint()  # [B, H, n, t], A (the keys' weights; with a sink, rows sum to < 1)
        if sinks:
            self.hook_sink_weight = HookPoint()  # [B, H, n, 1], the sink's weight: 1 − Σ_t A
        self.hook_z = HookPoint()  # [B, H, n, d_v], A·V per head
        # differential attention (DiffLlama): the layer calls attention twice with the same Q and K — the values'
        # two halves — and combines heads j and j + H/2 as (A_j − λ·A_{j+H/2})·[V_1, V_2]
        self.differential: Any = None  # () -> λ (a 0-d float32 tensor), set by HFDecoder for such a layer
        self.pending_call: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None  # call 1's (Q, K, M)
        # attention in several lists of layers (BLT, model/sources/_hf_stacks.py): eager with the mask transformers
        # hands it, always — a cross-attention's mask, or one over patches, is no causal / window / padding description
        self.given_mask = False
        if differential:
            self.hook_pattern_1 = HookPoint()  # [B, H/2, n, t], A_j: the first softmax of each differential head
            self.hook_pattern_2 = HookPoint()  # [B, H/2, n, t], A_{j+H/2}: the second, subtracted
            self.hook_diff_lambda = HookPoint()  # [1], λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init
            self.hook_diff_pattern = HookPoint()  # [B, H/2, n, t], A_1 − λ·A_2: what the layer applies
            self.hook_v_all_2 = HookPoint()  # [B, G, t, d_v], the values of the second call
            self.hook_z_2 = HookPoint()  # [B, H, n, d_v], A·V of the second call
        if indexed:  # indexed (sparse) attention (DeepSeek-V3.2's DSA, GLM-5, Qwen4-Exp's QSA, …): a learned indexer
            # scores the keys and each query attends to the ones it selects; the indexer keeps keys of its own
            self.hook_index_keys = HookPoint()  # [B, n, d_I], the indexer's new keys
            self.hook_index_keys_all = HookPoint()  # [B, t, d_I], its key cache + new
            self.hook_index_scores = HookPoint()  # [B, n, t], what the top-k ranks (−∞ where the mask hides a key)
            self.hook_index_visible = HookPoint()  # [B, n, t] bool, the keys the causal / padding mask lets it see
            self.hook_index_selected = HookPoint()  # [B, n, t] bool, the visible keys the indexer chose
        self.pending_selection: tuple[torch.Tensor, torch.Tensor] | None = None  # (visible, selected) from an indexer
        # that folds its choice into the mask itself (Qwen4-Exp's QSA), for the attention call that follows
        self.w_o: nn.Module | None = None  # the model's own output projection (not a submodule here)
        self.calls = 0  # forwards that reached the traced attention (HFDecoder checks each layer's once)
        self.seen: tuple[int, int, int, int] = (0, 0, 0, 0)  # (H, G, d_qk, d_v) as the last call received them
        # compressed attention (DeepSeek-V4): how many compressed entries the next call's K, V end with, after the
        # new rows (set by model/sources/_hf_compressed.py's compressor hook, read once)
        self.tail = 0

    def receive(self, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q ``[B,H,n,d_qk]``, K ``[B,G,t,d_qk]`` and V ``[B,G,t,d_v]`` as the attention receives them, through
        ``hook_q``, ``hook_k``/``hook_v`` (the n rows this forward added: a cache appends them last) and
        ``hook_k_all``/``hook_v_all``; counts the call and the head counts and sizes it saw."""
        H, n, dh = query.shape[-3], query.shape[-2], query.shape[-1]
        G, t = key.shape[-3], key.shape[-2]
        self.calls += 1
        self.seen = (H, G, dh, value.shape[-1])
        end, self.tail = t - self.tail, 0
        self.hook_k(key[..., end - n:end, :])
        self.hook_v(value[..., end - n:end, :])
        return self.hook_q(query), self.hook_k_all(key), self.hook_v_all(value)

    def head_outputs(self, z: torch.Tensor) -> torch.Tensor:
        """Each head's share of the attention output, O_h·W_O^h ``[B,H,n,d]`` (W_O's bias left out)."""
        if self.differential is not None:
            raise HFDecoderError("a differential attention layer combines its heads in pairs (A_j − λ·A_{j+H/2}) and "
                                 "normalises them before W_O, so the output of each head cannot be separated")
        if self.w_o is None:
            raise HFDecoderError("this model's attention output projection was not found, so the output of "
                                 "each head cannot be separated")
        H, dh = z.shape[1], z.shape[-1]
        w_o = self.w_o.weight  # nn.Linear: [d, H·d_head]
        if not isinstance(w_o, torch.Tensor):
            raise HFDecoderError(f"this model's attention output projection ({type(self.w_o).__name__}) has no "
                                 "weight matrix, so the output of each head cannot be separated")
        w = w_o.t() if w_o.shape[0] != H * dh else w_o  # -> [H·d_head, d]
        return torch.einsum("bhnk,hkd->bhnd", z, w.reshape(H, dh, -1))  # [B,H,n,d_head] @ [H,d_head,d]


def traced_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention interface, stage by stage through the layer's hook points (or fused, where
    ``model.gpt.choose_path`` says so: then no weights are returned, as transformers' SDPA returns none).

    ``query [B,H,n,d_qk]``, ``key [B,G,t,d_qk]``, ``value [B,G,t,d_v]`` (d_v = d_qk but in latent attention);
    returns ``(output [B,n,H,d_v], weights [B,H,n,t])`` as transformers' eager function does."""
    record = getattr(_probing, "record", None)
    if record is not None:  # HFDecoder's probe: which module called, inside which layer, with what
        record(module, query, key, value, attention_mask, kwargs)
    # [H]: gpt-oss's learned sink logits; [B,H,n,1]: Inkling 2's, one per head and query
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    bias = kwargs.get("position_bias")  # [B|1,H,n,t]: Inkling's learned relative position bias
    hooks = _HOOKS.get(module)
    if hooks is not None and hooks.differential is not None:
        pending, hooks.pending_call = hooks.pending_call, None
        if pending is not None and pending[0] is query and pending[1] is key:  # the second call: same Q, K
            z, _ = attention(query, key, value, pending[2], None, scale=scaling if scaling is not None else
                             query.shape[-1] ** -0.5, softcap=softcap)  # the same softmax as the first call's
            hooks.hook_v_all_2(value)
            return hooks.hook_z_2(z).transpose(1, 2).contiguous(), None
    received = (query, key)  # as transformers handed them (the second call of a differential layer hands the same)
    if sinks is not None and hooks is not None and not hasattr(hooks, "hook_sink_logits"):
        raise HFDecoderError(f"{type(module).__name__} passes attention sinks (s_aux) but has no sinks parameter "
                             "of its own, so its sink logits cannot be shown")
    if hooks is not None:
        query, key, value = hooks.receive(query, key, value)
    n, t = query.shape[2], key.shape[2]
    mask = attention_mask[:, :, :, :t] if attention_mask is not None else None  # [B|1,1,n,t]
    indices = kwargs.get("indices")  # [B,n,k]: the keys a DSA indexer chose for each query (transformers hands them
    # to any attention function but its eager and SDPA ones, which fold them into the mask instead)
    indexed = indices is not None or (hooks is not None and hooks.pending_selection is not None)
    if indexed:  # eager always: the choice is in the mask, which no description of causal / window / padding holds
        mask = _indexed_mask(query, mask, indices, hooks)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    forward = getattr(_forward, "keys", None)  # (key_is_token,) while HFDecoder.forward runs on this thread
    window = kwargs.get("sliding_window")
    differential = hooks is not None and hooks.differential is not None
    if sinks is not None or differential or bias is not None:  # eager always: the sink is a column no fused kernel
        # here computes; a differential layer's two softmaxes are recorded and subtracted; a score bias is a stage
        if mask is None and forward is not None:  # not built (the settings chose fused): built from its description
            spec = MaskSpec(n=n, t=t, scale=scale, key_is_token=forward[0], empty_rows="uniform", softcap=softcap,
                            window=int(window) if isinstance(window, int) and window > 0 else None)
            mask = spec.full_additive(query.dtype, query.device)
        if differential and bias is None:
            z, weights = _differential_first_call(query, key, value, mask, cast(_AttentionHooks, hooks), scale,
                                                  softcap, received)
        else:
            z, weights = attention_with_extras(query, key, value, mask, hooks, scale, bias, sinks), None
    elif hooks is not None and hooks.given_mask:
        z, weights = attention(query, key, value, _as_infinite(mask), hooks, scale=scale, softcap=softcap)
    elif forward is None or dropout > 0.0 or (mask is not None and _adds_a_bias(mask)) or indexed:
        # eager with transformers' own mask; always so for a mask that adds values to the scores (Doge's learned
        # per-head dynamic mask), which a description of causal / window / padding slots cannot rebuild
        z, weights = attention(query, key, value, mask, hooks, scale=scale, softcap=softcap)  # [B,H,n,d_head]
    else:
        # the mask described as transformers' eager mask writes it (a row that sees nothing stays finfo.min)
        spec = MaskSpec(n=n, t=t, scale=scale, window=int(window) if isinstance(window, int) and window > 0 else None,
                        key_is_token=forward[0], empty_rows="uniform", softcap=softcap)
        if mask is not None:
            spec.use_mask(mask)  # an eager layer uses transformers' own mask, as before
        z, weights = run_attention(query, key, value, spec, hooks), None
    if hooks is not None:
        z = hooks.hook_z(z)
    return z.transpose(1, 2).contiguous(), weights  # [B,n,H,d_v], as transformers expects


def _indexed_mask(query: torch.Tensor, mask: torch.Tensor | None, indices: torch.Tensor | None,
                  hooks: _AttentionHooks | None) -> torch.Tensor:
    """The mask an indexed layer's softmax applies, ``[B,1,n,t]``: the causal / padding mask with every key the
    indexer did not choose hidden too — as transformers' eager path folds a DSA indexer's top-k ``indices``
    ``[B,n,k]`` into it (``finfo.min`` there, −∞ here where the row sees a key: the same softmax). A QSA indexer
    (Qwen4-Exp) has folded its choice in already; its forward hook left what it saw and chose in
    ``hooks.pending_selection``. Records the keys each query could see and the ones it chose."""
    if mask is None:
        raise HFDecoderError("an indexed attention layer was called without a mask, so the keys its indexer chose "
                             "cannot be told from the ones the causal mask hides")
    B, n, t = query.shape[0], query.shape[2], mask.shape[-1]
    hidden_value = torch.finfo(mask.dtype).min / 2
    visible = (mask[:, 0] > hidden_value).expand(B, n, t)  # [B,n,t]
    if indices is not None:
        chosen = torch.zeros(B, n, t, dtype=torch.bool, device=mask.device)
        chosen.scatter_(-1, indices.long().clamp(0, t - 1), indices >= 0)  # a −1 chose nothing
        selected = chosen & visible
        mask = mask.masked_fill(~chosen[:, None], torch.finfo(mask.dtype).min)  # [B|1,1,n,t] -> [B,1,n,t]
    else:
        pending = cast(_AttentionHooks, hooks).pending_selection
        visible, selected = cast(tuple[torch.Tensor, torch.Tensor], pending)
    sees = (mask > hidden_value).any(dim=-1, keepdim=True)  # a row that sees something: −∞, as traced_mask writes
    mask = mask.masked_fill((mask <= hidden_value) & sees, float("-inf"))
    if hooks is not None:
        hooks.pending_selection = None
        if hasattr(hooks, "hook_index_visible"):
            hooks.hook_index_visible(visible)
            hooks.hook_index_selected(selected)
    return mask


def _differential_first_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                             hooks: _AttentionHooks, scale: float, softcap: float | None,
                             received: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The first of a differential attention layer's two calls (DiffLlama; Ye et al. 2024, "Differential
    Transformer"): the softmax of all H query heads, staged through the hooks as any layer's, then its two halves —
    A_1 = heads 0 … H/2−1 and A_2 = heads H/2 … H−1, the two softmaxes of each differential head — and what the layer
    applies to the values, A_1 − λ·A_2 ``[B, H/2, n, t]``. Keeps Q, K and the mask for the second call, whose values
    are the other half of V."""
    z, weights = attention(query, key, value, mask, hooks, scale=scale, softcap=softcap)  # [B,H,n,d_v], [B,H,n,t]
    half = weights.shape[1] // 2
    lam = hooks.differential().to(weights.dtype)  # a 0-d tensor
    hooks.hook_diff_lambda(lam.reshape(1))
    first, second = hooks.hook_pattern_1(weights[:, :half]), hooks.hook_pattern_2(weights[:, half:])
    hooks.hook_diff_pattern(first - lam * second)  # [B,H/2,n,t]
    hooks.pending_call = (*received, mask)
    return z, weights


def differential_lambda(attn: nn.Module) -> Any:
    """For a differential attention module (its learned λ_q1, λ_k1, λ_q2, λ_k2 vectors and λ_init), a function
    returning λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init (Ye et al. 2024, eq. 2) as a 0-d float32 tensor; None for
    any other module."""
    vectors = [getattr(attn, name, None) for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")]
    init = getattr(attn, "lambda_init", None)
    if not all(isinstance(v, torch.Tensor) for v in vectors) or not isinstance(init, (int, float, torch.Tensor)):
        return None
    q1, k1, q2, k2 = cast(list[torch.Tensor], vectors)

    def lam() -> torch.Tensor:
        return (torch.exp(torch.sum(q1 * k1, dtype=torch.float32)) - torch.exp(torch.sum(q2 * k2, dtype=torch.float32))
                + init)

    return lam


def _as_infinite(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A mask handed to the attention with ``finfo.min`` as −∞ where a row sees at least one key (as ``traced_mask``
    writes transformers' masks: the same softmax), so that M shows −∞ for every hidden key."""
    if mask is None or not mask.is_floating_point() or mask.device.type == "meta":
        return mask
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    fill = hidden & torch.isfinite(mask) & (~hidden).any(dim=-1, keepdim=True)
    # the very tensor where nothing changes (traced_mask wrote −∞ already): the record of M is then the layer's
    # input itself, which is how a trace knows that input's −∞ as a mask's
    return mask.masked_fill(fill, float("-inf")) if bool(fill.any()) else mask


def _adds_a_bias(mask: torch.Tensor) -> bool:
    """Whether an additive float mask holds values other than 0 (seen) and a large negative number (hidden)."""
    if not mask.is_floating_point() or mask.device.type == "meta":
        return False
    return bool(((mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)).any())


_probing = threading.local()  # .record: HFDecoder's probe's callback while it runs on this thread
_forward = threading.local()  # .keys: (key_is_token [B,t] | None, the mask must be built) while HFDecoder.forward
# runs on this thread


@contextmanager
def _restored(before: tuple | None):
    try:
        yield
    finally:
        _forward.keys = before


def traced_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """transformers' eager mask with ``finfo.min`` written as −∞ where a row sees at least one key: the
    same softmax (exp of either is 0 in float32), and the mask the views show is ``attention``'s M. A row that
    sees nothing (a padding query) keeps ``finfo.min``, so its softmax stays finite, as transformers' does."""
    from transformers.masking_utils import eager_mask

    from gpt_shape_tracer.model.sources._hf_compressed import compressed_config

    forward = getattr(_forward, "keys", None)
    # our forward: the attention can work from a description — not where an indexer reads the mask (an indexed
    # model's), nor for compressed attention (DeepSeek-V4), which extends a mask tensor with its compressor's block
    # bias and, without one, drops that bias
    if forward is not None and not forward[1] and not compressed_config(kwargs.get("config")):
        mode, threshold = attention_path_settings()
        batch, n, t = kwargs.get("batch_size", 1), kwargs.get("q_length", 0), kwargs.get("kv_length", 0)
        # under "auto" the mask is built up to the size at which an eager layer held whole stages (WHOLE_DERIVED):
        # cheap (one [B,1,n,t] per forward), and a family's own mask that adds values to the scores (Doge) is then
        # seen and run eager with it, as before the threshold fell to 0
        if isinstance(n, int) and isinstance(t, int) and isinstance(batch, int) and (
                mode == "fused" or (mode == "auto" and batch * n * t >= max(threshold, WHOLE_DERIVED))):
            return None  # not built: no [B,1,n,t] tensor; an eager layer builds it from MaskSpec
    mask = eager_mask(*args, **kwargs)
    if mask is None or not mask.is_floating_point():
        return mask
    hidden = mask <= torch.finfo(mask.dtype).min / 2
    sees_something = (~hidden).any(dim=-1, keepdim=True)
    return mask.masked_fill(hidden & sees_something, float("-inf"))


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from gpt_shape_tracer.model.sources._hf_families import register_families

    AttentionInterface.register(ATTENTION, traced_attention)
    AttentionMaskInterface.register(ATTENTION, traced_mask)
    register_families(ATTENTION, traced_attention)  # GPT-J, GPT-Neo, Falcon, GIT: their own tables of classes


