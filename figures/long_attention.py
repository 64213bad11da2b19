"""One head's attention at any length: an overview computed tile by tile, an exact zoomed region, one query row
over every key, and per-head long-context statistics (tracer.attention_overview, attention_region, query_row,
head_statistics). Nothing of n × t is ever built; at most ``MAX_ZOOM`` × ``MAX_ZOOM`` exact cells are sent.

Pure functions: a trace in, figures and tables out.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from figures.palette import AMOUNT
from figures.plot import figure
from model.gpt import act_name
from tracer import (
    HeadStatistics,
    Overview,
    Trace,
    attention_overview,
    attention_region,
    is_derived,
    query_row,
)

MAX_ZOOM = 256  # most exact rows and columns a zoomed region sends
OVERVIEW_BINS = 128


def overview(trace: Trace, step: int, layer: int, head: int, batch: int, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> Overview:
    return attention_overview(trace, act_name("pattern", layer), step, head=head, batch=batch, bins=OVERVIEW_BINS,
                              rows=rows, cols=cols)


def overview_figure(view: Overview, statistic: str = "mean") -> go.Figure:
    """The block mean (or max) heatmap, each cell labelled with the query rows and keys it covers."""
    z = (view.mean if statistic == "mean" else view.peak).numpy().astype(np.float32)
    r, c = view.row_edges, view.col_edges
    y = [f"q {a}–{b - 1}" if b - a > 1 else f"q {a}" for a, b in zip(r, r[1:])]
    x = [f"k {a}–{b - 1}" if b - a > 1 else f"k {a}" for a, b in zip(c, c[1:])]
    fig = figure(go.Heatmap(z=z, x=x, y=y, colorscale=AMOUNT, zmin=0, zmax=float(z.max()) if z.size else 1,
                            colorbar={"title": {"text": "A" if view.exact else f"block {statistic}", "side": "top"},
                                      "thickness": 10},
                            hovertemplate="%{y} × %{x}: %{z:.4g}<extra></extra>"))
    fig.update_yaxes(autorange="reversed", showticklabels=False)
    fig.update_xaxes(showticklabels=False)
    title = "exact weights" if view.exact else f"block {statistic}: {view.label()}"
    fig.update_layout(title={"text": title, "font": {"size": 12}}, height=460)
    return fig


def zoom(trace: Trace, step: int, layer: int, head: int, batch: int, rows: tuple[int, int],
         cols: tuple[int, int]) -> tuple[np.ndarray, bool]:
    """The region's exact weights ``[r, c]`` when it has at most ``MAX_ZOOM`` rows and columns (second item
    True), else its block means (False)."""
    if rows[1] - rows[0] <= MAX_ZOOM and cols[1] - cols[0] <= MAX_ZOOM:
        region = attention_region(trace, act_name("pattern", layer), step, rows=rows, cols=cols, heads=[head])
        if region is None:
            raise ValueError("this pattern's value is no longer kept")
        return region[batch, 0].float().numpy(), True
    return overview(trace, step, layer, head, batch, rows, cols).mean.numpy(), False


def zoom_figure(matrix: np.ndarray, rows: tuple[int, int], cols: tuple[int, int], exact: bool) -> go.Figure:
    y = [f"q {i}" for i in range(rows[0], rows[0] + matrix.shape[0])] if exact else None
    x = [f"k {j}" for j in range(cols[0], cols[0] + matrix.shape[1])] if exact else None
    fig = figure(go.Heatmap(z=matrix.astype(np.float32), x=x, y=y, colorscale=AMOUNT, zmin=0,
                            colorbar={"title": {"text": "A", "side": "top"}, "thickness": 10},
                            hovertemplate="%{y} × %{x}: %{z:.6f}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    what = "exact weights" if exact else "block means (narrow the range to see single cells)"
    fig.update_layout(title={"text": f"queries {rows[0]}–{rows[1] - 1} × keys {cols[0]}–{cols[1] - 1}: {what}",
                             "font": {"size": 12}}, height=460)
    return fig


def row_strip_figure(trace: Trace, step: int, layer: int, head: int, batch: int, row: int,
                     top: int = 8) -> go.Figure:
    """One query row's exact weights over all keys, its ``top`` keys labelled."""
    weights, best = query_row(trace, act_name("pattern", layer), step, row=row, head=head, batch=batch, top=top)
    w = weights.numpy().astype(np.float32)
    fig = figure(go.Scattergl(x=np.arange(len(w)), y=w, mode="lines", line={"width": 1},
                              hovertemplate="key %{x}: %{y:.6f}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[k for k, _ in best], y=[v for _, v in best], mode="markers+text",
                             text=[f"k {k}" for k, _ in best], textposition="top center", showlegend=False,
                             hovertemplate="key %{x}: %{y:.6f}<extra></extra>"))
    fig.update_layout(title={"text": f"query {row}: its weight on each of {len(w):,} keys (top {len(best)} named)",
                             "font": {"size": 12}}, height=300, showlegend=False)
    fig.update_xaxes(title="key position")
    fig.update_yaxes(title="A")
    return fig


def statistics_frame(stats: list[HeadStatistics], sink: int = 4) -> pd.DataFrame:
    """One row per head: mean row entropy, mass on the first ``sink`` keys, mass within distance < 16 and ≥ 1024
    (local vs long range), and the three keys receiving the most weight."""
    rows = []
    for s in stats:
        near = sum(m for e, m in zip(s.distance_edges, s.distance_mass) if e < 16)
        far = sum(m for e, m in zip(s.distance_edges, s.distance_mass) if e >= 1024)
        rows.append({"head": s.head, "entropy (nats)": s.entropy, f"mass on keys 0–{sink - 1}": s.sink_mass,
                     "mass at distance < 16": near, "mass at distance ≥ 1024": far,
                     "top keys": ", ".join(str(k) for k, _ in s.top_keys[:3])})
    return pd.DataFrame(rows)


def distance_figure(stats: list[HeadStatistics]) -> go.Figure:
    """Mean attention mass by distance (query − key) in powers of two, one line per head."""
    fig = figure(None)
    for s in stats:
        labels = [f"{a}–{b - 1}" if b - a > 1 else str(a) for a, b in zip(s.distance_edges, s.distance_edges[1:])]
        fig.add_trace(go.Scatter(x=labels, y=s.distance_mass, mode="lines+markers", name=f"head {s.head}"))
    fig.update_layout(title={"text": "mean weight by distance (query − key)", "font": {"size": 12}}, height=320)
    fig.update_xaxes(title="distance")
    fig.update_yaxes(title="mean weight per row")
    return fig


def derived_sentence(trace: Trace, step: int, layer: int) -> str:
    name = act_name("pattern", layer)
    if is_derived(trace, name, step):
        return ("This layer ran the fused kernel: the pattern was never held whole; every number here is recomputed "
                "from the recorded Q and K, each row normalised over all its keys in tiles.")
    return "This layer ran eager: the numbers are read from its recorded pattern."
