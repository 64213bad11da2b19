"""A dry run: any model built from its ``config.json`` alone on PyTorch's ``meta`` device — shapes and dtypes, no
weights, no memory — so that a 405B model's forward can be traced, shape for shape, on a laptop.

``build_dry(spec)`` (what ``load_model(spec, weights=False)`` calls) accepts

* ``shapes:NAME``: a config shipped with the project (``assets/shapes/NAME/config.json``, ``SHAPES``);
* a ``config.json`` file;
* a directory holding ``config.json`` (and a tokenizer, which is used when present), a Hugging Face cache folder,
  or a repo id found in the local cache (``model.sources._resolve``; never downloaded). Where the directory holds
  safetensors, only their *headers* are read (names, dtypes, shapes: no tensor bytes), and checked against the
  model the config describes.

Our GPT (model/gpt/_gpt.py) is built for the families we implement (gpt2, llama, mistral, qwen2); transformers builds
every other decoder (``from_config`` under ``torch.device("meta")``, wrapped in ``HFDecoder``). The dtype is the
config's ``torch_dtype`` (or ``dtype``) unless asked otherwise. Mixture-of-experts layers run transformers'
``batched_mm`` experts, which computes every token's chosen experts with shapes fixed in advance: the default
experts loop asks which experts were chosen (``nonzero``), a question a meta tensor cannot answer. The experts
module is one module either way, so its records are the same.

Refused before anything is built: an unknown ``model_type`` (by name), numbers beyond our ``GPTConfig``'s limits
(vocabulary, width) and more than ``MAX_DRY_LAYERS`` layers — each layer makes dozens of records per step, and a
dry-run trace holds at most ``MAX_DRY_RECORDS``; a config transformers refuses gives transformers' own message.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gpt_shape_tracer.model.gpt import GPT, MAX_VOCAB, MAX_WIDTH, GPTConfig, ModelIdentity
from gpt_shape_tracer.model.sources._common import check_expert_counts
from gpt_shape_tracer.model.sources._hf_decoder import HFDecoder
from gpt_shape_tracer.model.sources._tokenizer import TextTokenizer

SHAPES_PREFIX = "shapes:"
_MODEL = Path(__file__).resolve().parent.parent  # model/: installed, assets/ is model/bundled/ (pyproject.toml)
SHAPES_DIR = (_MODEL / "bundled" / "shapes" if (_MODEL / "bundled" / "shapes").is_dir()
              else _MODEL.parent / "assets" / "shapes")
MAX_DRY_LAYERS = 1024  # 4× the deepest published decoder we know of (Llama 3.1 405B: 126)
MAX_DRY_RECORDS = 2_000_000  # records one dry-run trace may hold (a 405B prefill and 4 decode steps: ~0.1M)
NO_WEIGHTS = "none: a dry run (config only, no weights)"  # the identity's weights_digest
DRY_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DryRunError(ValueError):
    """A config that cannot be built for a dry run; the message names the file and the problem."""


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` is a dry run: every parameter on the meta device, and none of them a placeholder that
    accelerate fills from an offload folder at each forward (those models have values)."""
    params = list(model.parameters())
    if not params or not all(p.is_meta for p in params):
        return False
    return not any(hasattr(m, "_hf_hook") for m in model.modules())


def shapes_available() -> dict[str, str]:
    """The shipped shape configs: name → the one-line description in their README table."""
    out = {}
    for d in sorted(SHAPES_DIR.iterdir()) if SHAPES_DIR.is_dir() else []:
        if (d / "config.json").is_file():
            out[d.name] = str(d / "config.json")
    return out


