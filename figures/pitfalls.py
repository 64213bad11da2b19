"""The pitfalls the scale and the mask prevent, shown on one head's own recorded Q, K and M: the pattern
recomputed four ways (as the model does, without the scale, without the mask, neither), and what a sink column
takes from each row (gpt-oss).
"""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.attention import score_bias, score_bias_name
from gpt_shape_tracer.figures.common import (
    bidirectional,
    key_labels,
    kv_head,
    own_stream,
    position_is_token,
    query_labels,
    real_query_rows,
    score_scale,
)
from gpt_shape_tracer.figures.heatmap import (
    add,
    grid,
    style_axes,
)
from gpt_shape_tracer.figures.plot import fitted, subplots
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import Trace


def pitfall_patterns(trace: Trace, step: int, layer: int, head: int, batch: int = 0
                     ) -> dict[str, torch.Tensor] | None:
    """The head's weights recomputed from its recorded Q, K and M four ways: as the model does it; without
    ÷√d_k; without the mask; with the mask applied after the softmax (zeroing, not renormalising)."""
    rope = trace.has(act_name("rot_q", layer), step)
    q = trace.get(act_name("rot_q" if rope else "q", layer), step)
    k = trace.get(act_name("k_all", layer), step)
    mask = trace.get(act_name("mask", layer), step)
    if q is None or k is None or mask is None:
        return None
    qh = q[batch, head].double()  # [n, d_head]
    kh = k[batch, kv_head(trace, layer, head, step)].double()  # [t, d_head]
    m = mask[min(batch, mask.shape[0] - 1), 0].double()  # [n, t]
    raw = qh @ kh.T  # [n, t]
    scale = score_scale(trace, qh.shape[-1])
    scaled = raw * scale
    cap = getattr(trace.config, "attn_softcap", None)
    if cap:  # the model soft-caps after scaling: recomputed as it does
        scaled = torch.tanh(scaled / cap) * cap
    sink = sink_logits(trace, step, layer, head, batch)
    if trace.has(act_name("sink_logits", layer), step) and sink is None:
        return None  # the model has a sink, whose values were not kept: the recomputation would leave it out
    bias = score_bias(trace, step, layer, head, batch)
    if trace.has(score_bias_name(layer), step) and bias is None:
        return None  # likewise its score bias
    if bias is not None:  # Inkling: part of the scores in every variant (it is no scale and no mask)
        raw, scaled = raw + bias, scaled + bias

    def softmax(x: torch.Tensor) -> torch.Tensor:  # over the keys, and the sink where the model has one
        return torch.softmax(x, dim=-1) if sink is None else softmax_with_sink(x, sink)

    allowed = torch.isfinite(m)
    after = softmax(scaled) * allowed
    unscaled = "without ÷√d_k" if math.isclose(scale, qh.shape[-1] ** -0.5, rel_tol=1e-6) else "without the scale s"
    return {
        "as the model does it": softmax(scaled + m),
        unscaled: softmax(raw + m),
        "without the mask M": softmax(scaled),
        "mask after the softmax": after,
    }



