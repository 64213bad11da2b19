"""nanoGPT checkpoints: the ``ckpt.pt`` Karpathy's nanoGPT ``train.py`` writes, loaded as our GPT.

A checkpoint is a pickle, ``{'model': state_dict, 'model_args': {n_layer, n_head, n_embd, block_size, bias,
vocab_size, dropout}, 'optimizer': …, 'iter_num': …, 'config': …}``. It is read only with
``torch.load(weights_only=True)``: tensors, numbers, strings, lists and dicts load; a pickle that names any
class or function is refused before anything in it runs.

nanoGPT's model is GPT-2's architecture with three differences our config spells out:

* its MLP uses the *exact* GELU (``nn.GELU()``, erf), not GPT-2's tanh form: ``activation="gelu"``;
* with ``bias=False`` neither its LayerNorms nor its Linear layers have a bias: ``norm_bias``, ``qkv_bias``,
  ``attn_out_bias`` and ``mlp_bias`` all False;
* its Linear weights are ``nn.Linear``'s ``[d_out, d_in]`` (``c_attn``, ``c_proj``, ``c_fc``), transposed here
  once to our ``[d_in, d_out]`` (GPT-2's Conv1D is already ``[d_in, d_out]``; see ``Projection``).

``lm_head.weight`` is tied to ``wte`` in nanoGPT (both names in the state dict, one storage); a checkpoint whose
``lm_head`` differs is loaded with its own W_U. A ``torch.compile``d model saves every name with the prefix
``_orig_mod.``, which is dropped. nanoGPT tokenizes with tiktoken's GPT-2 BPE, which cannot be fetched here: the
tokenizer is ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``) beside the checkpoint, or one given.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from gpt_shape_tracer.model.gpt import GPT, GPTConfig, ModelIdentity
from gpt_shape_tracer.model.sources._common import (
    READ_CHUNK,
    ModelLoadError,
    check_dir,
    check_tensors_fit,
    parse_device,
    parse_dtype,
    unpickling_error,
)
from gpt_shape_tracer.model.sources._tokenizer import TextTokenizer, load_tokenizer

CHECKPOINT_NAME = "ckpt.pt"  # what nanoGPT's train.py writes into out_dir
COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper puts this before every parameter name
REQUIRED_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")
NANOGPT_EPS = 1e-5  # nanoGPT's LayerNorm calls F.layer_norm(…, 1e-5)
_LAYER = re.compile(r"^transformer\.h\.(\d+)\.")
_MASK_BUFFER = re.compile(r"^transformer\.h\.\d+\.attn\.bias$")  # the causal-mask buffer of non-flash attention


def is_nanogpt_path(path: Path) -> bool:
    """Whether ``path`` names a nanoGPT checkpoint: a ``.pt`` file, or a directory holding ``ckpt.pt`` and no
    ``config.json`` (a directory with one is a Hugging Face checkpoint)."""
    if path.is_file():
        return path.suffix == ".pt"
    return path.is_dir() and (path / CHECKPOINT_NAME).is_file() and not (path / "config.json").exists()


def load_nanogpt(
    path: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | TextTokenizer | None = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    name: str | None = None,
) -> tuple[GPT, TextTokenizer | None]:
    """Load a nanoGPT ``ckpt.pt`` (the file, or the ``out_dir`` holding it) as our GPT.

    ``tokenizer``: a ``tokenizer.json``, a directory holding one (or ``vocab.json`` + ``merges.txt``), or a
    ``TextTokenizer``; by default the tokenizer files beside the checkpoint, else None (nanoGPT's own tiktoken
    GPT-2 BPE is not available offline). Returns the model (eval mode, no gradients, ``dtype``, on ``device``)
    carrying ``model.identity`` (its digest is the checkpoint file's sha256), and the tokenizer. Raises
    ``ModelLoadError`` naming the file and the problem."""
    target_dtype, target_device = parse_dtype(dtype), parse_device(device)
    file = _checkpoint_file(path)
    hasher = hashlib.sha256()
    ckpt = _read_checkpoint(file, hasher)
    state, args = _parts(ckpt, file)
    config = config_from_nanogpt(args, state, file)
    _check_state(state, config, file)
    ours = {k: v.to(device=target_device, dtype=target_dtype).contiguous()
            for k, v in nanogpt_to_state(state, config).items()}
    del ckpt, state
    with torch.device("meta"):
        model = GPT(config)
    model.load_state_dict(ours, assign=True)
    model.eval().requires_grad_(False)
    model.identity = ModelIdentity(
        name=name or (file.parent.name if file.name == CHECKPOINT_NAME else file.stem), source=str(file),
        family="nanogpt", config=config.to_dict(), weights_digest="sha256:" + hasher.hexdigest(),
    )
    tok: TextTokenizer | None
    if isinstance(tokenizer, TextTokenizer):
        if tokenizer.vocab_size > config.vocab_size:
            raise ModelLoadError(f"{tokenizer.source}: the tokenizer has {tokenizer.vocab_size} tokens but the "
                                 f"model's vocab_size is {config.vocab_size}")
        tok = tokenizer
    else:
        tok = load_tokenizer(tokenizer if tokenizer is not None else file.parent, config.vocab_size,
                             required=tokenizer is not None)
    return model, tok


def _checkpoint_file(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise ModelLoadError(f"{path!r}: a checkpoint path must be a string or a path, not {type(path).__name__}")
    p = Path(path).expanduser()
    if p.is_dir():
        directory = check_dir(p)  # resolved, and no file in it links out of it
        if not (directory / CHECKPOINT_NAME).is_file():
            raise ModelLoadError(f"{p}: holds no {CHECKPOINT_NAME} (nanoGPT's train.py writes one into out_dir)")
        return directory / CHECKPOINT_NAME
    if not p.is_file():
        raise ModelLoadError(f"{p}: no such file")
    return p.resolve()


def _read_checkpoint(file: Path, hasher) -> object:
    """The unpickled checkpoint, tensors memory-mapped (the optimizer state, twice the model's size, is never
    read into memory), hashing the file's bytes on a first streaming pass."""
    try:
        with open(file, "rb") as f:
            while chunk := f.read(READ_CHUNK):
                hasher.update(chunk)
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(file, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except Exception as e:  # noqa: BLE001 - weights_only runs no code of the file's: any error is a malformed file
        raise unpickling_error(file, e, "PyTorch checkpoint") from None


def _parts(ckpt: object, file: Path) -> tuple[dict[str, torch.Tensor], Mapping]:
    """The state dict (``_orig_mod.`` dropped) and ``model_args`` of a nanoGPT checkpoint."""
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict) or not isinstance(
            ckpt.get("model_args"), dict):
        what = f"keys {sorted(map(str, ckpt))[:6]}" if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ModelLoadError(
            f"{file}: not a nanoGPT checkpoint — expected a dict with 'model' (the state dict) and 'model_args', "
            f"got {what}")
    state: dict[str, torch.Tensor] = {}
    for key, value in ckpt["model"].items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ModelLoadError(f"{file}: 'model' must map names to tensors, got {key!r}: {type(value).__name__}")
        name = key.removeprefix(COMPILED_PREFIX)
        if name in state:  # torch.compile's prefix on one copy only: which one the model means is unknowable
            raise ModelLoadError(f"{file}: 'model' holds {name!r} both with and without {COMPILED_PREFIX!r}: "
                                 "refused rather than let one silently win")
        state[name] = value
    check_tensors_fit(state, file)
    return state, ckpt["model_args"]


def config_from_nanogpt(args: Mapping, state: Mapping[str, torch.Tensor], file: Path) -> GPTConfig:
    """Our config for nanoGPT's ``model_args`` (GPT-2's architecture, exact GELU, biases as ``bias`` says)."""
    missing = [k for k in REQUIRED_ARGS if k not in args]
    if missing:
        raise ModelLoadError(f"{file}: model_args lacks {', '.join(missing)}")
    bias = args["bias"]
    if not isinstance(bias, bool):
        raise ModelLoadError(f"{file}: model_args['bias'] must be True or False, got {bias!r}")
    lm_head, wte = state.get("lm_head.weight"), state.get("transformer.wte.weight")
    tied = lm_head is None or (wte is not None and lm_head.shape == wte.shape and (
        lm_head.data_ptr() == wte.data_ptr() or torch.equal(lm_head, wte)))
    try:
        return GPTConfig(
            vocab_size=args["vocab_size"], n_ctx=args["block_size"], d_model=args["n_embd"],
            n_layer=args["n_layer"], n_head=args["n_head"], layer_norm_eps=NANOGPT_EPS, family="gpt2",
            qkv_bias=bias, attn_out_bias=bias, mlp_bias=bias, norm_bias=bias, activation="gelu",
            tie_embeddings=tied,
        )
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{file}: model_args: {e}") from None


def nanogpt_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a nanoGPT state dict of ``config`` holds, by name, with its shape (``nn.Linear``: [out, in])."""
    d, V, bias = config.d_model, config.vocab_size, config.mlp_bias
    shapes: dict[str, tuple[int, ...]] = {"transformer.wte.weight": (V, d), "transformer.wpe.weight": (config.n_ctx, d)}

    def linear(prefix: str, d_out: int, d_in: int) -> None:
        shapes[prefix + ".weight"] = (d_out, d_in)
        if bias:
            shapes[prefix + ".bias"] = (d_out,)

    def layer_norm(prefix: str) -> None:
        shapes[prefix + ".weight"] = (d,)
        if config.norm_bias:
            shapes[prefix + ".bias"] = (d,)

    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        layer_norm(p + "ln_1")
        linear(p + "attn.c_attn", 3 * d, d)
        linear(p + "attn.c_proj", d, d)
        layer_norm(p + "ln_2")
        linear(p + "mlp.c_fc", config.d_ff, d)
        linear(p + "mlp.c_proj", d, config.d_ff)
    layer_norm("transformer.ln_f")
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (V, d)
    return shapes


def _check_state(state: Mapping[str, torch.Tensor], config: GPTConfig, file: Path) -> None:
    """Names and shapes against ``model_args``, before anything is built; every difference is named."""
    layers = sorted({int(m.group(1)) for name in state if (m := _LAYER.match(name))})
    if layers != list(range(config.n_layer)):
        raise ModelLoadError(f"{file}: model_args says n_layer = {config.n_layer}, but the state dict holds "
                             f"blocks {layers[:8]}{' …' if len(layers) > 8 else ''}")
    expected = nanogpt_shapes(config)
    for name, tensor in state.items():
        if name in expected:
            if tuple(tensor.shape) != expected[name]:
                raise ModelLoadError(f"{file}: tensor {name!r} has shape {list(tensor.shape)}, but model_args "
                                     f"implies {list(expected[name])}")
            if not tensor.is_floating_point():
                raise ModelLoadError(f"{file}: tensor {name!r} is {tensor.dtype}, not floating point")
        elif not (_MASK_BUFFER.match(name) or (name == "lm_head.weight" and config.tie_embeddings)):
            hint = " (model_args says bias=False)" if name.endswith(".bias") and not config.mlp_bias else ""
            raise ModelLoadError(f"{file}: unexpected tensor {name!r}, not part of a nanoGPT model{hint}")
    missing = [name for name in expected if name not in state]
    if missing:
        hint = " (model_args says bias=True)" if all(n.endswith(".bias") for n in missing) else ""
        raise ModelLoadError(f"{file}: the state dict lacks {len(missing)} tensor(s) model_args implies{hint}: "
                             + ", ".join(missing[:4]) + (" …" if len(missing) > 4 else ""))


def nanogpt_to_state(state: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """nanoGPT names → ours; ``nn.Linear`` weights ``[d_out, d_in]`` transposed to our ``[d_in, d_out]``."""
    ours: dict[str, torch.Tensor] = {
        "embed.weight": state["transformer.wte.weight"],  # W_E [V, d]
        "pos_embed.weight": state["transformer.wpe.weight"],  # W_pos [n_ctx, d]
    }
    if not config.tie_embeddings:
        ours["unembed.weight"] = state["lm_head.weight"].t()  # [V, d] -> W_U [d, V]
    norms = {"ln_1": "ln1", "ln_2": "ln2"}
    for name, tensor in state.items():
        parts = name.split(".")
        if name.startswith("transformer.ln_f."):
            ours["ln_final." + parts[-1]] = tensor
        elif _LAYER.match(name) and not _MASK_BUFFER.match(name):
            layer, module, rest = parts[2], parts[3], parts[4:]
            if module in norms:
                ours[".".join(["blocks", layer, norms[module], *rest])] = tensor
            else:  # attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
                is_weight = rest[-1] == "weight"
                ours[".".join(["blocks", layer, module, *rest])] = tensor.t() if is_weight else tensor
    return ours
