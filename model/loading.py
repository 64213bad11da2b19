"""Loading and saving checkpoints in Hugging Face's ``save_pretrained`` layout: GPT-2, Llama, Mistral, Qwen2.

A directory holds ``config.json``, the weights (``model.safetensors``, sharded
safetensors with ``model.safetensors.index.json``, or ``pytorch_model.bin``) and
optionally the tokenizer (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``).
A Hugging Face cache snapshot (``…/models--org--name/snapshots/<hash>``, whose
files are symlinks into ``../../blobs/``) is such a directory too. The bundled
models in ``assets/`` are written in this same layout, so one loader serves all,
and Hugging Face's own ``from_pretrained`` can read them.

Order of work, so that a hostile or mistaken directory costs milliseconds:
read config.json → validate its numbers (``GPTConfig``) → read the safetensors
*headers* (names, dtypes, shapes; no data) → compare them with the shapes the
config implies → only then map the files and copy each tensor once into our
layout (while a second thread hashes the files for ``ModelIdentity.weights_digest``,
which the model's first reader of ``identity`` waits for) → build the model on
the ``meta`` device and ``load_state_dict(assign=True)``. A config
that claims 20 000 layers over weights for 4 is refused before anything is
allocated, with a message saying what the weights hold.

Nothing here touches the network, and ``.bin`` files are read only with
``torch.load(weights_only=True)``: a pickle that holds anything but tensors is
refused, never executed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import mmap
import os
import pickle
import re
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model._json import read_json_object
from model.gpt import GPT, GPTConfig, RopeScaling
from model.hf_decoder import HFDecoder, HFDecoderError, MaxMemory, load_hf_decoder
from model.identity import BackgroundDigest, ModelIdentity, PendingIdentity
from model.tokenizer import TextTokenizer, TokenizerConfigError

# the bundled checkpoints: assets/ in a checkout, model/bundled/ once installed (pyproject.toml maps one to the other)
_HERE = Path(__file__).resolve().parent
ASSETS = _HERE / "bundled" if (_HERE / "bundled" / "story-gpt").is_dir() else _HERE.parent / "assets"
BUNDLED_DIR = ASSETS / "story-gpt"
BUNDLED_MODELS: dict[str, str] = {
    "story-gpt": "GPT-2 architecture, 4 layers × 4 heads, d=128, learned positions, LayerNorm, GELU (0.96M)",
    "story-llama": "Llama architecture, 4 layers × 4 query heads sharing 2 key/value heads, d=128, RoPE, RMSNorm, "
                   "SwiGLU, untied W_U",
}
SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2")  # re-implemented here (model/gpt.py)
IMPLEMENTATIONS = ("auto", "ours", "transformers")  # load_hf: who runs the model
SUPPORTED_ACTIVATIONS = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 100 << 20  # a safetensors header is JSON names and shapes: 100 MB is far beyond any real one
READ_CHUNK = 16 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Tolerance on |Δ logits| between two computations of the same model in a dtype (ours vs Hugging Face,
# cached vs recompute). float32: 1e-4, the project's parity bar (measured ≈1e-6 on small models). bf16 keeps 8
# significant bits (a step of 2^-8 ≈ 0.4% relative, 0.125 at a logit of 20) and float16 11 bits, and a different
# but equally valid order of operations (fused QKV, a cached decode) rounds differently at every layer. Measured
# on the bundled story-gpt (logits up to 22) against Hugging Face in the same dtype: 0.5 in bf16, 0.07 in fp16;
# the values below keep a 2× margin (tests/test_model_families.py checks them on that model).
LOGIT_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1.0, torch.float16: 0.15}


class ModelLoadError(ValueError):
    """A checkpoint directory or file that cannot be loaded; the message names the file and the problem."""


def logit_tolerance(dtype: torch.dtype | str) -> float:
    """How far two logits of the same model in ``dtype`` may differ and still count as equal."""
    return LOGIT_TOLERANCE[_dtype(dtype)]


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not supported: use one of {', '.join(DTYPES)}")
        return DTYPES[dtype.removeprefix("torch.")]
    if dtype not in LOGIT_TOLERANCE:
        raise ModelLoadError(f"dtype {dtype!r} is not supported: use torch.float32, torch.bfloat16 or torch.float16")
    return dtype


def _device(device: torch.device | str) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"device {device!r} is not a device name ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {str(device)!r} was asked for, but torch.cuda.is_available() is False here")
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {str(device)!r} is not supported: use 'cpu' or 'cuda'")
    return dev


# ---- config.json ----------------------------------------------------------------------------------------------


def _get(raw: dict, key: str, default=None):
    value = raw.get(key, default)
    return default if value is None else value


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
        attention_bias = bool(_get(raw, "attention_bias", False))
        qkv_bias = attn_out_bias = attention_bias
        mlp_bias = bool(_get(raw, "mlp_bias", False))
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
        tie_embeddings=bool(_get(raw, "tie_word_embeddings", False)),
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


# ---- what the weights must hold --------------------------------------------------------------------------------

_LAYER = re.compile(r"^(?:transformer\.)?(?:h|model\.layers)\.(\d+)\.")
_GPT2_IGNORED = re.compile(r"^(?:transformer\.)?h\.\d+\.attn\.(?:bias|masked_bias)$|^lm_head\.weight$")
_LLAMA_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def hf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds, by its Hugging Face name, with its shape."""
    d, V, d_ff = config.d_model, config.vocab_size, config.d_ff
    shapes: dict[str, tuple[int, ...]] = {}
    if config.family == "gpt2":
        shapes["transformer.wte.weight"] = (V, d)
        shapes["transformer.wpe.weight"] = (config.n_ctx, d)
        for i in range(config.n_layer):
            p = f"transformer.h.{i}."
            for ln in ("ln_1", "ln_2"):
                shapes[p + ln + ".weight"] = shapes[p + ln + ".bias"] = (d,)
            shapes[p + "attn.c_attn.weight"], shapes[p + "attn.c_attn.bias"] = (d, config.d_qkv), (config.d_qkv,)
            shapes[p + "attn.c_proj.weight"], shapes[p + "attn.c_proj.bias"] = (d, d), (d,)
            shapes[p + "mlp.c_fc.weight"], shapes[p + "mlp.c_fc.bias"] = (d, d_ff), (d_ff,)
            shapes[p + "mlp.c_proj.weight"], shapes[p + "mlp.c_proj.bias"] = (d_ff, d), (d,)
        shapes["transformer.ln_f.weight"] = shapes["transformer.ln_f.bias"] = (d,)
        return shapes
    q_width, kv_width = config.n_head * config.d_head, config.n_kv_heads * config.d_head
    shapes["model.embed_tokens.weight"] = (V, d)
    for i in range(config.n_layer):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (d,)
        for name, width in (("q_proj", q_width), ("k_proj", kv_width), ("v_proj", kv_width)):
            shapes[p + f"self_attn.{name}.weight"] = (width, d)
            if config.qkv_bias:
                shapes[p + f"self_attn.{name}.bias"] = (width,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_width)
        if config.attn_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        for name, shape in (("gate_proj", (d_ff, d)), ("up_proj", (d_ff, d)), ("down_proj", (d, d_ff))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if config.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (d,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (V, d)
    return shapes


def _canonical(name: str, family: str) -> str:
    """GPT-2 checkpoints exist with and without the ``transformer.`` prefix; compare names with it."""
    if family == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
        return "transformer." + name
    return name


def _ignored(name: str, config: GPTConfig) -> bool:
    if config.family == "gpt2":
        return bool(_GPT2_IGNORED.match(name))
    # a tied checkpoint may still carry lm_head (Hugging Face ties it to the embedding and ignores it)
    return bool(_LLAMA_IGNORED.match(name)) or (config.tie_embeddings and name == "lm_head.weight")


def check_weights(held: dict[str, tuple[tuple[int, ...], Path]], config: GPTConfig, cfg_path: Path) -> None:
    """Compare what the files declare (name → (shape, file)) with what ``config`` implies; raise on any mismatch.

    Runs on the headers alone, before any tensor is allocated."""
    layers = sorted({int(m.group(1)) for name in held if (m := _LAYER.match(name))})
    if layers != list(range(config.n_layer)):
        what = (f"{len(layers)} layers (blocks {layers[0]}–{layers[-1]})" if layers and layers == list(
            range(layers[0], layers[-1] + 1)) else f"layers {_ranges(layers)}" if layers else "no layers")
        raise ModelLoadError(
            f"{cfg_path}: says n_layer = {config.n_layer}, but the weights hold {what}"
        )
    expected = hf_shapes(config)
    for name, (shape, file) in held.items():
        if name in expected:
            if tuple(shape) != expected[name]:
                raise ModelLoadError(
                    f"{file}: tensor {name!r} has shape {list(shape)}, but config.json implies {list(expected[name])}"
                )
        elif not _ignored(name, config):
            raise ModelLoadError(f"{file}: unexpected tensor {name!r}, not part of a {config.family} model")
    missing = [name for name in expected if name not in held]
    if missing:
        raise ModelLoadError(
            f"{cfg_path.parent}: the weights lack {len(missing)} tensor(s) config.json implies: "
            + ", ".join(missing[:4]) + (" …" if len(missing) > 4 else "")
        )


def _ranges(xs: list[int]) -> str:
    shown = ", ".join(str(x) for x in xs[:8])
    return shown + (f" … ({len(xs)} in all)" if len(xs) > 8 else "")


@dataclasses.dataclass(frozen=True)
class _Part:
    """One Hugging Face tensor inside one of ours."""

    source: str  # its Hugging Face name (canonical)
    transposed: bool  # an ``nn.Linear`` weight [d_out, d_in], which we store as [d_in, d_out]


def our_layout(config: GPTConfig) -> dict[str, tuple[_Part, ...]]:
    """Each tensor of our state dict as the Hugging Face tensors it is made of, side by side along its last
    dimension: W_QKV = [W_Q | W_K | W_V] and [W_gate | W_up], Llama-family ``nn.Linear`` weights transposed
    to our ``[d_in, d_out]`` (``model/gpt.py``'s ``Projection`` says why), GPT-2's tensors as they are."""
    layout: dict[str, tuple[_Part, ...]] = {}
    if config.family == "gpt2":
        for name in hf_shapes(config):
            parts = name.removeprefix("transformer.").split(".")
            ours = {"wte": "embed", "wpe": "pos_embed", "ln_f": "ln_final"}.get(parts[0])
            if ours is None:  # h.{i}.<module>.…
                sub = {"ln_1": "ln1", "ln_2": "ln2"}.get(parts[2], parts[2])
                ours = ".".join(["blocks", parts[1], sub, *parts[3:-1]])
            layout[f"{ours}.{parts[-1]}"] = (_Part(name, False),)
        return layout

    def linear(*names: str) -> tuple[_Part, ...]:
        return tuple(_Part(n, True) for n in names)

    def vector(*names: str) -> tuple[_Part, ...]:
        return tuple(_Part(n, False) for n in names)

    layout["embed.weight"] = vector("model.embed_tokens.weight")
    layout["ln_final.weight"] = vector("model.norm.weight")
    if not config.tie_embeddings:
        layout["unembed.weight"] = linear("lm_head.weight")  # W_U: [d, V]
    for i in range(config.n_layer):
        p, o = f"model.layers.{i}.", f"blocks.{i}."
        layout[o + "ln1.weight"] = vector(p + "input_layernorm.weight")
        layout[o + "ln2.weight"] = vector(p + "post_attention_layernorm.weight")
        layout[o + "attn.c_attn.weight"] = linear(*(p + f"self_attn.{x}_proj.weight" for x in "qkv"))
        if config.qkv_bias:
            layout[o + "attn.c_attn.bias"] = vector(*(p + f"self_attn.{x}_proj.bias" for x in "qkv"))
        layout[o + "attn.c_proj.weight"] = linear(p + "self_attn.o_proj.weight")
        if config.attn_out_bias:
            layout[o + "attn.c_proj.bias"] = vector(p + "self_attn.o_proj.bias")
        layout[o + "mlp.c_fc.weight"] = linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        layout[o + "mlp.c_proj.weight"] = linear(p + "mlp.down_proj.weight")
        if config.mlp_bias:
            layout[o + "mlp.c_fc.bias"] = vector(p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias")
            layout[o + "mlp.c_proj.bias"] = vector(p + "mlp.down_proj.bias")
    return layout


def hf_to_state(source: Callable[[str], torch.Tensor], config: GPTConfig, *, dtype: torch.dtype,
                device: torch.device, done: Callable[[str], None] = lambda name: None) -> dict[str, torch.Tensor]:
    """Our state dict (``our_layout``) from Hugging Face tensors, each read by ``source(name)`` and copied
    once, straight into its place in a fresh contiguous tensor of ``dtype`` on ``device``: the copy transposes,
    converts and concatenates in one pass, so loading writes the weights once. ``done(name)`` is told when a
    source has been copied (the loader then lets its file pages go: peak memory about the weights once,
    bench/bench_big_load.py)."""
    state: dict[str, torch.Tensor] = {}
    scratch = torch.empty(0, dtype=dtype, device=device)
    for ours, parts in our_layout(config).items():
        views = [source(p.source).t() if p.transposed else source(p.source) for p in parts]
        width = sum(v.shape[-1] for v in views)
        out = torch.empty((*views[0].shape[:-1], width), dtype=dtype, device=device)
        at = 0
        for part, view in zip(parts, views):
            place = out.narrow(-1, at, view.shape[-1])
            if part.transposed and len(parts) > 1:
                # a transposing copy into a contiguous tensor takes PyTorch's blocked path, about twice as fast
                # as one into columns of a wider tensor (measured on 5632 × 2048): transpose into a reused
                # scratch tensor, then copy its rows into place
                scratch = scratch if scratch.numel() >= view.numel() else torch.empty(view.numel(), dtype=dtype,
                                                                                        device=device)
                place.copy_(scratch[:view.numel()].view(view.shape).copy_(view))
            else:
                place.copy_(view)
            at += view.shape[-1]
        del views
        state[ours] = out
        for p in parts:
            done(p.source)
    return state


def state_to_hf(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under Hugging Face's names and in their layout (the inverse of ``hf_to_state``)."""
    config = model.config
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    if config.family == "gpt2":
        for name, t in state.items():
            parts = name.split(".")
            if parts[0] in ("embed", "pos_embed", "ln_final"):
                out[{"embed": "transformer.wte.", "pos_embed": "transformer.wpe.",
                     "ln_final": "transformer.ln_f."}[parts[0]] + parts[1]] = t
            else:
                sub = {"ln1": "ln_1", "ln2": "ln_2"}.get(parts[2], parts[2])
                out[".".join(["transformer.h", parts[1], sub, *parts[3:]])] = t
        return {k: v.contiguous() for k, v in out.items()}
    q_width, kv_width = config.n_head * config.d_head, config.n_kv_heads * config.d_head
    out["model.embed_tokens.weight"] = state["embed.weight"]
    out["model.norm.weight"] = state["ln_final.weight"]
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["unembed.weight"].t()
    for i in range(config.n_layer):
        p, o = f"model.layers.{i}.", f"blocks.{i}."
        out[p + "input_layernorm.weight"] = state[o + "ln1.weight"]
        out[p + "post_attention_layernorm.weight"] = state[o + "ln2.weight"]
        q, k, v = state[o + "attn.c_attn.weight"].split((q_width, kv_width, kv_width), dim=1)
        for x, t in zip("qkv", (q, k, v)):
            out[p + f"self_attn.{x}_proj.weight"] = t.t()
        if config.qkv_bias:
            for x, t in zip("qkv", state[o + "attn.c_attn.bias"].split((q_width, kv_width, kv_width))):
                out[p + f"self_attn.{x}_proj.bias"] = t
        out[p + "self_attn.o_proj.weight"] = state[o + "attn.c_proj.weight"].t()
        if config.attn_out_bias:
            out[p + "self_attn.o_proj.bias"] = state[o + "attn.c_proj.bias"]
        gate, up = state[o + "mlp.c_fc.weight"].split(config.d_ff, dim=1)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate.t(), up.t()
        out[p + "mlp.down_proj.weight"] = state[o + "mlp.c_proj.weight"].t()
        if config.mlp_bias:
            gate_b, up_b = state[o + "mlp.c_fc.bias"].split(config.d_ff)
            out[p + "mlp.gate_proj.bias"], out[p + "mlp.up_proj.bias"] = gate_b, up_b
            out[p + "mlp.down_proj.bias"] = state[o + "mlp.c_proj.bias"]
    return {k: v.clone().contiguous() for k, v in out.items()}  # clone: safetensors refuses shared storage


# ---- reading files ---------------------------------------------------------------------------------------------


def _check_dir(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ModelLoadError(f"{path!r}: a checkpoint path must be a string or a path, not {type(path).__name__}")
    if "\x00" in os.fspath(path):
        raise ModelLoadError(f"{os.fspath(path)!r}: not a usable path (it holds a NUL byte)")
    try:
        p = Path(path).expanduser()
    except RuntimeError as e:  # "~nosuchuser/x": no such user, so no home directory to expand
        raise ModelLoadError(f"{os.fspath(path)!r}: cannot expand the home directory ({e})") from None
    try:
        resolved = p.resolve(strict=True)
    except FileNotFoundError:
        raise ModelLoadError(f"{p}: no such directory") from None
    except ValueError as e:  # an embedded NUL byte
        raise ModelLoadError(f"{os.fspath(path)!r}: not a usable path ({e})") from None
    except (RuntimeError, OSError) as e:  # a symlink loop lands here
        raise ModelLoadError(f"{p}: cannot resolve the path ({e})") from None
    if not resolved.is_dir():
        raise ModelLoadError(f"{p}: is a file, not a directory; give the directory holding config.json")
    for entry in resolved.iterdir():
        if entry.suffix in MODEL_FILE_SUFFIXES:
            check_link(resolved, entry)
    return resolved


def _read_json(path: Path, what: str) -> dict:
    return read_json_object(path, MAX_CONFIG_BYTES, what, ModelLoadError)


def read_config(directory: Path) -> GPTConfig:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{cfg_path}: missing; a checkpoint directory needs config.json")
    return config_from_hf(_read_json(cfg_path, "a config"), cfg_path)


def _inside(directory: Path, name: str) -> bool:
    """Whether ``name`` names a path inside ``directory`` *as written*: no absolute path, no ``..``.

    The link path is what counts, not where a symlink points: in a Hugging Face cache snapshot every
    file is a symlink into ``../../blobs/``, and that is fine; an index naming ``../../etc/passwd`` is not."""
    if not name or "\x00" in name or os.path.isabs(name):
        return False
    normal = os.path.normpath(name)
    return not (normal == ".." or normal.startswith(".." + os.sep) or normal == ".")


MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".txt", ".jinja", ".model", ".pt")  # what a loader reads


def _link_roots(directory: Path) -> tuple[Path, ...]:
    """Where the files of ``directory`` (resolved) may really lie: in it, and for a Hugging Face cache snapshot
    (``models--org--name/snapshots/<hash>``) also in that repository's own ``blobs/``."""
    repo = directory.parent.parent
    if directory.parent.name == "snapshots" and repo.name.startswith("models--"):
        return directory, repo / "blobs"
    return (directory,)


def check_link(directory: Path, file: Path) -> None:
    """Refuse ``file`` when it is (or passes through) a symlink that leads out of ``directory`` (resolved) —
    except into the Hugging Face cache's ``../../blobs/`` of the same repository, where every snapshot file
    points. A directory whose ``model.safetensors`` links to ``~/.ssh/id_rsa`` is refused, not read."""
    try:
        target = file.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop
        raise ModelLoadError(f"{file}: cannot resolve the path ({e})") from None
    if target == file or any(target.is_relative_to(root) for root in _link_roots(directory)):
        return
    where = " or its Hugging Face cache blobs/" if len(_link_roots(directory)) > 1 else ""
    raise ModelLoadError(
        f"{file}: a symlink to {target}, outside the checkpoint directory{where}: refused (copy the file in, "
        "or give the directory it lives in)")


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of ``directory``: the index's shards (sorted) or ``model.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        raw = _read_json(index, "a safetensors index")
        weight_map = raw.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: not a valid safetensors index (no \"weight_map\" object)")
        bad = [v for v in weight_map.values() if not isinstance(v, str)]
        if bad:
            raise ModelLoadError(
                f"{index}: not a valid safetensors index (shard names must be strings, got {bad[0]!r})")
        files = []
        for name in sorted(set(weight_map.values())):
            if not _inside(directory, name):
                raise ModelLoadError(f"{index}: shard {name!r} lies outside the checkpoint directory")
            check_link(directory, directory / name)
            files.append(directory / name)
        return files
    single = directory / "model.safetensors"
    return [single] if single.exists() or single.is_symlink() else []


class SafetensorsFile:
    """One safetensors file, read by hand: the header first (names, dtypes, shapes — checkable before any
    allocation), then the data mapped, not read: ``tensor(name)`` is a view of the file's pages (the page
    cache, shared with the identity's hash on its own thread, ``model.identity.BackgroundDigest``), copied
    once into our layout (``hf_to_state``), after which ``release(name)`` lets those pages go. (As with any
    memory-mapped load, transformers' included, a file cut short by another process *while* it is being
    copied would stop the process with SIGBUS; the sizes are checked against the header before.)

    Format: 8 bytes little-endian header length N, N bytes of JSON ``{name: {dtype, shape,
    data_offsets: [begin, end]}, "__metadata__": {...}}``, then the data (offsets relative to its start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                first = f.read(8)
                if len(first) < 8:
                    self._fail("shorter than the 8-byte header length")
                n = int.from_bytes(first, "little")
                if n > MAX_HEADER_BYTES or 8 + n > size:
                    self._fail(f"the header claims {n:,} bytes but the file has {size:,}")
                header_bytes = f.read(n)
                # copy-on-write: torch.frombuffer wants a writable buffer, and nothing is ever written. Never
                # mmap.close()d: that unmaps at once even while views made by torch.frombuffer live on (they
                # keep the object, not its buffer, alive), and a view left in an error's traceback would then
                # read unmapped memory and crash; the file is unmapped when the last view of it goes
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise ModelLoadError(f"{path}: cannot be read ({e})") from None
        try:
            header = json.loads(header_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            self._fail(f"the header is not JSON ({e})")
        if not isinstance(header, dict):
            self._fail("the header is not a JSON object")
        self._data_start = 8 + n
        self.data_size = size - 8 - n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = SAFETENSORS_DTYPES[info["dtype"]]
                shape = tuple(info["shape"])
                begin, end = info["data_offsets"]
                if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (*shape, begin, end)):
                    raise ValueError("negative or non-integer numbers")
            except (KeyError, TypeError, ValueError) as e:
                self._fail(f"tensor {name!r} has a malformed entry ({type(e).__name__}: {e})")
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if not begin <= end <= self.data_size or end - begin != nbytes:
                self._fail(f"tensor {name!r} declares bytes {begin}–{end} for {nbytes:,} bytes of data, "
                           f"in {self.data_size:,} bytes")
            self.entries[name] = (dtype, shape, begin, end)
        pos = 0
        for name, (_, _, begin, end) in sorted(self.entries.items(), key=lambda kv: kv[1][2]):
            if begin < pos:
                self._fail(f"tensor {name!r} overlaps the one before it")
            pos = end

    def _fail(self, problem: str):
        raise ModelLoadError(f"{self.path}: not a readable safetensors file ({problem})")

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name``, a view of the mapped file (no copy; its pages are read when first touched)."""
        dtype, shape, begin, end = self.entries[name]
        if end == begin:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=end - begin, offset=self._data_start + begin)
        return raw.view(dtype).view(shape)

    def release(self, name: str) -> None:
        """Unmap tensor ``name``'s pages once its copy exists, so that the process holds the weights once, not
        twice. The mapping is private and never written, so a page touched again is read again from the file:
        releasing is always safe, only ever slower."""
        _, _, begin, end = self.entries[name]
        if end == begin or not hasattr(self._map, "madvise"):  # madvise: not on Windows
            return
        start = (self._data_start + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        with contextlib.suppress(OSError):  # e.g. locked pages: they stay, and only memory is spent
            self._map.madvise(mmap.MADV_DONTNEED, start, self._data_start + end - start)


def _read_bin(file: Path) -> dict[str, torch.Tensor]:
    """``pytorch_model.bin``: read once into memory, unpickled with ``weights_only=True``."""
    try:
        data = io.BytesIO()
        with open(file, "rb") as f:
            while chunk := f.read(READ_CHUNK):
                data.write(chunk)
        data.seek(0)
        state = torch.load(data, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"{file}: refused — it holds Python objects other than tensors, and pickles are only "
            f"loaded with weights_only=True ({first})"
        ) from None
    except Exception as e:  # noqa: BLE001 - weights_only runs no code of the file's: any error is a malformed file
        # (a crafted pickle can call an allowed rebuild function with wrong arguments: TypeError, IndexError, …)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{file}: not a readable PyTorch weights file ({type(e).__name__}: {first})") from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ModelLoadError(f"{file}: expected a dictionary of tensors")
    return state


def _load_tokenizer(directory: Path, vocab_size: int) -> TextTokenizer | None:
    """The directory's tokenizer as transformers reads it (special tokens, end-of-sequence ids, chat template:
    ``TextTokenizer.from_directory``), or None when it has none."""
    tok_json = directory / "tokenizer.json"
    try:
        tok = TextTokenizer.from_directory(directory)
    except TokenizerConfigError as e:
        raise ModelLoadError(str(e)) from None
    except Exception as e:  # tokenizers raises plain Exception subclasses from Rust
        source = tok_json if tok_json.is_file() else directory / "vocab.json"
        raise ModelLoadError(f"{source}: not a readable tokenizer ({e})") from None
    if tok is None:
        return None
    if tok.vocab_size > vocab_size:
        raise ModelLoadError(
            f"{tok.source}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {vocab_size}"
        )
    return tok


def _display_name(directory: Path) -> str:
    """``org/name`` for a Hugging Face cache snapshot (``models--org--name/snapshots/<hash>``), else the folder."""
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent.name.removeprefix("models--").replace("--", "/")
    return directory.name


# ---- the public loaders ----------------------------------------------------------------------------------------


def known_to_transformers(model_type: str) -> bool:
    """Whether the installed transformers has a config class for ``model_type`` (then it can run it)."""
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def load_hf(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    name: str | None = None,
    implementation: str = "auto",
    max_memory: MaxMemory | None = None,
    offload_folder: str | os.PathLike | None = None,
) -> tuple[GPT | HFDecoder, TextTokenizer | None]:
    """Load a local ``save_pretrained`` directory of a decoder-only causal LM.

    ``implementation``: "ours" builds our GPT (GPT-2, Llama, Mistral, Qwen2: model/gpt.py);
    "transformers" has transformers run it, seen through our hook points (any family whose attention
    goes through transformers' attention interface: model/hf_decoder.py); "auto" (the default) is
    "ours" for the four families and "transformers" for every other ``model_type``.

    ``max_memory`` (bytes, "4GiB", or ``{0: "20GiB", "cpu": "30GiB"}``) runs a model larger than the memory
    it is given: transformers runs it, and accelerate keeps what does not fit on disk (in ``offload_folder``,
    by default a private temporary directory) and reads it in for each layer's forward
    (``load_hf_decoder``). Our implementation holds every weight, so ``implementation="ours"`` refuses it.

    Returns the model (eval mode, no gradients, ``dtype`` — float32 unless asked for
    bfloat16/float16 —, on ``device``) carrying ``model.identity``, and its tokenizer,
    or None when the directory has none. Raises ``ModelLoadError`` naming the file
    and the problem for anything missing, corrupt, mis-shaped or unsupported."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    target_dtype = _dtype(dtype)
    target_device = _device(device)
    directory = _check_dir(path)
    raw_config = _read_json(directory / "config.json", "a config") if (directory / "config.json").is_file() else {}
    model_type = raw_config.get("model_type") if isinstance(raw_config, dict) else None
    if max_memory is not None and implementation == "ours":
        raise ModelLoadError("max_memory offloads weights with accelerate, which needs transformers to run the "
                             "model: use implementation='transformers' (or 'auto')")
    if implementation == "transformers" or max_memory is not None or (
            implementation == "auto" and isinstance(model_type, str) and model_type not in SUPPORTED_MODEL_TYPES
            and known_to_transformers(model_type)):
        try:
            generic = load_hf_decoder(directory, dtype=target_dtype, device=target_device, name=name,
                                      max_memory=max_memory, offload_folder=offload_folder)
        except HFDecoderError as e:
            raise ModelLoadError(str(e)) from None
        return generic, _load_tokenizer(directory, generic.config.vocab_size)
    config = read_config(directory)
    files = safetensors_files(directory)
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file}: missing (listed by the index)")
    bin_file = directory / "pytorch_model.bin"
    weight_files = files or ([bin_file] if bin_file.is_file() else [])  # regular files only: a FIFO never ends
    # the identity's hash of the weight files (their bytes, shards in order) runs on a second thread while
    # they are copied into our layout, and goes on after the load returns: the first reader of model.identity
    # (the first traced step) waits for what is left of it (bench/bench_big_load.py)
    digest = BackgroundDigest(weight_files, by_name=False) if weight_files else None
    try:
        model = _build_ours(directory, config, files, bin_file, target_dtype, target_device)
    except BaseException:
        if digest is not None:
            digest.abandon()  # a refused or failed load leaves no thread reading a large directory for nothing
        raise
    display_name = name or _display_name(directory)
    if digest is None:
        model.identity = ModelIdentity(name=display_name, source=str(directory), family=config.family,
                                       config=model.config.to_dict(), weights_digest="")
    else:
        model.identity = PendingIdentity(digest, name=display_name, source=str(directory), family=config.family,
                                         config=model.config.to_dict())
        weakref.finalize(model, digest.abandon)  # nor does a model dropped before its hash is done
    tokenizer = _load_tokenizer(directory, model.config.vocab_size)
    return model, tokenizer


def _build_ours(directory: Path, config: GPTConfig, files: list[Path], bin_file: Path, target_dtype: torch.dtype,
                target_device: torch.device) -> GPT:
    """Our GPT from a directory's weights: every header checked first, then each tensor copied once from the
    mapped files into our layout (``hf_to_state``), its file pages let go as soon as its copy exists."""
    cfg_path = directory / "config.json"
    if files:
        opened = [SafetensorsFile(file) for file in files]  # headers only
        where: dict[str, tuple[SafetensorsFile, str]] = {
            _canonical(tensor_name, config.family): (st, tensor_name) for st in opened for tensor_name in st.entries}
        check_weights({k: (st.entries[n][1], st.path) for k, (st, n) in where.items()}, config, cfg_path)
        raw = {k: st.tensor(n) for k, (st, n) in where.items()}  # views of the mapped files: nothing read yet

        def release(name: str) -> None:
            st, tensor_name = where[name]
            st.release(tensor_name)
    elif bin_file.exists():
        raw = {_canonical(k, config.family): v for k, v in _read_bin(bin_file).items()}
        check_weights({k: (tuple(v.shape), bin_file) for k, v in raw.items()}, config, cfg_path)

        def release(name: str) -> None:
            raw.pop(name)  # the only copy besides ours: let it go
    else:
        raise ModelLoadError(
            f"{directory}: no weights found (looked for model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin)"
        )
    config = _untied_if_distinct(config, raw, directory)
    for tensor_name in hf_shapes(config):
        if not raw[tensor_name].is_floating_point():
            raise ModelLoadError(f"{directory}: tensor {tensor_name!r} is {raw[tensor_name].dtype}, not floating point")
    state = hf_to_state(raw.__getitem__, config, dtype=target_dtype, device=target_device, done=release)
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict(state, assign=True)
    return model.eval().requires_grad_(False)


def _untied_if_distinct(config: GPTConfig, raw: dict[str, torch.Tensor], directory: Path) -> GPTConfig:
    """A config that says ``tie_word_embeddings`` over a checkpoint whose ``lm_head.weight`` differs from the
    embedding: transformers keeps the distinct lm_head then (it ties only equal or missing weights), so the
    model is loaded untied, as transformers loads it."""
    head = raw.get("lm_head.weight")
    if not config.tie_embeddings or head is None:
        return config
    embed = raw.get("model.embed_tokens.weight", raw.get("transformer.wte.weight"))
    if embed is None or (head.shape == embed.shape and torch.equal(head, embed)):
        return config
    if config.family == "gpt2":
        raise ModelLoadError(f"{directory}: lm_head.weight differs from the tied embedding; our GPT-2 ties them. "
                             "load_hf(..., implementation='transformers') runs it as transformers does (untied)")
    return dataclasses.replace(config, tie_embeddings=False)


def load_hf_gpt2(path: str | os.PathLike) -> tuple[GPT, TextTokenizer | None]:
    """Load a GPT-2 written by Hugging Face ``save_pretrained`` from a local directory (float32, CPU).

    ``load_hf`` loads every supported family; this one refuses anything but ``gpt2``."""
    directory = _check_dir(path)
    raw = _read_json(directory / "config.json", "a config") if (directory / "config.json").is_file() else {}
    if raw and raw.get("model_type") != "gpt2":
        raise ModelLoadError(f"{directory / 'config.json'}: model_type is {raw.get('model_type')!r}, but "
                             "load_hf_gpt2 loads only 'gpt2' checkpoints (load_hf loads every supported family)")
    model, tokenizer = load_hf(directory)
    assert isinstance(model, GPT)  # gpt2 is one of the families load_hf builds itself
    return model, tokenizer


def load_tokenizer(path: str | os.PathLike, vocab_size: int, *, required: bool = True) -> TextTokenizer | None:
    """A tokenizer from ``path``: a directory (its tokenizer.json or vocab.json + merges.txt, and the config files
    beside them), a ``tokenizer.json`` / ``vocab.json`` (read with its directory's config files), or any other
    ``tokenizers`` JSON file. None when a directory has none and ``required`` is False; a ``ModelLoadError`` when
    it is required, or when the tokenizer knows more ids than the model's ``vocab_size``."""
    p = Path(path).expanduser()
    if p.is_file() and p.name not in ("tokenizer.json", "vocab.json"):
        try:
            tok = TextTokenizer.from_file(p)
        except Exception as e:  # tokenizers raises plain Exception subclasses from Rust
            raise ModelLoadError(f"{p}: not a readable tokenizer ({e})") from None
        if tok.vocab_size > vocab_size:
            raise ModelLoadError(f"{p}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                                 f"{vocab_size}")
        return tok
    directory = p.parent if p.is_file() else p
    if not directory.is_dir():
        raise ModelLoadError(f"{p}: no such tokenizer file or directory")
    found = _load_tokenizer(directory.resolve(), vocab_size)
    if found is None and required:
        raise ModelLoadError(f"{p}: no tokenizer here (looked for tokenizer.json, and vocab.json + merges.txt)")
    return found


def load_model(
    spec: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    name: str | None = None,
    tokenizer: str | os.PathLike | None = None,
    max_memory: MaxMemory | None = None,
    weights: bool = True,
) -> tuple[GPT | HFDecoder, TextTokenizer | None]:
    """Load a model however it is named (``model.resolve.resolve_model_path``): a local directory, a Hugging
    Face cache folder (``models--org--name`` or one of its ``snapshots/<hash>``), a repo id ``org/name`` found in
    the local cache (never downloaded), or a nanoGPT ``ckpt.pt`` (the file or its out_dir).

    ``tokenizer`` (a path) replaces the one the checkpoint carries; a nanoGPT checkpoint needs one beside it or
    here. ``max_memory`` offloads what does not fit (``load_hf``; not for a nanoGPT checkpoint, which is one
    pickle-free file read whole). Returns what ``load_hf`` / ``load_nanogpt`` return.

    ``weights=False``: a dry run (model/dry_run.py): the model built on the meta device from its config alone —
    also from ``shapes:NAME`` (a shipped config) or a bare ``config.json`` — with its tokenizer when it has one."""
    from model.nanogpt import is_nanogpt_path, load_nanogpt
    from model.resolve import resolve_model_path

    if not weights:
        from model.dry_run import DryRunError, build_dry

        if max_memory is not None or str(device) != "cpu":
            raise ModelLoadError("a dry run (weights=False) builds the model on the meta device: no device or "
                                 "max_memory to place it on")
        try:
            dry, tok = build_dry(spec, dtype=dtype, name=name)
        except DryRunError as e:
            raise ModelLoadError(str(e)) from None
        if tokenizer is not None:
            tok = load_tokenizer(tokenizer, dry.config.vocab_size)
        return dry, tok  # a GPT or an HFDecoder, on the meta device

    path = resolve_model_path(spec)
    if is_nanogpt_path(path):
        if max_memory is not None:
            raise ModelLoadError(f"{path}: a nanoGPT checkpoint is loaded whole; max_memory (offloading with "
                                 "accelerate) needs a Hugging Face directory")
        return load_nanogpt(path, tokenizer=tokenizer, dtype=dtype, device=device, name=name)
    model, tok = load_hf(path, dtype=dtype, device=device, name=name, max_memory=max_memory)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer, model.config.vocab_size)
    return model, tok


def save_hf(model: GPT, path: str | os.PathLike, tokenizer: TextTokenizer | None = None,
            extra: dict | None = None) -> Path:
    """Write ``model`` as a Hugging Face directory of its family (config.json + model.safetensors [+ tokenizer.json]);
    ``GPT2LMHeadModel`` / ``LlamaForCausalLM`` / … ``.from_pretrained`` read it back."""
    directory = Path(path)
    config = config_to_hf(model.config)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state_to_hf(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    if extra:
        config.update(extra)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save(directory / "tokenizer.json")
    return directory


def save_hf_gpt2(
    model: GPT, path: str | os.PathLike, tokenizer: TextTokenizer | None = None, extra: dict | None = None
) -> Path:
    """Write a GPT-2 as a Hugging Face GPT-2 directory (config.json + model.safetensors [+ tokenizer.json])."""
    if model.config.family != "gpt2":
        raise ValueError(f"save_hf_gpt2 writes GPT-2 checkpoints; this model is {model.config.family}: use save_hf")
    return save_hf(model, path, tokenizer, extra)


def load_bundled(name: str = "story-gpt") -> tuple[GPT, TextTokenizer]:
    """A small story model shipped in ``assets/<name>/`` (no network, ever); ``BUNDLED_MODELS`` lists them."""
    if name not in BUNDLED_MODELS:
        raise ModelLoadError(f"no bundled model is called {name!r}; bundled: {', '.join(BUNDLED_MODELS)}")
    directory = ASSETS / name
    model, tokenizer = load_hf(directory, name=name)
    assert isinstance(model, GPT)  # every bundled model is of a family load_hf builds itself (gpt2, llama)
    if tokenizer is None:
        raise ModelLoadError(f"{directory}: the bundled model has no tokenizer.json")
    return model, tokenizer
