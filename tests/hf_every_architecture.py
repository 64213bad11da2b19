"""Every causal-LM ``model_type`` the installed transformers maps (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), built
as a tiny random-weight directory from its own config class with the sizes shrunk generically, loaded with
``load_hf`` and compared with transformers' own forward on the same weights.

Nothing is hand-picked: the list is transformers' own, and the shrinking knows size names, not families.
``python -m tests.hf_every_architecture [TYPE ...]`` prints one line per type and the counts."""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

# the sizes every config is shrunk to, by the names transformers' config classes give them
_WIDTH = 64
_SIZES: dict[str, int] = {
    "vocab_size": 256,
    # widths
    "hidden_size": _WIDTH, "n_embd": _WIDTH, "d_model": _WIDTH, "embed_dim": _WIDTH, "dim": _WIDTH, "n_embed": _WIDTH,
    "word_embed_proj_dim": _WIDTH, "embedding_size": _WIDTH, "d_embed": _WIDTH, "embedding_dim": _WIDTH,
    "hidden_size_global": _WIDTH,  # BLT: the width of its global transformer, which its byte-level stacks read
    # MLP widths
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128, "ffn_hidden_size": 128, "d_inner": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "ffn_config_hidden": 128, "decoder_ffn_dim": 128, "encoder_ffn_dim": 128,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_blocks": 2,
    # one stream of audio codes (MusicGen): its causal LM then reads [B, n] like a text decoder
    "num_codebooks": 1,
    # heads
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2,
    "head_dim": 16, "kv_channels": 16, "rotary_dim": 8,
    # latent attention (DeepSeek-V2/V3 and descendants)
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "kv_lora_rank": 32, "q_lora_rank": 32,
    # experts
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_k": 2, "moe_topk": 2, "n_group": 1, "topk_group": 1, "num_expert_group": 1, "num_experts_per_token": 2,
    # positions
    "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128, "seq_length": 128,
    # indexed (sparse) attention: a top-k below the sweep's 8 tokens, so that the indexer really skips keys
    "index_topk": 4, "index_n_heads": 2, "index_head_dim": 16,
    # a draft model's (Gemma 4's assistant): the width of the model it drafts for, its vocabulary's clusters
    "backbone_hidden_size": _WIDTH, "num_centroids": 16, "centroid_intermediate_top_k": 4,
}
# sizes some config classes leave None by default although their model reads them as numbers (DeepSeek-family
# experts, Qwen4-exp's token indexer): filled, only where None, with tiny values
_WHEN_NONE: dict[str, int] = {
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
    "indexer_compress_ratio": 2,
}
_WINDOW_NAMES = ("sliding_window", "attention_window_size", "window_size")
# the per-layer lists that say what each layer is (attention kind, state-space mixer, ...), most telling first:
# the layers kept are picked from them so that every other per-layer list is cut at the same layers
_KIND_LISTS = ("layer_types", "layers_block_type", "attention_layers", "attn_layers", "block_types", "attn_type_list",
               "hybrid_override_pattern", "mlp_layer_types", "indexer_types")
