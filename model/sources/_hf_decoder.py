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

* ``hook_compressed_kv_all``, ``hook_compressed_mask``, ``hook_index_keys_all``, ``hook_index_scores``,
  ``hook_index_selected``, ``hook_window_kv`` … (compressed attention: DeepSeek-V4): the compressed K = V entries the
  attention reads after its window's rows, the compressor's block bias, the CSA indexer's keys, scores and choice,
  and what the family's own cache layers hold after each step (``CompressedCache`` keeps those layers;
  model/sources/_hf_compressed.py lists the records). Not in the hook table: their widths are V4's own.
* ``hook_score_bias`` (Inkling, Inkling 2: a learned relative position bias handed to the attention function beside
  the mask): ``[B|1, H, n, t]``, a stage between the scores and the mask (masked scores = scores + bias + M); Inkling
  2's sink logits, one per head and query, are the extra softmax column as gpt-oss's (model/sources/_hf_variants.py).
* One block per attention call where a layer calls attention more than once per forward (``call_blocks``): HRM's
  layers, run several times per forward (each run its own cache slot), and LongCat-Flash's two attention sublayers
  per layer are blocks of their own, in the order of the calls, which is the order of the cache slots they write.
* One block per call where attention runs in several lists of layers (BLT: model/sources/_hf_stacks.py), each named
  by its layer's path (``GPTConfig.block_paths``, ``cross_blocks``), traced without a cache (``no_cache_reason``).
* State kept outside transformers' ``Cache`` (``HeldState``): RecurrentGemma's in attributes of its recurrent
  blocks, xLSTM's in its family's own cache object — held in ``StateCache`` (set where the model reads it before every
  forward, read back after), recorded as ``hook_conv_state`` / ``hook_ssm_state``.

