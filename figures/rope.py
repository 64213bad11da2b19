"""RoPE's rotation on one head's recorded queries and keys (RoFormer, Su et al. 2021): the pairs of q and k
turned by position, and the score of one (query, key) pair as both move together or the key alone.
"""

from __future__ import annotations

import plotly.graph_objects as go
import torch

from gpt_shape_tracer.figures.common import (
    facts_of,
    gen_step,
    kv_head,
    query_labels,
)
from gpt_shape_tracer.figures.heatmap import (
    add,
    grid,
    style_axes,
)
from gpt_shape_tracer.figures.plot import figure, fitted, subplots
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import Trace


def rope_not_drawn(trace: Trace) -> str | None:
    """Why the RoPE views are not drawn for this trace's model, or None when they are. A transformers-run
    model rotates Q and K inside its own attention module, with its own variant (partial rotary, scaled
    frequencies): the trace holds them rotated, not the rotation itself, and our rotation functions would
    not be this model's."""
    config = trace.config
    if getattr(config, "family", None) == "module":
        return (f"Your module ({config.hf_model_type}) applies any position encoding itself, before it calls "
                "scaled_dot_product_attention: the Q and K recorded here are what it passed to that call. The "
                "rotation itself is the module's code, so it is not redrawn here.")
    if getattr(config, "family", None) == "hf":
        return (f"This {config.hf_model_type} model is run by transformers, which applies its position encoding "
                "inside the model's own attention module: the Q and K recorded here (hook_q, hook_k) are already "
                "encoded, and the projections' outputs before it are the module records named …q_proj:out / "
                "…k_proj:out (Inspector). The rotation itself is the model's code, so it is not redrawn here.")
    return None


@fitted
def rope_figure(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> go.Figure | None:
    """Q and K of one head before and after the rotation (query rows / key rows × d_head)."""
    if rope_not_drawn(trace) is not None:
        return None
    names = {"Q before": "q", "Q rotated": "rot_q", "K before (new rows)": "k", "K rotated (new rows)": "rot_k"}
    mats = {}
    for title, kind in names.items():
        value = trace.get(act_name(kind, layer), step)
        if value is None:
            return None
        mats[title] = value[batch, head if kind in ("q", "rot_q") else kv_head(trace, layer, head, step)]
    ys = query_labels(trace, step, batch)
    fig = subplots(rows=1, cols=4, subplot_titles=list(mats), horizontal_spacing=0.04)
    top = max(float(m.abs().max()) for m in mats.values()) or 1.0
    for i, m in enumerate(mats.values(), start=1):
        g = grid(m, [f"d{j}" for j in range(m.shape[1])], ys)
        add(fig, g, "signed", row=1, col=i, zmin=-top, zmax=top, showscale=i == 4, colorbar="value")
        style_axes(fig, g, row=1, col=i, max_ticks=8, y_ticks=i == 1, x_title="d_head", y_title="column · token")
    fig.update_layout(height=max(260, min(700, 140 + 16 * len(ys))), margin={"t": 40, "l": 10, "r": 10, "b": 10})
    return fig


def rope_title(query_col: int, key_col: int, m: int, n: int) -> str:
    """The RoPE check's title: the columns (as every other view counts them) and the positions the rotation uses
    (real tokens before it: padding does not move a token's position), said apart where they differ."""
    if (query_col, key_col) == (m, n):
        return (f"query in column {query_col}, key in column {key_col}, rotated as positions m = {m}, n = {n}: "
                f"m − n = {m - n}")
    return (f"query in column {query_col} → position m = {m}, key in column {key_col} → position n = {n} (RoPE "
            f"counts real tokens, not padding): m − n = {m - n}")


@fitted
def rope_relative_figure(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> go.Figure | None:
    """RoPE in numbers: the head's recorded q (the last of this step's rows holding a token of sequence ``batch``,
    before rotation) and a key k (the first such row; padding rows are never picked; None when the step has
    none for this sequence), rotated with the model's own functions to positions m + s and n + s for shifts s: the score
    R(m+s)q · R(n+s)k stays the same (it depends only on m − n), while moving the key alone, R(m)q · R(n+s)k,
    changes — the property RoFormer (Su et al., 2021) builds on."""
    from gpt_shape_tracer.model.gpt import apply_rope, rope_cos_sin

    config = trace.config
    q = trace.get(act_name("q", layer), step)
    k = trace.get(act_name("k", layer), step)
    if config is None or config.positions != "rope" or q is None or k is None or rope_not_drawn(trace):
        return None
    forward = gen_step(trace, step).forward
    real = facts_of(trace).is_token(batch, step)  # per column; positions count real tokens only
    new_tokens = [j for j in range(forward.t - forward.n, forward.t) if real[j]]  # this step's rows holding a token
    if not new_tokens:
        return None
    query_col, key_col = new_tokens[-1], new_tokens[0]  # the last real query row, the first real new key row
    qv = q[batch, head, query_col - (forward.t - forward.n)].double()  # before rotation
    kv = k[batch, kv_head(trace, layer, head, step), key_col - (forward.t - forward.n)].double()
    m_pos, n_pos = sum(real[:query_col]), sum(real[:key_col])
    shifts = torch.arange(0, 64)

    def rotated(vec: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(config, positions[None])  # [1, S, d_head]
        x = vec.float().expand(1, 1, len(positions), -1)  # [B=1, H=1, n=S, d_head], as the model rotates q
        return apply_rope(x, cos, sin)[0, 0].double()  # [S, d_head]

    together = (rotated(qv, m_pos + shifts) * rotated(kv, n_pos + shifts)).sum(-1)
    key_only = (rotated(qv, torch.full_like(shifts, m_pos)) * rotated(kv, n_pos + shifts)).sum(-1)
    fig = figure([
        go.Scatter(x=shifts.tolist(), y=together.tolist(), mode="lines", name="both moved by s: R(m+s)q·R(n+s)k"),
        go.Scatter(x=shifts.tolist(), y=key_only.tolist(), mode="lines", name="key alone moved: R(m)q·R(n+s)k",
                   line={"dash": "dot"}),
    ])
    fig.update_layout(height=340, margin={"t": 90, "l": 10, "r": 10, "b": 10}, xaxis_title_text="shift s (positions)",
                      yaxis_title_text="qᵀk after rotation",
                      legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"}, title_font_size=13,
                      title_text=rope_title(query_col, key_col, m_pos, n_pos))
    return fig



def rope_takeaway(figure: go.Figure) -> str:
    """RoPE's takeaway, read from the relative figure's own numbers: moving both q and k leaves their score as it
    was (to rounding), moving the key alone does not."""
    together = [float(v) for v in figure.data[0].y]
    alone = [float(v) for v in figure.data[1].y]
    drift = max(abs(v - together[0]) for v in together)
    change = max(abs(v - alone[0]) for v in alone)
    return (f"Moving query and key together by up to {len(together) - 1} positions changes their score by at most "
            f"{drift:.1e}; moving the key alone changes it by up to {change:.3g}: the score depends on m − n only.")