# Where transformers' own default config cannot build the model its mapping names, or shrinking by name cannot
# keep what the model requires, the values that fix it — each with why (the sweep names no family otherwise).
_OVERRIDES: dict[str, dict[str, Any]] = {
    # HY-V4's checkpoints run an indexer in some layers and reuse its choice in the next ("shared"); the generic picker
    # keeps the dense and the sparse MLP layer, both "full": one of each indexer kind instead
    "hy_v4": {"indexer_types": ["full", "shared"]},
    # the default attn_config lacks rope_theta, which the model reads; clip_qkv None fails its forward
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    # the default has no attention layer at all (a pure Mamba-2 stack; transformers' own cached forward fails on it):
    # one attention layer makes it the hybrid the family exists for
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    # layer_types defaults to None, which the model indexes
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # rope_parameters defaults to {}, which the model indexes by layer type
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    # XLNet keeps its checkpoints' attn_type "bi" (every position of the text sees every other: traced without a
    # cache, every step a full forward); its causal "uni" is tested in tests/model/test_hf_reach_relative.py
    # axial position embeddings: the factors of the width must sum to hidden_size, those of the length multiply to
    # the longest sequence
    "reformer": {"axial_pos_embds_dim": [16, 48], "axial_pos_shape": [8, 16]},
    # one attention block shared by the hybrid layers: transformers ties it across them, so it needs two of them;
    # its config fixes the first three layers (state, state, hybrid) and derives the rest from period and offset
    "zamba": {"num_hidden_layers": 4, "attn_layer_period": 1, "attn_layer_offset": 0, "layers_block_type": None},
    # the config's query/key width rounds hidden_size · qk_dim_factor (0.5) up to a multiple of 64 where its layers
    # do not round it: the two agree only where that product is a multiple of 64 (at width 64 the state is built
    # 16 wide per head for queries 8 wide, and the forward fails)
    "xlstm": {"hidden_size": 128, "embedding_dim": 128},
    # Inkling, Inkling 2: the sliding layers' window (sliding_window_size, also their relative-bias extent) and the
    # full layers' bias extent (rel_extent) shorter than the prompt, so that the window slides and the bias stops at
    # its extent within the check; the sliding layers' own head counts and width shrunk like the others'; the
    # logarithmic scaling of queries and bias (log_scaling_n_floor; Inkling's default leaves it off) starting within
    # the prompt
    "inkling_text": {"sliding_window_size": 4, "rel_extent": 6, "swa_num_attention_heads": 4,
                     "swa_num_key_value_heads": 2, "swa_head_dim": 16, "log_scaling_n_floor": 4},
    "inkling2_text": {"sliding_window_size": 4, "rel_extent": 6, "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 2, "swa_head_dim": 16, "log_scaling_n_floor": 4},
    # Gemma 4's assistant (a drafter for multi-token prediction) validates that its text layers take no per-layer
    # inputs, which the Gemma 4 text config's default gives them
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    # XLMConfig's default (causal = false) is XLM's masked LM, bidirectional; causal = true is its causal LM, as the
    # CLM checkpoints (xlm-clm-enfr-1024, xlm-clm-ende-1024) set it
    "xlm": {"causal": True},
    # its own cached forward fails on its own config (it builds DynamicCache(config=BltConfig), which has no
    # num_hidden_layers: a top-level config over four stacks of layers); without a cache it runs
    "blt": {"use_cache": False},
    # every attention kind real checkpoints use (DeepSeek-V4-Flash: sliding-window-only layers first, then compressed
    # sparse (CSA, rate 4, with its indexer) and heavily compressed (HCA, rate 128) layers alternating), with rates
    # small enough that both compress within the prompt and grow during the cached steps, and an indexer keeping
    # fewer entries than exist (its default top-k, 512, would keep them all)
    "deepseek_v4": {"num_hidden_layers": 3,
                    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                    "mlp_layer_types": ["hash_moe", "moe", "moe"],
                    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                    "index_topk": 2, "index_n_heads": 2, "index_head_dim": 16, "o_groups": 2, "o_lora_rank": 16},
}
WINDOW = 4  # shorter than the prompt, so that sliding-window layers really slide in the check
PROMPT = 8  # tokens in the prefill; then DECODE_STEPS cached steps of one token
DECODE_STEPS = 3
TOLERANCE = 1e-4  # float32, the project's parity bar

# "follows uncached": traced, equal to transformers' uncached forward at every step, where transformers' own cached
# path differs from it (the model says so in reference_note); "no cache": traced, a model whose forward takes no cache
# (OpenAI GPT), every step a full forward over the whole text compared with transformers' full forward on it
Outcome = Literal["traced", "follows uncached", "no cache", "refused", "crash", "differs", "not built"]


def causal_lm_types() -> list[str]:
    """Every model_type the installed transformers maps to a causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _depth(values: dict[str, Any], layers_before: int | None) -> int | None:
    return next((values[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if
                 _is_int(values.get(k))), layers_before)


def _is_per_layer(key: str, value: Any, depth: int | None) -> bool:
    """A list with one entry per layer (a string only where it is a pattern of layer kinds, not any word that
    happens to have as many letters as the model has layers)."""
    if not depth or depth <= 2 or key in ("architectures", "model_type") or not isinstance(value, (list, str)):
        return False
    return len(value) == depth and (isinstance(value, list) or "pattern" in key)


def _is_index_list(key: str, value: Any, depth: int | None) -> bool:
    """A list of layer indices (which layers are attention, MoE, ...): strictly increasing whole numbers below the
    depth, under a name that says so."""
    return bool(depth) and isinstance(value, list) and bool(value) and all(_is_int(v) for v in value) and \
        all(a < b for a, b in zip(value, value[1:])) and value[-1] < depth and (  # type: ignore[operator]
            "idx" in key or "indices" in key or key.endswith("_layers"))


def _first_of_each_kind(kinds: list | str, how_many: int = 2) -> list[int]:
    """The first occurrence of each of the first ``how_many`` kinds (a hybrid keeps an attention and a state
    layer); [0, 1] where there is only one kind."""
    firsts: list[int] = []
    for i, kind in enumerate(kinds):
        if all(kinds[j] != kind for j in firsts):
            firsts.append(i)
    return sorted(firsts[:how_many]) if len(firsts) >= how_many else list(range(how_many))


def _picked_layers(values: dict[str, Any], depth: int | None) -> list[int]:
    """The two layers kept: told apart by the first per-layer list of kinds that has more than one kind."""
    for key in _KIND_LISTS:
        kinds = values.get(key)
        if _is_per_layer(key, kinds, depth) and len(set(kinds)) > 1:  # type: ignore[arg-type]
            return _first_of_each_kind(kinds)  # type: ignore[arg-type]
    return [0, 1]


def _kv_sharing_layers(values: dict[str, Any], depth: int | None, picked: list[int]) -> list[int]:
    """Where the config's last ``num_kv_shared_layers`` layers read the K and V of earlier ones (Gemma 3n, Gemma 4,
    as their real checkpoints do): for each kept layer, the first sharing layer of the same kind, kept after them —
    so that the tiny model has a layer producing each kind's K, V and one reading them. Empty without sharing."""
    shared = values.get("num_kv_shared_layers")
    if not (_is_int(shared) and shared > 0 and depth and shared < depth):  # none, or every layer (a drafter: below)
        return []
    first = depth - shared
    kinds = next((values[k] for k in _KIND_LISTS if _is_per_layer(k, values.get(k), depth)), None)
    readers = []
    for layer in picked:
        kind = kinds[layer] if kinds is not None else None
        reader = next((i for i in range(first, depth) if kinds is None or kinds[i] == kind), None)
        if reader is not None and reader not in readers:
            readers.append(reader)
    return readers


