"""Scores that name what an attention head does, read from ``attn.hook_pattern`` — the one home of their
formulas (``role_scores``); the app's head roles (``tracer.head_scores``) and the bundled models' training
checks both use it.

* previous-token score: mean weight a query at position i puts on key i−1;
* induction score: on a random token sequence repeated twice, mean weight a
  query in the second copy puts on the token right after the earlier
  occurrence of its own token (key i − R + 1 for a repeat of length R);
* duplicate-token score: in the second copy, the weight on the earlier occurrence of its own token;
* first-token score: the mean weight on the very first key (an "attention sink").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from gpt_shape_tracer.model.gpt import GPT, block_attention


@torch.no_grad()
def attention_patterns(model: GPT, tokens: torch.Tensor) -> list[torch.Tensor]:
    """One forward of ``tokens`` ``[B, n]``; returns the pattern ``[B, H, n, n]`` of every layer."""
    patterns: list[torch.Tensor] = []
    handles = [
        block_attention(model, layer).hook_pattern.register_forward_hook(
            lambda _m, _i, out: patterns.append(out.detach()))
        for layer in range(len(model.blocks))
    ]
    try:
        model(tokens)
    finally:
        for h in handles:
            h.remove()
    return patterns


HEAD_ROLES = ("previous-token", "induction", "duplicate-token", "first-token")


def role_scores(pattern: torch.Tensor, length: int | None = None) -> dict[str, torch.Tensor]:
    """Per head ``[H]``, the scores of one layer's pattern ``[B, H, n, n]``: previous-token and first-token
    always; induction and duplicate-token when the last ``2·length`` positions are a repeat of ``length``."""
    n = pattern.shape[-1]
    out = {"previous-token": pattern.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2)),  # keys i−1
           "first-token": pattern[:, :, 1:, 0].mean(dim=(0, 2))}
    if length is not None:
        queries = torch.arange(n - length, n)  # the second copy
        out["induction"] = pattern[:, :, queries, queries - length + 1].mean(dim=(0, 2))
        out["duplicate-token"] = pattern[:, :, queries, queries - length].mean(dim=(0, 2))
    return out


def previous_token_scores(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """``[n_layer, n_head]``: mean attention weight on position i−1, over queries i ≥ 1."""
    return torch.stack([role_scores(p)["previous-token"] for p in attention_patterns(model, tokens)])


def repeated_random_tokens(
    vocab_size: int, length: int, batch: int, seed: int, first_id: int = 1, prefix: int | None = None
) -> torch.Tensor:
    """``[batch, (prefix?) + 2·length]``: random ids in ``[first_id, vocab_size)`` repeated twice."""
    g = torch.Generator().manual_seed(seed)
    half = torch.randint(first_id, vocab_size, (batch, length), generator=g)
    parts = [half, half]
    if prefix is not None:
        parts.insert(0, torch.full((batch, 1), prefix, dtype=torch.long))
    return torch.cat(parts, dim=1)


def induction_scores(model: GPT, tokens: torch.Tensor, length: int) -> torch.Tensor:
    """``[n_layer, n_head]`` for ``tokens`` whose last ``2·length`` positions are a repeat."""
    return torch.stack([role_scores(p, length)["induction"] for p in attention_patterns(model, tokens)])


@contextmanager
def ablated(model: GPT, layer: int, head: int) -> Iterator[None]:
    """Zero one head's output ``z`` while the block runs (to see what depends on it)."""

    def zero_head(module, args, output):
        out = output.clone()
        out[:, head] = 0
        return out

    handle = block_attention(model, layer).hook_z.register_forward_hook(zero_head)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def repeat_loss(model: GPT, tokens: torch.Tensor, length: int) -> float:
    """Mean next-token loss over the second copy of a repeated sequence (what induction predicts)."""
    logits = model(tokens)
    n = tokens.size(1)
    pred = logits[:, n - length : n - 1]
    target = tokens[:, n - length + 1 : n]
    return torch.nn.functional.cross_entropy(pred.flatten(0, 1), target.flatten()).item()


@torch.no_grad()
def ablation_effects(model: GPT, tokens: torch.Tensor, length: int) -> tuple[float, torch.Tensor]:
    """The loss on the repeated half of ``tokens`` intact, and ``[n_layer, n_head]``: how much zeroing
    each head alone raises it (nats; negative when the loss falls)."""
    intact = repeat_loss(model, tokens, length)
    effects = torch.zeros(model.config.n_layer, model.config.n_head)
    for layer in range(model.config.n_layer):
        for head in range(model.config.n_head):
            with ablated(model, layer, head):
                effects[layer, head] = repeat_loss(model, tokens, length) - intact
    return intact, effects
