"""Whether each block of a transformers-run model is a plain residual sum — the stream after attention (or a
hybrid layer's mixer) the stream entering the block + its output, and the stream leaving it that + the MLP's — as
measured on the load's one-token forward (``GPTConfig.plain_residual``: the views add the parts only where it
holds), within float rounding scaled to the sums' own size."""

from __future__ import annotations

import torch

_RESIDUAL_POINTS = ("hook_resid_pre", "hook_attn_out", "hook_mixer_out", "hook_resid_mid", "hook_mlp_out",
                    "hook_resid_post")


def _sum_holds(total: torch.Tensor, parts: list[torch.Tensor]) -> bool | None:
    """Whether ``total`` is the sum of ``parts`` within the rounding of their dtype (a few ulps of the largest
    magnitude involved: the model may add in another order, or in its own dtype where we add in float64). None
    where that cannot tell: a part that is all zeros (every mix of it is a sum) or a value that is not finite."""
    eps = torch.finfo(total.dtype).eps if total.is_floating_point() else 0.0
    parts64 = [p.to("cpu", torch.float64) for p in parts]
    total64 = total.to("cpu", torch.float64)
    if not all(bool(t.isfinite().all()) for t in [total64, *parts64]) or any(not bool(p.any()) for p in parts64):
        return None
    scale = max(float(t.abs().max()) for t in [total64, *parts64])
    return float((total64 - sum(parts64)).abs().max()) <= 8 * eps * scale


def _plain_residual(seen: dict[tuple[int, str], torch.Tensor], n_layer: int) -> bool | None:
    """From one forward's block tensors: True where every block's stream after attention (or its mixer) is the
    stream entering it + that output, and the stream leaving it is that + the MLP's output (a parallel block, with
    no stream in between: x + both); False where some block is not; None where a block lacks a tensor to tell."""
    verdicts: list[bool | None] = []
    for L in range(n_layer):
        pre, post, mlp, mid = (seen.get((L, k)) for k in ("hook_resid_pre", "hook_resid_post", "hook_mlp_out",
                                                           "hook_resid_mid"))
        mix = seen.get((L, "hook_attn_out"), seen.get((L, "hook_mixer_out")))
        if pre is None or post is None or mlp is None or mix is None \
                or any(t.numel() != pre.numel() for t in (post, mlp, mix, *([mid] if mid is not None else []))):
            verdicts.append(None)
            continue
        # [B, n, d] each (OPT's MLP and the norm before it see [B·n, d]: the same numbers, flattened)
        post, mlp, mix = (t.reshape(pre.shape) for t in (post, mlp, mix))
        if mid is None:
            verdicts.append(_sum_holds(post, [pre, mix, mlp]))
        else:
            mid = mid.reshape(pre.shape)
            halves = (_sum_holds(mid, [pre, mix]), _sum_holds(post, [mid, mlp]))
            verdicts.append(False if False in halves else None if None in halves else True)
    if False in verdicts:
        return False
    return None if None in verdicts else True
