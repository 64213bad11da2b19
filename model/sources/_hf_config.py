"""A Hugging Face ``config.json`` read into our ``GPTConfig`` (``config_from_hf``, GPT-2, Llama, Mistral, Qwen2)
and written back (``config_to_hf``); every refusal names the file and the problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpt_shape_tracer.model.gpt import GPTConfig, RopeScaling
from gpt_shape_tracer.model.sources._common import ModelLoadError, read_json

IMPLEMENTATIONS = ("auto", "ours", "transformers")  # load_hf: who runs the model


def known_to_transformers(model_type: str) -> bool:
    """Whether the installed transformers has a config class for ``model_type`` (then it can run it)."""
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2")  # re-implemented here (model/gpt/_gpt.py)
SUPPORTED_ACTIVATIONS = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}


def _get(raw: dict, key: str, default=None):
    value = raw.get(key, default)
    return default if value is None else value


def _flag(raw: dict, key: str, source: Path) -> bool:
    """A true/false field: ``"false"`` (a string, truthy) would turn it on, so anything but a boolean is refused."""
    value = _get(raw, key, False)
    if not isinstance(value, bool):
        raise ModelLoadError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def config_from_hf(raw: dict, source: Path) -> GPTConfig:
    """A ``GPTConfig`` from a Hugging Face ``config.json`` dictionary (any supported ``model_type``)."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{source}: model_type is {model_type!r}: neither one of the families re-implemented here "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}) nor a model type this transformers knows"
        )
    try:
        if model_type == "gpt2":
            return _gpt2_config(raw, source)
        return _llama_config(raw, source, model_type)
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{source}: {e}") from None


def _gpt2_config(raw: dict, source: Path) -> GPTConfig:
    act = raw.get("activation_function", "gelu_new")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"{source}: activation_function {act!r} is not GPT-2's tanh GELU")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if raw.get(flag):
            raise ModelLoadError(f"{source}: {flag} = true is a GPT-2 variant this model does not implement")
    if raw.get("tie_word_embeddings") is False:
        raise ModelLoadError(f"{source}: tie_word_embeddings = false; GPT-2 checkpoints tie the unembedding to W_E")
    n_ctx: Any = raw.get("n_positions", raw.get("n_ctx"))  # JSON, as every value here: GPTConfig checks it
    return GPTConfig(
        vocab_size=raw["vocab_size"],
        n_ctx=n_ctx,
        d_model=raw["n_embd"],
        n_layer=raw["n_layer"],
        n_head=raw["n_head"],
        d_mlp=raw.get("n_inner"),
        layer_norm_eps=_get(raw, "layer_norm_epsilon", 1e-5),
    )


_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}