def _shrunk(values: dict[str, Any], layers_before: int | None) -> dict[str, Any]:
    """A config's own values with every size named in _SIZES made small (nested sub-configs too), and every
    per-layer list, per-layer override table and list of layer indices cut to the same two layers (four where the
    last layers share K and V: ``_kv_sharing_layers``)."""
    out: dict[str, Any] = {}
    depth = _depth(values, layers_before)
    picked = _picked_layers(values, depth)
    readers = _kv_sharing_layers(values, depth, picked)
    if readers:
        picked = picked + readers
    vocab = min(values.get("vocab_size") or _SIZES["vocab_size"], _SIZES["vocab_size"])
    for key, value in values.items():
        if isinstance(value, dict) and key.endswith("config") and key != "per_layer_config":
            inner = _shrunk(value, depth)
            if inner:  # a sub-config left at its defaults is left out, as the config class's default builds it
                out[key] = {**value, **inner}
        elif key == "per_layer_config" and isinstance(value, dict) and depth and depth > 2:
            # overrides keyed by layer index (Gemma 4's global layers, dots3's latent-attention layers): those of
            # the kept layers, renumbered, their sizes shrunk as the config's own
            out[key] = {str(new): {**value[k], **_shrunk(value[k], None)} for new, old in enumerate(picked)
                        for k in value if int(k) == old}
        elif key.endswith(("_token_id", "_token_index")) and _is_int(value) and value >= vocab:
            out[key] = value % vocab  # special tokens inside the shrunk vocabulary
        elif key == "head_dim" and value is not None and value == values.get("qk_rope_head_dim"):
            out[key] = _SIZES["qk_rope_head_dim"]  # the head size the rotary embedding is built for
        elif key in _SIZES and _is_int(value) and value > 0:
            out[key] = min(value, _SIZES[key])
        elif key in _WHEN_NONE and value is None:
            out[key] = _WHEN_NONE[key]
        elif "vocab" in key and _is_int(value) and value > vocab:
            out[key] = vocab  # any other table indexed by ids (BLT's hash n-gram vocabularies: 500 002 rows)
        elif key in _WINDOW_NAMES and _is_int(value) and value > 0:
            out[key] = WINDOW
        elif key.endswith("_offset") and _is_int(values.get(key[:-len("_offset")] + "_period")) and depth and \
                _is_int(value) and value > 0:
            # a layer kind every `period` layers from `offset` (Jamba's attention layers): kept in the second layer
            out[key], out[key[:-len("_offset")] + "_period"] = 1, 2
        elif _is_index_list(key, value, depth) and depth and depth > 2:
            out[key] = [new for new, old in enumerate(picked) if old in value]
        elif _is_per_layer(key, value, depth):
            out[key] = "".join(value[i] for i in picked) if isinstance(value, str) else [value[i] for i in picked]
        elif key in _KIND_LISTS and isinstance(value, list) and len(value) > 2 and depth and len(value) < depth:
            # a pattern of kinds repeated over the layers (RecurrentGemma's recurrent, recurrent, attention)
            out[key] = [value[i] for i in _first_of_each_kind(value)]
    if readers:  # the kept layers, the sharing ones last
        for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if key in out:
                out[key] = len(picked)
        out["num_kv_shared_layers"] = len(readers)
    elif _is_int(values.get("num_kv_shared_layers")) and depth and values["num_kv_shared_layers"] >= depth:
        out["num_kv_shared_layers"] = len(picked)  # a drafter (Gemma 4's assistant): every layer reads shared K, V
    elif _is_int(values.get("num_kv_shared_layers")):
        out["num_kv_shared_layers"] = 0
    nope, rope = values.get("qk_nope_head_dim"), values.get("qk_rope_head_dim")
    if _is_int(values.get("head_dim")) and _is_int(rope) and (values["head_dim"] == (nope or 0) + rope or any(
            isinstance(layer, dict) and values["head_dim"] == layer.get("qk_nope_head_dim", 0) + rope
            for layer in (values.get("per_layer_config") or {}).values())):
        # a head size that is the latent attention's query/key head (nope + rope), here or in the per-layer overrides
        out["head_dim"] = _SIZES["qk_nope_head_dim"] + _SIZES["qk_rope_head_dim"]
    if _is_int(values.get("kv_lora_rank")) and "num_attention_heads" in out and "num_key_value_heads" in values:
        # latent attention: every query head gets its own key and value, expanded from the shared latent
        out["num_key_value_heads"] = out["num_attention_heads"]
    if _is_int(values.get("expand")) and _is_int(out.get("num_heads")) and _is_int(out.get("head_dim")):
        # Mamba-2: its heads tile the expanded width (hidden_size · expand = num_heads · head_dim)
        width = out.get("hidden_size", values.get("hidden_size"))
        out["num_heads"] = width * values["expand"] // out["head_dim"]
        if _is_int(values.get("n_groups")):
            out["n_groups"] = 1
    if values.get("default_language") is None and values.get("languages"):
        out["default_language"] = list(values["languages"])[0]  # X-MOD: the adapter its forward uses
    return out