def _config_file(spec: str | os.PathLike) -> tuple[Path, str]:
    """(the config.json, a display name) that ``spec`` names."""
    from gpt_shape_tracer.model.sources._common import ModelLoadError
    from gpt_shape_tracer.model.sources._resolve import resolve_model_path

    raw = os.fspath(spec)
    if raw.startswith(SHAPES_PREFIX):
        name = raw.removeprefix(SHAPES_PREFIX)
        shipped = shapes_available()
        if name not in shipped:
            raise DryRunError(f"no shipped shape config is called {name!r}; shipped: {', '.join(shipped)}")
        return Path(shipped[name]), name
    path = resolve_model_path(spec)
    if path.is_file():
        if path.suffix != ".json":
            raise DryRunError(f"{path}: a dry run reads a config.json (or a directory holding one), not this file")
        return path, path.parent.name
    cfg = path / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"{cfg}: missing; a dry run needs config.json")
    from gpt_shape_tracer.model.sources._common import display_name_of as _display_name

    return cfg, _display_name(path)


def _read_raw(cfg: Path) -> dict:
    from gpt_shape_tracer.model.sources._common import MAX_CONFIG_BYTES, read_json_object

    return read_json_object(cfg, MAX_CONFIG_BYTES, "a config", DryRunError)


def config_dtype(raw: dict, asked: torch.dtype | str | None) -> torch.dtype:
    """The dtype of the dry run: the one asked for, else the config's ``torch_dtype`` / ``dtype``, else float32."""
    value: Any = asked if asked is not None else (raw.get("torch_dtype") or raw.get("dtype")
                                                  or (raw.get("text_config") or {}).get("torch_dtype"))
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        if value not in DRY_DTYPES.values():
            raise DryRunError(f"dtype {value} is not supported: use float32, bfloat16 or float16")
        return value
    name = str(value).removeprefix("torch.")
    if name not in DRY_DTYPES:
        raise DryRunError(f"dtype {value!r} is not supported: use one of {', '.join(DRY_DTYPES)}")
    return DRY_DTYPES[name]


def _text(raw: dict) -> dict:
    text = raw.get("text_config")
    return text if isinstance(text, dict) else raw


# the names configs give the sizes a dry run checks, at the top level or in any sub-config (text_config, a vision
# tower's, an MPT's attn_config); a config class's attribute_map adds its own aliases (check_sizes)
_SIZE_KEYS = {"layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers",
                         "num_decoder_layers"),
              "vocab_size": ("vocab_size", "padded_vocab_size"),
              "hidden_size": ("hidden_size", "n_embd", "d_model")}
_STANDARD_NAME = {"layers": "num_hidden_layers", "vocab_size": "vocab_size", "hidden_size": "hidden_size"}
_SUB_CONFIG_DEPTH = 4  # sub-configs of sub-configs; nothing a decoder's config nests deeper is built from


def _size_keys(model_type: object) -> dict[str, set[str]]:
    """The keys of each size, with the aliases ``model_type``'s config class maps the standard names to (MPT and
    DBRX keep their layer count in ``n_layers``; a name not in _SIZE_KEYS would otherwise go unchecked)."""
    keys = {what: set(names) for what, names in _SIZE_KEYS.items()}
    if isinstance(model_type, str):
        from gpt_shape_tracer.model.sources._hf_config import known_to_transformers

        if known_to_transformers(model_type):
            from transformers import CONFIG_MAPPING

            aliases = getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {}
            for what, standard in _STANDARD_NAME.items():
                if isinstance(aliases.get(standard), str):
                    keys[what].add(aliases[standard])
    return keys


def _sizes(raw: dict, keys: dict[str, set[str]], path: str = "", depth: int = 0):
    """(what, where, value) of every size in ``raw`` and its sub-configs, ``where`` the dotted key."""
    for key, value in raw.items():
        where = f"{path}{key}"
        if isinstance(value, dict) and depth < _SUB_CONFIG_DEPTH:
            yield from _sizes(value, keys, f"{where}.", depth + 1)
            continue
        for what, names in keys.items():
            if key in names:
                yield what, where, value


