"""One head's attention at any length: an overview computed tile by tile, an exact zoomed region, one query row
over every key, and per-head long-context statistics (tracer.attention_overview, attention_region, query_row,
head_statistics). Nothing of n × t is ever built; at most ``MAX_ZOOM`` × ``MAX_ZOOM`` exact cells are sent.

Pure functions: a trace in, figures and tables out.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from gpt_shape_tracer.figures.heatmap import colour_top
from gpt_shape_tracer.figures.palette import AMOUNT
from gpt_shape_tracer.figures.plot import figure
from gpt_shape_tracer.model.gpt import act_name, grid_edges
from gpt_shape_tracer.tracer import (
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


def position_edges(edges: list[int]) -> list[float]:
    """Cell edges on an axis of positions: position i is drawn over [i − ½, i + ½), so a block of positions
    a … b−1 spans [a − ½, b − ½) and a box drawn on the figure reads back as positions (``box_range``)."""
    return [e - 0.5 for e in edges]


def box_range(lo: float, hi: float, size: int) -> tuple[int, int] | None:
    """The positions whose cells' centres a box from ``lo`` to ``hi`` covers (half-open), clipped to
    [0, ``size``); a box narrower than one cell gives the cell it lies in; None when it lies outside."""
    lo, hi = min(lo, hi), max(lo, hi)
    first, last = max(0, math.ceil(lo)), min(size - 1, math.floor(hi))
    if first > last:  # between two centres: the cell under the box
        first = last = round((lo + hi) / 2)
    if not 0 <= first <= last < size:
        return None
    return first, last + 1


def position_axes(fig: go.Figure) -> None:
    """Query positions down, key positions across, whole numbers on the ticks (plotly would write 32.7k)."""
    fig.update_yaxes(autorange="reversed", title="query position", tickformat=",d")
    fig.update_xaxes(title="key position", tickformat=",d")


def overview_figure(view: Overview, statistic: str = "mean") -> go.Figure:
    """The block mean (or max) heatmap on axes of positions: each cell covers the query rows and keys of its
    block, so a box drawn on it selects those positions."""
    z = (view.mean if statistic == "mean" else view.peak).numpy().astype(np.float32)
    what = "A" if view.exact else f"block {statistic}"
    scale = colour_top(z)
    clip = f"<br>{scale.note()}" if scale.clipped else ""  # a line of its own: the title does not wrap
    fig = figure(go.Heatmap(z=z, x=position_edges(view.col_edges), y=position_edges(view.row_edges),
                            colorscale=AMOUNT, zmin=0, zmax=scale.top,
                            colorbar={**scale.bar(what), "thickness": 10, "tickformat": "~g"},
                            hovertemplate=("q %{y:,.0f} × k %{x:,.0f}" if view.exact else
                                           "block centred at q %{y:,.0f} × k %{x:,.0f}")
                            + f": {what} %{{z:.4g}}<extra></extra>"))
    position_axes(fig)
    fig.update_layout(title={"text": overview_title(view, statistic) + clip, "font": {"size": 12}}, height=460,
                      dragmode="select")
    return fig


def overview_title(view: Overview, statistic: str) -> str:
    """What one cell of the overview is, from its block sizes."""
    if view.exact:
        return "exact weights, one cell per query × key (draw a box to zoom)"
    rh = max(b - a for a, b in zip(view.row_edges, view.row_edges[1:]))
    cw = max(b - a for a, b in zip(view.col_edges, view.col_edges[1:]))
    return (f"block {statistic} of up to {rh:,} queries × {cw:,} keys per cell, {len(view.row_edges) - 1} × "
            f"{len(view.col_edges) - 1} cells (draw a box to zoom)")


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
    """The region: exact weights one cell per query × key, or (larger than ``MAX_ZOOM``) its block means, each
    block drawn over the positions it covers — so a box drawn on it narrows the region further."""
    if exact:
        y, x = np.arange(rows[0], rows[1]), np.arange(cols[0], cols[1])
        where = "q %{y:,d} × k %{x:,d}"
    else:
        y = np.array(position_edges([rows[0] + e for e in grid_edges(rows[1] - rows[0], OVERVIEW_BINS)]))
        x = np.array(position_edges([cols[0] + e for e in grid_edges(cols[1] - cols[0], OVERVIEW_BINS)]))
        where = "block centred at q %{y:,.0f} × k %{x:,.0f}"
    fig = figure(go.Heatmap(z=matrix.astype(np.float32), x=x, y=y, colorscale=AMOUNT, zmin=0,
                            colorbar={"title": {"text": "A" if exact else "block mean", "side": "top"},
                                      "thickness": 10, "tickformat": "~g"},
                            hovertemplate=where + ": %{z:.6f}<extra></extra>"))
    position_axes(fig)
    what = "exact weights" if exact else f"block means (at most {MAX_ZOOM} × {MAX_ZOOM} cells are exact: narrow it)"
    fig.update_layout(title={"text": f"queries {rows[0]:,}–{rows[1] - 1:,} × keys {cols[0]:,}–{cols[1] - 1:,}: "
                                     f"{what}", "font": {"size": 12}}, height=460, dragmode="select")
    return fig


def row_strip_figure(trace: Trace, step: int, layer: int, head: int, batch: int, row: int,
                     top: int = 8) -> go.Figure:
    """One query row's exact weights over all keys, its ``top`` keys labelled."""
    weights, best = query_row(trace, act_name("pattern", layer), step, row=row, head=head, batch=batch, top=top)
    w = weights.numpy().astype(np.float32)
    fig = figure(go.Scattergl(x=np.arange(len(w)), y=w, mode="lines", line={"width": 1},
                              hovertemplate="key %{x}: %{y:.6f}<extra></extra>"))
    # the key numbers alone, to the left and right by turns: the heaviest keys often sit side by side
    fig.add_trace(go.Scatter(x=[k for k, _ in best], y=[v for _, v in best], mode="markers+text",
                             text=[f"{k:,}" for k, _ in best], showlegend=False,
                             textposition=["top left" if i % 2 else "top right" for i in range(len(best))],
                             hovertemplate="key %{x}: %{y:.6f}<extra></extra>"))
    seen = np.flatnonzero(w)
    last = int(seen[-1]) if seen.size else len(w) - 1
    after = f"; keys after {last:,} have weight 0, not drawn" if last < len(w) - 1 else ""
    if after:
        fig.update_xaxes(range=[-0.5, last + 0.5])
    fig.update_yaxes(range=[0, 1.25 * float(w.max()) if w.size and w.max() > 0 else 1])  # room for the numbers
    fig.update_layout(title={"text": f"query {row}: its weight on each of {len(w):,} keys (its top {len(best)} "
                                     f"keys numbered{after})",
                             "font": {"size": 12}}, height=300, showlegend=False)
    fig.update_xaxes(title="key position", tickformat=",d")
    fig.update_yaxes(title="A", tickformat="~g")
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


