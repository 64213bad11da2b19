"""The one table of hook points: name, symbolic shape, meaning, and which models have it.

model/README.md shows this table (a test checks the two agree, and another
that every hook point of a GPT-2 and of a grouped-query Llama config is here
with exactly this shape, at prefill and decode). ``{L}`` is the block index.
Symbols follow the legend in ``model/gpt/_gpt.py``; the table writes the general
form, and ``spec_for(name, config)`` / ``hooks_for(config)`` write it for one
model: for GPT-2 (G = H) the key/value heads read ``H``, the QKV width ``3d``,
the merged heads ``d`` and the MLP width ``4d``, exactly as before the Llama
family arrived.

A hook name can have two rows when two architectures compute a different thing
under TransformerLens's one name (``ln1.hook_normalized`` is LayerNorm or
RMSNorm, ``mlp.hook_pre`` is x·W_1 + b_1 or x·W_gate); ``needs`` says which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

GQA_NOTE = "each of the G key heads serves H/G query heads: query head h reads key head h // (H/G)"
NEEDS = {
    "": "all",
    "learned_positions": "GPT-2 (learned positions)",
    "rope": "Llama-style (RoPE)",
    "layernorm": "GPT-2 (LayerNorm)",
    "rmsnorm": "Llama-style (RMSNorm)",
    "gelu": "GPT-2 (GELU MLP)",
    "swiglu": "Llama-style (SwiGLU MLP)",
    "softcap": "transformers-run, soft-capped (Gemma 2)",
    "latent": "transformers-run, latent attention (DeepSeek-V2/V3, MiniCPM3)",
    "sinks": "transformers-run, attention sinks (gpt-oss)",
    "indexed": "transformers-run, indexed (sparse) attention (DeepSeek-V3.2, GLM-5, Qwen4-Exp …)",
    "hybrid": "transformers-run, at a layer without attention (hybrid models: Qwen3-Next, Jamba …)",
}


@dataclass(frozen=True)
class HookSpec:
    name: str  # with {L} for the block index
    shape: tuple[str, ...]  # symbols: B n t d H G d_head V d_ff d_qkv H·d_head, multiples like 4d, and literals
    meaning: str
    transformer_lens: str  # the TransformerLens name and layout, or "—"
    needs: str = ""  # "" (every model) or the architecture feature it belongs to: a key of NEEDS
    note: str = ""  # what else a reader must know (the grouped-query broadcast)


HOOKS: tuple[HookSpec, ...] = (
    HookSpec("hook_embed", ("B", "n", "d"), "token embeddings W_E[tokens]", "hook_embed [batch, pos, d_model]"),
    HookSpec("hook_pos_embed", ("B", "n", "d"), "position embeddings W_pos[positions]", "hook_pos_embed, same",
             needs="learned_positions"),
    HookSpec("blocks.{L}.hook_resid_pre", ("B", "n", "d"), "residual stream entering block L", "same"),
    HookSpec("blocks.{L}.ln1.hook_normalized", ("B", "n", "d"), "LN(x) = γ⊙(x−μ)/√(σ²+ε)+β", "same",
             needs="layernorm"),
    HookSpec("blocks.{L}.ln1.hook_normalized", ("B", "n", "d"), "RMSNorm(x) = γ⊙x/√(mean(x²)+ε)", "same",
             needs="rmsnorm"),
    HookSpec("blocks.{L}.attn.hook_qkv", ("B", "n", "d_qkv"),
             "X·W_QKV (+ b), the combined projection: d_qkv = (H+2G)·d_head", "—"),
    HookSpec("blocks.{L}.attn.hook_q", ("B", "H", "n", "d_head"), "queries Q", "hook_q [batch, pos, head, d_head]"),
    HookSpec("blocks.{L}.attn.hook_k", ("B", "G", "n", "d_head"), "keys of the new positions",
             "hook_k [batch, pos, head, d_head]"),
    HookSpec("blocks.{L}.attn.hook_v", ("B", "G", "n", "d_head"), "values of the new positions",
             "hook_v [batch, pos, head, d_head]"),
    HookSpec("blocks.{L}.attn.hook_rot_q", ("B", "H", "n", "d_head"), "Q rotated by its positions (RoPE)",
             "hook_rot_q [batch, pos, head, d_head]", needs="rope"),
    HookSpec("blocks.{L}.attn.hook_rot_k", ("B", "G", "n", "d_head"), "K rotated by its positions (what the cache keeps)",
             "hook_rot_k [batch, pos, head, d_head]", needs="rope"),
    HookSpec("blocks.{L}.attn.hook_k_all", ("B", "G", "t", "d_head"), "all keys K: cache ++ new", "—", note=GQA_NOTE),
    HookSpec("blocks.{L}.attn.hook_v_all", ("B", "G", "t", "d_head"), "all values V: cache ++ new", "—",
             note=GQA_NOTE),
    HookSpec("blocks.{L}.attn.hook_kv_latent_all", ("B", "1", "t", "d_c"),
             "the compressed KV latent c_KV = RMSNorm(x·W_DKV) of every position: cache ++ new (the cache holds it, "
             "and K's unrotated part and V are expanded from it at every step)", "—", needs="latent"),
    HookSpec("blocks.{L}.attn.hook_k_rope_all", ("B", "1", "t", "d_R"),
             "the decoupled rotary key k_R (after RoPE), one for all heads: cache ++ new (the cache holds it)", "—",
             needs="latent"),
    HookSpec("blocks.{L}.attn.hook_qk", ("B", "H", "n", "t"), "QKᵀ", "—", note=GQA_NOTE),
    HookSpec("blocks.{L}.attn.hook_attn_scores", ("B", "H", "n", "t"), "QKᵀ/√d_k",
             "hook_attn_scores is scaled *and* masked"),
    HookSpec("blocks.{L}.attn.hook_softcapped", ("B", "H", "n", "t"), "c·tanh(scores / c), the soft-cap (Gemma 2)",
             "—", needs="softcap"),
    HookSpec("blocks.{L}.attn.hook_index_keys", ("B", "n", "d_I"),
             "the indexer's keys of the new positions (its own projection of x, kept in the cache beside K and V)", "—",
             needs="indexed"),
    HookSpec("blocks.{L}.attn.hook_index_keys_all", ("B", "t", "d_I"), "the indexer's keys: its cache ++ new", "—",
             needs="indexed"),
    HookSpec("blocks.{L}.attn.hook_index_scores", ("B", "n", "t"),
             "what the indexer ranks: Σ_h w_h·ReLU(q_h·k) per key, −∞ where the mask hides it (DSA; a QSA indexer "
             "scores blocks of keys)", "—", needs="indexed"),
    HookSpec("blocks.{L}.attn.hook_index_visible", ("B", "n", "t"),
             "the keys the causal / padding mask lets each query see (bool)", "—", needs="indexed"),
    HookSpec("blocks.{L}.attn.hook_index_selected", ("B", "n", "t"),
             "the visible keys the indexer chose for each query, its top-k (bool): M hides every other key", "—",
             needs="indexed"),
    HookSpec("blocks.{L}.attn.hook_mask", ("B|1", "1", "n", "t"),
             "additive mask M: 0 or −∞ (B rows only with padding; a sliding window hides keys ≥ window back)", "—"),
    HookSpec("blocks.{L}.attn.hook_masked_scores", ("B", "H", "n", "t"), "QKᵀ/√d_k + M", "≈ hook_attn_scores"),
    HookSpec("blocks.{L}.attn.hook_sink_logits", ("B", "H", "n", "1"),
             "the learned sink logit s_h of each head, one more column beside the t scores + M", "—", needs="sinks"),
    HookSpec("blocks.{L}.attn.hook_pattern", ("B", "H", "n", "t"), "A = softmax(QKᵀ/√d_k + M)",
             "hook_pattern, same layout"),
    HookSpec("blocks.{L}.attn.hook_sink_weight", ("B", "H", "n", "1"),
             "the weight the softmax over the keys and the sink gives the sink: 1 − Σ_t A", "—", needs="sinks"),
    HookSpec("blocks.{L}.attn.hook_z", ("B", "H", "n", "d_head"), "A·V per head", "hook_z [batch, pos, head, d_head]"),
    HookSpec("blocks.{L}.attn.hook_merged", ("B", "n", "H·d_head"), "heads concatenated, before W_O", "—"),
    HookSpec("blocks.{L}.hook_attn_out", ("B", "n", "d"), "attention output ·W_O (+ b)", "same"),
    HookSpec("blocks.{L}.hook_mixer_in", ("B", "n", "d"),
             "the input of the layer's mixer where it has no attention (a Gated DeltaNet, Mamba or convolution "
             "mixer): the normed residual stream", "—", needs="hybrid"),
    HookSpec("blocks.{L}.hook_mixer_out", ("B", "n", "d"),
             "what that mixer returns, in place of an attention output (its state, fixed-size, stays in "
             "transformers' cache)", "—", needs="hybrid",
             note="added to x as it is only where the model's load measured each block a plain sum"),
    HookSpec("blocks.{L}.hook_resid_mid", ("B", "n", "d"), "x + attention output", "same",
             note="in a transformers-run model: the stream entering the MLP's norm, x + attention output only where "
                  "its load measured each block a plain sum (GPTConfig.plain_residual)"),
    HookSpec("blocks.{L}.ln2.hook_normalized", ("B", "n", "d"), "LN of the mid residual", "same", needs="layernorm"),
    HookSpec("blocks.{L}.ln2.hook_normalized", ("B", "n", "d"), "RMSNorm of the mid residual", "same",
             needs="rmsnorm"),
    HookSpec("blocks.{L}.mlp.hook_pre", ("B", "n", "d_ff"), "x·W_1 + b_1, before GELU", "hook_pre [batch, pos, d_mlp]",
             needs="gelu"),
    HookSpec("blocks.{L}.mlp.hook_pre", ("B", "n", "d_ff"), "x·W_gate, the gate before SiLU",
             "hook_pre [batch, pos, d_mlp]", needs="swiglu"),
    HookSpec("blocks.{L}.mlp.hook_pre_linear", ("B", "n", "d_ff"), "x·W_up, the linear half",
             "hook_pre_linear [batch, pos, d_mlp]", needs="swiglu"),
    HookSpec("blocks.{L}.mlp.hook_post", ("B", "n", "d_ff"), "GELU(x·W_1 + b_1)", "hook_post [batch, pos, d_mlp]",
             needs="gelu"),
    HookSpec("blocks.{L}.mlp.hook_post", ("B", "n", "d_ff"), "SiLU(x·W_gate) ⊙ x·W_up",
             "hook_post [batch, pos, d_mlp]", needs="swiglu"),
    HookSpec("blocks.{L}.hook_mlp_out", ("B", "n", "d"), "MLP output ·W_2 (+ b_2); W_down for SwiGLU", "same"),
    HookSpec("blocks.{L}.hook_resid_post", ("B", "n", "d"), "residual stream leaving block L", "same"),
    HookSpec("ln_final.hook_normalized", ("B", "n", "d"), "final LayerNorm", "same", needs="layernorm"),
    HookSpec("ln_final.hook_normalized", ("B", "n", "d"), "final RMSNorm", "same", needs="rmsnorm"),
    HookSpec("hook_logits", ("B", "n", "V"),
             "logits x·W_U: W_U = W_Eᵀ when tied (GPT-2), its own matrix (lm_head) when not", "— (TL returns logits)"),
)

_BLOCK = re.compile(r"^blocks\.(\d+)\.")


def _default_config():
    from gpt_shape_tracer.model.gpt._config import GPTConfig  # here, not at import: model.gpt does not need this module

    return GPTConfig()


# The rows a transformers-run model (family "hf", model/sources/_hf_decoder.py) has: the ones its forward passes through
# hook points; the rest of its tensors are module records under its own names (``hf.model.layers.0.…``).
HF_ROWS = frozenset({
    "hook_embed", "blocks.{L}.hook_resid_pre", "blocks.{L}.attn.hook_q", "blocks.{L}.attn.hook_k",
    "blocks.{L}.attn.hook_v", "blocks.{L}.attn.hook_k_all", "blocks.{L}.attn.hook_v_all", "blocks.{L}.attn.hook_qk",
    "blocks.{L}.attn.hook_attn_scores", "blocks.{L}.attn.hook_softcapped", "blocks.{L}.attn.hook_mask",
    "blocks.{L}.attn.hook_masked_scores", "blocks.{L}.attn.hook_pattern", "blocks.{L}.attn.hook_z",
    "blocks.{L}.hook_attn_out", "blocks.{L}.hook_resid_mid", "blocks.{L}.hook_mlp_out", "blocks.{L}.hook_resid_post",
    "hook_logits", "blocks.{L}.attn.hook_kv_latent_all", "blocks.{L}.attn.hook_k_rope_all",
    "blocks.{L}.attn.hook_sink_logits", "blocks.{L}.attn.hook_sink_weight", "blocks.{L}.hook_mixer_in",
    "blocks.{L}.hook_mixer_out", "blocks.{L}.attn.hook_index_keys", "blocks.{L}.attn.hook_index_keys_all",
    "blocks.{L}.attn.hook_index_scores", "blocks.{L}.attn.hook_index_visible", "blocks.{L}.attn.hook_index_selected"})
HF_ONLY_NEEDS = ("softcap", "latent", "sinks", "hybrid", "indexed")  # the features only a transformers-run model has
LATENT_ROWS = frozenset({"blocks.{L}.attn.hook_kv_latent_all", "blocks.{L}.attn.hook_k_rope_all",
                         "blocks.{L}.attn.hook_sink_logits", "blocks.{L}.attn.hook_sink_weight",
                         "blocks.{L}.hook_mixer_in", "blocks.{L}.hook_mixer_out", "blocks.{L}.attn.hook_index_keys",
                         "blocks.{L}.attn.hook_index_keys_all", "blocks.{L}.attn.hook_index_scores",
                         "blocks.{L}.attn.hook_index_visible", "blocks.{L}.attn.hook_index_selected"})  # hf only
MODULE_ROWS = frozenset(r for r in HF_ROWS - LATENT_ROWS if ".attn." in r and "softcapped" not in r) | {"hook_logits"}
V_ROWS = ("blocks.{L}.attn.hook_v", "blocks.{L}.attn.hook_v_all", "blocks.{L}.attn.hook_z", "blocks.{L}.attn.hook_merged")
HF_MEANINGS = {  # what a row means there, where that differs from our GPT
    "blocks.{L}.attn.hook_q": "queries Q as the attention receives them (after RoPE and QK-norm where the model has them)",
    "blocks.{L}.attn.hook_k": "keys of the new positions, as the cache keeps them (after RoPE and QK-norm if any)",
    "blocks.{L}.attn.hook_attn_scores": "QKᵀ × the model's scale (1/√d_head unless its config sets another)",
    "blocks.{L}.attn.hook_masked_scores": "scores + M",
    "blocks.{L}.attn.hook_pattern": "A = softmax(scores + M), in float32 as transformers' eager path",
    "blocks.{L}.hook_attn_out": "attention output ·W_O (+ b), before any post-attention norm",
    "blocks.{L}.hook_resid_mid": "the stream entering the MLP's norm (absent in a parallel block)",
    "blocks.{L}.hook_mlp_out": "the MLP's (or the mixture of experts') output",
    "hook_logits": "logits as the model returns them (after any final soft-cap or scaling)",
}


def residual_sums(config) -> bool | None:
    """Whether each block of a model with ``config`` adds its sublayers' outputs to x as they are (x + attention,
    then + MLP): always for our own GPT; for a transformers-run model what its load measured
    (``GPTConfig.plain_residual``), None where nothing was measured (a dry run on the meta device)."""
    if config is None or getattr(config, "family", "gpt2") not in ("hf", "module"):
        return True
    return getattr(config, "plain_residual", None)


def _hf_meaning(name: str, config) -> str | None:
    """A transformers-run model's row meaning where it depends on whether its blocks are plain residual sums."""
    plain = residual_sums(config)
    mixer = " (or mixer)" if getattr(config, "mixers", None) is not None else ""
    if name == "blocks.{L}.hook_resid_mid":
        if plain:
            return f"x + attention{mixer} output: the stream entering the MLP's norm (absent in a parallel block)"
        if plain is False:
            return (f"the stream entering the MLP's norm: this model's own mix of x and the attention{mixer} output, "
                    "not their plain sum (measured at load; see the model's code)")
    if name == "blocks.{L}.hook_mixer_out":
        if plain:
            return ("what that mixer adds to the residual stream, in place of an attention output (its state, "
                    "fixed-size, stays in transformers' cache)")
        return ("what that mixer returns, in place of an attention output"
                + (" (the block mixes it with x its own way, not a plain sum: measured at load)" if plain is False
                   else "") + "; its state, fixed-size, stays in transformers' cache")
    return HF_MEANINGS.get(name)


