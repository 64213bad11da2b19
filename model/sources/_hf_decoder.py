"""Any Hugging Face decoder, run by transformers itself, seen through our hook points.

transformers 5 routes the attention of most decoder families through one pluggable function
(``AttentionInterface``): every attention module computes its own Q, K and V — projections, QK-norm,
RoPE or partial RoPE, the cache update — and hands ``query [B,H,n,d_head]``, ``key``/``value``
``[B,G,t,d_head]`` (cache included), the additive mask ``[B|1,1,n,t]`` and its scale to that function.
``HFDecoder`` registers one, ``"shape_tracer"``, that computes the same numbers stage by stage through
our hook points — QKᵀ, × scale, the soft-cap where the model has one, + M, softmax (in float32, as
transformers' eager path), A·V — and routes the embeddings, every layer's residual stream, the attention
and MLP outputs and the logits through hook points too. Everything else is transformers' own code, so
the logits are transformers' by construction; the names and layouts are ours (``act_name``), so every
view reads a Qwen3 or a Gemma 2 as it reads our GPT.

What the records mean for such a model (the hook table's rows, specialised):

* ``hook_q``, ``hook_k`` are the queries and the new keys **as the attention receives them**: after the
  model's position encoding (RoPE, partial RoPE) and QK-norm where it has them. The pre-rotation values
  are the projections' own module records (``…q_proj:out``), which every trace holds.
* ``hook_k_all``, ``hook_v_all`` are the model's KV cache, ``[B,G,t,d_head]``: our ``KVCache`` serves as
  transformers' cache (``_CacheLayer``), so it grows by one row per decode step and rolls back a failed
  forward.
* ``hook_softcapped`` (Gemma 2): ``c·tanh(scores/c)`` between the scaling and the mask.
* ``hook_resid_mid`` exists only where the layer has one (a sequential block: the input of the norm in
  front of the MLP); a parallel block (GPT-NeoX, GPT-J, Phi, Falcon, Cohere) adds attention and MLP to
  the same stream and has none.

* ``hook_sink_logits``, ``hook_sink_weight`` (gpt-oss): the learned sink logit of each head, one more column of
  the softmax, and the weight it took; ``hook_pattern`` is then the keys' share, rows summing to less than 1.
* ``hook_kv_latent_all``, ``hook_k_rope_all`` (latent attention: DeepSeek-V2/V3, MiniCPM3): what the cache holds
  instead of K and V — the compressed latent c_KV and the rotary key k_R — from which K ``[B,H,t,d_qk]`` and V
  ``[B,H,t,d_v]`` (d_v ≠ d_qk) are expanded at every step.

* ``hook_pattern_1``, ``hook_pattern_2``, ``hook_diff_lambda``, ``hook_diff_pattern``, ``hook_v_all_2``,
  ``hook_z_2`` (differential attention: DiffLlama): the layer calls the attention function twice with the same Q
  and K, once per half of V; the softmax of its H heads is recorded as any layer's (``hook_pattern``), its halves
  A_1 (heads 0 … H/2−1) and A_2 (heads H/2 … H−1) under their own names, λ, and A_1 − λ·A_2 ``[B, H/2, n, t]``, the
  pattern each differential head applies to its values [V_1, V_2] (``hook_v_all``, ``hook_v_all_2``).

* ``blocks.{L}.hook_conv_state``, ``blocks.{L}.hook_ssm_state`` (hybrid models: Falcon-H1): the convolution and
  state-space state a layer's mixer keeps after each step, as transformers' own cache layer holds it (fixed-size,
  overwritten every step; ``StateCache``). Not in the hook table: their widths are the mixer's, not the legend's.
  MiniMax's lightning attention keeps its state ([B, H, d_head, d_head]) in a cache class of its own, the only one
  its forward accepts: the cache view is then an instance of that class whose ``get_linear_cache`` /
  ``set_linear_cache`` read and write the layer's state in ``StateCache`` (``hook_ssm_state``).

The attention is found by what it does (``_find_attention``): a two-token forward records which module calls
the attention function inside which element of which list of layers; the list the calls come from is the
decoder stack (a vision tower not run for text never is), each layer's one caller its attention. A model that makes
no attention call at all but whose every layer writes state into transformers' cache (Mamba, Mamba-2,
Falcon-Mamba: ``_state_stack``) is traced as mixers only: no attention record, no K, V row, the state in
``StateCache``; its forward takes the cache as ``cache_params`` (``cache_keyword``).
Refused, with a ``RefusalReason``: models whose attention does not go through the interface, linear-attention and
state-space layers our cache cannot hold beside K and V, several attention calls per layer (but differential
attention's two calls with the same Q and K), attention in several stacks of layers (BLT), encoders and
encoder-decoders; and, after loading, a model whose cached decode step is not
transformers' own forward (``guard_against_transformers``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import (
    BackgroundDigest,
    GPTConfig,
    HookPoint,
    KVCache,
    MaskSpec,
    ModelIdentity,
    PendingIdentity,
    attention,
    attention_path_settings,
    check_tokens,
    computed_identity,
    parameters_digest,
    positions_and_keys,
    run_attention,
    transaction,
)
from gpt_shape_tracer.model.sources._meta_ops import meta_op_cache
from gpt_shape_tracer.model.sources._tensor_parallel import TensorParallelPlan

if TYPE_CHECKING:  # transformers is imported where it is used: loading our own models never needs it
    from transformers import PreTrainedModel

ATTENTION = "shape_tracer"  # the name our attention function is registered under
# the attention modules of every wrapped model, each mapped to its layer's hook points
_HOOKS: weakref.WeakKeyDictionary[nn.Module, _AttentionHooks] = weakref.WeakKeyDictionary()
_NAMES_OUT = ("o_proj", "dense", "out_proj", "c_proj", "wo")  # the attention's output projection W_O
_NAMES_FINAL_NORM = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")
_NAMES_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "fc2")  # fc2: OPT's MLP has no module of its own
_NAMES_MLP_NORM = ("pre_feedforward_layernorm", "post_attention_layernorm", "ln_2", "ffn_norm", "final_layer_norm")
PARALLEL_BLOCKS = ("gptj", "phi", "cohere", "cohere2")  # attention and MLP read the same stream (also: a
# config's use_parallel_residual, Falcon's parallel_attn)
RefusalReason = Literal[
    "encoder-decoder",  # a separate encoder feeds the decoder through cross-attention
    "encoder",  # bidirectional self-attention: position i sees positions after it
    "no softmax attention",  # state-space, recurrent or linear-attention layers only
    "attention outside the interface",  # softmax attention computed by the family's own code
    "state layers",  # state in a family's own cache class (MiniMax's is traced) or in its modules (RecurrentGemma)
    "latent attention",  # value head size ≠ query/key head size (multi-head latent attention)
    "attention sinks",  # a learned sink logit in every softmax row
    "several attentions per layer",  # a layer calls attention more than once per forward (recurrent depth, …)
    "several stacks",  # attention runs in more than one list of layers (BLT's byte-level and patch-level stacks)
    "alibi",  # a per-head linear bias added to the scores
    "score bias",  # another bias the attention function receives and adds to the scores (a learned position bias)
    "indexed attention",  # a learned indexer picks each query's keys and keeps its own key cache (DeepSeek DSA)
    "compressed attention",  # the family's own cache layers keep compressed keys/values (DeepSeek-V4)
    "differs from transformers",  # the guard: our cached step is not transformers' own forward
    "cannot load",  # transformers itself cannot build or run it from this directory
    "weights missing",  # the config builds more layers than the weights hold
]
REFUSAL_REASONS: tuple[str, ...] = RefusalReason.__args__  # type: ignore[attr-defined]
REFUSED: dict[str, tuple[RefusalReason, str]] = {}  # by model_type, before anything runs (none at present)
# BERT-family types: transformers maps them to a causal LM (…ForCausalLM / LMHeadModel), which is causal only when
# the config says is_decoder = true; otherwise every position attends to every other
ENCODERS = ("bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "ernie", "data2vec-text",
            "bert-generation", "rembert", "roc_bert", "megatron-bert", "xmod", "big_bird", "roformer",
            "roberta-prelayernorm")


class HFDecoderError(ValueError):
    """A Hugging Face model that cannot be traced: the message says what, why and what would work;
    ``reason`` names the category (None for a problem with the request rather than with the model)."""

    def __init__(self, message: str, reason: RefusalReason | None = None) -> None:
        super().__init__(message)
        self.reason = reason


# -- the attention function -----------------------------------------------------------------------------
class _AttentionHooks(nn.Module):
    """One layer's attention hook points, under ``blocks.{L}.attn`` (shapes as in model/gpt/_gpt.py)."""

    def __init__(self, softcap: bool, latent: bool = False, sinks: bool = False, differential: bool = False) -> None:
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
        if differential:
            self.hook_pattern_1 = HookPoint()  # [B, H/2, n, t], A_j: the first softmax of each differential head
            self.hook_pattern_2 = HookPoint()  # [B, H/2, n, t], A_{j+H/2}: the second, subtracted
            self.hook_diff_lambda = HookPoint()  # [1], λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init
            self.hook_diff_pattern = HookPoint()  # [B, H/2, n, t], A_1 − λ·A_2: what the layer applies
            self.hook_v_all_2 = HookPoint()  # [B, G, t, d_v], the values of the second call
            self.hook_z_2 = HookPoint()  # [B, H, n, d_v], A·V of the second call
        self.w_o: nn.Module | None = None  # the model's own output projection (not a submodule here)
        self.calls = 0  # forwards that reached the traced attention (HFDecoder checks each layer's once)
        self.seen: tuple[int, int, int, int] = (0, 0, 0, 0)  # (H, G, d_qk, d_v) as the last call received them

    def receive(self, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q ``[B,H,n,d_qk]``, K ``[B,G,t,d_qk]`` and V ``[B,G,t,d_v]`` as the attention receives them, through
        ``hook_q``, ``hook_k``/``hook_v`` (the n rows this forward added: a cache appends them last) and
        ``hook_k_all``/``hook_v_all``; counts the call and the head counts and sizes it saw."""
        H, n, dh = query.shape[-3], query.shape[-2], query.shape[-1]
        G, t = key.shape[-3], key.shape[-2]
        self.calls += 1
        self.seen = (H, G, dh, value.shape[-1])
        self.hook_k(key[..., t - n:, :])
        self.hook_v(value[..., t - n:, :])
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
    sinks = kwargs.get("s_aux")  # [H]: gpt-oss's learned sink logits
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
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    forward = getattr(_forward, "keys", None)  # (key_is_token,) while HFDecoder.forward runs on this thread
    window = kwargs.get("sliding_window")
    differential = hooks is not None and hooks.differential is not None
    if sinks is not None or differential:  # eager always: the sink is a column no fused kernel here computes; a
        # differential layer's two softmaxes are recorded and subtracted
        if mask is None and forward is not None:  # not built (the settings chose fused): built from its description
            spec = MaskSpec(n=n, t=t, scale=scale, key_is_token=forward[0], empty_rows="uniform", softcap=softcap,
                            window=int(window) if isinstance(window, int) and window > 0 else None)
            mask = spec.full_additive(query.dtype, query.device)
        if differential:
            z, weights = _differential_first_call(query, key, value, mask, cast(_AttentionHooks, hooks), scale,
                                                  softcap, received)
        else:
            z, weights = attention_with_sinks(query, key, value, mask, hooks, scale, cast(torch.Tensor, sinks)), None
    elif forward is None or dropout > 0.0 or (mask is not None and _adds_a_bias(mask)):
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


def _adds_a_bias(mask: torch.Tensor) -> bool:
    """Whether an additive float mask holds values other than 0 (seen) and a large negative number (hidden)."""
    if not mask.is_floating_point() or mask.device.type == "meta":
        return False
    return bool(((mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)).any())


def attention_with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                         hooks: _AttentionHooks | None, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a learned sink per head (gpt-oss), stage by stage as transformers' eager path computes it:
    the sink logit s_h joins each row of scores + M as one more column, the softmax runs over the t keys and the
    sink, and the sink's column is dropped — so A's rows sum to less than 1, and what is missing went to the sink
    (``hook_sink_weight``). ``query [B,H,n,d_head]``, ``key``/``value`` ``[B,G,t,d_head]``, ``sinks [H]``;
    returns ``z [B,H,n,d_head]``."""
    def through(name: str, x: torch.Tensor) -> torch.Tensor:
        point = getattr(hooks, name, None) if hooks is not None else None
        return point(x) if point is not None else x

    B, H, n, _ = query.shape
    group = H // key.shape[1]  # query head h reads key/value head h // (H/G), as transformers' repeat_kv
    keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)  # [B,H,t,d_head]
    qk = through("hook_qk", query @ keys.transpose(-2, -1))  # [B,H,n,d_head] @ [B,H,d_head,t] -> [B,H,n,t]
    scores = through("hook_attn_scores", qk * scale)
    if mask is not None:
        scores = through("hook_masked_scores", scores + through("hook_mask", mask))  # + [B|1,1,n,t]
    sink = through("hook_sink_logits", sinks.reshape(1, H, 1, 1).to(scores.dtype).expand(B, H, n, 1))
    logits = torch.cat([scores, sink], dim=-1)  # [B,H,n,t+1]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(scores.dtype)  # rows sum to 1 over keys + sink
    pattern = through("hook_pattern", probs[..., :-1])  # [B,H,n,t]: the keys' share, rows sum to < 1
    through("hook_sink_weight", probs[..., -1:])  # [B,H,n,1]
    return pattern @ values  # [B,H,n,t] @ [B,H,t,d_head] -> [B,H,n,d_head]


