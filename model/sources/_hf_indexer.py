"""Indexed (sparse) attention, watched: DeepSeek-V3.2's DeepSeek Sparse Attention and the families built on it
(GLM-5's ``glm_moe_dsa``, HY-V4, dots3, AXK2), and Qwen4-Exp's block-wise QSA.

A learned *indexer* beside the attention scores every key for every query with projections of its own, keeps
keys of its own in the cache (``update_indexer``: transformers' ``DynamicIndexedLayer``; here ``KVCache``'s
indexer buffers), and each query attends only to the keys it ranks highest (DeepSeek-AI 2025, "DeepSeek-V3.2";
the top-k of ``index_score[b,s,t] = Σ_h w[b,s,h]·ReLU(q[b,s,h]·k[b,t])``). The layer's own code does this: our
attention function receives the choice — a DSA indexer's top-k ``indices`` ``[B,n,k]``, or a QSA mask already
folded into the attention mask — and the attention over the chosen keys is staged through the hook points as any
layer's (``model.sources._hf_attention._indexed_mask``).

What the indexer module computes inside is watched by behaviour, not re-implemented: a forward pre-hook enters a
torch function mode that keeps the input of the last ``topk`` over ``[B, n, t]`` — the scores the indexer ranks
(``hook_index_scores``) — and the forward hook reads what the module returned: top-k indices (DSA: the attention
receives them itself) or a boolean ``[B, 1, n, t]`` choice (QSA), with the mask it was given (what each query could
see), left for the attention call that follows (``pending_selection``)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from gpt_shape_tracer.model.sources._hf_attention import _AttentionHooks


def indexer_of(attn: nn.Module) -> nn.Module | None:
    """The indexer of an indexed attention module (its ``indexer`` child: every family transformers ships names it
    so), None where the module has none — a GLM-5 "shared" layer reuses the previous layer's choice."""
    child = getattr(attn, "indexer", None)
    return child if isinstance(child, nn.Module) else None


class _TopkWatch(TorchFunctionMode):
    """Keeps the input of every ``topk`` over the last axis while the indexer runs (nothing is changed)."""

    def __init__(self) -> None:
        super().__init__()
        self.ranked: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.topk, torch.Tensor.topk) and args and isinstance(args[0], torch.Tensor):
            dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
            if dim in (-1, args[0].dim() - 1):
                self.ranked.append(args[0])
        return func(*args, **kwargs)


def watch_indexer(indexer: nn.Module, hooks: _AttentionHooks) -> list[Any]:
    """Hooks on ``indexer`` recording its scores and choice through ``hooks``; returns the handles."""
    signature = inspect.signature(indexer.forward)
    watch: list[_TopkWatch] = []

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        mode = _TopkWatch()
        mode.__enter__()
        watch.append(mode)

    def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        mode = watch.pop()
        mode.__exit__(None, None, None)
        try:
            mask = signature.bind(*args, **kwargs).arguments.get("attention_mask")
        except TypeError:
            mask = None
        if not isinstance(output, torch.Tensor) or not isinstance(mask, torch.Tensor):
            return
        visible = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        if visible.dim() == 4:
            visible = visible[:, 0]  # [B,1,n,t] -> [B,n,t]
        B, n, t = visible.shape
        ranked = [x for x in mode.ranked if tuple(x.shape) == (B, n, t)]
        if ranked:  # DSA: the scores its top-k ranked, [B,n,t]
            hooks.hook_index_scores(ranked[-1])
        if output.dtype == torch.bool and output.dim() == 4:  # QSA: its choice, already folded into the mask
            hooks.pending_selection = (visible, output[:, 0, :, :t] & visible)

    return [indexer.register_forward_pre_hook(enter, with_kwargs=True),
            indexer.register_forward_hook(leave, with_kwargs=True)]
