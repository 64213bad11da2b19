"""Your own torch module, run by its own code, its attention seen where it calls
``torch.nn.functional.scaled_dot_product_attention`` (nanoGPT, transformers' sdpa path, most hand-written GPTs).

``OwnDecoder(module)`` counts the module's SDPA calls in a one-token probe — one per layer — and gives each
call a layer's hook points (``blocks.{L}.attn.hook_q`` …, the names our views read). During its forward the
SDPA function is routed, on this thread only, through ``traced_sdpa``: the same inputs, computed stage by
stage — QKᵀ, × scale, + M (from ``attn_mask`` or ``is_causal``), softmax, A·V — so the pattern, scores and mask
the module used are recorded, and an ablation or patch of a head changes what the module goes on to compute.
(A module that imported the function by name before this ran calls the original and is refused by the probe.)

The module runs without a KV cache (it has its own API for one, or none): every step recomputes all positions.

``load_factory("package.module:factory")`` imports a factory from the user's own code — on their machine,
from a module file nobody else can write — and wraps what it returns.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import stat
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.gpt import GPT, GPTConfig, HookPoint, KVCache, ModelIdentity, attention, check_tokens, computed_identity
from model.sources._hf_decoder import HFDecoder, _AttentionHooks

_ORIGINAL_SDPA = F.scaled_dot_product_attention
_routing = threading.local()  # .decoder: the OwnDecoder whose forward runs on this thread, .call: SDPA calls so far


class OwnModuleError(ValueError):
    """A module or factory that cannot be traced this way: the message says what, why and what would work."""


def traced_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s contract, stage by stage through the current layer's hook points
    (the original function when no ``OwnDecoder`` forward runs on this thread).

    ``query [B,H,n,d_head]``, ``key``/``value`` ``[B,G,t,d_head]`` (G = H unless ``enable_gqa``)."""
    decoder = getattr(_routing, "decoder", None)
    if decoder is None:
        return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                              scale=scale, enable_gqa=enable_gqa)
    layer = _routing.call
    _routing.call += 1
    hooks = decoder.blocks[layer].attn if layer < len(decoder.blocks) else None
    if hooks is not None:
        query, key, value = hooks.receive(query, key, value)
    n, t = query.shape[-2], key.shape[-2]
    mask = _additive_mask(attn_mask, is_causal, n, t, query)  # [..., n, t] or None
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    # grouped K/V are read per group by attention(), as enable_gqa does, without copying them H/G times
    z, _ = attention(query, key, value, mask, hooks, scale=scale, dropout_p=dropout_p)  # [B,H,n,d_head]
    return hooks.hook_z(z) if hooks is not None else z


def _additive_mask(attn_mask: torch.Tensor | None, is_causal: bool, n: int, t: int,
                   like: torch.Tensor) -> torch.Tensor | None:
    """SDPA's mask as the additive M (0 / −∞) ``[..., n, t]``: ``is_causal`` is the top-left-aligned lower
    triangle (query i sees keys 0 … i, as PyTorch documents it); a boolean mask is True where allowed."""
    if is_causal:
        allowed = torch.ones(n, t, dtype=torch.bool, device=like.device).tril()
        return torch.zeros(n, t, dtype=like.dtype, device=like.device).masked_fill(~allowed, float("-inf"))[None, None]
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=like.dtype, device=like.device).masked_fill(~attn_mask, float("-inf"))
    return attn_mask.to(like.dtype)


