"""What the weights of a Hugging Face checkpoint must hold (``hf_shapes``, ``check_weights``: on the headers
alone, before anything is allocated), and how they become our GPT's state dict and back (``our_layout``,
``hf_to_state``, ``state_to_hf``)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import torch

from gpt_shape_tracer.model.gpt import GPT, GPTConfig
from gpt_shape_tracer.model.sources._common import ModelLoadError

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


def canonical(name: str, family: str) -> str:
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
    to our ``[d_in, d_out]`` (``model/gpt/_gpt.py``'s ``Projection`` says why), GPT-2's tensors as they are."""
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
