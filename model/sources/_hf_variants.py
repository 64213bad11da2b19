"""Attention variants the traced attention function stages beyond the plain softmax: a learned score bias handed to
the attention function beside the mask (Inkling's relative position bias, ``position_bias``), and sink logits that
vary per query (Inkling 2's ``sinks``, one logit per head and position projected from the hidden state).

``_hf_attention.traced_attention`` calls ``attention_with_score_bias`` where a call passes ``position_bias``; the
stages go through the layer's hook points (``_AttentionHooks``): the scores, then the bias (``hook_score_bias``),
the mask, their sum (``hook_masked_scores`` = scores + bias + M), the sink column where there is one
(``hook_sink_logits`` / ``hook_sink_weight``, as gpt-oss's in ``attention_with_sinks``), the pattern and A·V.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gpt_shape_tracer.model.sources._hf_attention import _AttentionHooks


def sink_column(sinks: torch.Tensor, B: int, H: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The sink logits as one column beside the scores, ``[B, H, n, 1]``: from one learned logit per head (gpt-oss's
    ``s_aux [H]``) or from one per head and query (Inkling 2's ``sinks [B, H, n, 1]``, projected from each
    position's hidden state)."""
    if sinks.dim() == 1:
        sinks = sinks.reshape(1, H, 1, 1)
    return sinks.to(dtype).expand(B, H, n, 1)


def attention_with_score_bias(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                              hooks: _AttentionHooks | None, scale: float, bias: torch.Tensor,
                              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with a score bias beside the mask, stage by stage as Inkling's eager function computes it:
    scores = QKᵀ·scale, + the bias ``[B|1, H, n, t]`` (``hook_score_bias``), + M; softmax in float32 over the t keys —
    and, where ``sinks`` is given (Inkling 2), over one more column holding the sink logit, dropped after the
    softmax, so that A's rows sum to less than 1 (``hook_sink_weight``: what the sink took). ``query [B,H,n,d]``,
    ``key``/``value`` ``[B,G,t,d]``; returns ``z [B,H,n,d_v]``."""
    def through(name: str, x: torch.Tensor) -> torch.Tensor:
        point = getattr(hooks, name, None) if hooks is not None else None
        return point(x) if point is not None else x

    B, H, n, _ = query.shape
    group = H // key.shape[1]  # query head h reads key/value head h // (H/G), as transformers' repeat_kv
    keys, values = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)  # [B,H,t,d]
    qk = through("hook_qk", query @ keys.transpose(-2, -1))  # [B,H,n,d] @ [B,H,d,t] -> [B,H,n,t]
    scores = through("hook_attn_scores", qk * scale)
    biased = scores + through("hook_score_bias", bias.to(scores.dtype))  # the order of Inkling's eager function
    if mask is not None:
        biased = biased + through("hook_mask", mask)  # + [B|1,1,n,t]
    logits = through("hook_masked_scores", biased)  # scores + bias + M
    if sinks is None:
        pattern = through("hook_pattern", torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype))
        return pattern @ values  # [B,H,n,t] @ [B,H,t,d_v]
    sink = through("hook_sink_logits", sink_column(sinks, B, H, n, logits.dtype))
    probs = torch.softmax(torch.cat([logits, sink], dim=-1).float(), dim=-1).to(query.dtype)  # [B,H,n,t+1]
    pattern = through("hook_pattern", probs[..., :-1])  # the keys' share: rows sum to < 1
    through("hook_sink_weight", probs[..., -1:])  # [B,H,n,1]
    return pattern @ values
