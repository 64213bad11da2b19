"""Attention views: the four stages of A = softmax(QKᵀ/√d_k + M), all heads, the history built up by the cache."""

from __future__ import annotations

import math
from dataclasses import dataclass

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from figures.common import (
    HEATMAP_SCALE,
    facts_of,
    finite_or_none,
    gen_step,
    hover_values,
    key_labels,
    query_labels,
    safe_text,
    shape_text,
    tick_step,
)
from model.hook_table import act_name
from tracer import Trace

STAGES = ("hook_qk", "hook_attn_scores", "hook_masked_scores", "hook_pattern")
ALL_HEADS_MAX_CELLS = 400_000  # above this the all-heads grid shows the newest query rows only


@dataclass
class Stage:
    hook: str
    title: str  # the formula of this stage
    shapes: str  # the real shapes: operands → result
    matrix: torch.Tensor | None  # [n, t] for the chosen batch row and head; None if not kept


def _attn(layer: int, hook: str) -> str:
    return act_name(hook, layer)


def attention_stages(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> list[Stage]:
    """QKᵀ, ÷√d_k, + M and softmax for one head, with the formula and the real shapes of each."""
    q = trace.record(_attn(layer, "hook_q"), step).shape
    k = trace.record(_attn(layer, "hook_k_all"), step).shape
    qk = trace.record(_attn(layer, "hook_qk"), step).shape
    mask = trace.record(_attn(layer, "hook_mask"), step).shape
    d_k = q[-1]
    kt = (*k[:-2], k[-1], k[-2])
    stages = [
        Stage("hook_qk", "QKᵀ", f"{shape_text(q)} @ {shape_text(kt)} → {shape_text(qk)}", None),
        Stage("hook_attn_scores", f"QKᵀ / √d_k   (√{d_k} = {math.sqrt(d_k):.3f})",
              f"{shape_text(qk)} / {math.sqrt(d_k):.3f} → {shape_text(qk)}", None),
        Stage("hook_masked_scores", "QKᵀ/√d_k + M",
              f"{shape_text(qk)} + {shape_text(mask)} → {shape_text(qk)}", None),
        Stage("hook_pattern", "A = softmax(QKᵀ/√d_k + M)", f"row-wise over t = {qk[-1]} keys → {shape_text(qk)}", None),
    ]
    for stage in stages:
        value = trace.get(_attn(layer, stage.hook), step)
        if value is not None:
            stage.matrix = value[batch, head]
    return stages


def _heatmap(matrix: torch.Tensor, x_labels: list[str], y_labels: list[str], zmin=None, zmax=None,
             coloraxis: str | None = None, showscale: bool = True) -> go.Heatmap:
    """Query rows × key columns on category axes named by the (escaped, position-prefixed, so unique)
    token labels: the hover reads them from the axes instead of an n × t array of label strings, which
    made a long prompt's figures megabytes. Per-cell value strings only where ±∞ needs naming (NaN cells
    are the history's blanks: nothing to hover)."""
    finite = not bool(torch.isinf(matrix).any())
    return go.Heatmap(
        z=finite_or_none(matrix),
        x=[safe_text(label) for label in x_labels],
        y=[safe_text(label) for label in y_labels],
        customdata=None if finite else hover_values(matrix),
        hovertemplate="q %{y}<br>k %{x}<br>" + ("%{z:.4f}" if finite else "%{customdata}") + "<extra></extra>",
        colorscale=HEATMAP_SCALE,
        zmin=zmin,
        zmax=zmax,
        coloraxis=coloraxis,
        showscale=showscale,
    )


def _axes(fig: go.Figure, x_labels: list[str], y_labels: list[str], row=None, col=None,
          max_x_ticks: int | None = None, y_ticks: bool = True) -> None:
    """Token tick labels (thinned to fit) on the category axes of ``_heatmap``; ``max_x_ticks`` for narrow
    panels, ``y_ticks=False`` beside a panel that already names the rows."""
    sx = tick_step(len(x_labels)) if max_x_ticks is None else max(1, math.ceil(len(x_labels) / max_x_ticks))
    sy = tick_step(len(y_labels))
    xs = [safe_text(label) for label in x_labels[::sx]]
    ys = [safe_text(label) for label in y_labels[::sy]]
    fig.update_xaxes(type="category", tickvals=xs, ticktext=xs, tickangle=-60, row=row, col=col,
                     title_text="key position (t)")
    fig.update_yaxes(type="category", tickvals=ys, ticktext=ys, showticklabels=y_ticks, autorange="reversed",
                     row=row, col=col)


def attention_stages_figure(trace: Trace, step: int, layer: int, head: int, batch: int = 0) -> go.Figure:
    """Four heatmaps side by side (query rows × key columns) with formula and shapes above each."""
    stages = attention_stages(trace, step, layer, head, batch)
    xs, ys = key_labels(trace, step, batch), query_labels(trace, step, batch)
    titles = [f"<b>{s.title}</b><br><span style='font-size:11px'>{s.shapes}</span>" for s in stages]
    fig = make_subplots(rows=1, cols=4, subplot_titles=titles, horizontal_spacing=0.075)
    for i, stage in enumerate(stages, start=1):
        if stage.matrix is None:
            fig.add_annotation(text="values not kept", showarrow=False, row=1, col=i, x=0.5, y=0.5)
            continue
        zmin, zmax = (0.0, 1.0) if stage.hook == "hook_pattern" else (None, None)
        trace_ = _heatmap(stage.matrix, xs, ys, zmin=zmin, zmax=zmax)
        # each stage its own scale: raw scores, scaled scores and weights live on different ranges
        right = fig.layout[f"xaxis{i if i > 1 else ''}"].domain[1]
        trace_.colorbar = {"title": {"text": "A" if i == 4 else "score", "side": "top"}, "len": 0.75,
                           "thickness": 8, "x": right + 0.004, "xpad": 0, "tickfont": {"size": 9}}
        fig.add_trace(trace_, row=1, col=i)
        # four narrow panels with the same rows: row names once, at most ~12 key names per panel
        _axes(fig, xs, ys, row=1, col=i, max_x_ticks=12, y_ticks=i == 1)
    height = max(320, min(900, 140 + 18 * len(ys)))
    fig.update_xaxes(showgrid=False)
    fig.update_yaxes(showgrid=False)  # masked cells are blank: no gridlines drawn through them
    fig.update_layout(height=height, margin={"t": 90, "l": 10, "r": 10, "b": 10},
                      title_text=f"layer {layer}, head {head}, step {step}")
    fig.update_annotations(font_size=12)
    return fig


def pattern_figure(matrix: torch.Tensor, x_labels: list[str], y_labels: list[str], title: str) -> go.Figure:
    fig = go.Figure(_heatmap(matrix, x_labels, y_labels, zmin=0.0, zmax=1.0))
    _axes(fig, x_labels, y_labels)
    fig.update_xaxes(showgrid=False)
    fig.update_yaxes(showgrid=False)  # blank cells (keys a row could not see) stay blank
    fig.update_layout(title_text=title, height=max(300, min(900, 120 + 18 * len(y_labels))),
                      margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


def all_heads_figure(trace: Trace, step: int, batch: int = 0) -> tuple[go.Figure, str]:
    """Every layer × head attention pattern at ``step``; returns (figure, note)."""
    n_layer = len(trace.filter(step=step, name="*attn.hook_pattern"))
    n_head = trace.record(_attn(0, "hook_pattern"), step).shape[1]
    info = gen_step(trace, step).forward
    rows_shown = info.n
    note = ""
    if n_layer * n_head * info.n * info.t > ALL_HEADS_MAX_CELLS:
        rows_shown = max(1, ALL_HEADS_MAX_CELLS // (n_layer * n_head * info.t))
        note = f"showing the newest {rows_shown} of {info.n} query rows per head to keep the page light"
    # One heatmap with the heads tiled into it, not n_layer × n_head subplots: a browser lays out 144
    # plotly subplots (GPT-2 small) in seconds, one heatmap in milliseconds.
    t = info.t
    gap_rows, gap_cols = 1, max(1, t // 16)
    grid = torch.full((n_layer * (rows_shown + gap_rows) - gap_rows, n_head * (t + gap_cols) - gap_cols), math.nan)
    missing = 0
    for layer in range(n_layer):
        pattern = trace.get(_attn(layer, "hook_pattern"), step)
        if pattern is None:
            missing += 1
            continue
        r0 = layer * (rows_shown + gap_rows)
        for head in range(n_head):
            c0 = head * (t + gap_cols)
            grid[r0:r0 + rows_shown, c0:c0 + t] = pattern[batch, head, -rows_shown:].double()
    # unique category labels, so hovering names the layer, head, query and key
    first_query = t - rows_shown
    y_labels = [f"L{layer} q{first_query + i}" if i < rows_shown else f"L{layer} ·{i}"
                for layer in range(n_layer) for i in range(rows_shown + gap_rows)][: grid.shape[0]]
    x_labels = [f"H{head} k{j}" if j < t else f"H{head} ·{j}"
                for head in range(n_head) for j in range(t + gap_cols)][: grid.shape[1]]
    z = [[None if math.isnan(v) else round(v, 3) for v in row] for row in grid.tolist()]
    fig = go.Figure(go.Heatmap(z=z, x=x_labels, y=y_labels, coloraxis="coloraxis", xgap=0, ygap=0,
                               hovertemplate="%{y} · %{x}<br>weight %{z}<extra></extra>"))
    fig.update_xaxes(tickvals=[x_labels[h * (t + gap_cols) + t // 2] for h in range(n_head)],
                     ticktext=[f"H{h}" for h in range(n_head)], side="top", showgrid=False)
    fig.update_yaxes(tickvals=[y_labels[layer * (rows_shown + gap_rows) + rows_shown // 2] for layer in range(n_layer)],
                     ticktext=[f"L{layer}" for layer in range(n_layer)], autorange="reversed", showgrid=False)
    cell = 40 if rows_shown == 1 else 90
    fig.update_layout(coloraxis={"colorscale": HEATMAP_SCALE, "cmin": 0, "cmax": 1,
                                 "colorbar": {"title": "weight"}},
                      height=60 + cell * n_layer, margin={"t": 40, "l": 10, "r": 10, "b": 10},
                      plot_bgcolor="white")
    if missing:
        note = (note + "; " if note else "") + f"{missing} layer(s) have no kept values at this step"
    return fig, note


def attention_history(trace: Trace, layer: int, head: int, upto_step: int, batch: int = 0
                      ) -> tuple[torch.Tensor, list[str], list[str], list[int]]:
    """The attention rows of steps 0…upto_step stacked into one [rows × keys] matrix.

    With the cache, step 0 gives the prefill's n₀ rows and every later step one
    more row, so the lower-triangular picture builds up token by token. Cells a
    row could not see are NaN. Returns (matrix, row labels, key labels, step of each row)."""
    keys = key_labels(trace, upto_step, batch)
    t = len(keys)
    facts = facts_of(trace)
    is_token = facts.is_token(batch, upto_step)
    rows: list[torch.Tensor] = []
    row_steps: list[int] = []
    row_labels: list[str] = []
    for s in range(upto_step + 1):
        pattern = trace.get(_attn(layer, "hook_pattern"), s)
        new = query_labels(trace, s, batch)
        if s > 0 and not facts.info.use_cache:
            new = new[-1:]  # without the cache a step recomputes all rows; only its newest row is new
        n_rows = len(query_labels(trace, s, batch))
        for i, label in enumerate(new):
            row = torch.full((t,), float("nan"))
            padding = False
            if pattern is not None:
                values = pattern[batch, head, n_rows - len(new) + i]
                position = values.numel() - len(new) + i  # this query's own key column
                padding = position < len(is_token) and not is_token[position]
                if not padding:  # a padding position is no real query: its row stays blank
                    row[: position + 1] = values[: position + 1]  # later keys: masked, or not there yet
            rows.append(row)
            row_steps.append(s)
            row_labels.append(f"s{s} · {label}" + (" (padding: no query)" if padding else ""))
    return torch.stack(rows), row_labels, keys, row_steps


def attention_history_figure(trace: Trace, layer: int, head: int, upto_step: int, batch: int = 0) -> go.Figure:
    matrix, ys, xs, row_steps = attention_history(trace, layer, head, upto_step, batch)
    fig = pattern_figure(matrix, xs, ys, f"rows of layer {layer} head {head} over steps 0…{upto_step}")
    first_new = row_steps.index(upto_step)
    fig.add_shape(type="rect", x0=-0.5, x1=matrix.shape[1] - 0.5, y0=first_new - 0.5, y1=matrix.shape[0] - 0.5,
                  line={"color": "#ff4b4b", "width": 2})
    return fig


def query_attention_html(trace: Trace, step: int, layer: int, head: int, query: int, batch: int = 0) -> str:
    """The key tokens coloured by how much query row ``query`` attends to them (escaped text)."""
    pattern = trace.get(_attn(layer, "hook_pattern"), step)
    if pattern is None:
        return "<i>values not kept for this step</i>"
    weights = pattern[batch, head, query]
    keys = key_labels(trace, step, batch)
    spans = []
    for j, w in enumerate(weights.tolist()):
        text = keys[j].split(" · ", 1)[-1]
        alpha = min(1.0, max(0.0, w))
        spans.append(
            f"<span title='{w:.3f}' style='background: rgba(255, 75, 75, {alpha:.3f}); padding: 1px 2px; "
            f"border-radius: 3px; white-space: pre'>{safe_text(text)}</span>"
        )
    return "<div style='line-height: 2; font-family: monospace'>" + "".join(spans) + "</div>"