def _has(spec: HookSpec, config) -> bool:
    """Whether a model with ``config`` has this row (a config without the new fields is GPT-2)."""
    family = getattr(config, "family", "gpt2")
    if family == "module":  # only its attention is seen (model/sources/_own_module.py), and the logits
        return spec.name in MODULE_ROWS
    if family == "hf":
        if spec.needs == "softcap":
            return spec.name in HF_ROWS and getattr(config, "attn_softcap", None) is not None
        if spec.needs == "latent":
            return getattr(config, "kv_latent_dim", None) is not None
        if spec.needs == "sinks":
            return bool(getattr(config, "attn_sinks", False))
        if spec.needs == "indexed":  # at the indexed layers only (GPTConfig.indexed_layers)
            return bool(getattr(config, "indexed_layers", ()))
        if spec.needs == "hybrid":  # at the layers without attention only (GPTConfig.has_attention says which)
            return getattr(config, "mixers", None) is not None
        return spec.name in HF_ROWS
    needs = spec.needs
    if not needs:
        return True
    if needs in HF_ONLY_NEEDS:
        return False
    if needs in ("learned_positions", "rope"):
        return getattr(config, "positions", "learned") == ("rope" if needs == "rope" else "learned")
    if needs in ("layernorm", "rmsnorm"):
        return getattr(config, "norm", "layernorm") == needs
    return getattr(config, "mlp", "gelu") == needs


