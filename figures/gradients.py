"""Backpropagation through attention, drawn: one head's six gradients as heatmaps, each titled with its formula,
its live shape and how far the formula is from autograd; and ‖∂L/∂x‖ per layer. Pure functions: a
``tracer.HeadGradients`` in, figures out."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from figures.heatmap import add, grid, style_axes
from figures.palette import ACCENT, NEUTRAL
from figures.plot import figure, fitted, subplots
from tracer import HeadGradients

FORMULAS = {"G_O": "G_O = ∂L/∂O", "G_V": "G_V = Pᵀ·G_O", "G_P": "G_P = G_O·Vᵀ",
            "G_S": "G_S,r = (diag(P_r) − P_r P_rᵀ)·G_P,r", "G_Q": "G_Q = s·G_S·K", "G_K": "G_K = s·G_Sᵀ·Q"}
AXES = {"G_O": ("d_head", "query"), "G_V": ("d_head", "key"), "G_P": ("key", "query"), "G_S": ("key", "query"),
        "G_Q": ("d_head", "query"), "G_K": ("d_head", "key")}


@fitted
def gradients_figure(result: HeadGradients, keys: list[str]) -> go.Figure:
    """The six gradients of one head (3 × 2), by formula, each title with the shape and max |formula − autograd|."""
    names = list(FORMULAS)
    titles = [f"{FORMULAS[n]} {list(result.formula[n].shape)} · |Δ| ≤ {result.max_abs_delta(n):.0e}" for n in names]
    fig = subplots(rows=3, cols=2, subplot_titles=titles, horizontal_spacing=0.08, vertical_spacing=0.12)
    for i, name in enumerate(names):
        row, col = i // 2 + 1, i % 2 + 1
        matrix = result.formula[name]
        x_kind, y_kind = AXES[name]
        xs = keys[: matrix.shape[1]] if x_kind == "key" else [f"d{j}" for j in range(matrix.shape[1])]
        ys = keys[-matrix.shape[0]:] if y_kind == "query" else keys[: matrix.shape[0]]
        g = grid(matrix, xs, ys)
        add(fig, g, "signed", row=row, col=col, showscale=False)
        style_axes(fig, g, row=row, col=col, max_ticks=8, x_title=x_kind, y_title=y_kind)
    fig.update_layout(height=900, margin={"t": 40, "l": 10, "r": 10, "b": 10}, title_font_size=12)
    fig.update_annotations(font_size=11)
    return fig


@fitted
def gradient_norms_figure(result: HeadGradients) -> go.Figure:
    """‖∂L/∂x‖ per layer for the residual stream entering each block and the attention and MLP outputs, on a
    log axis: a gradient that vanishes or explodes with depth shows as a line falling or rising by decades."""
    colours = {"resid_pre": ACCENT, "attn_out": NEUTRAL, "mlp_out": "#4c78a8"}
    labels = {"resid_pre": "residual stream entering block L", "attn_out": "attention output of block L",
              "mlp_out": "MLP output of block L"}
    fig = figure([go.Scatter(x=list(range(len(values))), y=[v if math.isfinite(v) and v > 0 else None for v in values],
                             mode="lines+markers", name=labels[kind], line={"color": colours[kind]})
                  for kind, values in result.norms.items()])
    fig.update_yaxes(type="log", exponentformat="power", title_text="‖∂L/∂x‖")
    fig.update_xaxes(title_text="layer L", dtick=1)
    fig.update_layout(height=320, legend={"orientation": "h", "y": 1.15}, title_font_size=13,
                      margin={"t": 60, "l": 10, "r": 10, "b": 10})
    return fig