def tiny_config(model_type: str) -> Any:
    """The config class's defaults with the sizes shrunk (raises whatever the config class raises)."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = CONFIG_MAPPING[model_type]
    causal_lm = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    own = getattr(causal_lm, "config_class", None)
    if isinstance(own, type) and own is not cls and own.__name__ != "PretrainedConfig":
        cls = own  # the causal LM reads its own config class (MusicGen's decoder config, not the composite one)
    overrides = _OVERRIDES.get(model_type, {})
    try:
        defaults = cls().to_dict()
    except Exception:  # noqa: BLE001 (a default its own validator refuses, which the override fixes)
        defaults = cls(**overrides).to_dict()
    values = _shrunk({**defaults, **{k: v for k, v in overrides.items() if not isinstance(v, dict)}}, None)
    for key, value in overrides.items():  # overrides win over shrinking; a sub-config override merges
        values[key] = {**defaults.get(key, {}), **values.get(key, {}), **value} if isinstance(value, dict) and \
            key.endswith("config") else value
    if "is_decoder" in defaults and not defaults.get("is_encoder_decoder"):
        values["is_decoder"] = True  # a causal LM class: the configuration transformers asks for to use it as one
    config = cls(**values)
    for name in ("head_dim", "num_key_value_heads"):  # left None by a config whose model reads them
        try:
            left_none = hasattr(config, name) and getattr(config, name) is None
        except Exception:  # noqa: BLE001 (a per-layer attribute, which a config with per_layer_config won't read)
            left_none = False
        if left_none:
            setattr(config, name, _SIZES[name])
    return config


def build(model_type: str, directory: Path, seed: int = 0, **changes: Any) -> Path:
    """Save a random-weight causal LM of ``model_type`` into ``directory`` (``changes``: config values set over the
    tiny config's)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = tiny_config(model_type)
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    # the class transformers maps the type to (what AutoModelForCausalLM.from_config picks, also where the config
    # is the causal LM's own rather than the one registered for the type)
    model = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])._from_config(config).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so every term shows in the logits
        for p in model.parameters():
            if p.dim() == 1 and p.is_floating_point():
                p.add_(torch.randn_like(p) * 0.1)
        if "shared_kv_states" in inspect.signature(model.forward).parameters:  # a drafter, run as generate() does
            model(**_drafter_inputs(model))
        else:
            model(input_ids=torch.arange(PROMPT)[None] % 200)  # transformers' own forward runs on this config
    model.save_pretrained(directory)
    return directory