def _specialise(spec: HookSpec, config) -> HookSpec:
    """The row written for one model: G → H when every head has its own keys, and GPT-2's names for the widths."""
    H = config.n_head
    G = getattr(config, "n_kv_heads", H)
    d, dh = config.d_model, config.d_head
    names = {}
    if G == H:
        names["G"] = "H"
        if H * dh == d:
            names["d_qkv"] = "3d"
    if H * dh == d:
        names["H·d_head"] = "d"
    if getattr(config, "mlp", "gelu") == "gelu":
        names["d_ff"] = "4d"  # GPT-2's name for its MLP width (n_inner when a checkpoint sets it)
    if getattr(config, "d_v", dh) != dh:  # latent attention: the two head sizes get their own names
        names.update({"d_head": "d_v", "H·d_head": "H·d_v"} if spec.name in V_ROWS else {"d_head": "d_qk"})
    shape = tuple(names.get(s, s) for s in spec.shape)
    external = getattr(config, "family", "gpt2") in ("hf", "module")
    meaning = (_hf_meaning(spec.name, config) or spec.meaning) if external else spec.meaning
    return spec if (shape, meaning) == (spec.shape, spec.meaning) else replace(spec, shape=shape, meaning=meaning)


def hooks_for(config) -> tuple[HookSpec, ...]:
    """The rows a model with ``config`` has, each written for it (``[B, G, t, d_head]`` for a grouped-query
    model, ``[B, H, t, d_head]`` for GPT-2)."""
    return tuple(_specialise(spec, config) for spec in HOOKS if _has(spec, config))


