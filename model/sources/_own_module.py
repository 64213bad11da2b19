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
from an import chain (parent packages, module file, links) nobody else can write — and wraps what it returns.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import stat
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gpt_shape_tracer.model.gpt import (
    GPT,
    GPTConfig,
    HookPoint,
    KVCache,
    ModelIdentity,
    attention,
    check_tokens,
    computed_identity,
)
from gpt_shape_tracer.model.sources._hf_attention import _AttentionHooks
from gpt_shape_tracer.model.sources._hf_decoder import HFDecoder

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
        # why it runs without our KV cache, as HFDecoder.no_cache_reason says it for a family that keeps none
        self.no_cache_reason = "your module runs its own forward, without our KV cache"

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
                padding_mask: torch.Tensor | None = None, logits_to_keep: int = 0) -> torch.Tensor:
        """Logits ``[B, n, V]``: the module's own forward, its SDPA calls routed through our hook points
        (``logits_to_keep`` k > 0: its logits cut to the last k positions, ``[B, k, V]``)."""
        if cache is not None:
            self.new_cache()  # raises, saying why
        if padding_mask is not None and not bool(padding_mask.all()):
            raise OwnModuleError("your module's forward takes no padding mask: give one prompt, or prompts of "
                                 "equal length")
        check_tokens(self.config, tokens, None, logits_to_keep)
        with _Routed(self):
            logits = _logits_of(self.inner(tokens))
        if _routing.call != len(self.blocks):
            raise OwnModuleError(f"this forward made {_routing.call} attention calls, the probe {len(self.blocks)}: "
                                 "a module whose number of layers changes between calls cannot be traced")
        return self.hook_logits(logits[:, -logits_to_keep:] if logits_to_keep else logits)


def load_factory(spec: str) -> tuple[nn.Module, Any]:
    """``"package.module:factory"`` → ``(model, tokenizer or None)``: the factory returns a model, or a
    ``(model, tokenizer)`` pair. A model that is not ours (GPT) or transformers' is wrapped in ``OwnDecoder``.

    The module is found on ``sys.path`` and in the working directory without importing anything; then its whole
    import chain — every parent package's folder and ``__init__.py``, the module file, its cached bytecode, every
    symbolic link on the way and the real file and folders it leads to — is checked (``_check_writers``) before
    a line of it runs, and the chain is imported from exactly the files checked (code others can change is never
    run)."""
    import sys

    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise OwnModuleError(f"{spec!r}: give the factory as package.module:function")
    module_name, attr = spec.split(":")
    if not all(part.isidentifier() for part in module_name.split(".")) or not attr.isidentifier():
        raise OwnModuleError(f"{spec!r}: give the factory as package.module:function (Python names)")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    chain = _import_chain(module_name)  # [(name, spec)] from the top package down; nothing imported yet
    for _, found in chain:
        for path in _code_paths(found):
            _check_writers(path)
    module = _import_checked(chain)
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise OwnModuleError(f"{module_name} has no function {attr!r}")
    try:
        made = factory()
    except Exception as e:  # noqa: BLE001 - your code's own failure, whatever its class: a refusal that says it
        raise OwnModuleError(f"{spec} raised {type(e).__name__}: {str(e)[:500]}") from e
    model, tokenizer = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not isinstance(model, nn.Module):
        raise OwnModuleError(f"{spec} returned {type(model).__name__}, not a torch module")
    if isinstance(model, (GPT, OwnDecoder, HFDecoder)):
        return model, tokenizer
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return HFDecoder(model), tokenizer
    return OwnDecoder(model, name=spec, source=str(chain[-1][1].origin)), tokenizer