_probing = threading.local()  # .record: HFDecoder's probe's callback while it runs on this thread
_forward = threading.local()  # .keys: (key_is_token [B,t] | None,) while HFDecoder.forward runs on this thread


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

    if getattr(_forward, "keys", None) is not None:  # our forward: the attention can work from a description
        mode, threshold = attention_path_settings()
        batch, n, t = kwargs.get("batch_size", 1), kwargs.get("q_length", 0), kwargs.get("kv_length", 0)
        if isinstance(n, int) and isinstance(t, int) and isinstance(batch, int) and (
                mode == "fused" or (mode == "auto" and batch * n * t >= threshold)):
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


# -- the KV cache -----------------------------------------------------------------------------------------
def _cache_view(cache: KVCache, n_layer: int, latent: list[_AttentionHooks | None] | None = None,
                own: type | None = None):
    """transformers' ``Cache`` over our ``KVCache``: ``update`` appends to our buffers (transactionally:
    our model commits after the forward), sizes come from our length.

    ``own``: the family's own cache class where its forward accepts no other (MiniMax's ``MiniMaxCache``, whose
    lightning-attention layers read and write their state through ``get_linear_cache`` / ``set_linear_cache``):
    the view is then an instance of it, that state kept in the layer's ``StateCache`` state layer.

    A latent-attention layer (DeepSeek-V2/V3: ``latent[layer]`` holds its hooks) hands ``update`` its compressed
    latent c_KV ``[B,1,n,d_c]`` and its rotary key k_R ``[B,1,n,d_R]`` in place of K and V — transformers' own
    cache holds those too — and expands K and V from what comes back: both go through the layer's
    ``hook_kv_latent_all`` / ``hook_k_rope_all`` on the way."""
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
                 attention_layers: set[int] | None = None) -> None:
        super().__init__(n_layer, batch_size, storage)
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
        twin = StateCache(self.n_layer, self.batch_size, self.storage, self.templates, self.attention_layers)
        twin._buffers, twin._length, twin.key_is_token = held._buffers, held._length, held.key_is_token
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