def spec_for(name: str, config=None) -> HookSpec | None:
    """The table row of a concrete hook name such as ``blocks.3.attn.hook_q``, written for ``config``
    (default: GPT-2 small). None when the name is not a hook point of such a model."""
    config = config if config is not None else _default_config()
    generic = _BLOCK.sub("blocks.{L}.", name)
    for spec in HOOKS:
        if spec.name == generic and _has(spec, config):
            return _specialise(spec, config)
    return None


# Short names for ``act_name``, in the spirit of TransformerLens's ``get_act_name``: the hook's own
# last word, with the layer norms and the MLP named by where they sit (their last words repeat).
_SHORT: dict[str, str] = {}
for _spec in HOOKS:
    _last = _spec.name.rsplit(".", 1)[-1].removeprefix("hook_")
    if _last == "normalized":
        _last = _spec.name.split(".")[-2] if _spec.name.startswith("blocks.") else "ln_final"
    elif ".mlp." in _spec.name:
        _last = "mlp_" + _last
    _SHORT[_last] = _spec.name
_SHORT["scores"] = _SHORT["attn_scores"]


def act_name(kind: str, layer: int | None = None) -> str:
    """The full hook name: ``act_name("pattern", 0)`` → ``"blocks.0.attn.hook_pattern"``,
    ``act_name("logits")`` → ``"hook_logits"``. ``kind`` is a short name (``q``, ``k_all``,
    ``pattern``, ``ln1``, ``mlp_post``, ``rot_q``, ``mlp_pre_linear``, ``resid_pre``, …) or a hook's
    own name (``hook_q``)."""
    template = _SHORT.get(kind.removeprefix("hook_"))
    if template is None:
        import difflib

        close = difflib.get_close_matches(kind, sorted(_SHORT), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise KeyError(f"no hook point is called {kind!r}{hint}")
    if "{L}" in template:
        if layer is None or isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"{kind!r} lives in every block: give its layer, a whole number ≥ 0 (got {layer!r})")
        return template.replace("{L}", str(layer))
    if layer is not None:
        raise ValueError(f"{kind!r} is not inside a block: it takes no layer (got {layer!r})")
    return template