def sink_logits(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> torch.Tensor | None:
    """The learned sink logit beside each query row of one head, ``[n]`` (gpt-oss); None for a model without
    sinks, or when its values were not kept."""
    name = act_name("sink_logits", layer)
    value = trace.get(name, step) if trace.has(name, step) else None
    return None if value is None else value[batch, head, :, 0].double()  # [B,H,n,1] -> [n]


def softmax_with_sink(scores: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The keys' weights ``[n, t]`` of a softmax over the t keys and one sink logit per row ``[n]``: rows sum to
    less than 1, the rest is the sink's."""
    return torch.softmax(torch.cat([scores, sink[:, None]], dim=-1), dim=-1)[:, :-1]


def sink_sentence(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> str | None:
    """How much of each query row's weight went to the sink at this head (from ``hook_sink_weight``), and so
    what the rows of A sum to; None for a model without sinks or without their values."""
    name = act_name("sink_weight", layer)
    weight = trace.get(name, step) if trace.has(name, step) else None
    if weight is None:
        return None
    w = weight[batch, head, :, 0].double()  # [n]
    if trace.generation is not None:  # a padding query row sees no key: the sink takes all of it, which says nothing
        real = trace.generation.is_token(batch, step)[-len(w):]
        w = w[torch.tensor(real, dtype=torch.bool)] if len(real) == len(w) else w
    if not len(w):
        return None
    mean, low, high = float(w.mean()), float(w.min()), float(w.max())
    spread = (f"{low:.1%} to {high:.1%} over its {len(w)} query rows" if len(w) > 1 else "at its one query row")
    return (f"This model adds a learned sink to every softmax: one more logit per head (s_h), beside the keys, "
            f"whose weight is dropped after the softmax. In layer {layer}, head {head}, the sink took {mean:.1%} of "
            f"the weight on average ({spread}), so the rows of A sum to {1 - high:.3f}…{1 - low:.3f} instead of 1: "
            "the output O = A·V is that much smaller than a weighted mean of the values. (Some families — Granite's "
            "sliding-window ones — write the same thing as the softmax over the keys alone with O scaled by "
            "σ(logsumexp(scores + M) − s_h) afterwards: the same O; A here is the keys' share after the sink.)")


def pitfall_table(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> pd.DataFrame | None:
    """Per variant: the mean over the real (non-padding) query rows of the largest weight, of the entropy (nats),
    of the weight on keys the mask forbids, and of the row sums."""
    variants = pitfall_patterns(trace, step, layer, head, batch)
    if variants is None:
        return None
    mask = trace.get(act_name("mask", layer), step)
    assert mask is not None  # pitfall_patterns read it
    forbidden = ~torch.isfinite(mask[min(batch, mask.shape[0] - 1), 0])
    real = real_query_rows(trace, step, batch, forbidden.shape[0], layer)
    if not bool(real.any()):  # no real row at all: the means are over every row rather than none
        real = torch.ones_like(real)
    rows = []
    for name, a in variants.items():
        a, forbidden_rows = a[real], forbidden[real]
        p = a.clamp_min(1e-300)
        rows.append({"variant": name, "max weight (mean over rows)": float(a.max(-1).values.mean()),
                     "entropy, nats (mean over rows)": float(-(a * p.log()).sum(-1).mean()),
                     "weight on forbidden keys": float((a * forbidden_rows).sum(-1).mean()),
                     "row sum": float(a.sum(-1).mean())})
    return pd.DataFrame(rows)


def pitfall_sentence(trace: Trace, step: int, layer: int, head: int, batch: int = 0,
                     scaling: str = "÷√d_k") -> str:
    """What the pitfalls do at this step, read from the recomputed weights: where weight leaks without M
    (keys after their query, padding keys) and whether masking after the softmax breaks the row sums, or
    that neither can happen here (a cached decode step: the one query row is the newest position)."""
    table = pitfall_table(trace, step, layer, head, batch)
    mask = trace.get(act_name("mask", layer), step)
    if table is None or mask is None:
        return ""
    forbidden = ~torch.isfinite(mask[min(batch, mask.shape[0] - 1), 0])  # [n, t]
    n_rows, t = forbidden.shape  # [n, t]
    real = real_query_rows(trace, step, batch, n_rows, layer)
    if not bool(real.any()):  # as pitfall_table: every row, rather than none
        real = torch.ones_like(real)
    first = (f"Without {scaling} the scores are larger and the softmax far peakier (a larger max weight, a lower "
             "entropy).")
    # BLT's cross-attention, its patches: no key is "after" a query; CPM-Ant: every position sees every other
    streams = own_stream(trace, step, layer) is not None
    if streams or bidirectional(trace):
        hidden = int((forbidden & real[:, None]).sum())
        after = float(table.set_index("variant").loc["mask after the softmax", "row sum"])
        why = ("its rows and columns are positions of its own streams, not of the text" if streams else
               "this model's mask is not causal, a query seeing the keys after it too")
        after_sentence = (f"Masking after the softmax leaves rows that no longer sum to 1 (mean row sum {after:.3f})."
                          if after < 1 - 1e-9 else "Masking after the softmax leaves the row sums at 1 here.")
        return first + (f" Without M, weight leaks onto the {hidden:,} (query, key) pairs this block's mask hides "
                        f"({why}: which key a query may read is its mask's rule, not causality). " if hidden else
                        f" This block's mask hides no (query, key) pair at this step ({why}), so leaving it out "
                        "changes nothing. ") + after_sentence
    query_col = torch.arange(t - n_rows, t)[:, None]  # each query row's own column
    later = torch.arange(t)[None, :] > query_col
    forbidden = forbidden & real[:, None]  # a padding row's output is never read: its leaks matter to no one
    real_keys = (torch.tensor(position_is_token(trace, batch, step)[:t], dtype=torch.bool)
                 if trace.generation is not None else torch.ones(t, dtype=torch.bool))[None, :]
    future = int((forbidden & later).sum())
    padding = int((forbidden & ~later & ~real_keys).sum())
    window = int((forbidden & ~later & real_keys).sum())  # an earlier real key hidden: a sliding window
    sinks = trace.has(act_name("sink_logits", layer), step)  # gpt-oss: the model's own rows sum to less than 1
    own = float(table.set_index("variant").loc["as the model does it", "row sum"])
    sums = (f"the model's own row sums, {own:.3f} on average: the rest is the sink's" if sinks else "row sums of 1")
    if not future and not padding and not window:
        return (first + " At this step M forbids nothing: its query row is the newest position, with no key after "
                "it and no padding, so leaving M out or masking after the softmax gives exactly the model's weights "
                f"(the table shows no leak and {sums}). The other two pitfalls show on the prefill, step 0, "
                "or on any step with the KV cache off.")
    leaks = [f"the {future:,} (query, key) pairs where the key comes after its query"] if future else []
    leaks += [f"the {padding:,} pairs where the key is padding"] if padding else []
    leaks += [f"the {window:,} pairs where the key is earlier than the sliding window reaches"] if window else []
    after = float(table.set_index("variant").loc["mask after the softmax", "row sum"])
    skipped = n_rows - int(real.sum())
    over = f" over the {int(real.sum())} real query rows" + (
        f"; the {skipped} padding rows, which no one reads, left out" if skipped else "")
    if sinks:
        ending = (f"Masking after the softmax leaves rows summing to less than the model's own (mean row sum "
                  f"{after:.3f} against {own:.3f}{over})." if after < own - 1e-9 else
                  "Masking after the softmax leaves the model's own row sums here: the forbidden keys held no weight.")
    else:
        ending = (f"Masking after the softmax leaves rows that no longer sum to 1 (mean row sum {after:.3f}{over})."
                  if after < 1 - 1e-9 else "Masking after the softmax leaves the row sums at 1 here: the forbidden "
                  "keys held no weight.")
    return first + " Without M, weight leaks onto " + " and onto ".join(leaks) + " that M forbids here. " + ending


@fitted
def pitfall_figure(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> go.Figure | None:
    variants = pitfall_patterns(trace, step, layer, head, batch)
    if variants is None:
        return None
    xs, ys = key_labels(trace, step, batch, layer), query_labels(trace, step, batch, layer)
    fig = subplots(rows=1, cols=4, subplot_titles=list(variants), horizontal_spacing=0.04)
    for i, a in enumerate(variants.values(), start=1):
        g = grid(a, xs, ys)
        add(fig, g, "amount", row=1, col=i, showscale=i == 4, colorbar="A" if i == 4 else "")
        style_axes(fig, g, row=1, col=i, max_ticks=12, y_ticks=i == 1, x_title="key (t)")
    fig.update_layout(height=max(280, min(700, 150 + 16 * min(len(ys), 30))), margin={"t": 40, "l": 10, "r": 10,
                                                                                     "b": 10})
    return fig


# -- RoPE -----------------------------------------------------------------------------------------------
