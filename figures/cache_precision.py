"""A cheaper cache (the KV cache tab): the same prompt run with K and V stored at a lower precision beside the model's
own — how far the logits moved per step, and what sharing key/value heads and quantizing each save."""

from __future__ import annotations

import plotly.graph_objects as go

from gpt_shape_tracer.figures.palette import ACCENT, NEUTRAL
from gpt_shape_tracer.figures.plot import figure, fitted
from gpt_shape_tracer.tracer import CachePrecisionRun


@fitted
def precision_figure(run: CachePrecisionRun) -> go.Figure:
    """max |Δ logits| per step of a cheaper cache against the model-precision one (the same tokens fed), on a
    log axis; steps where the cheaper cache's own argmax would have chosen another token are marked."""
    xs = [s.step for s in run.steps]
    ys = [max(s.max_abs_delta, 1e-12) for s in run.steps]
    differs = [s for s in run.steps if s.differs]
    fig = figure([
        go.Scatter(x=xs, y=ys, mode="lines+markers", name="max |Δ logits|", line={"color": NEUTRAL},
                   hovertemplate="step %{x}: max |Δ logits| = %{y:.3g}<extra></extra>"),
        go.Scatter(x=[s.step for s in differs], y=[max(s.max_abs_delta, 1e-12) for s in differs], mode="markers",
                   name="its own choice would differ", marker={"color": ACCENT, "size": 11, "symbol": "x"}),
    ])
    fig.update_yaxes(type="log", exponentformat="power", title_text="max |Δ logits|")
    fig.update_xaxes(title_text="step (0: the prefill)", dtick=1 if len(xs) <= 20 else None)
    fig.update_layout(height=320, title_font_size=13, legend={"orientation": "h", "y": 1.12},
                      title_text=f"K and V stored as {run.storage} against the model's own precision, the same tokens "
                                 "fed to both",
                      margin={"t": 70, "l": 10, "r": 10, "b": 10})
    return fig


def sharing_sentence(run: CachePrecisionRun) -> str:
    """The cheaper cache's formula, and — for a model whose query heads share key/value heads — what sharing
    saves and what quantizing saves, each as its own share, from this run's bytes."""
    text = run.formula()
    if run.kv_heads >= run.query_heads:
        return text + "."
    multi = run.reference_bytes * run.query_heads // run.kv_heads  # the model's precision with G = H
    sharing = 1 - run.reference_bytes / multi
    quantizing = 1 - run.stored_bytes / run.reference_bytes
    both = 1 - run.stored_bytes / multi
    return (text + f". Two savings multiply here. Sharing K and V among query heads (G = {run.kv_heads} key/value "
            f"heads for H = {run.query_heads} query heads; multi-query is G = 1, Shazeer 2019) holds "
            f"{run.reference_bytes:,} B instead of {multi:,} B in the model's precision: {sharing:.0%} less. "
            f"Storing as {run.storage} holds {run.stored_bytes:,} B of those {run.reference_bytes:,} B: "
            f"{quantizing:.0%} less. Together, {both:.0%} less than a multi-head cache in the model's precision.")
