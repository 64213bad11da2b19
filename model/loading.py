"""Loading and saving GPT-2 checkpoints in Hugging Face's ``save_pretrained`` layout.

A directory holds ``config.json``, the weights (``model.safetensors``, sharded
safetensors with ``model.safetensors.index.json``, or ``pytorch_model.bin``) and
optionally the tokenizer (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``).
The bundled model in ``assets/`` is written in this same layout, so one loader
serves both, and Hugging Face's own ``GPT2LMHeadModel.from_pretrained`` can read
it too.

Nothing here touches the network, and ``.bin`` files are read only with
``torch.load(weights_only=True)``: a pickle that holds anything but tensors is
refused, never executed.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.gpt import GPT, GPTConfig
from model.tokenizer import TextTokenizer

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "assets" / "story-gpt"
SUPPORTED_ACTIVATIONS = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast"}
MAX_CONFIG_BYTES = 1 << 20


class ModelLoadError(ValueError):
    """A checkpoint directory or file that cannot be loaded; the message names the file."""


def _hf_to_ours(name: str) -> str | None:
    """Hugging Face GPT-2 parameter name → ours; None for buffers we rebuild."""
    if name.startswith("transformer."):
        name = name[len("transformer.") :]
    if name == "lm_head.weight":
        return None
    if name.endswith(".attn.bias") or name.endswith(".attn.masked_bias"):
        return None  # old checkpoints stored the causal mask as a buffer
    parts = name.split(".")
    if parts[0] == "wte":
        return "embed." + parts[1]
    if parts[0] == "wpe":
        return "pos_embed." + parts[1]
    if parts[0] == "ln_f":
        return "ln_final." + parts[1]
    if parts[0] == "h" and len(parts) >= 4:
        sub = {"ln_1": "ln1", "ln_2": "ln2"}.get(parts[2], parts[2])
        return ".".join(["blocks", parts[1], sub, *parts[3:]])
    return name


def _ours_to_hf(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "embed":
        return "transformer.wte." + parts[1]
    if parts[0] == "pos_embed":
        return "transformer.wpe." + parts[1]
    if parts[0] == "ln_final":
        return "transformer.ln_f." + parts[1]
    sub = {"ln1": "ln_1", "ln2": "ln_2"}.get(parts[2], parts[2])
    return ".".join(["transformer.h", parts[1], sub, *parts[3:]])


def config_from_hf(raw: dict, source: Path) -> GPTConfig:
    """A ``GPTConfig`` from a Hugging Face GPT-2 ``config.json`` dictionary."""
    model_type = raw.get("model_type")
    if model_type != "gpt2":
        raise ModelLoadError(f"{source}: model_type is {model_type!r}, but only 'gpt2' checkpoints are supported")
    act = raw.get("activation_function", "gelu_new")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"{source}: activation_function {act!r} is not GPT-2's tanh GELU")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if raw.get(flag):
            raise ModelLoadError(f"{source}: {flag} = true is a GPT-2 variant this model does not implement")
    if raw.get("tie_word_embeddings") is False:
        raise ModelLoadError(f"{source}: tie_word_embeddings = false; this model ties the unembedding to W_E")
    try:
        return GPTConfig(
            vocab_size=raw["vocab_size"],
            n_ctx=raw.get("n_positions", raw.get("n_ctx")),
            d_model=raw["n_embd"],
            n_layer=raw["n_layer"],
            n_head=raw["n_head"],
            d_mlp=raw.get("n_inner"),
            layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        )
    except KeyError as e:
        raise ModelLoadError(f"{source}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: {e}") from None


def config_to_hf(config: GPTConfig) -> dict:
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


def _check_dir(path: str | os.PathLike) -> Path:
    p = Path(path).expanduser()
    try:
        resolved = p.resolve(strict=True)
    except FileNotFoundError:
        raise ModelLoadError(f"{p}: no such directory") from None
    except (RuntimeError, OSError) as e:  # a symlink loop lands here
        raise ModelLoadError(f"{p}: cannot resolve the path ({e})") from None
    if not resolved.is_dir():
        raise ModelLoadError(f"{p}: is a file, not a directory; give the directory holding config.json")
    return resolved


def _read_config(directory: Path) -> GPTConfig:
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{cfg_path}: missing; a GPT-2 checkpoint directory needs config.json")
    if cfg_path.stat().st_size > MAX_CONFIG_BYTES:
        raise ModelLoadError(f"{cfg_path}: {cfg_path.stat().st_size} bytes is far too large for a config")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{cfg_path}: expected a JSON object, got {type(raw).__name__}")
    return config_from_hf(raw, cfg_path)


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = []
        for name in names:
            shard = (directory / name).resolve()
            if shard.parent != directory:
                raise ModelLoadError(f"{index}: shard {name!r} lies outside the checkpoint directory")
            files.append(shard)
        return files
    single = directory / "model.safetensors"
    return [single] if single.exists() else []


def _read_safetensors(files: list[Path], expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file}: missing (listed by the index)")
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
                # check every declared shape before reading any data
                for name in names:
                    ours = _hf_to_ours(name)
                    if ours is None:
                        continue
                    shape = f.get_slice(name).get_shape()
                    _check_shape(file, name, ours, tuple(shape), expected)
                for name in names:
                    ours = _hf_to_ours(name)
                    if ours is not None:
                        tensors[ours] = f.get_tensor(name)
        except SafetensorError as e:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({e})") from None
        except OSError as e:
            raise ModelLoadError(f"{file}: cannot be read ({e})") from None
    return tensors


def _read_bin(file: Path, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(
            f"{file}: refused — it holds Python objects other than tensors, and pickles are only "
            f"loaded with weights_only=True ({first})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise ModelLoadError(f"{file}: not a readable PyTorch weights file ({e})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"{file}: expected a dictionary of tensors")
    tensors = {}
    for name, tensor in state.items():
        ours = _hf_to_ours(name)
        if ours is None:
            continue
        _check_shape(file, name, ours, tuple(tensor.shape), expected)
        tensors[ours] = tensor
    return tensors


def _check_shape(file: Path, name: str, ours: str, shape: tuple, expected: dict[str, torch.Size]) -> None:
    if ours not in expected:
        raise ModelLoadError(f"{file}: unexpected tensor {name!r}, not part of a GPT-2 model")
    if tuple(expected[ours]) != shape:
        raise ModelLoadError(
            f"{file}: tensor {name!r} has shape {list(shape)}, but config.json implies {list(expected[ours])}"
        )


def _load_tokenizer(directory: Path, vocab_size: int) -> TextTokenizer | None:
    tok_json = directory / "tokenizer.json"
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    try:
        if tok_json.is_file():
            tok = TextTokenizer.from_file(tok_json)
        elif vocab.is_file() and merges.is_file():
            tok = TextTokenizer.from_vocab_merges(vocab, merges)
        else:
            return None
    except Exception as e:  # tokenizers raises plain Exception subclasses from Rust
        source = tok_json if tok_json.is_file() else vocab
        raise ModelLoadError(f"{source}: not a readable tokenizer ({e})") from None
    if tok.vocab_size > vocab_size:
        raise ModelLoadError(
            f"{tok.source}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {vocab_size}"
        )
    return tok


def load_hf_gpt2(path: str | os.PathLike) -> tuple[GPT, TextTokenizer | None]:
    """Load a GPT-2 written by Hugging Face ``save_pretrained`` from a local directory.

    Returns the model (eval mode, CPU, float32) and its tokenizer, or None when
    the directory has no tokenizer files. Raises ``ModelLoadError`` naming the
    file and the problem for anything missing, corrupt or mis-shaped."""
    directory = _check_dir(path)
    config = _read_config(directory)
    with torch.device("meta"):
        model = GPT(config)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    st_files = _safetensors_files(directory)
    bin_file = directory / "pytorch_model.bin"
    if st_files:
        tensors = _read_safetensors(st_files, expected)
    elif bin_file.exists():
        tensors = _read_bin(bin_file, expected)
    else:
        raise ModelLoadError(
            f"{directory}: no weights found (looked for model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin)"
        )
    missing = sorted(set(expected) - set(tensors))
    if missing:
        shown = ", ".join(_ours_to_hf(m) for m in missing[:4])
        raise ModelLoadError(f"{directory}: the weights lack {len(missing)} tensor(s): {shown}")
    state = {}
    for name, tensor in tensors.items():
        if not tensor.is_floating_point():
            raise ModelLoadError(f"{directory}: tensor {_ours_to_hf(name)!r} is {tensor.dtype}, not floating point")
        state[name] = tensor.to(torch.float32).contiguous()
    model.load_state_dict(state, assign=True)
    model.eval().requires_grad_(False)
    tokenizer = _load_tokenizer(directory, config.vocab_size)
    return model, tokenizer


def save_hf_gpt2(
    model: GPT, path: str | os.PathLike, tokenizer: TextTokenizer | None = None, extra: dict | None = None
) -> Path:
    """Write ``model`` as a Hugging Face GPT-2 directory (config.json + model.safetensors [+ tokenizer.json])."""
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    state = {_ours_to_hf(k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = config_to_hf(model.config)
    if extra:
        config.update(extra)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if tokenizer is not None:
        tokenizer.save(directory / "tokenizer.json")
    return directory


def load_bundled() -> tuple[GPT, TextTokenizer]:
    """The small story model shipped in ``assets/`` (no network, ever)."""
    model, tokenizer = load_hf_gpt2(BUNDLED_DIR)
    if tokenizer is None:
        raise ModelLoadError(f"{BUNDLED_DIR}: the bundled model has no tokenizer.json")
    return model, tokenizer