The attention is found by what it does (``_find_attention``): a two-token forward records which module calls
the attention function inside which element of which list of layers; the list the calls come from is the
decoder stack (a vision tower not run for text never is), each layer's one caller its attention. A model that makes
no attention call at all but whose every layer writes state into transformers' cache (Mamba, Mamba-2,
Falcon-Mamba: ``_state_stack``) is traced as mixers only: no attention record, no K, V row, the state in
``StateCache``; its forward takes the cache as ``cache_params`` (``cache_keyword``).
A family whose attention module computes the softmax in its own code (Bloom, MPT, CodeGen, XGLM, the BERT-style
decoders …) makes no call of the attention function: its attention is found by what its ops do and recorded under the
same hook names (``model/sources/_hf_own_attention.py``; ``OwnAttention`` watches each such module's forward), and
the model then runs transformers' eager path, mask included; ``hook_score_bias`` holds a bias such as ALiBi.

A forward that takes no cache (OpenAI GPT) runs without one, every step a full forward; XLM's own ``cache=``, which
wants the whole text, is ours too; CPM-Ant, whose forward puts learned prompt positions before the text and whose mask
lets every position see every other, runs without one too, every record over positions holding its P prompt positions
first (``GPTConfig.prompt_positions``, ``GPTConfig.bidirectional``; ``model/sources/_hf_own_cache.py``).

Refused, with a ``RefusalReason``: own-code attention that does not read as one softmax attention, linear-attention
and state-space layers our cache cannot hold beside K and V, several attention calls per layer (but differential
attention's two calls with the same Q and K, and calls that are one block each: ``call_blocks``), attention in several
stacks of layers not one call per element, or with different heads or widths, encoders and encoder-decoders; and,
after loading, a model whose cached decode step is not transformers' own forward (``guard_against_transformers``). """

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import (
    GPTConfig,
    HookPoint,
    KVCache,
    ModelIdentity,
    PendingIdentity,
    check_tokens,
    computed_identity,
    parameters_digest,
    positions_and_keys,
    transaction,
)
from gpt_shape_tracer.model.sources import _hf_stacks as several  # BLT: attention in several lists of layers
from gpt_shape_tracer.model.sources._hf_attention import (
    _HOOKS,
    ATTENTION,
    _AttentionHooks,
    _forward,
    _register,
    _restored,
    differential_lambda,
)
from gpt_shape_tracer.model.sources._hf_cache import HeldHidden, StateCache, _cache_view, latent_widths, state_templates
from gpt_shape_tracer.model.sources._hf_compressed import CompressedCache, add_hooks, compressed_config, record_held
from gpt_shape_tracer.model.sources._hf_indexer import indexer_of, watch_indexer
from gpt_shape_tracer.model.sources._hf_own_attention import OwnAttention
from gpt_shape_tracer.model.sources._hf_own_cache import (
    no_cache_reason,
    padding_refusal,
    permutation_reason,
    prompt_positions,
    prompt_reason,
    takes_whole_text,
    whole_text,
)
from gpt_shape_tracer.model.sources._hf_probe import (
    _NAMES_FINAL_NORM,
    _NAMES_OUT,
    _accelerate_hooks,
    _Call,
    _child,
    _find_attention,
    _guess_architecture,
    _indexer_key_dim,
    _keeps_linear_state,
    _kv_shared,
    _own_cache_class,
    _text_config,
    _token_device,
    cache_keyword,
    mixer_name,
    mixer_of,
    mlp_norm_of,
    mlp_of,
    permutation_lm,
    sees_ahead,
)
from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError, _special_cache_layers, refusal_by_config
from gpt_shape_tracer.model.sources._hf_residual import _RESIDUAL_POINTS, _plain_residual
from gpt_shape_tracer.model.sources._hf_variants import (
    HeldState,
    OwnCacheState,
    Reentry,
    block_origins,
    install_sublayer,
    join_states,
    module_state,
    own_cache_state,
    split_layers,
)
from gpt_shape_tracer.model.sources._tensor_parallel import TensorParallelPlan

if TYPE_CHECKING:  # transformers is imported where it is used: loading our own models never needs it
    from transformers import PreTrainedModel

def _eager_masks(hf: nn.Module) -> None:
    """transformers' eager path for a model whose attention is the family's own code: its masks built by
    ``eager_mask``, never left unbuilt. Written into every config the model holds, since these families do not take
    ``set_attn_implementation`` (they warn and keep the implementation they were loaded with)."""
    for module in hf.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", "eager") != "eager":
            config._attn_implementation = "eager"


# -- the model ------------------------------------------------------------------------------------------
class _BlockHooks(nn.Module):
    def __init__(self, softcap: bool, has_mid: bool, latent: bool = False, sinks: bool = False,
                 attention: bool = True, differential: bool = False, indexed: bool = False,
                 score_bias: bool = False) -> None:
        super().__init__()
        self.hook_resid_pre = HookPoint()  # [B, n, d]
        if attention:
            self.attn = _AttentionHooks(softcap, latent, sinks, differential, indexed, score_bias)
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
    if isinstance(output, tuple):  # a named tuple stays one (Reformer's attention outputs are read by field)
        return type(output)(value, *output[1:]) if hasattr(output, "_fields") else (value, *output[1:])
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
        # a layer whose attention the family computes in its own code (Bloom, MPT, CodeGen …): read from its ops,
        # which then run as transformers' eager path runs them (its mask included: eager_mask, never left unbuilt)
        own = [call is not None and call.own is not None for call in probed]
        self._own_code = any(own)
        if any(own):
            _eager_masks(hf)
        # OpenAI GPT keeps no cache (every step a full forward, as its generate() runs it); XLM keeps its own under
        # cache= and takes the whole text (model/sources/_hf_own_cache.py)
        self.no_cache_reason = no_cache_reason(hf, model_type, cache_keyword(hf))
        self._whole_text = takes_whole_text(cache_keyword(hf))
        self._kv_shared = _kv_shared(probed)  # (layer, source): layers attending over another layer's K and V
        # a hybrid's first attention layer may come after a state layer; a state-space model (Mamba) has none
        first = next((L for L, attn in enumerate(attns) if attn is not None), None)
        self.architecture = _guess_architecture(hf, layers[first or 0], attns[first] if first is not None else None,
                                                model_type)
        # CPM-Ant: learned prompt positions before the text in every forward, every position seeing every other; traced
        # without a cache, each step a full forward of the whole text (model/sources/_hf_own_cache.py)
        first_call = probed[first] if first is not None else None
        self.prompt_positions = prompt_positions(first_call)
        self.bidirectional = first_call is not None and (bool(self.prompt_positions) or permutation_lm(hf)) \
            and sees_ahead(first_call.mask)
        if self.prompt_positions:
            self.no_cache_reason = prompt_reason(model_type, self.prompt_positions, self.bidirectional)
        elif self.bidirectional:  # XLNet's attn_type "bi"
            self.no_cache_reason = permutation_reason(model_type)
        if first is not None and own[first]:  # the scale its ops apply (XGLM scales its queries: 1)
            self.architecture = replace(self.architecture, scale=cast(_Call, probed[first]).own.scale)
        arch = self.architecture
        mlp_norms = [None if arch.parallel_block else mlp_norm_of(layer) for layer in layers]
        self._latent = [latent_widths(attn) if attn is not None else None for attn in attns]  # (d_c, d_R) or None
        # gpt-oss (a sinks parameter), Inkling 2 (sink logits projected per position, handed over as sinks=)
        self._sinks = [isinstance(getattr(attn, "sinks", None), torch.Tensor) or (call is not None and call.sinks)
                       for attn, call in zip(attns, probed)]
        self._state_templates = state_templates(hf)  # hybrid models: the layers whose state transformers keeps
        if len(self._state_templates) != len(layers):
            self._state_templates = [None] * len(layers)
        self._carried = all(attn is None for attn in attns) and not writers and cache_keyword(hf) == "state"
        # state kept outside transformers' Cache (_hf_variants.py): xLSTM's own cache object, RecurrentGemma's
        # module attributes; held in StateCache's carried tensors
        device, keyword = _token_device(hf), cache_keyword(hf)
        # XLNet's, Reformer's cache: each layer's input hidden states, not K, V
        self._mems = HeldHidden(cfg, keyword) if keyword in ("mems", "past_buckets_states") else None
        own_state = own_cache_state(hf, {id(layers): layers}, device, keyword) if not self._carried and not writers \
            and all(attn is None for attn in attns) else None
        self._held: HeldState | None = own_state[1] if own_state is not None else module_state(
            hf, layers, [L for L, attn in enumerate(attns) if attn is None and L not in writers], device)
        own_cache = _own_cache_class(hf)
        # MiniMax: its forward accepts only its own cache class, whose linear-attention state our view keeps in the
        # state layers transformers' shared cache describes for the config (one per layer without attention)
        self._cache_keyword = cache_keyword(hf)
        # most families unembed only the positions asked (transformers' logits_to_keep); the rest are cut after
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(hf.forward).parameters
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
        # indexed (sparse) attention: the layers transformers gives an indexer key cache and whose attention has an
        # indexer of its own (a GLM-5 "shared" layer reuses the previous layer's choice and keeps no such keys)
        indexers = [indexer_of(attn) if attn is not None else None for attn in attns]
        cached_index = set(_special_cache_layers(hf.config)[0])
        self._indexed = tuple(L for L, ix in enumerate(indexers) if ix is not None and L in cached_index)
        block_hooks = [_BlockHooks(arch.softcap is not None, norm is not None, latent is not None, sinks,
                                   attention=attn is not None, differential=diff, indexed=ix is not None or (
                                       attn is not None and bool(cached_index) and L in cached_index),
                                   score_bias=call is not None and call.score_bias)
                       for L, (norm, latent, sinks, attn, diff, ix, call) in enumerate(
                           zip(mlp_norms, self._latent, self._sinks, attns, differential, indexers, probed))]
        self.blocks = nn.ModuleList(block_hooks)
        self._compressed = compressed_config(hf.config)  # its own cache layers compress K/V (_hf_compressed.py)
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
            if template is not None or self._carried or self._held is not None:  # what the layer's state holds after
                # each step, [B, …]
                hooks.hook_conv_state = HookPoint()
                hooks.hook_ssm_state = HookPoint()
            if self._mems is not None:  # the hidden states the layer keeps after each step, [B, m, d]
                hooks.hook_mems = HookPoint()
        # HRM: its layers run several times per forward, one block per run: each block's hooks on a shared module act
        # in that block's run only; LongCat-Flash: two attention sublayers per layer, one block each, whose residual
        # hooks sit on the sublayer's own modules (_hf_variants.py)
        reentry, sublayers = Reentry(layers, attns), split_layers(list(layers), attns)
        self.block_origins = block_origins(hf, layers, attns)  # what each block is, where a layer holds several
        self.stacks = several.stack_of_blocks(hf, layers, attns)  # BLT: the list of layers each block is in
        self.block_origins = several.with_stacks(self.stacks, self.block_origins, block_hooks)
        # BLT: its lists of layers keep caches that are not one K, V slot per block (model/sources/_hf_stacks.py)
        self.no_cache_reason = self.no_cache_reason or several.no_cache_reason(model_type, self.stacks)
        if reentry.active:
            self._handles += reentry.install(hf, layers, attns, _HOOKS, [getattr(b, "attn", None) for b in block_hooks])
        for block, (layer, attn, mixer, hooks, mlp_norm, call) in enumerate(zip(layers, attns, self._mixers,
                                                                                block_hooks, mlp_norms, probed)):
            gated = reentry.gate(layer, block)
            sub = sublayers.get(block)
            own_code = call is not None and call.own is not None
            if sub is not None:
                self._handles += install_sublayer(sub, hooks)
            else:
                self._handles.append(layer.register_forward_pre_hook(gated(self._pre_layer(hooks)), with_kwargs=True))
                self._handles.append(layer.register_forward_hook(gated(
                    lambda m, a, out, h=hooks: _replace_first(out, h.hook_resid_post(_first(out))))))
            if attn is not None and own_code:  # its forward's ops watched, before hook_attn_out reads its output
                self._handles.extend(OwnAttention(attn, hooks.attn, model_type,
                                                  bias=cast(_Call, call).own.bias is not None).handles)
            elif attn is not None:
                _HOOKS[attn] = hooks.attn
                if (indexer := indexer_of(attn)) is not None:
                    self._handles.extend(watch_indexer(indexer, hooks.attn))
            if attn is not None:
                hooks.attn.w_o = _child(attn, _NAMES_OUT)
                if self._compressed:  # DeepSeek-V4: its compressed K/V, indexer and what its cache holds
                    self._handles.extend(add_hooks(hooks.attn, attn))
                if hasattr(hooks.attn, "hook_diff_pattern"):  # differential attention: its λ from its own parameters
                    hooks.attn.differential = differential_lambda(attn)
                self._handles.append(attn.register_forward_hook(gated(
                    lambda m, a, out, h=hooks: _replace_first(out, h.hook_attn_out(_first(out))))))
            elif mixer is not None:
                self._handles.append(mixer.register_forward_pre_hook(gated(
                    lambda m, args, kwargs, h=hooks: _through_first_input(h.hook_mixer_in, args, kwargs)),
                    with_kwargs=True))
                self._handles.append(mixer.register_forward_hook(gated(
                    lambda m, a, out, h=hooks: _replace_first(out, h.hook_mixer_out(_first(out))))))
            mlp = mlp_of(layer) if sub is None else None
            if mlp is not None:
                self._handles.append(mlp.register_forward_hook(gated(
                    lambda m, a, out, h=hooks: _replace_first(out, h.hook_mlp_out(_first(out))))))
            if mlp_norm is not None and sub is None:
                self._handles.append(mlp_norm.register_forward_pre_hook(gated(
                    lambda m, args, h=hooks: (h.hook_resid_mid(args[0]), *args[1:]))))
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
        several.refuse_unequal_heads(model_type, self.stacks, block_hooks, attns)
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
        width = int(cfg.hidden_size) if hasattr(cfg, "hidden_size") else several.stacks_width(self.hf)
        H, G, d_head, d_v = first.seen if first is not None else (1, 1, width, width)
        latent = next((widths for widths in self._latent if widths is not None), None)
        d_ff = next((getattr(cfg, name) for name in ("intermediate_size", "n_inner", "ffn_dim", "dim_ff")  # CPM-Ant:
                     if getattr(cfg, name, None)), None)  # dim_ff
        if isinstance(d_ff, (list, tuple)):  # one width per layer (Gemma 3n): one number only where they agree
            d_ff = d_ff[0] if len(set(d_ff)) == 1 else None
        n_ctx = int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048)
        n_ctx = (self._mems.n_ctx if self._mems is not None else None) or n_ctx  # XLNet: as far as its mems keep
        window = getattr(cfg, "sliding_window", None)
        return GPTConfig(
            vocab_size=int(cfg.vocab_size), n_ctx=n_ctx, d_model=width,
            n_layer=len(self.blocks),
            n_head=H, n_kv_head=G, head_dim=d_head, d_mlp=int(d_ff) if d_ff else None, family="hf",
            norm=arch.norm, positions=arch.positions, mlp="swiglu" if arch.mlp == "swiglu" else "gelu",
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            sliding_window=int(window) if isinstance(window, int) and window > 0 else None,
            hf_model_type=arch.model_type, attn_scale=arch.scale, attn_softcap=arch.softcap,
            v_head_dim=d_v if d_v != d_head else None, kv_latent_dim=latent[0] if latent else None,
            rope_key_dim=latent[1] if latent else None, attn_sinks=any(self._sinks),
            mixers=self.mixer_names if any(self.mixer_names) else None,
            state_layers=tuple(L for L, t in enumerate(self._state_templates) if t is not None or self._carried
                               or (self._held is not None and L in self._held.layers)),
            kv_shared=self._kv_shared,
            indexed_layers=tuple(L for L, block in enumerate(self.blocks)
                                 if hasattr(getattr(block, "attn", None), "hook_index_selected")),
            indexer_key_dim=_indexer_key_dim(cfg) if self._indexed else None,
            block_paths=tuple(b.path for b in self.stacks) if self.stacks is not None else (),
            cross_blocks=tuple(L for L, b in enumerate(self.stacks or ()) if b.cross),
            prompt_positions=self.prompt_positions, bidirectional=self.bidirectional,
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
        if self.no_cache_reason is not None:
            raise HFDecoderError(f"{self.no_cache_reason}: every step recomputes all positions (turn the cache off)")
        if self._compressed:
            return CompressedCache(self.config.n_layer, batch_size, storage, self.hf.config)
        if self._mems is not None:  # no layer appends K, V rows: each keeps its input hidden states (carried)
            return self._mems.new_cache(self.config.n_layer, batch_size, storage, self._state_templates, self._indexed)
        if any(t is not None for t in self._state_templates) or any(self.mixer_names) or self._kv_shared:
            # a hybrid model, or one whose KV-sharing layers append no K, V rows (they count as updated)
            readers = {L for L, _ in self._kv_shared}
            return StateCache(self.config.n_layer, batch_size, storage, self._state_templates,
                              set(self.config.attention_layers) - readers, self._indexed)
        return KVCache(self.config.n_layer, batch_size, storage, self._indexed)

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
                padding_mask: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits ``[B, n, V]`` for token ids ``[B, n]``, as ``GPT.forward`` (positions count real tokens;
        ``logits_to_keep`` k > 0: the last k positions' ``[B, k, V]``, handed to a family that takes the argument,
        else its logits cut to them)."""
        if cache is not None and self.no_cache_reason is not None:
            self.new_cache()  # raises, saying why
        check_tokens(self.config, tokens, cache, logits_to_keep)
        tokens = tokens.to(self.input_device)
        B, n = tokens.shape
        past = cache.length if cache is not None else 0
        if padding_mask is not None:
            padding_mask = padding_mask.to(device=tokens.device, dtype=torch.bool)
            if self.prompt_positions and (padding_mask.is_meta or not bool(padding_mask.all())):
                raise HFDecoderError(padding_refusal(self.architecture.model_type))  # CPM-Ant reads no mask
        positions, key_is_token = positions_and_keys(B, n, past, padding_mask, cache, tokens.device)
        attention_mask = key_is_token.long() if key_is_token is not None else None
        if self._mems is not None and cache is not None:  # XLNet's mems keep no padding mask (a full forward
            self._mems.check(key_is_token)  # keeps none: its mask holds every key)
        if attention_mask is None and cache is None and tokens.is_meta:  # a dry run without a cache: as in the
            attention_mask = torch.ones(B, n, dtype=torch.long, device=tokens.device)  # routing check
        elif attention_mask is None and self.bidirectional and not self.prompt_positions:
            # XLNet's attn_type "bi" applies no mask unless given one: given one hiding nothing, its own code applies
            # (and the trace records) the mask it means — every position seeing every other — the logits unchanged
            attention_mask = torch.ones(B, n, dtype=torch.long, device=tokens.device)
        if self._own_code:  # its attention reads the mask transformers' eager path builds; our mask function may
            # leave it unbuilt (a fused path), which such a family would read as no mask at all
            _eager_masks(self.hf)
        before = getattr(_forward, "keys", None)
        # an indexer reads the mask, and a model with several stacks attends with the masks it is given: built
        _forward.keys = (key_is_token, bool(self._indexed) or self.stacks is not None)
        with transaction(cache, n, key_is_token), _restored(before):
            # positions count real tokens; a family whose embeddings derive positions from the ids themselves
            # (RoBERTa's padding_idx + 1 + …) gets them only with padding, else its own default applies
            own = self._own_positions and key_is_token is None
            calls = self._attention_calls(self.blocks) if self._routing_unchecked else None
            inputs = {"input_ids": tokens, "attention_mask": attention_mask,
                      "position_ids": None if own else positions.expand(B, n)}
            if self._whole_text:  # XLM: the ids, mask and positions of every position so far
                inputs = whole_text(tokens, past, attention_mask, inputs["position_ids"])
            kept = {"logits_to_keep": logits_to_keep} if logits_to_keep and self._takes_logits_to_keep else {}
            out = self.hf(**inputs, **kept, **{self._cache_keyword: self._passed(cache)},
                          use_cache=cache is not None, return_dict=True)
            if calls is not None:  # a dry run's first forward: the routing check __init__ left to it
                self._routed(self.blocks, calls)
                self._routing_unchecked = False
            logits = out.logits if not logits_to_keep else out.logits[:, -logits_to_keep:]  # [B,n|k,V]
            logits = self.hook_logits(logits)
            if isinstance(cache, StateCache) and self._held is not None:  # the state back into the cache
                self._held.kept(cache, out)
            if isinstance(cache, StateCache) and self._carried:  # RWKV: the state it handed back, kept for the next
                cache.carried = list(getattr(out, "state", None) or [])  # step (and snapshotted at commit)
            if isinstance(cache, StateCache) and self._mems is not None:  # XLNet: the next step's mems
                self._mems.kept(cache, out)
            if isinstance(cache, StateCache):
                self._record_states(cache)
            if isinstance(cache, CompressedCache):
                record_held(self.blocks, cache)
        return logits

    def _record_states(self, cache: StateCache) -> None:
        """A hybrid model's convolution and state-space state after this forward, through each state layer's
        ``hook_conv_state`` / ``hook_ssm_state`` (copies: transformers overwrites the state in place next step)."""
        if self._mems is not None:
            self._mems.record(cache, self.blocks)
        elif self._held is not None:
            self._held.record(cache, self.blocks)
        elif cache.carried:  # RWKV: per layer its slice of each state tensor; token shifts [B, d, 2], the rest
            # [B, d, k]
            shifts, rest = cache.carried[:2], cache.carried[2:]
            for layer, block in enumerate(self.blocks):
                cast(HookPoint, block.hook_conv_state)(torch.stack([x[..., layer] for x in shifts], dim=-1).clone())
                if rest:
                    cast(HookPoint, block.hook_ssm_state)(torch.stack([x[..., layer] for x in rest], dim=-1).clone())
        for layer, state in cache.states.items():
            block = self.blocks[layer]
            for name, values in (("hook_conv_state", state.conv_states), ("hook_ssm_state", state.recurrent_states)):
                held = [v for _, v in sorted(values.items()) if isinstance(v, torch.Tensor)]  # Inkling: 4 convolutions
                if held and isinstance(getattr(block, name, None), HookPoint):
                    getattr(block, name)(join_states(held))

    def _passed(self, cache: KVCache | None) -> Any:
        """What the forward receives under its cache keyword: our cache as transformers' ``Cache``; RWKV's carried
        state; xLSTM's own cache object, or the cache view with RecurrentGemma's module state set (``HeldState``)."""
        if cache is None:
            return None
        if isinstance(cache, StateCache) and self._mems is not None:
            return self._mems.passed(cache)
        if isinstance(cache, StateCache) and self._carried:
            return cache.carried
        view = self._cache_view(cache) if not isinstance(self._held, OwnCacheState) else None
        return self._held.passed(cache, view) if isinstance(cache, StateCache) and self._held is not None else view

    def _cache_view(self, cache: KVCache) -> Any:
        """transformers' cache over ``cache``, with the latent-attention layers' hooks where the model has them."""
        if isinstance(cache, CompressedCache):
            return cache.view()
        latent: list[_AttentionHooks | None] = [cast(_AttentionHooks, block.attn) if widths is not None else None
                                                 for block, widths in zip(self.blocks, self._latent)]
        return _cache_view(cache, self.config.n_layer, latent if any(h is not None for h in latent) else None,
                           self._own_cache, [getattr(block, "attn", None) for block in self.blocks])