def check_sizes(raw: dict, source: Path) -> None:
    """Refuse sizes no dry run should try, before anything is built (the limits are stated in the message).

    Every size the model may be built with is checked, wherever it is: transformers builds a Llama from the top
    level even when a ``text_config`` is present, a multimodal model from its ``text_config`` and its other
    sub-configs, an MPT from ``n_layers``. A config class also does work per layer when it is made (Gemma 2 lists
    each layer's type), so the check comes before transformers sees the config."""
    text = _text(raw)
    limits = {"layers": (MAX_DRY_LAYERS, f"each layer makes dozens of records per step, and a dry-run trace holds "
                                         f"at most {MAX_DRY_RECORDS:,} records"),
              "vocab_size": (MAX_VOCAB, "the vocabulary limit of every model here"),
              "hidden_size": (MAX_WIDTH, "the width limit of every model here")}
    # the sizes of the text model must be positive whole numbers where they are given
    main = (("layers", text.get("num_hidden_layers", text.get("n_layer"))), ("vocab_size", text.get("vocab_size")),
            ("hidden_size", text.get("hidden_size", text.get("n_embd"))))
    for what, value in main:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise DryRunError(f"{source}: {what} is {value!r}, not a positive whole number")
    for level in (raw, text):
        check_expert_counts(level.get, str(source), DryRunError)
    for what, where, value in _sizes(raw, _size_keys(raw.get("model_type"))):
        limit, why = limits[what]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit:
            shown = f"{value:,}" if isinstance(value, int) else repr(value)
            name = what if where == what else f"{what} ({where})"
            raise DryRunError(f"{source}: {name} = {shown} is more than a dry run builds ({limit:,}: {why})")


def build_dry(spec: str | os.PathLike, *, dtype: torch.dtype | str | None = None, name: str | None = None,
              implementation: str = "auto", tensor_parallel: int = 1) -> tuple[GPT | HFDecoder, TextTokenizer | None]:
    """The model ``spec`` names, on the meta device (module doc), and its tokenizer when its directory has one.

    ``tensor_parallel=k`` (k > 1): one rank of k, as transformers' own plan splits the model
    (``sources/_tensor_parallel.py``); built by transformers whatever the family, since the plan is its; the plan
    is ``model.tensor_parallel``."""
    from gpt_shape_tracer.model.sources._hf_config import IMPLEMENTATIONS, SUPPORTED_MODEL_TYPES
    from gpt_shape_tracer.model.sources._tokenizer import directory_tokenizer as _load_tokenizer

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    cfg, display = _config_file(spec)
    raw = _read_raw(cfg)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        raise DryRunError(f"{cfg}: no model_type: a config.json names its architecture in \"model_type\"")
    check_sizes(raw, cfg)
    target = config_dtype(raw, dtype)
    headers = _headers(cfg.parent) if cfg.name == "config.json" else {}
    if tensor_parallel != 1 and implementation == "ours":
        raise ValueError("tensor parallelism follows transformers' plan: implementation 'ours' has none")
    ours = implementation == "ours" or (implementation == "auto" and model_type in SUPPORTED_MODEL_TYPES
                                        and tensor_parallel == 1)
    if ours:
        model: GPT | HFDecoder = _build_ours(raw, cfg, target, headers)
    else:
        from gpt_shape_tracer.model.sources._hf_config import known_to_transformers

        if not known_to_transformers(model_type):
            raise DryRunError(f"{cfg}: model_type {model_type!r} is unknown: neither one of the families "
                              f"re-implemented here ({', '.join(SUPPORTED_MODEL_TYPES)}) nor a model type this "
                              "transformers knows")
        model = _build_transformers(raw, cfg, target, headers, tensor_parallel)
    config = model.config
    family = config.family if config.family != "hf" else f"hf:{model_type}"
    model.identity = ModelIdentity(name=name or display, source=str(cfg), family=family, config=config.to_dict(),
                                   weights_digest=NO_WEIGHTS)
    tokenizer = _load_tokenizer(cfg.parent, config.vocab_size) if cfg.name == "config.json" else None
    return model, tokenizer