class _Block(nn.Module):
    """One SDPA call's hook points, under ``blocks.{L}.attn`` (the names every view reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = _AttentionHooks(softcap=False)


class _Routed:
    """While an ``OwnDecoder`` forward runs: SDPA calls on this thread go to ``traced_sdpa`` for it."""

    def __init__(self, decoder: OwnDecoder) -> None:
        self.decoder = decoder

    def __enter__(self) -> None:
        if getattr(_routing, "decoder", None) is not None:
            raise RuntimeError("an OwnDecoder forward is already running on this thread")
        F.scaled_dot_product_attention = traced_sdpa  # idempotent: the router falls through when not routing
        _routing.decoder, _routing.call = self.decoder, 0

    def __exit__(self, *exc: object) -> None:
        _routing.decoder = None


def _logits_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]  # nanoGPT returns (logits, loss)
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise OwnModuleError(f"the module returned {type(output).__name__}; expected logits [B, n, V], a tuple whose "
                         "first item they are, or an object with .logits")


class OwnDecoder(nn.Module):
    """A user's decoder module (``module(tokens [B, n]) → logits [B, n, V]``) with our hook points on every
    SDPA call it makes. ``n_ctx`` defaults to the module's ``config.block_size`` / ``n_ctx`` when it has one."""

    def __init__(self, module: nn.Module, *, n_ctx: int | None = None, name: str = "your module",
                 source: str = "built in code") -> None:
        super().__init__()
        self.inner = module.eval()
        self.blocks = nn.ModuleList()
        self.hook_logits = HookPoint()  # [B, n, V]
        cfg = getattr(module, "config", None)
        n_ctx = n_ctx or getattr(cfg, "block_size", None) or getattr(cfg, "n_ctx", None)
        if not isinstance(n_ctx, int) or n_ctx < 2:
            raise OwnModuleError("the module's context length is unknown: give n_ctx (the module has no "
                                 "config.block_size or config.n_ctx)")
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        with torch.no_grad(), _Routed(self):  # count the SDPA calls: one per layer
            logits = _logits_of(module(torch.zeros(1, 1, dtype=torch.long, device=device)))
        calls = _routing.call
        if calls == 0:
            raise OwnModuleError(
                f"{type(module).__name__} made no call to torch.nn.functional.scaled_dot_product_attention, so "
                "its attention cannot be seen (a module that imports the function by name at import time calls "
                "the original: call it as F.scaled_dot_product_attention)")
        blocks = [_Block() for _ in range(calls)]
        self.blocks.extend(blocks)
        with torch.no_grad(), _Routed(self):  # now with hook points: learn each layer's head counts
            module(torch.zeros(1, 1, dtype=torch.long, device=device))
        H, G, d_head, d_v = blocks[0].attn.seen
        d_model = int(getattr(cfg, "n_embd", None) or getattr(cfg, "d_model", None) or H * d_head)
        self.config = GPTConfig(vocab_size=int(logits.shape[-1]), n_ctx=int(n_ctx), d_model=d_model, n_layer=calls,
                                n_head=H, n_kv_head=G, head_dim=d_head, family="module",
                                v_head_dim=d_v if d_v != d_head else None,
                                hf_model_type=type(module).__name__)
        self._named = (name, source)
        self._identity: ModelIdentity | None = None  # set only to override the computed one

    @property
    def identity(self) -> ModelIdentity:
        """Your module's name and source, and a digest of its weights as they are now (computed once per set of
        weights)."""
        if self._identity is not None:
            return self._identity
        name, source = self._named
        return computed_identity(self, f"module:{type(self.inner).__name__}", self.config.to_dict(),
                                 weights=self.inner, name=name, source=source)

    @identity.setter
    def identity(self, value: ModelIdentity) -> None:
        self._identity = value

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.inner.parameters())

    def new_cache(self, batch_size: int = 1, storage: str = "model") -> KVCache:
        raise OwnModuleError("your module runs without our KV cache: every step recomputes all positions "
                             "(turn the cache off)")

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, *,
                padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, n, V]``: the module's own forward, its SDPA calls routed through our hook points."""
        if cache is not None:
            self.new_cache()  # raises, saying why
        if padding_mask is not None and not bool(padding_mask.all()):
            raise OwnModuleError("your module's forward takes no padding mask: give one prompt, or prompts of "
                                 "equal length")
        check_tokens(self.config, tokens, None)
        with _Routed(self):
            logits = _logits_of(self.inner(tokens))
        if _routing.call != len(self.blocks):
            raise OwnModuleError(f"this forward made {_routing.call} attention calls, the probe {len(self.blocks)}: "
                                 "a module whose number of layers changes between calls cannot be traced")
        return self.hook_logits(logits)


def load_factory(spec: str) -> tuple[nn.Module, Any]:
    """``"package.module:factory"`` → ``(model, tokenizer or None)``: the factory returns a model, or a
    ``(model, tokenizer)`` pair. A model that is not ours (GPT) or transformers' is wrapped in ``OwnDecoder``.

    The module is imported from ``sys.path`` and the working directory; its file, and the folder holding it,
    must not be writable by anyone but their owner (code others can change is never run)."""
    import sys

    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise OwnModuleError(f"{spec!r}: give the factory as package.module:function")
    module_name, attr = spec.split(":")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    found = importlib.util.find_spec(module_name)
    if found is None or found.origin is None:
        raise OwnModuleError(f"{module_name}: no such module on the Python path or in {os.getcwd()}")
    for path in (Path(found.origin), Path(found.origin).parent):
        mode = path.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise OwnModuleError(f"{path} can be written by others (mode {stat.filemode(mode)}): refusing to run "
                                 "code from it (chmod go-w it first)")
    module = importlib.import_module(module_name)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise OwnModuleError(f"{module_name} has no function {attr!r}")
    made = factory()
    model, tokenizer = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module):
        raise OwnModuleError(f"{spec} returned {type(model).__name__}, not a torch module")
    if isinstance(model, (GPT, OwnDecoder, HFDecoder)):
        return model, tokenizer
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return HFDecoder(model), tokenizer
    return OwnDecoder(model, name=spec, source=str(found.origin)), tokenizer
