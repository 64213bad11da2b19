"""Token views: the growing text, each chosen token on the colour of its probability, and the next-token
distribution with the chosen token marked."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from gpt_shape_tracer.figures.common import choice_at, facts_of, inert, is_greedy, safe_text
from gpt_shape_tracer.figures.palette import ACCENT, NEUTRAL, amount_legend, amount_span
from gpt_shape_tracer.figures.plot import figure, fitted, set_layout
from gpt_shape_tracer.model.sampling import STAGES
from gpt_shape_tracer.tracer import Trace


def generated_text_html(trace: Trace, row: int = 0, upto_step: int | None = None) -> str:
    """Prompt tokens plain, each chosen token on the ``AMOUNT`` colour of the probability it was chosen with.

    Tokens after ``upto_step`` (when time-travelling) are left out. Every token string is made inert (a
    prompt like ``<script>`` shows as text, and a label from a file cannot end the HTML block)."""
    facts = facts_of(trace)
    last = upto_step if upto_step is not None else facts.n_steps - 1
    _, is_token, labels = facts.info.padded_prompt(row)
    parts = ["<div style='font-family: monospace; line-height: 1.9; white-space: pre-wrap'>"]
    for label, real in zip(labels, is_token):
        if real:
            parts.append(f"<span style='color: #555'>{inert(label)}</span>")
    for label, p, s in facts.chosen_through(row, last):
        parts.append(amount_span(inert(label), p, f"step {s}: p = {p:.3f}"))
    stopped = [s.step for s in facts.steps[: last + 1] if s.sampling is None]
    if stopped:
        parts.append(f"<span style='color: #d62728'> ⟂ no token at step {stopped[0]}</span>")
    parts.append("</div>")
    return "".join(parts)


def text_legend() -> str:
    return amount_legend("probability each generated token was chosen with (prompt in grey; hover a token)")


@fitted
def next_token_figure(trace: Trace, step: int, row: int = 0, log_scale: bool = False) -> go.Figure:
    """Top candidates by final probability, each bar labelled with its probability; the chosen one outlined
    in the accent. ``log_scale`` draws the probabilities on a log axis, where candidates far below the winner
    stay visible (a probability of 0 — cut by top-k or top-p — has no place there and is left out)."""
    info = choice_at(trace, step)
    ids = info.candidates[row]
    labels = info.candidate_labels[row]
    final = info.stage_probs[row][len(STAGES) - 1] if ids else []
    order = sorted(range(len(ids)), key=lambda i: -final[i])
    if log_scale:
        order = [i for i in order if final[i] > 0]
    chosen_id = info.tokens[row]
    xs = [f"{safe_text(labels[i])} ({ids[i]})" for i in order]
    ys = [final[i] for i in order]
    chosen = next((k for k, i in enumerate(order) if ids[i] == chosen_id), None)
    fig = figure(go.Bar(
        x=xs, y=ys, marker_color=NEUTRAL, text=[f"{p:.3g}" for p in ys], textposition="outside",
        marker_line_color=[ACCENT if k == chosen else NEUTRAL for k in range(len(order))],
        marker_line_width=[4 if k == chosen else 0 for k in range(len(order))],
        hovertemplate="%{x}: p = %{y:.4g}<extra></extra>", cliponaxis=False))
    title = f"step {step}: next-token probabilities (final distribution); the chosen token outlined"
    if chosen is not None:
        fig.add_annotation(x=xs[chosen], y=ys[chosen] if not log_scale else math.log10(ys[chosen]),
                           text="chosen (argmax)" if is_greedy(trace) else "sampled",
                           showarrow=True, arrowhead=2, ax=70, ay=-6, font={"color": ACCENT})  # beside the label
    else:
        title = (f"step {step}: next-token probabilities; the chosen token {safe_text(info.labels[row])} "
                 f"({chosen_id}) is not among the {len(ids)} candidates recorded")
    y_axis: dict[str, object] = {"title": {"text": "probability" + (" (log scale)" if log_scale else "")}}
    if log_scale and ys:
        low, high = math.log10(min(ys)), math.log10(max(ys))
        y_axis |= {"type": "log", "range": [low - 0.5, high + 0.6]}  # headroom for the labels and the arrow
    else:  # headroom for the labels above the bars, but no tick above what a probability can be
        top = 1.2 * max(ys) if ys and max(ys) > 0 else 1.0
        y_axis |= {"range": [0, top], "tickvals": [round(0.2 * i, 1) for i in range(6) if 0.2 * i <= top]
                   if top > 0.5 else None}
    return set_layout(fig, {"title": {"text": title, "font": {"size": 13}}, "height": 380, "yaxis": y_axis,
                            "xaxis": {"tickangle": -45}, "margin": {"t": 50, "l": 10, "r": 10, "b": 10}})


@fitted
def distribution_stages_figure(trace: Trace, step: int, row: int = 0) -> go.Figure:
    """Each candidate's probability at each stage: softmax(z), softmax(z/τ), top-k, top-p."""
    info = choice_at(trace, step)
    ids = info.candidates[row]
    labels = info.candidate_labels[row]
    base = info.stage_probs[row][0]
    order = sorted(range(len(ids)), key=lambda i: -base[i])
    xs = [f"{safe_text(labels[i])} ({ids[i]})" for i in order]
    sampling = facts_of(trace).info.sampling
    off = {2: not sampling.top_k, 3: sampling.top_p in (None, 1.0)}  # stages that changed nothing
    fig = figure()
    for s, stage in enumerate(STAGES):
        label = f"{stage} (off)" if off.get(s) else stage
        fig.add_trace(go.Bar(x=xs, y=[info.stage_probs[row][s][i] for i in order],
                             name=f"{label} — {info.kept[row][s]} token(s) left"))
    fig.update_layout(barmode="group", height=380, yaxis_title_text="probability", xaxis_tickangle=-45,
                      title_text="how temperature, top-k and top-p reshaped the distribution (z = the logits)",
                      title_font_size=13, legend={"orientation": "h", "y": 1.12},
                      margin={"t": 70, "l": 10, "r": 10, "b": 10})
    return fig