def resolve(symbol: str, dims: dict[str, int]) -> int:
    """Evaluate a symbol like ``d``, ``3d``, ``d_head``, ``G``, ``1`` with ``dims``.

    ``dims`` may name a symbol outright: ``"4d"`` is the MLP width, which
    equals 4·d unless a checkpoint sets ``n_inner``; ``d_qkv`` and ``H·d_head``
    are named widths (``dims_of`` gives them)."""
    if symbol in dims:
        return dims[symbol]
    if symbol.isdigit():
        return int(symbol)
    m = re.fullmatch(r"(\d*)([A-Za-z_]+)", symbol)
    if not m:
        raise ValueError(f"unknown shape symbol {symbol!r}")
    factor = int(m.group(1) or 1)
    return factor * dims[m.group(2)]


def dims_of(config, batch: int, new: int, keys: int) -> dict[str, int]:
    """The value of every symbol for a model config and one forward.

    ``config`` needs ``d_model``, ``n_head``, ``d_head``, ``vocab_size``, ``d_ff``; ``n_kv_heads``
    defaults to ``n_head`` (GPT-2), so a config object from before grouped-query attention still works."""
    H, dh = config.n_head, config.d_head
    G = getattr(config, "n_kv_heads", H)
    dv = getattr(config, "d_v", dh)
    dims = {
        "B": batch, "n": new, "t": keys, "d": config.d_model, "H": H, "G": G,
        "d_head": dh, "V": config.vocab_size, "4d": config.d_ff, "d_ff": config.d_ff,
        "d_qkv": (H + 2 * G) * dh, "H·d_head": H * dh, "d_qk": dh, "d_v": dv, "H·d_v": H * dv,
    }
    for symbol, field in (("d_c", "kv_latent_dim"), ("d_R", "rope_key_dim"), ("d_I", "indexer_key_dim")):
        if getattr(config, field, None) is not None:
            dims[symbol] = getattr(config, field)
    return dims


def markdown_table() -> str:
    """The README's table: every row of every family, with the models that have it."""
    lines = [
        "| hook name | shape | what it holds | models | TransformerLens |",
        "|---|---|---|---|---|",
    ]
    for spec in HOOKS:
        meaning = spec.meaning + (f" — *{spec.note}*" if spec.note else "")
        models = NEEDS[spec.needs] + ("; any transformers-run decoder"
                                      if spec.name in HF_ROWS and spec.needs not in HF_ONLY_NEEDS else "")
        lines.append(f"| `{spec.name}` | [{', '.join(spec.shape)}] | {meaning} | {models} | "
                     f"{spec.transformer_lens} |")
    return "\n".join(lines)
