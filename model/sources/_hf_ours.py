"""A Hugging Face directory into our GPT, and our GPT back into one, in Hugging Face's ``save_pretrained``
layout: GPT-2, Llama, Mistral, Qwen2.

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

import dataclasses
import json
import os
import weakref
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpt_shape_tracer.model.gpt import GPT, BackgroundDigest, GPTConfig, ModelIdentity, PendingIdentity
from gpt_shape_tracer.model.sources._common import ModelLoadError, display_name_of
from gpt_shape_tracer.model.sources._hf_config import config_to_hf, read_config
from gpt_shape_tracer.model.sources._hf_weights import canonical, check_weights, hf_shapes, hf_to_state, state_to_hf
from gpt_shape_tracer.model.sources._safetensors import SafetensorsFile, read_bin, safetensors_files
from gpt_shape_tracer.model.sources._tokenizer import TextTokenizer, directory_tokenizer, fitting_vocab


def load_hf_ours(directory: Path, target_dtype: torch.dtype, target_device: torch.device,
                 name: str | None) -> tuple[GPT, TextTokenizer | None]:
    """Our GPT (GPT-2, Llama, Mistral, Qwen2: model/gpt/) from a checked checkpoint ``directory`` (``load_hf``
    chose this source), with its identity and its tokenizer."""
    config = read_config(directory)
    tokenizer = directory_tokenizer(directory, None)  # a corrupt tokenizer.json refused before any weight is read
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
    display_name = name or display_name_of(directory)
    if digest is None:
        model.identity = ModelIdentity(name=display_name, source=str(directory), family=config.family,
                                       config=model.config.to_dict(), weights_digest="")
    else:
        model.identity = PendingIdentity(digest, name=display_name, source=str(directory), family=config.family,
                                         config=model.config.to_dict())
        weakref.finalize(model, digest.abandon)  # nor does a model dropped before its hash is done
    return model, fitting_vocab(tokenizer, model.config.vocab_size)


def _build_ours(directory: Path, config: GPTConfig, files: list[Path], bin_file: Path, target_dtype: torch.dtype,
                target_device: torch.device) -> GPT:
    """Our GPT from a directory's weights: every header checked first, then each tensor copied once from the
    mapped files into our layout (``hf_to_state``), its file pages let go as soon as its copy exists."""
    cfg_path = directory / "config.json"
    if files:
        opened = [SafetensorsFile(file) for file in files]  # headers only
        where: dict[str, tuple[SafetensorsFile, str]] = {
            canonical(tensor_name, config.family): (st, tensor_name) for st in opened for tensor_name in st.entries}
        check_weights({k: (st.entries[n][1], st.path) for k, (st, n) in where.items()}, config, cfg_path)
        raw = {k: st.tensor(n) for k, (st, n) in where.items()}  # views of the mapped files: nothing read yet

        def release(name: str) -> None:
            st, tensor_name = where[name]
            st.release(tensor_name)
    elif bin_file.exists():
        raw = {canonical(k, config.family): v for k, v in read_bin(bin_file).items()}
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
