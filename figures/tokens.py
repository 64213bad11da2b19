"""Token views: the growing text coloured by probability, and the next-token distribution."""

from __future__ import annotations

import plotly.graph_objects as go

from figures.common import facts_of, gen_step, is_greedy, safe_text
from model.sampling import STAGES
from tracer import Trace


def _prob_color(p: float) -> str:
    """Red (unlikely) → yellow → green (likely)."""
    p = min(1.0, max(0.0, p))
    r = int(220 * (1 - p) + 40 * p)
    g = int(60 * (1 - p) + 170 * p)
    return f"rgba({r}, {g}, 70, 0.35)"


def generated_text_html(trace: Trace, row: int = 0, upto_step: int | None = None) -> str:
    """Prompt tokens plain, generated tokens highlighted by the probability they were sampled with.

    Tokens after ``upto_step`` (when time-travelling) are left out. Every token
    string is HTML-escaped: a prompt like ``<script>`` shows as text."""
    facts = facts_of(trace)
    last = upto_step if upto_step is not None else facts.n_steps - 1
    _, is_token, labels = facts.info.padded_prompt(row)
    parts = ["<div style='font-family: monospace; line-height: 1.9; white-space: pre-wrap'>"]
    for label, real in zip(labels, is_token):
        if real:
            parts.append(f"<span style='color: #555'>{safe_text(label)}</span>")
    for label, p, s in facts.chosen_through(row, last):
        parts.append(
            f"<span title='step {s}: p = {p:.3f}' style='background: {_prob_color(p)}; border-radius: 3px; "
            f"padding: 1px 1px'>{safe_text(label)}</span>"
        )
    parts.append("</div>")
    return "".join(parts)


def next_token_figure(trace: Trace, step: int, row: int = 0) -> go.Figure:
    """Top candidates by final probability, the sampled one marked."""
    info = gen_step(trace, step).sampling
    ids = info.candidates[row]
    labels = info.candidate_labels[row]
    final = info.stage_probs[row][len(STAGES) - 1]
    order = sorted(range(len(ids)), key=lambda i: -final[i])
    sampled = info.tokens[row]
    xs = [f"{safe_text(labels[i])} ({ids[i]})" for i in order]
    colors = ["#ff4b4b" if ids[i] == sampled else "#4c78a8" for i in order]
    fig = go.Figure(go.Bar(x=xs, y=[final[i] for i in order], marker_color=colors,
                           hovertemplate="%{x}: p = %{y:.4f}<extra></extra>"))
    chosen = next(k for k, i in enumerate(order) if ids[i] == sampled)
    fig.add_annotation(x=xs[chosen], y=final[order[chosen]], text="chosen (argmax)" if is_greedy(trace) else "sampled",
                       showarrow=True, arrowhead=2,
                       ax=30, ay=-22, font={"color": "#ff4b4b"})
    # headroom for the "sampled" arrow; with p ≤ 1 the axis never gets a tick above 1
    fig.update_yaxes(range=[0, 1.18 * max(final) if max(final) > 0 else 1.0])
    fig.update_layout(title_text=f"step {step}: next-token probabilities (final distribution)", height=360,
                      yaxis_title="probability", xaxis_tickangle=-45, margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


def distribution_stages_figure(trace: Trace, step: int, row: int = 0) -> go.Figure:
    """Each candidate's probability at each stage: softmax(z), ÷τ, top-k, top-p."""
    info = gen_step(trace, step).sampling
    ids = info.candidates[row]
    labels = info.candidate_labels[row]
    base = info.stage_probs[row][0]
    order = sorted(range(len(ids)), key=lambda i: -base[i])
    xs = [f"{safe_text(labels[i])} ({ids[i]})" for i in order]
    sampling = facts_of(trace).info.sampling
    off = {2: not sampling.top_k, 3: sampling.top_p in (None, 1.0)}  # stages that changed nothing
    fig = go.Figure()
    for s, stage in enumerate(STAGES):
        kept = info.kept[row][s]
        label = f"{stage} (off)" if off.get(s) else stage
        name = f"{label} — {kept} token(s) left" if kept is not None else label
        fig.add_trace(go.Bar(x=xs, y=[info.stage_probs[row][s][i] for i in order], name=name))
    fig.update_layout(barmode="group", height=380, yaxis_title="probability", xaxis_tickangle=-45,
                      title_text="how temperature, top-k and top-p reshaped the distribution",
                      legend={"orientation": "h", "y": 1.12}, margin={"t": 70, "l": 10, "r": 10, "b": 10})
    return fig