def statistics_sentence(stats: list[HeadStatistics], n: int, t: int, sink: int = 4) -> str:
    """How to read the table, and what it says, from its numbers: each value is a mean over the ``n`` query rows
    (of ``t`` keys); for the mass on the first ``sink`` keys, within 16 positions and 1,024 or more back, the head
    with the most — or, where every head shows the same value at the three decimals written, that they agree."""
    frame = statistics_frame(stats, sink)
    sentence = (f"Each number is a mean over this layer's {n:,} query rows (entropy in nats: a row spread evenly over "
                f"{t:,} keys would have ln {t:,} = {math.log(t):.2f}).")
    alike, apart = [], []
    for column, where in ((f"mass on keys 0–{sink - 1}", f"on keys 0–{sink - 1}"),
                          ("mass at distance < 16", "within 15 positions back"),
                          ("mass at distance ≥ 1024", "1,024 or more positions back")):
        values = frame[column].to_numpy()
        if f"{values.max():.3f}" == f"{values.min():.3f}":
            alike.append(f"{values.max():.3f} {where}")
        else:
            top = frame.iloc[int(values.argmax())]
            apart.append(f" Head {int(top['head'])} puts the most {where}: {top[column]:.3f} of a row's weight "
                         f"(the least: {values.min():.3f}).")
    if alike:
        who = "Every head puts" if len(stats) > 1 else "The head puts"
        listed = alike[0] if len(alike) == 1 else ", ".join(alike[:-1]) + " and " + alike[-1]
        sentence += f" {who}, of a row's weight, {listed}."
    return sentence + "".join(apart)


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
                "from the recorded Q and K, each row normalised over all of its keys, a few rows at a time.")
    return "This layer ran eager: the numbers are read from its recorded pattern."