def _import_chain(module_name: str) -> list[tuple[str, importlib.machinery.ModuleSpec]]:
    """Every package from the top one down to the module, found the way ``import`` finds it but without
    running any of it (``importlib.util.find_spec`` of a dotted name would import the parents first)."""
    import sys

    chain: list[tuple[str, importlib.machinery.ModuleSpec]] = []
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name)
        if loaded is not None and getattr(loaded, "__spec__", None) is not None:
            found = loaded.__spec__
        elif depth == 1:
            found = importlib.util.find_spec(name)  # the finders only: nothing of the module runs
        else:
            search = chain[-1][1].submodule_search_locations
            if search is None:
                raise OwnModuleError(f"{chain[-1][0]} is a module, not a package: {module_name} cannot be in it")
            found = importlib.machinery.PathFinder.find_spec(name, list(search))
        if found is None:
            raise OwnModuleError(f"{name}: no such module on the Python path or in {os.getcwd()}")
        if found.origin in ("built-in", "frozen") or (found.origin is None and not found.submodule_search_locations):
            raise OwnModuleError(f"{name} is built into Python ({found.origin or 'no file'}), not a file of your "
                                 "own: give your module's package.module:function")
        chain.append((name, found))
    return chain


def _code_paths(found: importlib.machinery.ModuleSpec) -> list[Path]:
    """The files and folders whose contents become this module's code: its file (a package's ``__init__.py``)
    and the folder holding it, a namespace package's folders, and the cached bytecode Python would run instead of
    the source when its timestamp matches."""
    paths: list[Path] = []
    if found.origin is not None and found.has_location:
        origin = Path(found.origin)
        paths += [origin, origin.parent]
        cached = getattr(found, "cached", None)
        if cached and os.path.lexists(cached):
            paths += [Path(cached), Path(cached).parent]
    paths += [Path(p) for p in (found.submodule_search_locations or ())]
    return paths


def _check_writers(path: Path, *, holds_code: bool = True, depth: int = 0) -> None:
    """Refuse ``path`` if anyone but its owner (you, or root) could change what it leads to: the path is walked
    folder by folder from ``/``; every folder on the way must be owned by you or root and not writable by group
    or others — unless it has the sticky bit (like /tmp: others may add entries, not rename or replace yours),
    allowed above the code's own folder only (a sticky folder holding the module would let anyone add a
    ``__pycache__`` beside it). A symbolic link is followed and its target walked the same way. The last
    component (the file, or the code's own folder) is checked strictly."""
    if depth > 40:
        raise OwnModuleError(f"{path}: too many symbolic links")
    path = Path(os.path.abspath(path))
    current = Path(path.anchor)
    parts = path.parts[1:]
    _check_one(current, strict=not parts and holds_code)
    for k, part in enumerate(parts):
        step = current / part
        last = k == len(parts) - 1
        if step.is_symlink():
            target = Path(os.readlink(step))
            resolved = target if target.is_absolute() else current / target
            rest = Path(*parts[k + 1:]) if not last else None
            _check_writers(resolved / rest if rest is not None else resolved, holds_code=holds_code, depth=depth + 1)
            return
        _check_one(step, strict=last and holds_code)
        current = step


def _check_one(path: Path, *, strict: bool) -> None:
    try:
        info = path.lstat()
    except OSError as e:
        raise OwnModuleError(f"{path}: cannot be checked ({e.strerror}): refusing to run code from it") from None
    mode = info.st_mode
    if info.st_uid not in (0, os.getuid()):
        raise OwnModuleError(f"{path} belongs to user id {info.st_uid}, not to you or root: refusing to run code "
                             "from it (its owner can change it)")
    others_write = bool(mode & (stat.S_IWGRP | stat.S_IWOTH))
    if others_write and (strict or not (stat.S_ISDIR(mode) and mode & stat.S_ISVTX)):
        raise OwnModuleError(f"{path} can be written by others (mode {stat.filemode(mode)}): refusing to run "
                             "code from it (chmod go-w it first)")


def _import_checked(chain: list[tuple[str, importlib.machinery.ModuleSpec]]) -> Any:
    """Import the chain from exactly the specs checked (not a new search of ``sys.path``, which a file added
    meanwhile to an earlier folder could answer)."""
    import sys

    module: Any = None
    for name, found in chain:
        if name in sys.modules:
            module = sys.modules[name]
            continue
        child = importlib.util.module_from_spec(found)
        sys.modules[name] = child
        try:
            assert found.loader is not None
            found.loader.exec_module(child)
        except BaseException:
            sys.modules.pop(name, None)
            raise
        if module is not None:
            setattr(module, name.rpartition(".")[2], child)
        module = sys.modules[name]
    return module