def _drafter_inputs(model: Any) -> dict[str, Any]:
    """What transformers' drafting hands a drafter (Gemma 4's assistant) for one token after PROMPT tokens: the
    token's embedding beside the main model's hidden state, and per layer kind the main model's keys and values
    ``[1, kv heads, PROMPT, d_head]`` (random here, shaped as its layers read them)."""
    kinds = {}
    for m in model.modules():
        if getattr(m, "is_kv_shared_layer", False) and m.layer_type not in kinds:
            heads = m.q_proj.out_features // m.head_dim
            kinds[m.layer_type] = tuple(torch.randn(1, heads // m.num_key_value_groups, PROMPT, m.head_dim)
                                        for _ in range(2))
    return {"inputs_embeds": torch.randn(1, 1, 2 * model.config.backbone_hidden_size), "shared_kv_states": kinds,
            "position_ids": torch.tensor([[PROMPT - 1]])}


@dataclass
class Result:
    model_type: str
    outcome: Outcome
    reason: str = ""  # the refusal's category (HFDecoderError.reason), or what failed
    message: str = ""
    deltas: list[float] = field(default_factory=list)  # max |Δ logits| at the prefill and each decode step
    uncached: list[float] = field(default_factory=list)  # the same against transformers' uncached forward
    note: str | None = None  # the model's reference_note


def _reference_logits(directory: Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """transformers' own eager forward: the prefill, then DECODE_STEPS steps with its own cache."""
    from transformers import AutoModelForCausalLM

    from gpt_shape_tracer.model.sources._hf_probe import cache_keyword

    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    keyword = cache_keyword(hf)  # past_key_values, or cache_params (Mamba's forward names its cache so)
    # XLM names it cache and, as its generate() does, is handed the whole text at every step: its forward slices off
    # the positions its cache holds ("do not recompute cached elements")
    whole = keyword == "cache"
    out = []
    with torch.no_grad():
        result = hf(input_ids=tokens[:, :PROMPT], use_cache=True)
        past = getattr(result, keyword, None)
        if past is None and keyword in ("past_key_values", "cache"):  # RecurrentGemma and XLM return no cache
            # object (RecurrentGemma's recurrent state stays in its modules): given one from the start, as generate()
            # gives it, they fill its K and V
            from transformers import DynamicCache

            past = DynamicCache(config=hf.config)
            result = hf(input_ids=tokens[:, :PROMPT], **{keyword: past}, use_cache=True)
        out.append(result.logits)
        for i in range(PROMPT, PROMPT + DECODE_STEPS):
            result = hf(input_ids=tokens[:, :i + 1] if whole else tokens[:, i:i + 1], **{keyword: past},
                        use_cache=True)
            returned = getattr(result, keyword, None)
            past = returned if returned is not None else past
            out.append(result.logits)
    return out


def _uncached_logits(directory: Path, tokens: torch.Tensor) -> list[torch.Tensor]:
    """transformers' own eager forward without a cache: the whole text again at every step (its last row)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = [hf(input_ids=tokens[:, :PROMPT], use_cache=False).logits]
        out += [hf(input_ids=tokens[:, :i + 1], use_cache=False).logits[:, -1:]
                for i in range(PROMPT, PROMPT + DECODE_STEPS)]
    return out


def check(model_type: str, directory: Path) -> Result:
    """Load ``directory`` with ``load_hf``; traced: compare with transformers at the prefill and each cached step."""
    from gpt_shape_tracer.model.sources import ModelLoadError, load_hf

    try:
        model, _ = load_hf(directory)
    except ModelLoadError as e:
        return Result(model_type, "refused", str(getattr(e, "reason", "") or ""), str(e))
    tokens = torch.randint(0, 200, (1, PROMPT + DECODE_STEPS), generator=torch.Generator().manual_seed(1))
    note = getattr(model, "reference_note", None)
    if getattr(model, "no_cache_reason", None):  # traced without a cache: every step a full forward over the text so
        # far, compared with transformers' full forward on the same text (its last row). OpenAI GPT: its forward takes
        # no cache ("no cache"); BLT: transformers' own cached forward fails on its config, CPM-Ant: it differs from its
        # full forward (a prefix LM), and the model says so in its reference_note ("follows uncached")
        with torch.no_grad():
            ours = [model(tokens[:, :PROMPT])] + [model(tokens[:, :i + 1])[:, -1:]
                                                  for i in range(PROMPT, PROMPT + DECODE_STEPS)]
        uncached = [float((a.float() - b.float()).abs().max()) for a, b in zip(ours, _uncached_logits(directory,
                                                                                                      tokens))]
        equal = max(uncached) <= TOLERANCE
        if getattr(model, "stacks", None) or note:  # BLT; CPM-Ant, whose own cached path (a prefix LM) differs
            return Result(model_type, "follows uncached" if equal and note else "differs", uncached=uncached,
                          note=note)
        return Result(model_type, "no cache" if equal else "differs", uncached=uncached, note=note)
    cache = model.new_cache()
    ours = []
    with torch.no_grad():
        ours.append(model(tokens[:, :PROMPT], cache))
        for i in range(PROMPT, PROMPT + DECODE_STEPS):
            ours.append(model(tokens[:, i:i + 1], cache))
    theirs = _reference_logits(directory, tokens)
    deltas = [float((a.float() - b.float()).abs().max()) for a, b in zip(ours, theirs)]
    if max(deltas) <= TOLERANCE:
        return Result(model_type, "traced", deltas=deltas, note=note)
    uncached = [float((a.float() - b.float()).abs().max()) for a, b in zip(ours, _uncached_logits(directory, tokens))]
    outcome: Outcome = "follows uncached" if max(uncached) <= TOLERANCE and note else "differs"
    return Result(model_type, outcome, deltas=deltas, uncached=uncached, note=note)


def unbuilt(model_type: str, directory: Path, error: Exception) -> Result:
    """A type whose model transformers could not build: refused where its config alone is refused by ``load_hf``
    (before anything is built, as a user's directory of that type would be), transformers' failure named beside;
    else "not built", with the failure."""
    from gpt_shape_tracer.model.sources import ModelLoadError, load_hf

    failure = f"{type(error).__name__}: {str(error)[:200]}"
    try:
        tiny_config(model_type).save_pretrained(directory)
        load_hf(directory)
    except ModelLoadError as e:
        if e.reason and e.reason != "cannot load":
            where, _, why = str(e).partition(": ")
            return Result(model_type, "refused", str(e.reason), f"{where}: transformers itself builds no model from "
                          f"this config ({failure}); and {why}")
    except Exception:  # noqa: BLE001 (the config itself fails: reported as not built below)
        pass
    return Result(model_type, "not built", type(error).__name__, str(error)[:300])


def run(model_type: str) -> Result:
    """Build and check one type; any exception is a crash (or 'not built' when building it failed)."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            build(model_type, Path(tmp))
        except Exception as e:  # noqa: BLE001 (the sweep reports, it does not stop)
            return unbuilt(model_type, Path(tmp), e)
        try:
            return check(model_type, Path(tmp))
        except Exception as e:  # noqa: BLE001
            return Result(model_type, "crash", type(e).__name__,
                          f"{str(e)[:300]} | {traceback.format_exc().splitlines()[-3][:200]}")


_OUTCOME_WORDS = {
    "traced": "traced, logits equal to transformers'",
    "follows uncached": "traced, equal to transformers' uncached forward (its own cached path differs)",
    "no cache": "traced, logits equal to transformers' (no cache: every step a full forward)",
    "refused": "refused",
    "crash": "CRASH",
    "differs": "DIFFERS",
    "not built": "not built offline (the message says why)",
}


def failing(result: Result) -> bool:
    """What the marked test counts as a failure: a crash, a difference, or the guard's refusal."""
    return result.outcome in ("crash", "differs") or result.reason == "differs from transformers"


def failing_sentence(results: list[Result]) -> str:
    bad = [r.model_type for r in results if failing(r)]
    if not bad:
        return "No type crashed or differed from transformers: the test passed on this run."
    return (f"The test failed on this run for {len(bad)} type(s), which crashed or differ from transformers: "
            f"{', '.join(bad)}.")


# what each refusal reason means, for the page (only the reasons a run gave are listed)
REASON_WORDS = {
    "attention outside the interface": "the family computes attention in its own code in a form the op-level reader "
                                       "(model/sources/_hf_own_attention.py, which traces Bloom, MPT, CodeGen and the "
                                       "other families whose own softmax multiplies V, XLNet's relative attention "
                                       "and Reformer's exp(x − logsumexp x) among them) cannot read as one softmax "
                                       "attention",
    "no softmax attention": "state-space or recurrent layers only, keeping their state where the trace cannot hold it "
                            "(Mamba's and the hybrids' in transformers' cache layers, RWKV's handed-back state, "
                            "xLSTM's own cache object and RecurrentGemma's module attributes are traced)",
    "state layers": "layers without attention keep their state in a cache class of the family's own other than "
                    "MiniMax's (which is traced) or inside its modules, not in transformers' shared cache layers",
    "latent attention": "value heads narrower or wider than query/key heads",
    "attention sinks": "a sink logit handed to the attention function that the traced attention cannot show "
                       "(gpt-oss's, one learned per head, and Inkling 2's, one per head and query, are traced as the "
                       "extra column of each softmax row)",
    "several attentions per layer": "a layer calls attention more than once per forward in a way the trace cannot "
                                    "lay out as one block per call (HRM's re-run layers and LongCat-Flash's two "
                                    "attention sublayers are traced as one block per call; DiffLlama's two calls as "
                                    "differential attention)",
    "several stacks": "attention runs in more than one list of layers other than as one call per element of each, "
                      "or its lists attend with different heads or widths (BLT's byte-level stacks around a "
                      "transformer over patches, cross-attending, are traced one block per call, without a cache)",
    "indexed attention": "a learned indexer picks each query's keys and keeps its own key cache",
    "score bias": "a bias handed to the attention function beside the mask that the traced attention does not "
                  "compute (a score_mod, an attention_bias; Inkling's learned relative position bias is traced as a "
                  "stage of its own, hook_score_bias)",
    "compressed attention": "the family's own cache layers keep compressed keys and values",
    "differs from transformers": "load_hf's guard found a cached decode step of ours differing from transformers' "
                                 "own forward (a failure of this sweep, not a verdict on the family)",
    "encoder-decoder": "a separate encoder feeds the decoder through cross-attention",
    "encoder": "bidirectional self-attention: not a causal decoder",
    "cannot load": "transformers itself fails on the directory or its forward",
    "drafter": "a draft model for another model's speculative decoding (Gemma 4's assistant): no layer computes keys "
               "or values, each attends over the main model's, and its input is the main model's hidden state",
    "weights missing": "the config builds more layers than the weights hold",
    "alibi": "a per-head linear bias added to the scores (ALiBi)",
}


def markdown(results: list[Result], machine: str, seconds: float) -> str:
    """docs/architectures.md: one row per type, from the sweep's own results."""
    import transformers

    counts: dict[str, int] = {}
    for r in results:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    lines = [
        "# Every causal LM of the installed transformers",
        "",
        f"Generated from one run of `WRITE_ARCHITECTURES_MD=docs/architectures.md python -m pytest -m "
        "every_architecture tests/model/test_every_architecture.py` (the test also checks each refusal's reason "
        "independently of the code that refused; `python -m tests.hf_every_architecture --markdown "
        f"docs/architectures.md` writes the same page without those checks) with transformers "
        f"{transformers.__version__}: every `model_type` in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` ({len(results)}), "
        "built as a tiny random-weight directory from its own config class, loaded with `load_hf`, and compared "
        f"with transformers' eager forward on the same weights at the prefill ({PROMPT} tokens) and {DECODE_STEPS} "
        f"cached decode steps (≤ {TOLERANCE:g}, float32); a model whose forward takes no cache at all is run as its "
        "generate() runs it, every step a full forward over the text so far, and compared with transformers' full "
        "forward on the same text (there are no cached steps to compare).",
        "",
        "The tiny config (tests/hf_every_architecture.py) shrinks sizes by their names, keeps two layers of "
        "different kinds where the layers differ (cutting every per-layer list, per-layer override table and list "
        "of layer indices at the same two layers), and keeps the relations some configs require (latent "
        "attention: one key/value head per query head; Mamba-2: heads tiling the expanded width). Where "
        "transformers' own default config cannot build its model, or a layout needs more than that, a short table "
        f"of values with the reason for each fixes it: {', '.join(sorted(_OVERRIDES))}.",
        "",
        "| outcome | types |",
        "|---|---|",
        *[f"| {_OUTCOME_WORDS[k]} | {v} |" for k, v in sorted(counts.items())],
        "",
        f"Run on {machine}: {seconds:.0f} s (1-minute load average at the end of the run: {os.getloadavg()[0]:.1f}; "
        "other processes sharing the cores slow it).",
        "",
        failing_sentence(results),
        "",
        "Reasons (`HFDecoderError.reason`, `ModelLoadError.reason`) given in this run: "
        + "; ".join(f"*{reason}* — {REASON_WORDS[reason]}" for reason in REASON_WORDS
                    if any(r.reason == reason for r in results)) + ".",
        "",
        r"| model_type | outcome | reason | max \|Δ logits\| (prefill, 3 decode steps) or message |",
        "|---|---|---|---|",
    ]
    for r in results:
        shown = r.deltas or (r.uncached if r.outcome == "no cache" else [])  # no cache: its full forwards' deltas
        detail = " ".join(f"{d:.1e}" for d in shown) if shown else r.message.split(": ", 1)[-1][:320]
        if r.note:
            detail += f" — {r.note}"
        detail = detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.model_type} | {_OUTCOME_WORDS[r.outcome]} | {r.reason if r.outcome != 'traced' else ''} "
                     f"| {detail} |")
    return "\n".join(lines) + "\n"


def machine() -> str:
    """The machine a run was on, for the page."""
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


def main(argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    import time

    out = None
    if argv[:1] == ["--markdown"]:
        out, argv = Path(argv[1]), argv[2:]
    types = argv or causal_lm_types()
    counts: dict[str, int] = {}
    results = []
    start = time.perf_counter()
    for model_type in types:
        result = run(model_type)
        results.append(result)
        counts[result.outcome] = counts.get(result.outcome, 0) + 1
        detail = " ".join(f"{d:.1e}" for d in result.deltas) if result.deltas else result.message[:400]
        if result.uncached:
            detail += " | uncached: " + " ".join(f"{d:.1e}" for d in result.uncached) + \
                (f" | {result.note}" if result.note else "")
        print(f"{model_type:28s} {result.outcome:9s} {result.reason:24s} {detail}", flush=True)
    print(counts)
    if out is not None:
        out.write_text(markdown(results, machine(), time.perf_counter() - start))


if __name__ == "__main__":
    main(sys.argv[1:])