def _llama_config(raw: dict, source: Path, family: str) -> GPTConfig:
    act = _get(raw, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{source}: hidden_act {act!r} is not SiLU, the gate of a SwiGLU MLP")
    n_layer = raw["num_hidden_layers"]
    n_ctx = _get(raw, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[family])
    rope_theta, rope_scaling = _rope_from_hf(raw, source, n_ctx)
    if family == "llama":
        attention_bias = _flag(raw, "attention_bias", source)
        qkv_bias = attn_out_bias = attention_bias
        mlp_bias = _flag(raw, "mlp_bias", source)
    elif family == "mistral":
        qkv_bias = attn_out_bias = mlp_bias = False
    else:  # qwen2: b_Q, b_K, b_V but no b_O and no MLP biases (Qwen2Attention, Qwen2MLP)
        qkv_bias, attn_out_bias, mlp_bias = True, False, False
    if family == "mistral":
        window = raw.get("sliding_window")
    elif family == "qwen2":
        window = _qwen2_window(raw, source, n_layer)
    else:
        window = None
    return GPTConfig.for_family(
        family,
        vocab_size=raw["vocab_size"],
        n_ctx=n_ctx,
        d_model=raw["hidden_size"],
        n_layer=n_layer,
        n_head=raw["num_attention_heads"],
        n_kv_head=raw.get("num_key_value_heads"),
        head_dim=raw.get("head_dim"),
        d_mlp=raw["intermediate_size"],
        layer_norm_eps=_get(raw, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=_flag(raw, "tie_word_embeddings", source),
        qkv_bias=qkv_bias,
        attn_out_bias=attn_out_bias,
        mlp_bias=mlp_bias,
        sliding_window=window,
    )


def _rope_from_hf(raw: dict, source: Path, n_ctx: int) -> tuple[float, RopeScaling | None]:
    """rope_theta and the scaling variant, from transformers-5 ``rope_parameters`` or the older
    ``rope_scaling`` + top-level ``rope_theta`` (``rope_scaling`` wins when both are set, as in transformers)."""
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source}: rope_parameters / rope_scaling must be an object, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(f"{source}: per-layer-type rope_parameters ({', '.join(params)}) are not implemented")
    theta = params.get("rope_theta", _get(raw, "rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(
            f"{source}: partial_rotary_factor = {partial!r} (RoPE on part of a head) is not implemented")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", factor=params["factor"])
    if rope_type == "llama3":
        original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", n_ctx))
        return theta, RopeScaling("llama3", factor=params["factor"], low_freq_factor=params["low_freq_factor"],
                                  high_freq_factor=params["high_freq_factor"],
                                  original_max_position_embeddings=original)
    raise ModelLoadError(
        f"{source}: rope_type {rope_type!r} is not implemented — only 'default', 'linear' and 'llama3', which "
        "change the inverse frequencies and nothing else, are ('dynamic', 'yarn', 'longrope' also rescale with "
        "the sequence length or scale the attention)"
    )


def _qwen2_window(raw: dict, source: Path, n_layer: object) -> int | None:
    """Qwen2 slides the window only on layers ≥ max_window_layers, and only with use_sliding_window."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    layer_types = raw.get("layer_types")
    if layer_types is None:
        if window is None:
            return None
        first = _get(raw, "max_window_layers", 28)
        if not isinstance(first, int) or not isinstance(n_layer, int):
            raise ModelLoadError(f"{source}: max_window_layers and num_hidden_layers must be integers")
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]
    if not isinstance(layer_types, list) or not all(isinstance(k, str) for k in layer_types):
        raise ModelLoadError(f"{source}: layer_types must be a list of strings, got {layer_types!r}")
    sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention" and window is not None]
    if not sliding:
        return None
    if len(sliding) != len(layer_types):
        raise ModelLoadError(
            f"{source}: a sliding window on some layers only ({len(sliding)} of {len(layer_types)}, from "
            f"max_window_layers / layer_types) is not implemented; every layer slides or none does"
        )
    return window


def config_to_hf(config: GPTConfig) -> dict:
    """The ``config.json`` Hugging Face's classes read for ``config``."""
    if config.family == "gpt2":
        if not (config.norm, config.positions, config.mlp, config.tie_embeddings) == (
                "layernorm", "learned", "gelu", True) or config.n_kv_heads != config.n_head or (
                config.head_dim not in (None, config.d_model // config.n_head)) or not (
                config.qkv_bias and config.attn_out_bias and config.mlp_bias) or config.sliding_window:
            raise ValueError("this config is not a GPT-2 architecture: it cannot be saved as a gpt2 checkpoint")
        if config.activation != "gelu_tanh" or not config.norm_bias:
            # nanoGPT's exact GELU / bias-free LayerNorm: a gpt2 config.json would say gelu_new and LayerNorm
            # biases, and whoever loads it would compute a different model
            raise ValueError("this model uses exact GELU or LayerNorm without β (a nanoGPT checkpoint): "
                             "a gpt2 checkpoint cannot say so")
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": config.vocab_size,
            "n_positions": config.n_ctx,
            "n_embd": config.d_model,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": config.d_mlp,
            "layer_norm_epsilon": config.layer_norm_eps,
            "activation_function": "gelu_new",
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "eos_token_id": None,
        }
    if (config.norm, config.positions, config.mlp) != ("rmsnorm", "rope", "swiglu"):
        raise ValueError(f"a {config.family} checkpoint is RMSNorm + RoPE + SwiGLU; this config is not")
    expected_bias = {"llama": (config.qkv_bias, config.qkv_bias), "mistral": (False, False),
                     "qwen2": (True, False)}[config.family]
    if (config.qkv_bias, config.attn_out_bias) != expected_bias or (config.mlp_bias and config.family != "llama"):
        raise ValueError(f"these biases cannot be written as a {config.family} checkpoint")
    if config.sliding_window is not None and config.family == "llama":
        raise ValueError("a llama checkpoint has no sliding window")
    rope: dict = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope.update({k: v for k, v in vars(config.rope_scaling).items() if v is not None})
        if config.rope_scaling.rope_type == "linear":
            for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                rope.pop(k)
    out = {
        "architectures": [{"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                           "qwen2": "Qwen2ForCausalLM"}[config.family]],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.d_head,
        "hidden_act": "silu",
        "max_position_embeddings": config.n_ctx,
        "rms_norm_eps": config.layer_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if config.family == "llama":
        out.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
    elif config.family == "mistral":
        out["sliding_window"] = config.sliding_window
    else:
        out.update(use_sliding_window=config.sliding_window is not None, sliding_window=config.sliding_window,
                   max_window_layers=0, layer_types=["sliding_attention" if config.sliding_window else
                                                     "full_attention"] * config.n_layer)
    return out



def read_config(directory: Path) -> GPTConfig:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{cfg_path}: missing; a checkpoint directory needs config.json")
    return config_from_hf(read_json(cfg_path, "a config"), cfg_path)