# -- finding the parts ----------------------------------------------------------------------------------
def _child(module: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    for name in names:
        found = getattr(module, name, None)
        if isinstance(found, nn.Module):
            return found
    return None


@dataclass(frozen=True)
class _Call:
    """One call of the attention function during the probe."""

    layer: tuple[int, int] | None  # (id of the outermost ModuleList running, index in it); None: outside any
    module: nn.Module
    heads: int  # H, the query heads
    kv_heads: int  # G, the key/value heads
    q_head: int  # d_head of the queries/keys
    v_head: int  # d_head of the values
    sinks: bool
    mask: torch.Tensor | None  # [B|1,1,n,t] as the attention received it
    unmodelled: tuple[str, ...] = ()  # arguments given that change the scores and that traced_attention ignores
    key: torch.Tensor | None = field(default=None, compare=False, repr=False)  # K as received: another layer's K
    # object itself where the layer reads that layer's K and V (KV sharing)
    query: torch.Tensor | None = field(default=None, compare=False, repr=False)  # Q as received
    differential: bool = False  # the layer's two calls share Q and K: differential attention (DiffLlama)


# arguments of the attention interface that change the scores or the softmax and that traced_attention does not
# model (its own sinks come as s_aux, gpt-oss's name): a family passing one of them is refused, not traced wrong
_UNMODELLED = {"position_bias": "a learned position bias added to the scores", "sinks": "learned sink logits",
               "score_mod": "a score modification function", "attention_bias": "a bias added to the scores"}


# words of state-space / recurrent mixers' class names: only to say why a model that makes no attention call at all is
# refused (no softmax attention, or attention in its own code); a hybrid's state layers are found by what they keep
# (``_state_writers``, ``_state_layers``)
_STATE_WORDS = ("mamba", "ssm", "conv", "rwkv", "recurrent", "lstm", "linear_attn", "linearattention", "mixer",
                "retention", "deltanet", "gated_delta", "lightning", "hyena", "short_conv")


def _module_words(hf: nn.Module) -> set[str]:
    return {type(m).__name__.lower() for m in hf.modules()}


def _token_device(hf: nn.Module) -> torch.device:
    """Where token ids go: the device of the embedding, or accelerate's execution device when the embedding is
    offloaded (its weight is then a ``meta`` placeholder)."""
    embed = hf.get_input_embeddings()  # type: ignore[operator]
    weight = embed.weight
    if weight.device.type != "meta":
        return weight.device
    hooks = _accelerate_hooks(embed)
    for hook in hooks:
        if getattr(hook, "execution_device", None) is not None:
            return torch.device(hook.execution_device)
    return torch.device("cpu") if hooks else weight.device  # no hook: a dry run, wholly on meta


def _probe_calls(hf: nn.Module) -> tuple[list[_Call], dict[int, nn.ModuleList]]:
    """Two tokens through the model, recording every call of the attention function and which element of which
    ModuleList was running (the outermost one) when it came — the layers are found by what they call, not by
    their class names or where they sit: a vision tower that is not run is never mistaken for the text stack."""
    frames: list[tuple[int, int]] = []
    calls: list[_Call] = []
    lists = {id(m): m for m in hf.modules() if isinstance(m, nn.ModuleList)}
    handles = []

    def leave(module: nn.Module, args: Any, output: Any) -> None:  # returns None: the output stays as it is
        if frames:
            frames.pop()

    for key, modules in lists.items():
        for i, layer in enumerate(modules):
            handles.append(layer.register_forward_pre_hook(lambda m, a, k=key, i=i: frames.append((k, i))))
            handles.append(layer.register_forward_hook(leave))

    def record(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               mask: torch.Tensor | None, kwargs: dict) -> None:
        calls.append(_Call(frames[0] if frames else None, module, int(query.shape[-3]), int(key.shape[-3]),
                           int(query.shape[-1]), int(value.shape[-1]),
                           kwargs.get("s_aux") is not None, mask,
                           tuple(k for k in _UNMODELLED if kwargs.get(k) is not None), key, query))

    device = _token_device(hf)
    # two tokens, so that the first's mask row shows whether it sees the second (causal or not); on the meta
    # device one (no mask value can be read there, and a state-space mixer asks padding questions of two)
    tokens = torch.zeros(1, 1 if device.type == "meta" else 2, dtype=torch.long, device=device)
    _probing.record = record
    try:
        # on the meta device each op's output is computed once per distinct input (its layers are alike)
        with torch.no_grad(), meta_op_cache() if device.type == "meta" else contextlib.nullcontext():
            hf(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False)
    except HFDecoderError:
        pass  # raised by traced_attention (sinks): the calls recorded so far say what the model is
    except Exception as e:  # noqa: BLE001 (transformers' own forward failing is a refusal, never a crash)
        raise HFDecoderError(f"transformers' own forward of this model fails on a two-token input "
                             f"({type(e).__name__}: {str(e)[:300]})", reason="cannot load") from None
    finally:
        _probing.record = None
        for handle in handles:
            handle.remove()
    return calls, lists


def _state_layers(hf: nn.Module) -> list[int]:
    """The layers whose cache holds convolution / state-space / linear-attention state (transformers' own cache
    for this config says so), which our KV cache does not keep."""
    try:
        from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

        config: Any = getattr(hf, "config", None)
        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 (a config whose cache transformers cannot describe: no state layers known)
        return []
    return [i for i, layer in enumerate(layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]


# the methods through which a layer writes the state it keeps between steps into transformers' cache: the shared
# cache's conv / recurrent state (Qwen3-Next, Kimi Linear, Jamba, LFM2 …) and MiniMax's own linear-attention cache
_STATE_WRITES = ("update_conv_state", "update_recurrent_state", "set_linear_cache")


def _state_writers(hf: nn.Module, layers: nn.ModuleList) -> dict[int, nn.Module]:
    """Per decoder layer that writes state into transformers' cache, the module that writes it — the outermost
    module inside the layer running when the cache's ``update_conv_state`` / ``update_recurrent_state`` (or MiniMax's
    ``set_linear_cache``) is called during one cached forward. What a layer keeps between steps, found by what it
    does, not by its class name: Kimi Linear's ``KimiLinearDeltaAttention`` is such a mixer as much as Qwen3-Next's
    ``GatedDeltaNet``. Empty where that forward cannot run (the layers' cache kinds then come from
    ``_state_layers``)."""
    from transformers.cache_utils import DynamicCache

    own = _own_cache_class(hf)
    try:
        config: Any = getattr(hf, "config", None)
        cache = own() if own is not None and _keeps_linear_state(own) else DynamicCache(config=config)
    except Exception:  # noqa: BLE001 (a cache transformers cannot build for this config: nothing recorded)
        return {}
    running: list[tuple[int, nn.Module]] = []
    writers: dict[int, nn.Module] = {}
    handles = []

    def leave(module: nn.Module, args: Any, output: Any) -> None:  # returns None: the output stays as it is
        if running:
            running.pop()

    for L, layer in enumerate(layers):
        for child in layer.children():
            handles.append(child.register_forward_pre_hook(lambda m, a, L=L: running.append((L, m))))
            handles.append(child.register_forward_hook(leave))

    def recording(name: str):
        original = getattr(cache, name)

        def write(*args: Any, **kwargs: Any) -> Any:
            if running:
                writers.setdefault(*running[-1])
            return original(*args, **kwargs)

        return write

    for name in _STATE_WRITES:
        if callable(getattr(cache, name, None)):
            setattr(cache, name, recording(name))  # on this instance only
    device = _token_device(hf)
    tokens = torch.zeros(1, 1 if device.type == "meta" else 2, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), meta_op_cache() if device.type == "meta" else contextlib.nullcontext():
            hf(input_ids=tokens, attention_mask=torch.ones_like(tokens), **{cache_keyword(hf): cache}, use_cache=True)
    except Exception:  # noqa: BLE001 (its cached forward fails: no layer's writes are known)
        return {}
    finally:
        for handle in handles:
            handle.remove()
    return writers


def _state_stack(hf: nn.Module, lists: dict[int, nn.ModuleList]) -> tuple[nn.ModuleList, dict[int, nn.Module]] | None:
    """A model that makes no attention call: the list of layers every one of which writes state into transformers'
    cache in a cached forward (Mamba, Mamba-2, Falcon-Mamba: every layer a state-space mixer), with each layer's
    writer (``_state_writers``) — found by what the layers do; None where no list's every layer keeps state. Only
    outermost lists are tried (a list inside another's element is part of a layer), longest first."""
    inner = {id(m) for outer in lists.values() for element in outer for m in element.modules()
             if isinstance(m, nn.ModuleList)}
    for layers in sorted((m for key, m in lists.items() if key not in inner and len(m)), key=len, reverse=True):
        writers = _state_writers(hf, layers)
        if len(writers) == len(layers):
            return layers, writers
    return None


def _carried_stack(hf: nn.Module, lists: dict[int, nn.ModuleList]) -> nn.ModuleList | None:
    """A model that makes no attention call and writes nothing into transformers' cache, but whose forward hands back
    its state (``state``: RWKV) as tensors with one slice per layer in their last axis: the outermost list of layers
    as long as that axis, every layer then a state layer (the state sliced at its index); None otherwise."""
    if cache_keyword(hf) != "state":
        return None
    device = _token_device(hf)
    if device.type == "meta":
        return None
    tokens = torch.zeros(1, 2, dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            carried = getattr(hf(input_ids=tokens, use_cache=True), "state", None)
    except Exception:  # noqa: BLE001 (its forward failing is reported by the refusal that follows)
        return None
    if not isinstance(carried, (list, tuple)) or not carried or not all(
            isinstance(x, torch.Tensor) and x.dim() >= 2 for x in carried):
        return None
    depth = {int(x.shape[-1]) for x in carried}
    inner = {id(m) for outer in lists.values() for element in outer for m in element.modules()
             if isinstance(m, nn.ModuleList)}
    stacks = [m for key, m in lists.items() if key not in inner and len(depth) == 1 and len(m) in depth]
    return stacks[0] if len(stacks) == 1 else None


def _find_attention(hf: nn.Module, model_type: str) -> tuple[nn.ModuleList, list[_Call | None], dict[int, nn.Module]]:
    """The decoder layers and each one's call of the attention function in the probe — its ``module`` the
    layer's self-attention — found by which module calls the attention function inside which layer (None for a
    hybrid model's layer that mixes its positions with a state-space, convolution or linear-attention mixer
    instead), and, for those layers, the module that writes the state they keep (``_state_writers``); refuses, with
    the true reason, a model that does not fit at most one call per layer."""
    calls, lists = _probe_calls(hf)
    words = _module_words(hf)
    stateful = _state_stack(hf, lists) if not calls else None
    if stateful is not None:  # every layer a state layer (Mamba): traced as mixers, no attention anywhere
        layers, writers = stateful
        return layers, [None] * len(layers), writers
    carried = _carried_stack(hf, lists) if not calls else None
    if carried is not None:  # RWKV: every layer keeps its slice of the state the forward hands back
        return carried, [None] * len(carried), {}
    if not calls:
        attention_named = [w for w in words if ("attention" in w or "attn" in w) and "norm" not in w]
        state = [w for w in words if any(s in w for s in _STATE_WORDS)]
        if attention_named and not (state and all(any(s in w for s in _STATE_WORDS) for w in attention_named)):
            raise HFDecoderError(
                f"{model_type}: its attention ({', '.join(sorted(attention_named)[:3])}) is computed by the family's "
                "own code, not through transformers' attention interface, so its Q, K, V and pattern cannot be "
                "recorded (the re-implemented families gpt2, llama, mistral, qwen2 and every family whose attention "
                "calls the interface can)", reason="attention outside the interface")
        raise HFDecoderError(f"{model_type}: no layer computes softmax attention (its mixers: "
                             f"{', '.join(sorted(state)[:3]) or 'none named'}): there is no attention pattern to "
                             "trace", reason="no softmax attention")
    unmodelled = sorted({k for c in calls for k in c.unmodelled})
    if unmodelled:  # Inkling 2: a relative position bias and sinks by names of its own
        given = "; ".join(f"{_UNMODELLED[k]} ({k})" for k in unmodelled)
        raise HFDecoderError(f"{model_type}: its attention passes {given} to transformers' attention function, which "
                             "the traced attention does not compute: its pattern would not be the one the model uses",
                             reason="attention sinks" if "sinks" in unmodelled else "score bias")
    counts: dict[int, int] = {}
    for c in calls:
        if c.layer is not None:
            counts[c.layer[0]] = counts.get(c.layer[0], 0) + 1
    if not counts:
        raise HFDecoderError(f"{model_type}: its attention runs outside any list of layers",
                             reason="attention outside the interface")
    layers = lists[max(counts, key=lambda k: counts[k])]
    per_layer: list[list[_Call]] = [[] for _ in layers]
    for c in calls:
        if c.layer is not None and c.layer[0] == id(layers):
            per_layer[c.layer[1]].append(c)
    elsewhere = [c for c in calls if c.layer is None or c.layer[0] != id(layers)]
    for L, cs in enumerate(per_layer):  # differential attention: one module's two calls with the same Q and K
        if len(cs) == 2 and cs[0].module is cs[1].module and cs[0].query is cs[1].query and cs[0].key is cs[1].key \
                and cs[0].heads % 2 == 0 and differential_lambda(cs[0].module) is not None:
            per_layer[L] = [replace(cs[0], differential=True)]
    repeated = [L for L, cs in enumerate(per_layer) if len(cs) > 1]
    stacks = {c.layer[0] for c in calls if c.layer is not None}
    if not repeated and len(stacks) > 1:  # BLT: byte-level stacks around a global transformer over patches
        path = {id(m): name for name, m in hf.named_modules() if isinstance(m, nn.ModuleList)}
        named = sorted(path.get(key, "?") for key in stacks)
        cross = sorted({type(c.module).__name__ for c in calls if "cross" in type(c.module).__name__.lower()})
        raise HFDecoderError(
            f"{model_type}: its attention runs in {len(stacks)} lists of layers ({', '.join(named[:6])})"
            + (f", cross-attention ({', '.join(cross[:2])}) among them: queries from one stack, keys and values from "
               "another" if cross else "")
            + "; the trace holds one stack of decoder layers, each with one attention", reason="several stacks")
    if repeated or elsewhere:
        where = (f"layer(s) {', '.join(map(str, repeated[:8]))} call attention more than once per forward"
                 if repeated else f"{len(elsewhere)} attention call(s) come from outside its list of layers")
        raise HFDecoderError(f"{model_type}: {where} (several attentions, or layers run more than once); the trace "
                             "holds one attention per layer", reason="several attentions per layer")
    missing = [L for L, cs in enumerate(per_layer) if not cs]
    writers = _state_writers(hf, layers) if missing else {}
    # a layer keeps state where transformers' own cache gives it a state layer, or where it writes state into the
    # cache in a cached forward (what it does, not what its classes are called)
    state_layers = set(_state_layers(hf)) | set(writers)
    for L in missing:
        if L in state_layers:
            continue  # its mixer is whatever writes its state (Kimi Linear's delta attention among them)
        # a layer without attention and without state that holds an attention module: that attention never called
        # the interface
        silent = sorted({type(m).__name__ for m in layers[L].modules() if m is not layers[L]
                         and any(w in type(m).__name__.lower() for w in ("attention", "attn"))
                         and "norm" not in type(m).__name__.lower()})
        if silent or not state_layers:  # nothing of it mixes positions in a way the trace can hold
            raise HFDecoderError(
                f"{model_type}: layer(s) {L} " + (f"hold attention ({', '.join(silent[:3])}) that " if silent else
                                                  "make no attention call and keep no state; their attention ")
                + "does not go through transformers' attention interface, so its Q, K, V and pattern cannot be "
                "recorded", reason="attention outside the interface")
    # a layer without attention (a hybrid's state layer: Gated DeltaNet, Mamba …) is traced as its mixer's input
    # and output, its state kept by transformers' own cache layer inside StateCache
    shared = {id(cs[0].module) for cs in per_layer if cs}
    if len(shared) < sum(1 for cs in per_layer if cs):  # one attention module run inside several layers (Zamba)
        raise HFDecoderError(f"{model_type}: one attention module is shared by several layers (a shared block); the "
                             "trace holds one attention module per layer", reason="several attentions per layer")
    first = next(cs for cs in per_layer if cs)[0].mask
    if first is not None and first.device.type != "meta" and first.shape[-1] >= 2 and first.shape[-2] >= 2:
        hidden = first[0, 0] <= torch.finfo(first.dtype).min / 2 if first.is_floating_point() else ~first[0, 0]
        if not bool(hidden[0, 1]):  # the first position sees the second: not causal
            raise HFDecoderError(f"{model_type}: its attention mask lets position 0 see position 1 (bidirectional, "
                                 "an encoder): only causal decoders, whose position i sees positions ≤ i, are "
                                 "traced", reason="encoder")
    return layers, [cs[0] if cs else None for cs in per_layer], writers


def _kv_shared(probed: list[_Call | None]) -> tuple[tuple[int, int], ...]:
    """(layer, source) for each layer whose attention receives, as its keys, the very tensor an earlier layer's
    attention received (KV sharing, Gemma 3n and Gemma 4: the last layers compute no K, V and attend over those of
    the last earlier layer of their kind) — found by what the layers hand the attention function, not by config
    names. Such a layer appends nothing to the cache."""
    pairs: list[tuple[int, int]] = []
    for L, call in enumerate(probed):
        if call is None or call.key is None:
            continue
        source = next((P for P in range(L) if probed[P] is not None and cast(_Call, probed[P]).key is call.key), None)
        if source is not None:
            pairs.append((L, dict(pairs).get(source, source)))
    return tuple(pairs)


def cache_keyword(hf: nn.Module) -> str:
    """The name under which the model's forward takes its cache (and its output returns it): ``past_key_values``,
    ``cache_params`` (Mamba, Mamba-2, Falcon-Mamba) or ``state`` (RWKV: a list of tensors with one slice per layer,
    which the forward updates in place and hands back)."""
    import inspect

    try:
        names = inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    if "past_key_values" in names:
        return "past_key_values"
    if "cache_params" in names:
        return "cache_params"
    return "state" if "state" in names else "past_key_values"  # RWKV: its state list, handed in and back


def _own_cache_class(hf: nn.Module) -> type | None:
    """A cache class the model's own modeling file defines (MiniMax's ``MiniMaxCache``: its forward accepts no
    other), None where the family uses transformers' shared cache."""
    import sys

    from transformers.cache_utils import Cache

    module = sys.modules.get(type(hf).__module__)
    for value in vars(module or object()).values():
        if isinstance(value, type) and issubclass(value, Cache) and value.__module__ == type(hf).__module__:
            return value
    return None


def _keeps_linear_state(own: type) -> bool:
    """Whether a family's own cache class is MiniMax's kind: a ``DynamicCache`` for the softmax layers' K and V
    plus one state tensor per linear-attention layer, read and written through ``get_linear_cache`` /
    ``set_linear_cache`` — which the traced cache's view can stand in for (``_cache_view``)."""
    from transformers.cache_utils import DynamicCache

    return issubclass(own, DynamicCache) and all(callable(getattr(own, name, None)) for name in
                                                 ("get_linear_cache", "set_linear_cache"))


def mixer_of(layer: nn.Module, writer: nn.Module | None = None) -> nn.Module:
    """The module that mixes a layer's positions when the layer has no attention: the one that writes the layer's
    state into the cache (``writer``, from ``_state_writers``: Qwen3-Next's GatedDeltaNet, Kimi Linear's delta
    attention, Jamba's MambaMixer, LFM2's ShortConv …); else the one child that is not a norm or an MLP
    (Nemotron-H's MoE-only blocks)."""
    if writer is not None:
        return writer
    mlp = _child(layer, _NAMES_MLP)
    skipped = {id(m) for m in mlp.modules()} if mlp is not None else set()
    children = [m for m in layer.children() if id(m) not in skipped
                and not any(w in type(m).__name__.lower() for w in ("norm", "dropout"))]
    if not children:
        raise HFDecoderError(f"{type(layer).__name__}: a layer without attention whose mixer was not found")
    return children[0]


_JOINED = {"Delta Net": "DeltaNet", "Mo E": "MoE", "Lo RA": "LoRA"}  # words the camel-case split would tear apart
# a name left with one of these only keeps its family: "Mixer", or RWKV's time mixing ("RwkvSelfAttention", which
# has no softmax) read as "Self Attention" would name nothing of its own
_GENERIC = ("Mixer", "Layer", "Block", "Module", "SelfAttention", "Attention")


def mixer_name(mixer: nn.Module, family_prefix: str) -> str:
    """A mixer's class name as words, without the family's prefix: ``Qwen3NextGatedDeltaNet`` → "Gated DeltaNet",
    ``NemotronHMamba2Mixer`` → "Mamba2 Mixer"; a name left with one generic word keeps its family ("Bamba Mixer")."""
    name = type(mixer).__name__
    own = name[len(family_prefix):] if family_prefix and name.startswith(family_prefix) else name
    if not own or own in _GENERIC:
        own = name
    words = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", own)
    for torn, joined in _JOINED.items():
        words = words.replace(torn, joined)
    return words


def refusal_by_config(config: Any, model_type: str) -> HFDecoderError | None:
    """What the config alone says cannot be traced (before anything is loaded)."""
    if model_type in REFUSED:
        reason, why = REFUSED[model_type]
        return HFDecoderError(f"model_type {model_type!r} is {why}", reason=reason)
    if getattr(config, "is_encoder_decoder", False):
        return HFDecoderError(f"{model_type} is an encoder-decoder (its decoder reads a separate encoder through "
                              "cross-attention); only decoder-only causal LMs are traced", reason="encoder-decoder")
    # add_cross_attention alone refuses nothing: a causal LM built with it (ProphetNetForCausalLM, a BERT decoder)
    # cross-attends only when handed an encoder's output, which a causal LM's forward is never given; the probe then
    # sees what its layers really call (ProphetNet: attention in its own n-gram code, refused for that)
    if model_type in ENCODERS and not getattr(config, "is_decoder", False):
        return HFDecoderError(f"{model_type} is configured as an encoder (is_decoder = false): every position "
                              "attends to every other; configured with is_decoder = true it is a causal decoder",
                              reason="encoder")
    if getattr(config, "alibi", False):
        return HFDecoderError(f"{model_type} adds ALiBi position biases to the attention scores, which the traced "
                              "attention does not model", reason="alibi")
    indexed, own = _special_cache_layers(config)
    if indexed:
        return HFDecoderError(
            f"{model_type}: layer(s) {', '.join(map(str, indexed[:12]))} use indexed (sparse) attention: a learned "
            "indexer picks the keys each query attends to and keeps its own key cache beside K and V, which the "
            "traced KV cache does not keep", reason="indexed attention")
    if own:
        return HFDecoderError(
            f"{model_type}: its layers keep a cache of the family's own kind ({', '.join(own[:4])}: compressed keys "
            "and values), not the K and V per position the traced KV cache keeps", reason="compressed attention")
    return None


def _special_cache_layers(config: Any) -> tuple[list[int], list[str]]:
    """From the ``DynamicCache`` transformers builds for the config: the layers whose cache holds an indexer's key
    cache (DeepSeek-V3.2's sparse attention, GLM-5, ...), and the names of cache layer classes a family defines
    for itself (DeepSeek-V4's compressed attention) other than state-space / linear-attention state."""
    try:
        from transformers.cache_utils import DynamicCache, DynamicIndexedLayer, LinearAttentionCacheLayerMixin

        layers = DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 (a config whose cache transformers cannot describe: none known)
        return [], []
    indexed = [i for i, layer in enumerate(layers) if isinstance(layer, DynamicIndexedLayer)]
    own = sorted({type(layer).__name__ for layer in layers if type(layer).__module__ != "transformers.cache_utils"
                  and not isinstance(layer, LinearAttentionCacheLayerMixin)})
    return indexed, own


def _text_config(hf_config: Any) -> Any:
    return getattr(hf_config, "text_config", None) or hf_config


@dataclass(frozen=True)
class Architecture:
    """What a Hugging Face config says about the pieces (the view's labels come from here)."""

    model_type: str
    positions: str  # "rope" | "learned"
    norm: str  # "rmsnorm" | "layernorm"
    mlp: str  # "swiglu" (a gated MLP) | "gelu" (any two-matrix MLP) | "moe"
    parallel_block: bool  # attention and MLP read the same stream
    softcap: float | None  # attention logit soft-capping
    scale: float  # the attention's scale (1/√d_head unless the config says otherwise)


def _guess_architecture(hf: nn.Module, layer: nn.Module, attn: nn.Module | None, model_type: str) -> Architecture:
    cfg = _text_config(hf.config)
    has_rope = any("rotary" in type(m).__name__.lower() for m in hf.modules())
    norms = [type(m).__name__.lower() for m in layer.modules() if "norm" in type(m).__name__.lower()]
    rms = any("rms" in n for n in norms) or (bool(norms) and not any("layernorm" in n and "rms" not in n
                                                                     for n in norms))
    mlp = _child(layer, _NAMES_MLP)
    if mlp is not None and any(k in type(mlp).__name__.lower() for k in ("moe", "sparse", "expert")):
        mlp_kind = "moe"
    elif mlp is not None and (hasattr(mlp, "gate_proj") or hasattr(mlp, "gate_up_proj")):
        mlp_kind = "swiglu"
    else:
        mlp_kind = "gelu"
    parallel = (model_type in PARALLEL_BLOCKS or bool(getattr(cfg, "use_parallel_residual", False))
                or (model_type == "falcon" and bool(getattr(cfg, "parallel_attn", True)
                                                    or getattr(cfg, "new_decoder_architecture", False))))
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    scaling = getattr(attn, "scaling", None)
    heads = getattr(cfg, "num_attention_heads", None)
    d_head = getattr(attn, "head_dim", None) or (cfg.hidden_size // heads if isinstance(heads, int) and heads else
                                                 cfg.hidden_size)
    return Architecture(model_type=model_type, positions="rope" if has_rope else "learned",
                        norm="rmsnorm" if rms else "layernorm", mlp=mlp_kind, parallel_block=parallel,
                        softcap=float(softcap) if softcap else None,
                        scale=float(scaling) if isinstance(scaling, (int, float)) else d_head**-0.5)


# -- the model ------------------------------------------------------------------------------------------
class _BlockHooks(nn.Module):
    def __init__(self, softcap: bool, has_mid: bool, latent: bool = False, sinks: bool = False,
                 attention: bool = True, differential: bool = False) -> None:
        super().__init__()
        self.hook_resid_pre = HookPoint()  # [B, n, d]
        if attention:
            self.attn = _AttentionHooks(softcap, latent, sinks, differential)
            self.hook_attn_out = HookPoint()  # [B, n, d]
        else:  # a hybrid model's layer whose mixer is not attention: what goes in and what comes out
            self.hook_mixer_in = HookPoint()  # [B, n, d], the mixer's input (the normed residual)
            self.hook_mixer_out = HookPoint()  # [B, n, d], what the mixer adds to the residual stream
        if has_mid:
            self.hook_resid_mid = HookPoint()  # [B, n, d]
        self.hook_mlp_out = HookPoint()  # [B, n, d]
        self.hook_resid_post = HookPoint()  # [B, n, d]


class _FinalNorm(nn.Module):
    """The model's final norm under our name ``ln_final`` (not a submodule: it stays where it is)."""

    _norm: nn.Module  # set past nn.Module.__setattr__, so that it is not registered as a submodule

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_norm", norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x)


def _replace_first(output: Any, value: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return value
    if isinstance(output, tuple):
        return (value, *output[1:])
    if hasattr(output, "__getitem__") and hasattr(output, "keys"):  # a ModelOutput
        output[next(iter(output.keys()))] = value
        return output
    return output


def _through_first_input(point: HookPoint, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook's result with the module's first input (positional, or ``hidden_states=``) through
    ``point``."""
    if args:
        return (point(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        kwargs["hidden_states"] = point(kwargs["hidden_states"])
    return args, kwargs


def _first(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _accelerate_hooks(module: nn.Module) -> list[Any]:
    """The accelerate hooks on a module (``dispatch_model`` attaches one, or a ``SequentialHook`` of several)."""
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(getattr(hook, "hooks", None) or [hook])


def _materialized(module: nn.Module, attr: str) -> torch.Tensor:
    """A module's parameter or buffer with its values: itself, or — when accelerate offloaded it and left a
    ``meta`` placeholder — the copy its hook reads from the offload folder at each forward."""
    tensor = getattr(module, attr)
    if tensor.device.type != "meta":
        return tensor
    for hook in _accelerate_hooks(module):
        weights = getattr(hook, "weights_map", None)
        if weights is not None and attr in weights:
            return weights[attr]
    raise HFDecoderError(f"{type(module).__name__}.{attr} has no values in memory and no offloaded copy")


def _state_items(hf: nn.Module):
    """``(name, tensor)`` of the state dict with every offloaded tensor read back, one at a time (so hashing an
    offloaded model never holds more than one of its tensors)."""
    for name, tensor in hf.state_dict().items():
        if tensor.device.type != "meta":
            yield name, tensor
        else:
            path, _, attr = name.rpartition(".")
            yield name, _materialized(hf.get_submodule(path), attr)


_RESIDUAL_POINTS = ("hook_resid_pre", "hook_attn_out", "hook_mixer_out", "hook_resid_mid", "hook_mlp_out",
                    "hook_resid_post")


def _sum_holds(total: torch.Tensor, parts: list[torch.Tensor]) -> bool | None:
    """Whether ``total`` is the sum of ``parts`` within the rounding of their dtype (a few ulps of the largest
    magnitude involved: the model may add in another order, or in its own dtype where we add in float64). None
    where that cannot tell: a part that is all zeros (every mix of it is a sum) or a value that is not finite."""
    eps = torch.finfo(total.dtype).eps if total.is_floating_point() else 0.0
    parts64 = [p.to("cpu", torch.float64) for p in parts]
    total64 = total.to("cpu", torch.float64)
    if not all(bool(t.isfinite().all()) for t in [total64, *parts64]) or any(not bool(p.any()) for p in parts64):
        return None
    scale = max(float(t.abs().max()) for t in [total64, *parts64])
    return float((total64 - sum(parts64)).abs().max()) <= 8 * eps * scale


def _plain_residual(seen: dict[tuple[int, str], torch.Tensor], n_layer: int) -> bool | None:
    """From one forward's block tensors: True where every block's stream after attention (or its mixer) is the
    stream entering it + that output, and the stream leaving it is that + the MLP's output (a parallel block, with
    no stream in between: x + both); False where some block is not; None where a block lacks a tensor to tell."""
    verdicts: list[bool | None] = []
    for L in range(n_layer):
        pre, post, mlp, mid = (seen.get((L, k)) for k in ("hook_resid_pre", "hook_resid_post", "hook_mlp_out",
                                                           "hook_resid_mid"))
        mix = seen.get((L, "hook_attn_out"), seen.get((L, "hook_mixer_out")))
        if pre is None or post is None or mlp is None or mix is None \
                or any(t.numel() != pre.numel() for t in (post, mlp, mix, *([mid] if mid is not None else []))):
            verdicts.append(None)
            continue
        # [B, n, d] each (OPT's MLP and the norm before it see [B·n, d]: the same numbers, flattened)
        post, mlp, mix = (t.reshape(pre.shape) for t in (post, mlp, mix))
        if mid is None:
            verdicts.append(_sum_holds(post, [pre, mix, mlp]))
        else:
            mid = mid.reshape(pre.shape)
            halves = (_sum_holds(mid, [pre, mix]), _sum_holds(post, [mid, mlp]))
            verdicts.append(False if False in halves else None if None in halves else True)
    if False in verdicts:
        return False
    return None if None in verdicts else True


class HFDecoder(nn.Module):
    """A transformers causal LM, run by transformers, with our hook points, cache and forward signature.

    ``HFDecoder(hf_model)`` for a model already in memory (built in Python or loaded by the user);
    ``load_hf_decoder(directory)`` for a ``save_pretrained`` directory."""

    def __init__(self, hf: PreTrainedModel, identity: ModelIdentity | None = None) -> None:
        super().__init__()
        _register()
        model_type = str(getattr(hf.config, "model_type", type(hf).__name__))
        refusal = refusal_by_config(hf.config, model_type)
        if refusal is not None:
            raise refusal
        try:
            hf.set_attn_implementation(ATTENTION)  # to every sub-model too; the routing check below verifies it
        except (ValueError, KeyError) as e:
            raise HFDecoderError(f"{model_type}: transformers cannot give it another attention implementation "
                                 f"({type(e).__name__}: {str(e)[:300]})",
                                 reason="attention outside the interface") from None
        self.hf = hf.eval().requires_grad_(False)
        cfg = _text_config(hf.config)
        layers, probed, writers = _find_attention(hf, model_type)
        attns = [call.module if call is not None else None for call in probed]
        self._kv_shared = _kv_shared(probed)  # (layer, source): layers attending over another layer's K and V
        # a hybrid's first attention layer may come after a state layer; a state-space model (Mamba) has none
        first = next((L for L, attn in enumerate(attns) if attn is not None), None)
        self.architecture = _guess_architecture(hf, layers[first or 0], attns[first] if first is not None else None,
                                                model_type)
        arch = self.architecture
        mlp_norms = [None if arch.parallel_block else _child(layer, _NAMES_MLP_NORM) for layer in layers]
        self._latent = [latent_widths(attn) if attn is not None else None for attn in attns]  # (d_c, d_R) or None
        self._sinks = [isinstance(getattr(attn, "sinks", None), torch.Tensor) for attn in attns]  # gpt-oss
        self._state_templates = state_templates(hf)  # hybrid models: the layers whose state transformers keeps
        if len(self._state_templates) != len(layers):
            self._state_templates = [None] * len(layers)
        self._carried = all(attn is None for attn in attns) and not writers and cache_keyword(hf) == "state"
        own_cache = _own_cache_class(hf)
        # MiniMax: its forward accepts only its own cache class, whose linear-attention state our view keeps in the
        # state layers transformers' shared cache describes for the config (one per layer without attention)
        self._cache_keyword = cache_keyword(hf)
        self._own_cache = own_cache if own_cache is not None and _keeps_linear_state(own_cache) and all(
            template is not None for template, attn in zip(self._state_templates, attns) if attn is None) else None
        if own_cache is not None and any(attn is None for attn in attns) and self._own_cache is None:
            raise HFDecoderError(
                f"{model_type}: its layers without attention keep their state in a cache class of the family's own "
                f"({own_cache.__name__}), which the traced KV cache cannot stand in for; only state that "
                "transformers' shared cache layers hold (Qwen3-Next, Jamba, Nemotron-H, Falcon-H1 …) or MiniMax's "
                "linear-attention cache is traced", reason="state layers")
        prefix = type(hf).__name__.split("For")[0]  # Qwen3NextForCausalLM -> Qwen3Next: the family's class prefix
        self._mixers = [None if attn is not None else mixer_of(layer, writers.get(L))
                        for L, (layer, attn) in enumerate(zip(layers, attns))]
        self.mixer_names = tuple("" if m is None else mixer_name(m, prefix) for m in self._mixers)
        differential = [call is not None and call.differential for call in probed]
        block_hooks = [_BlockHooks(arch.softcap is not None, norm is not None, latent is not None, sinks,
                                   attention=attn is not None, differential=diff)
                       for norm, latent, sinks, attn, diff in zip(mlp_norms, self._latent, self._sinks, attns,
                                                                  differential)]
        self.blocks = nn.ModuleList(block_hooks)
        self.hook_embed = HookPoint()  # [B, n, d], W_E[tokens] as the embedding module returns it
        self.hook_logits = HookPoint()  # [B, n, V]
        final = _child(getattr(hf, "model", None) or getattr(hf, "transformer", None)
                       or getattr(hf, "gpt_neox", None) or hf, _NAMES_FINAL_NORM)
        if final is None:
            final = next((m for name, m in hf.named_modules() if name.split(".")[-1] in _NAMES_FINAL_NORM), None)
        self.ln_final = _FinalNorm(final) if final is not None else None
        self._handles = []
        embed = hf.get_input_embeddings()
        self._handles.append(embed.register_forward_hook(lambda m, a, out: self.hook_embed(out)))
        for hooks, template in zip(block_hooks, self._state_templates):
            if template is not None or self._carried:  # what the layer's state holds after each step, [B, …]
                hooks.hook_conv_state = HookPoint()
                hooks.hook_ssm_state = HookPoint()
        for layer, attn, mixer, hooks, mlp_norm in zip(layers, attns, self._mixers, block_hooks, mlp_norms):
            self._handles.append(layer.register_forward_pre_hook(self._pre_layer(hooks), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(
                lambda m, a, out, h=hooks: _replace_first(out, h.hook_resid_post(_first(out)))))
            if attn is not None:
                _HOOKS[attn] = hooks.attn
                hooks.attn.w_o = _child(attn, _NAMES_OUT)
                if hasattr(hooks.attn, "hook_diff_pattern"):  # differential attention: its λ from its own parameters
                    hooks.attn.differential = differential_lambda(attn)
                self._handles.append(attn.register_forward_hook(
                    lambda m, a, out, h=hooks: _replace_first(out, h.hook_attn_out(_first(out)))))
            elif mixer is not None:
                self._handles.append(mixer.register_forward_pre_hook(
                    lambda m, args, kwargs, h=hooks: _through_first_input(h.hook_mixer_in, args, kwargs),
                    with_kwargs=True))
                self._handles.append(mixer.register_forward_hook(
                    lambda m, a, out, h=hooks: _replace_first(out, h.hook_mixer_out(_first(out)))))
            mlp = _child(layer, _NAMES_MLP)
            if mlp is not None:
                self._handles.append(mlp.register_forward_hook(
                    lambda m, a, out, h=hooks: _replace_first(out, h.hook_mlp_out(_first(out)))))
            if mlp_norm is not None:
                self._handles.append(mlp_norm.register_forward_pre_hook(
                    lambda m, args, h=hooks: (h.hook_resid_mid(args[0]), *args[1:])))
        self._identity: ModelIdentity | PendingIdentity | None = identity
        # set by guard_against_transformers where transformers' own cached and uncached forwards disagree: which
        # one the trace follows, with the numbers (None: they agree, or the guard has not run)
        self.reference_note: str | None = None
        # RoBERTa-style embeddings: positions from padding_idx + 1 onwards, computed from the ids
        self._own_positions = any(hasattr(m, "padding_idx") and hasattr(m, "position_embeddings")
                                  for m in hf.modules() if not isinstance(m, nn.Embedding))
        # the routing check: a forward with the hooks in place, every attention layer reached through its hooks.
        # On the meta device (a dry run) that forward would be the probe's again — the same one token and mask of
        # ones, and no value can steer a meta forward elsewhere — and it costs as much as a prefill (per op, not
        # per token), so it is not run here: the first forward of the model checks the same (``forward``), and
        # the head counts are the ones the attention received in the probe
        self._routing_unchecked = self.input_device.type == "meta"
        if self._routing_unchecked and first is not None:
            call = cast(_Call, probed[first])
            block_hooks[first].attn.seen = (call.heads, call.kv_heads, call.q_head, call.v_head)
        plain: bool | None = None  # on the meta device there are no values to add up
        if not self._routing_unchecked:
            plain = self._check_routing(block_hooks)
        self.config = replace(self._config(cfg, block_hooks[first].attn if first is not None else None),
                              plain_residual=plain)
        self.tensor_parallel: TensorParallelPlan | None = None  # one rank of k (a dry run): sources/_tensor_parallel.py

    def _check_routing(self, blocks: list[_BlockHooks]) -> bool | None:
        """One token through the model: every layer's attention must have gone through the traced function
        (a family that computes attention its own way would otherwise be shown without its patterns). Returns
        what the same forward shows of the blocks' residual sums (``_plain_residual``)."""
        device = self.input_device
        seen: dict[tuple[int, str], torch.Tensor] = {}
        taps = []
        for L, block in enumerate(blocks):
            for kind in _RESIDUAL_POINTS:
                point = getattr(block, kind, None)
                if isinstance(point, HookPoint):
                    taps.append(point.add_tap(lambda x, key=(L, kind): seen.__setitem__(key, x.detach())))
        # an ordinary token from the middle of the vocabulary: id 0 is often padding, whose embedding is zero (Gemma),
        # and a stream of zeros is every sum of zeros
        token = int(getattr(_text_config(self.hf.config), "vocab_size", 1) or 1) // 2
        try:
            with torch.no_grad():
                self.hf(input_ids=torch.full((1, 1), token, dtype=torch.long, device=device), use_cache=False)
        finally:
            for tap in taps:
                tap.remove()
        self._routed(blocks, [0] * len(blocks))
        return _plain_residual(seen, len(blocks))

    @staticmethod
    def _attention_calls(blocks: Any) -> list[int]:
        return [block.attn.calls if hasattr(block, "attn") else 0 for block in blocks]

    def _routed(self, blocks: Any, before: list[int]) -> None:
        """Refuses the model unless every attention layer's hooks counted a call since ``before``."""
        missed = [L for L, (block, calls) in enumerate(zip(blocks, before))
                  if hasattr(block, "attn") and block.attn.calls == calls]
        if missed:
            raise HFDecoderError(
                f"{self.architecture.model_type}: the attention of layer(s) {', '.join(map(str, missed))} does not "
                "go through transformers' attention interface, so its Q, K, V and pattern cannot be recorded; "
                "this family cannot be traced (the re-implemented families gpt2, llama, mistral, qwen2 can)")

    @staticmethod
    def _pre_layer(hooks: _BlockHooks):
        def pre(module: nn.Module, args: tuple, kwargs: dict):
            if args:
                return (hooks.hook_resid_pre(args[0]), *args[1:]), kwargs
            kwargs["hidden_states"] = hooks.hook_resid_pre(kwargs["hidden_states"])
            return args, kwargs

        return pre

    def _config(self, cfg: Any, first: _AttentionHooks | None) -> GPTConfig:
        """Our config's description of the model: the shapes and pieces the views label. The head counts and
        width are the ones the attention received in the routing check, not read from the config (whose
        names differ by family, and which keeps keys a family ignores). A model without attention (Mamba) has no
        heads: one "head" as wide as the stream stands in (H = G = 1, d_head = d_model), which no view reads as
        attention (``mixers`` names every layer's mixer)."""
        arch = self.architecture
        width = int(cfg.hidden_size)
        H, G, d_head, d_v = first.seen if first is not None else (1, 1, width, width)
        latent = next((widths for widths in self._latent if widths is not None), None)
        d_ff = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or getattr(cfg, "ffn_dim", None)
        if isinstance(d_ff, (list, tuple)):  # one width per layer (Gemma 3n): one number only where they agree
            d_ff = d_ff[0] if len(set(d_ff)) == 1 else None
        n_ctx = int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048)
        window = getattr(cfg, "sliding_window", None)
        return GPTConfig(
            vocab_size=int(cfg.vocab_size), n_ctx=n_ctx, d_model=int(cfg.hidden_size),
            n_layer=len(self.blocks),
            n_head=H, n_kv_head=G, head_dim=d_head, d_mlp=int(d_ff) if d_ff else None, family="hf",
            norm=arch.norm, positions=arch.positions, mlp="swiglu" if arch.mlp == "swiglu" else "gelu",
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            sliding_window=int(window) if isinstance(window, int) and window > 0 else None,
            hf_model_type=arch.model_type, attn_scale=arch.scale, attn_softcap=arch.softcap,
            v_head_dim=d_v if d_v != d_head else None, kv_latent_dim=latent[0] if latent else None,
            rope_key_dim=latent[1] if latent else None, attn_sinks=any(self._sinks),
            mixers=self.mixer_names if any(self.mixer_names) else None,
            state_layers=tuple(L for L, t in enumerate(self._state_templates) if t is not None or self._carried),
            kv_shared=self._kv_shared,
        )

    # -- what our GPT offers too ----------------------------------------------------------------------
    @property
    def identity(self) -> ModelIdentity:
        known = self._identity  # read once: another thread may resolve it meanwhile
        if isinstance(known, PendingIdentity):  # set by the loaders: the files' hash may still be going on
            known = self._identity = known.result()
        if known is not None:
            return known
        return computed_identity(self, f"hf:{self.architecture.model_type}", self.config.to_dict(), weights=self.hf,
                                 digest=lambda: parameters_digest(self.hf, tensors=_state_items(self.hf)))

    @identity.setter
    def identity(self, value: ModelIdentity | PendingIdentity) -> None:
        self._identity = value

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.hf.parameters())

    @property
    def offloaded(self) -> dict[str, str]:
        """Where accelerate placed each part of a model loaded with ``max_memory`` (``hf_device_map``: module
        path → "cpu", a GPU index or "disk"); empty for a model wholly in memory."""
        return {k: str(v) for k, v in (getattr(self.hf, "hf_device_map", None) or {}).items()}

    @property
    def input_device(self) -> torch.device:
        """Where token ids go (``_token_device``)."""
        return _token_device(self.hf)

    def new_cache(self, batch_size: int = 1, storage: str = "model") -> KVCache:
        if any(t is not None for t in self._state_templates) or any(self.mixer_names) or self._kv_shared:
            # a hybrid model, or one whose KV-sharing layers append no K, V rows (they count as updated)
            readers = {L for L, _ in self._kv_shared}
            return StateCache(self.config.n_layer, batch_size, storage, self._state_templates,
                              set(self.config.attention_layers) - readers)
        return KVCache(self.config.n_layer, batch_size, storage)

    @property
    def w_u(self) -> torch.Tensor:
        """The unembedding as ``[V, d]``: lm_head's weight (read from the offload folder when accelerate
        offloaded it)."""
        return _materialized(self.hf.get_output_embeddings(), "weight")

    def unembed_residual(self, x: torch.Tensor) -> torch.Tensor:
        """Logits from a residual stream ``[..., d]``: the final norm, lm_head, and what the model's head does
        after it where its config says so — Granite's ``logits_scaling`` (÷), Cohere's ``logit_scale`` (×),
        Gemma 2's ``final_logit_softcapping``. (The logit lens checks that this reproduces the recorded logits
        from the last block's output, and refuses a model where it does not.)"""
        if self.ln_final is None:
            raise HFDecoderError("this model's final norm was not found: the logit lens cannot apply it")
        logits = self.hf.get_output_embeddings()(self.ln_final(x))
        cfg = _text_config(self.hf.config)
        if isinstance(getattr(cfg, "logits_scaling", None), (int, float)):
            logits = logits / cfg.logits_scaling
        if isinstance(getattr(cfg, "logit_scale", None), (int, float)):
            logits = logits * cfg.logit_scale
        cap = getattr(cfg, "final_logit_softcapping", None)
        return torch.tanh(logits / cap) * cap if cap else logits

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, *,
                padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, n, V]`` for token ids ``[B, n]``, as ``GPT.forward`` (positions count real tokens)."""
        check_tokens(self.config, tokens, cache)
        tokens = tokens.to(self.input_device)
        B, n = tokens.shape
        past = cache.length if cache is not None else 0
        if padding_mask is not None:
            padding_mask = padding_mask.to(device=tokens.device, dtype=torch.bool)
        positions, key_is_token = positions_and_keys(B, n, past, padding_mask, cache, tokens.device)
        attention_mask = key_is_token.long() if key_is_token is not None else None
        if attention_mask is None and cache is None and tokens.is_meta:  # a dry run without a cache: as in the
            attention_mask = torch.ones(B, n, dtype=torch.long, device=tokens.device)  # routing check
        before = getattr(_forward, "keys", None)
        _forward.keys = (key_is_token,)
        with transaction(cache, n, key_is_token), _restored(before):
            # positions count real tokens; a family whose embeddings derive positions from the ids themselves
            # (RoBERTa's padding_idx + 1 + …) gets them only with padding, else its own default applies
            own = self._own_positions and key_is_token is None
            calls = self._attention_calls(self.blocks) if self._routing_unchecked else None
            out = self.hf(input_ids=tokens, attention_mask=attention_mask,
                          position_ids=None if own else positions.expand(B, n),
                          **{self._cache_keyword: (cache.carried if isinstance(cache, StateCache) and self._carried else
                                                   self._cache_view(cache)) if cache is not None else None},
                          use_cache=cache is not None, return_dict=True)
            if calls is not None:  # a dry run's first forward: the routing check __init__ left to it
                self._routed(self.blocks, calls)
                self._routing_unchecked = False
            logits = self.hook_logits(out.logits)
            if isinstance(cache, StateCache) and self._carried:  # RWKV: the state it handed back, kept for the next
                cache.carried = list(getattr(out, "state", None) or [])  # step (and snapshotted at commit)
            if isinstance(cache, StateCache):
                self._record_states(cache)
        return logits

    def _record_states(self, cache: StateCache) -> None:
        """A hybrid model's convolution and state-space state after this forward, through each state layer's
        ``hook_conv_state`` / ``hook_ssm_state`` (copies: transformers overwrites the state in place next step)."""
        if cache.carried:  # RWKV: per layer its slice of each state tensor; token shifts [B, d, 2], the rest [B, d, k]
            shifts, rest = cache.carried[:2], cache.carried[2:]
            for layer, block in enumerate(self.blocks):
                cast(HookPoint, block.hook_conv_state)(torch.stack([x[..., layer] for x in shifts], dim=-1).clone())
                if rest:
                    cast(HookPoint, block.hook_ssm_state)(torch.stack([x[..., layer] for x in rest], dim=-1).clone())
        for layer, state in cache.states.items():
            block = self.blocks[layer]
            for name, values in (("hook_conv_state", state.conv_states), ("hook_ssm_state", state.recurrent_states)):
                value = values.get(0)
                if isinstance(value, torch.Tensor) and isinstance(getattr(block, name, None), HookPoint):
                    getattr(block, name)(value.clone())

    def _cache_view(self, cache: KVCache) -> Any:
        """transformers' cache over ``cache``, with the latent-attention layers' hooks where the model has them."""
        latent: list[_AttentionHooks | None] = [cast(_AttentionHooks, block.attn) if widths is not None else None
                                                 for block, widths in zip(self.blocks, self._latent)]
        return _cache_view(cache, self.config.n_layer, latent if any(h is not None for h in latent) else None,
                           self._own_cache)


MaxMemory = int | str | dict[int | str, int | str]  # bytes, "4GiB", or accelerate's {device: amount}


def _max_memory(max_memory: MaxMemory) -> dict[int | str, int]:
    """accelerate's ``{device: bytes}`` from what a person writes: an amount alone is the CPU's share; an
    amount is bytes (an int, or a string of digits) or a size with its unit ("2GiB", "500MB")."""
    try:
        from accelerate.utils import convert_file_size_to_int
    except ModuleNotFoundError:
        raise HFDecoderError("max_memory needs Hugging Face accelerate, which is not installed: "
                             "pip install 'gpt-shape-tracer[offload]' (or pip install accelerate)") from None

    spec = max_memory if isinstance(max_memory, dict) else {"cpu": max_memory}
    sizes: dict[int | str, int] = {}
    for device, amount in spec.items():
        try:
            size = int(amount) if isinstance(amount, str) and amount.strip().isdigit() else amount
            sizes[device] = convert_file_size_to_int(size)
            if isinstance(size, bool) or sizes[device] <= 0:
                raise ValueError("not positive")
        except (ValueError, TypeError, AttributeError):
            raise HFDecoderError(f"max_memory for {device!r}: {amount!r} is not an amount of memory (bytes, or "
                                 "a size with its unit such as '2GiB' or '500MB')") from None
        has = _memory_of(device)
        if sizes[device] > has:  # accelerate would plan for memory that is not there, and the load fail late
            raise HFDecoderError(f"max_memory for {device!r}: {amount!r} is {sizes[device]:,} bytes, more than the "
                                 f"{has:,} bytes " + ("of this machine's memory" if device == "cpu" else
                                                      f"GPU {device} has"))
    return sizes


def _memory_of(device: int | str) -> int:
    """The bytes of memory ``device`` of max_memory has: "cpu" the machine's, an int a GPU's (refused when there
    is no such GPU or key)."""
    if device == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if isinstance(device, int) and not isinstance(device, bool):
        if not 0 <= device < torch.cuda.device_count():
            raise HFDecoderError(f"max_memory names GPU {device}, but this machine has "
                                 f"{torch.cuda.device_count()} GPU(s)")
        return torch.cuda.get_device_properties(device).total_memory
    raise HFDecoderError(f"max_memory's keys are GPU numbers (0, 1, …) and 'cpu', not {device!r}")


GUARD_PROMPT = 6  # tokens before the guard's decode step (more where a short sliding window must be passed)


@contextmanager
def _transformers_eager(hf: nn.Module):
    """transformers' own eager attention for the duration (our function again after); if the model cannot switch,
    our function stays (it computes transformers' eager numbers by construction, with our hook points idle)."""
    try:
        hf.set_attn_implementation("eager")  # type: ignore[operator]
    except (ValueError, KeyError, AttributeError, TypeError):
        yield
        return
    try:
        yield
    finally:
        hf.set_attn_implementation(ATTENTION)  # type: ignore[operator]


def guard_against_transformers(model: HFDecoder) -> None:
    """No silent difference: one decode step with our cache, compared with transformers' own forward on the same
    tokens — without a cache (what the model computes) and with its own cache (what its generate() runs).

    Ours differs from both: refused with the numbers. Ours equals the uncached forward but transformers' own
    cached path differs (moshi past its sliding window): loaded, and ``model.reference_note`` says which one the
    trace follows and by how much the other differs."""
    from gpt_shape_tracer.model.sources._common import logit_tolerance

    hf = model.hf
    window = model.config.sliding_window
    n = window + 2 if window is not None and window + 2 <= 64 else GUARD_PROMPT
    n = min(n, model.config.n_ctx - 1)
    tokens = (torch.arange(n + 1, device=model.input_device) * 7 + 3)[None] % model.config.vocab_size  # [1, n+1]
    tolerance = logit_tolerance(next(hf.parameters()).dtype)
    with torch.no_grad():
        cache = model.new_cache()
        model(tokens[:, :n], cache)
        ours = model(tokens[:, n:], cache)[0, -1].float()  # [V]
        with _transformers_eager(hf):
            uncached = hf(input_ids=tokens, use_cache=False).logits[0, -1].float()
            keyword = cache_keyword(hf)
            past = getattr(hf(input_ids=tokens[:, :n], use_cache=True), keyword, None)
            if past is None:  # RecurrentGemma: the state lives in its modules, set up by the forward itself
                raise HFDecoderError(
                    f"{model.architecture.model_type}: its forward returns no cache object — it keeps its recurrent "
                    "state inside its own modules, where our cache can neither hold, copy nor roll it back, so a "
                    "cached decode step cannot be traced", reason="state layers")
            cached = hf(input_ids=tokens[:, n:], **{keyword: past}, use_cache=True).logits[0, -1].float()
    to_uncached = float((ours - uncached).abs().max())
    to_cached = float((ours - cached).abs().max())
    name = model.architecture.model_type
    if to_uncached > tolerance and to_cached > tolerance:
        raise HFDecoderError(
            f"{name}: a decode step after {n} tokens differs from transformers' own forward on the same tokens by "
            f"{to_uncached:.3g} (without a cache) and {to_cached:.3g} (with its cache), beyond {tolerance:g}: the "
            "trace would not show what this model computes", reason="differs from transformers")
    if to_cached > tolerance:
        model.reference_note = (
            f"transformers' own cached forward of {name} differs from its uncached forward (by {to_cached:.3g} in the "
            f"logits of a decode step after {n} tokens); the trace follows the uncached forward (within "
            f"{to_uncached:.1g}), what the model computes for the whole text")
    elif to_uncached > tolerance:
        model.reference_note = (
            f"transformers' own uncached forward of {name} differs from its cached forward (by {to_uncached:.3g} in "
            f"the logits of a decode step after {n} tokens); the trace follows the cached forward (within "
            f"{to_cached:.1g}), what its generate() runs")


def load_hf_decoder(path: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                    device: torch.device | str = "cpu", name: str | None = None,
                    max_memory: MaxMemory | None = None, offload_folder: str | os.PathLike | None = None) -> HFDecoder:
    """A local ``save_pretrained`` directory of any transformers causal LM, as an ``HFDecoder``.

    ``max_memory`` (bytes, "4GiB", or accelerate's ``{0: "20GiB", "cpu": "30GiB"}``) loads a model larger than
    the memory it is given: accelerate places each layer on a GPU, in CPU memory or on disk within those
    amounts (``device_map="auto"``) and moves its weights in for its forward only. Disk-offloaded weights go
    to ``offload_folder`` — by default a private temporary directory deleted with the model. The logits and
    every record are the same as with every weight in memory; each forward reads the offloaded weights again.

    Never downloads (``local_files_only``), never runs code from the directory (``trust_remote_code`` off)."""
    directory = Path(path)
    # the identity's hash of every file runs on a second thread while transformers is imported and loads,
    # and goes on after the load returns: the first traced step waits for what is left of it, if anything
    try:
        digest = BackgroundDigest(_digest_files(directory), by_name=True)
    except OSError as e:
        raise HFDecoderError(f"{directory}: cannot be read ({e})") from None
    try:
        model = _load_hf_decoder(directory, digest, dtype, device, name, max_memory, offload_folder)
    except BaseException:
        digest.abandon()  # a refused or failed load leaves no thread reading a large directory for nothing
        raise
    weakref.finalize(model, digest.abandon)  # nor does a model dropped before its hash is done
    return model


def _load_hf_decoder(directory: Path, digest: BackgroundDigest, dtype: torch.dtype | str | None,
                     device: torch.device | str, name: str | None, max_memory: MaxMemory | None,
                     offload_folder: str | os.PathLike | None) -> HFDecoder:
    from transformers import AutoConfig, AutoModelForCausalLM

    dtypes = {None: torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    target = dtypes.get(dtype, dtype) if not isinstance(dtype, torch.dtype) else dtype
    try:
        hf_config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - no code of the directory's runs: any error is a config it refuses
        # (huggingface_hub's StrictDataclassClassValidationError, for one, is no ValueError)
        raise HFDecoderError(f"{directory}: transformers cannot read its config ({type(e).__name__}: "
                             f"{str(e)[:500]})") from None
    model_type = getattr(hf_config, "model_type", "?")
    refusal = refusal_by_config(hf_config, model_type)
    if refusal is not None:
        raise HFDecoderError(f"{directory}: {refusal}", reason=refusal.reason)
    _check_config_against_weights(directory, hf_config)  # before anything is built
    placement: dict[str, Any] = {}
    folder = None
    if max_memory is not None:
        if torch.device(device).type != "cpu":
            raise HFDecoderError("with max_memory, accelerate places the model: name the GPUs in it "
                                 "({0: '20GiB', 'cpu': '30GiB'}) instead of passing device")
        amounts = _max_memory(max_memory)  # before the folder: a refused amount leaves nothing behind
        if offload_folder is None:
            folder = tempfile.mkdtemp(prefix="gpt-shape-tracer-offload-")  # 0700: only this user reads it
        placement = {"device_map": "auto", "max_memory": amounts, "offload_folder": str(offload_folder or folder)}
    _register()
    try:
        try:
            hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, trust_remote_code=False,
                                                      dtype=target, attn_implementation=ATTENTION, **placement)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, AttributeError, AssertionError,
                ImportError, IndexError) as e:  # transformers' own code failing on this directory: a refusal
            raise HFDecoderError(f"{directory}: transformers cannot load it as a causal LM "
                                 f"({type(e).__name__}: {str(e)[:500]})", reason="cannot load") from None
        if not placement:
            # transformers declares PreTrainedModel.to as functools.wraps(nn.Module.to), whose typeshed type
            # keeps the unbound method's self: mypy reads every call as one argument short
            hf = hf.to(device)  # type: ignore[arg-type]
        model = HFDecoder(hf)
        if model.input_device.type != "meta":
            guard_against_transformers(model)
    except BaseException:  # a failed load leaves no offload folder behind
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    if folder is not None:
        weakref.finalize(model, shutil.rmtree, folder, True)
    model.identity = PendingIdentity(digest, name=name or directory.name, source=str(directory),
                                     family=f"hf:{model_type}", config=model.config.to_dict())
    return model


_LAYER_KEY = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def _check_config_against_weights(directory: Path, hf_config: Any) -> None:
    """What transformers would build without complaint but should not: a config whose sizes the weights do not
    back (600 layers over weights holding 2: 598 layers of random numbers, built for a minute), no attention
    heads (a division by zero later), a boolean written as a string (``"false"`` is truthy and ties). The layer
    count is read from the safetensors headers' names only."""
    try:  # transformers has just read it
        raw = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        raw = {}
    raw = raw if isinstance(raw, dict) else {}
    for flag in ("tie_word_embeddings", "use_cache", "attention_bias", "mlp_bias"):
        if flag in raw and not isinstance(raw[flag], bool):
            raise HFDecoderError(f"{directory / 'config.json'}: {flag} must be true or false, got {raw[flag]!r}")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for name in ("num_attention_heads", "num_hidden_layers", "hidden_size", "vocab_size"):
        value = getattr(text, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise HFDecoderError(f"{directory / 'config.json'}: {name} must be a positive whole number, got "
                                 f"{value!r}")
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None)
    if isinstance(kv_heads, int) and isinstance(heads, int) and (kv_heads < 1 or heads % kv_heads):
        raise HFDecoderError(f"{directory / 'config.json'}: num_key_value_heads = {kv_heads} does not divide "
                             f"num_attention_heads = {heads}")
    layer_types = getattr(text, "layer_types", None)
    n_layer = getattr(text, "num_hidden_layers", None)
    if isinstance(layer_types, (list, tuple)) and isinstance(n_layer, int) and len(layer_types) != n_layer:
        raise HFDecoderError(f"{directory / 'config.json'}: layer_types lists {len(layer_types)} layers, "
                             f"num_hidden_layers says {n_layer}")
    files = sorted(directory.glob("*.safetensors"))
    if not isinstance(n_layer, int) or not files:
        return
    from safetensors import safe_open

    held: set[int] = set()
    try:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                held.update(int(m.group(1)) for key in f.keys() if (m := _LAYER_KEY.search(key)))  # noqa: SIM118
    except (OSError, ValueError, RuntimeError) as e:  # safetensors raises its own SafetensorError (a RuntimeError)
        raise HFDecoderError(f"{directory}: the weights' headers cannot be read ({e})") from None
    if not held or n_layer <= len(held):
        return
    # the config claims more layers than the headers name: count the layers the config builds (on the meta device:
    # no memory, no initialisation), named as the weights are — a family whose layers sit in several lists
    # (hrm_text's H and L stacks) is compared list for list, not with num_hidden_layers
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(hf_config)
    except Exception:  # noqa: BLE001 - transformers refusing the config is reported where the model is built
        return
    expected = {int(m.group(1)) for key in built.state_dict() if (m := _LAYER_KEY.search(key))}
    if len(expected) > len(held):
        raise HFDecoderError(f"{directory / 'config.json'}: the config builds {len(expected)} layers "
                             f"(num_hidden_layers = {n_layer}), but the weights hold {len(held)} "
                             f"({min(held)} … {max(held)}): refused before loading (the rest would be random "
                             "numbers)", reason="weights missing")


def weights_size(directory: str | os.PathLike, dtype: torch.dtype | str = "float32") -> tuple[int, int]:
    """``(parameters, bytes in dtype)`` of a directory's safetensors weights, read from their headers only:
    what loading will hold, stated before anything is loaded. (0, 0) when there are no safetensors files."""
    from safetensors import safe_open

    itemsize = torch.empty(0, dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype).element_size()
    count = 0
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                count += int(torch.Size(f.get_slice(key).get_shape()).numel())
    return count, count * itemsize


def _digest_files(directory: Path) -> list[Path]:
    """What the identity of a directory run by transformers hashes: its config and weight files, by name."""
    return [file for file in sorted(directory.iterdir())
            if (file.name == "config.json" or file.suffix in (".safetensors", ".bin")) and file.is_file()]


def is_hf_decoder_dir(directory: Path) -> bool:
    """Whether a directory's config.json names a transformers model type (any)."""
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and isinstance(raw.get("model_type"), str)


__all__ = ["ATTENTION", "Architecture", "HFDecoder", "HFDecoderError", "MaxMemory", "is_hf_decoder_dir",
           "load_hf_decoder", "traced_attention", "weights_size"]
