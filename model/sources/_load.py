"""Loading a model however it is named, from one place: ``load_model`` resolves the spec once
(``resolve_model_path``) and hands the path to exactly one source — a nanoGPT checkpoint (``load_nanogpt``), or
a Hugging Face directory (``load_hf``), which our GPT runs (``load_hf_ours``) or transformers does
(``load_hf_decoder``). ``load_bundled`` loads the small story models shipped with the project.

Nothing here touches the network.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from gpt_shape_tracer.model.gpt import GPT
from gpt_shape_tracer.model.sources._common import ModelLoadError, check_dir, parse_device, parse_dtype, read_json
from gpt_shape_tracer.model.sources._hf_config import IMPLEMENTATIONS, SUPPORTED_MODEL_TYPES, known_to_transformers
from gpt_shape_tracer.model.sources._hf_decoder import HFDecoder
from gpt_shape_tracer.model.sources._hf_loading import MaxMemory, _max_memory, load_hf_decoder
from gpt_shape_tracer.model.sources._hf_ours import load_hf_ours
from gpt_shape_tracer.model.sources._hf_refusals import HFDecoderError
from gpt_shape_tracer.model.sources._nanogpt import is_nanogpt_path, load_nanogpt
from gpt_shape_tracer.model.sources._resolve import resolve_model_path
from gpt_shape_tracer.model.sources._tokenizer import TextTokenizer, directory_tokenizer, fitting_vocab, load_tokenizer

# the bundled checkpoints: assets/ in a checkout, model/bundled/ once installed (pyproject.toml maps one to the other)
_HERE = Path(__file__).resolve().parent.parent  # model/
ASSETS = _HERE / "bundled" if (_HERE / "bundled" / "story-gpt").is_dir() else _HERE.parent / "assets"
BUNDLED_DIR = ASSETS / "story-gpt"
BUNDLED_MODELS: dict[str, str] = {
    "story-gpt": "GPT-2 architecture, 4 layers × 4 heads, d=128, learned positions, LayerNorm, GELU (0.96M)",
    "story-llama": "Llama architecture, 4 layers × 4 query heads sharing 2 key/value heads, d=128, RoPE, RMSNorm, "
                   "SwiGLU, untied W_U",
}


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

    ``implementation``: "ours" builds our GPT (GPT-2, Llama, Mistral, Qwen2: model/gpt/);
    "transformers" has transformers run it, seen through our hook points (any family whose attention
    goes through transformers' attention interface: model/sources/_hf_decoder.py); "auto" (the default) is
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
    target_dtype = parse_dtype(dtype)
    target_device = parse_device(device)
    directory = check_dir(path)
    raw_config = read_json(directory / "config.json", "a config") if (directory / "config.json").is_file() else {}
    model_type = raw_config.get("model_type") if isinstance(raw_config, dict) else None
    if max_memory is not None and implementation == "ours":
        raise ModelLoadError("max_memory offloads weights with accelerate, which needs transformers to run the "
                             "model: use implementation='transformers' (or 'auto')")
    check_offload(max_memory, offload_folder)  # before any weight is read
    if implementation == "transformers" or max_memory is not None or (
            implementation == "auto" and isinstance(model_type, str) and model_type not in SUPPORTED_MODEL_TYPES
            and known_to_transformers(model_type)):
        tokenizer = directory_tokenizer(directory, None)  # a corrupt tokenizer.json refused before the weights
        try:
            generic = load_hf_decoder(directory, dtype=target_dtype, device=target_device, name=name,
                                      max_memory=max_memory, offload_folder=offload_folder)
        except HFDecoderError as e:
            raise ModelLoadError(str(e), reason=e.reason) from None
        return generic, fitting_vocab(tokenizer, generic.config.vocab_size)
    return load_hf_ours(directory, target_dtype, target_device, name)


def check_offload(max_memory: MaxMemory | None, offload_folder: str | os.PathLike | None) -> None:
    """``max_memory``'s amounts and ``offload_folder`` refused with the reason before anything is read: an amount
    that is not memory, more than the device has, a device that is not there; a folder without ``max_memory``
    (nothing would go there), one that is a file, or one this process cannot write (tried: a file made and
    removed, so a read-only file system or a folder under a file is found, also for root)."""
    if max_memory is not None:
        try:
            _max_memory(max_memory)
        except HFDecoderError as e:
            raise ModelLoadError(str(e)) from None
    if offload_folder is None:
        return
    if max_memory is None:
        raise ModelLoadError("offload_folder is where max_memory's offloaded weights go: give max_memory too "
                             "(without it every weight is held in memory and the folder would stay empty)")
    folder = Path(offload_folder).expanduser()
    existing = folder
    while not existing.exists() and existing != existing.parent:  # the nearest folder there is, to be written in
        existing = existing.parent
    if not existing.is_dir():
        raise ModelLoadError(f"offload_folder {folder}: {existing} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise ModelLoadError(f"offload_folder {folder}: cannot be written ({e.strerror or e} in {existing})") from None


def load_hf_gpt2(path: str | os.PathLike) -> tuple[GPT, TextTokenizer | None]:
    """Load a GPT-2 written by Hugging Face ``save_pretrained`` from a local directory (float32, CPU).

    ``load_hf`` loads every supported family; this one refuses anything but ``gpt2``."""
    directory = check_dir(path)
    raw = read_json(directory / "config.json", "a config") if (directory / "config.json").is_file() else {}
    if raw and raw.get("model_type") != "gpt2":
        raise ModelLoadError(f"{directory / 'config.json'}: model_type is {raw.get('model_type')!r}, but "
                             "load_hf_gpt2 loads only 'gpt2' checkpoints (load_hf loads every supported family)")
    model, tokenizer = load_hf(directory)
    assert isinstance(model, GPT)  # gpt2 is one of the families load_hf builds itself
    return model, tokenizer



def load_model(
    spec: str | os.PathLike,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    name: str | None = None,
    tokenizer: str | os.PathLike | None = None,
    max_memory: MaxMemory | None = None,
    offload_folder: str | os.PathLike | None = None,
    weights: bool = True,
    tensor_parallel: int = 1,
) -> tuple[GPT | HFDecoder, TextTokenizer | None]:
    """Load a model however it is named (``resolve_model_path``): a local directory, a Hugging
    Face cache folder (``models--org--name`` or one of its ``snapshots/<hash>``), a repo id ``org/name`` found in
    the local cache (never downloaded), or a nanoGPT ``ckpt.pt`` (the file or its out_dir).

    ``tokenizer`` (a path) replaces the one the checkpoint carries; a nanoGPT checkpoint needs one beside it or
    here. ``max_memory`` offloads what does not fit (``load_hf``; not for a nanoGPT checkpoint, which is one
    pickle-free file read whole), to ``offload_folder`` when given. Returns what ``load_hf`` / ``load_nanogpt``
    return.

    ``weights=False``: a dry run (``sources/_dry_run.py``): the model built on the meta device from its config
    alone — also from ``shapes:NAME`` (a shipped config) or a bare ``config.json`` — with its tokenizer when it
    has one. ``tensor_parallel=k`` with ``weights=False``: one rank of k, split by transformers' own plan
    (``sources/_tensor_parallel.py``)."""
    if tensor_parallel != 1 and weights:
        raise ModelLoadError("tensor_parallel is for a dry run (weights=False): one rank's shapes and costs; to run "
                             "a model split across GPUs, use transformers' tp_plan under torchrun")
    if not weights:
        from gpt_shape_tracer.model.sources._dry_run import DryRunError, build_dry

        if max_memory is not None or offload_folder is not None or str(device) != "cpu":
            raise ModelLoadError("a dry run (weights=False) builds the model on the meta device: no device or "
                                 "max_memory to place it on")
        try:
            dry, tok = build_dry(spec, dtype=dtype, name=name, tensor_parallel=tensor_parallel)
        except DryRunError as e:
            raise ModelLoadError(str(e)) from None
        if tokenizer is not None:
            tok = load_tokenizer(tokenizer, dry.config.vocab_size)
        return dry, tok  # a GPT or an HFDecoder, on the meta device
    path = resolve_model_path(spec)
    if is_nanogpt_path(path):
        if max_memory is not None or offload_folder is not None:
            raise ModelLoadError(f"{path}: a nanoGPT checkpoint is loaded whole; max_memory (offloading with "
                                 "accelerate) needs a Hugging Face directory")
        return load_nanogpt(path, tokenizer=tokenizer, dtype=dtype, device=device, name=name)
    model, tok = load_hf(path, dtype=dtype, device=device, name=name, max_memory=max_memory,
                         offload_folder=offload_folder)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer, model.config.vocab_size)
    return model, tok



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