def _headers(directory: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """name → (dtype, shape) from the directory's safetensors headers (no tensor bytes read); {} without any."""
    from gpt_shape_tracer.model.sources._safetensors import SafetensorsFile, safetensors_files

    out: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for file in safetensors_files(directory):
        if file.is_file():
            st = SafetensorsFile(file)  # reads the header; the data is mapped, never touched here
            out.update({n: (e[0], e[1]) for n, e in st.entries.items()})
    return out


def _build_ours(raw: dict, cfg: Path, target: torch.dtype, headers: dict) -> GPT:
    from gpt_shape_tracer.model.sources._hf_config import config_from_hf
    from gpt_shape_tracer.model.sources._hf_weights import canonical as _canonical
    from gpt_shape_tracer.model.sources._hf_weights import check_weights

    config = config_from_hf(raw, cfg)
    if headers:
        canonical = {_canonical(n, config.family): (shape, cfg.parent) for n, (_, shape) in headers.items()}
        if config.tie_embeddings and "lm_head.weight" in canonical:
            config = dataclasses.replace(config, tie_embeddings=False)  # what the weights would make it
        check_weights(canonical, config, cfg)
    with torch.device("meta"):
        model = GPT(config)  # nothing drawn on the meta device (init_normal in model/gpt/_gpt.py)
    return model.to(target).eval().requires_grad_(False)


def _build_transformers(raw: dict, cfg: Path, target: torch.dtype, headers: dict, ranks: int = 1) -> HFDecoder:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from gpt_shape_tracer.model.sources._hf_attention import ATTENTION, _register
    from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError

    model_type = raw["model_type"]
    try:
        config_class = CONFIG_MAPPING[model_type]
        # transformers writes a float JSON cannot hold (Falcon-H1's time_step_limit of ∞) as {"__float__": …} and
        # reads it back in from_pretrained, not in from_dict
        decode = getattr(config_class, "_decode_special_floats", None)
        hf_config = config_class.from_dict(decode(raw) if decode is not None else raw)
    except Exception as e:  # noqa: BLE001 (transformers validates with its own error classes: its message is passed on)
        raise DryRunError(f"{cfg}: transformers refuses this config ({type(e).__name__}: {e})") from None
    _register()
    try:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(hf_config, dtype=target, attn_implementation=ATTENTION)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        raise DryRunError(f"{cfg}: transformers refuses this config ({type(e).__name__}: {str(e)[:500]})") from None
    if any(hasattr(m, "num_experts") and hasattr(m, "gate_up_proj") for m in hf.modules()):
        hf.set_experts_implementation("batched_mm")  # shapes fixed in advance (module doc)
    if headers:
        held = {n: p.shape for n, p in hf.state_dict().items()}
        for n, (_, shape) in headers.items():
            if n in held and tuple(held[n]) != tuple(shape):
                raise DryRunError(f"{cfg.parent}: tensor {n!r} has shape {list(shape)} in the safetensors header, "
                                  f"but config.json implies {list(held[n])}")
    plan = None
    if ranks != 1:
        from gpt_shape_tracer.model.sources._tensor_parallel import TensorParallelError, shard

        try:
            plan = shard(hf, ranks)
        except TensorParallelError as e:
            raise DryRunError(f"{cfg}: {e}") from None
    try:
        model = HFDecoder(hf)
        model.tensor_parallel = plan
        return model
    except HFDecoderError as e:
        raise DryRunError(f"{cfg}: {e}") from None
    except RuntimeError as e:  # an op of this family that the meta device cannot run
        raise DryRunError(f"{cfg}: this model's forward cannot run on the meta device ({str(e)[:300]})") from None


def parameters_by_dtype(model: nn.Module) -> dict[str, int]:
    """Parameters counted per dtype (a meta model's too: shapes are all a count needs)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        key = str(p.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + p.numel()
    return out


def dry_config(model: nn.Module) -> GPTConfig:
    config = getattr(model, "config", None)
    if not isinstance(config, GPTConfig):
        raise TypeError(f"a dry run needs one of our decoders (GPT, HFDecoder), got {type(model).__name__}")
    return config


__all__ = ["DryRunError", "MAX_DRY_LAYERS", "MAX_DRY_RECORDS", "NO_WEIGHTS", "SHAPES_DIR", "SHAPES_PREFIX",
           "build_dry", "check_sizes", "config_dtype", "on_meta", "parameters_by_dtype", "shapes_available"]
