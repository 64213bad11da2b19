"""Hover linking: a cell under the pointer draws a line along its whole row and its whole column (plotly's spike
lines, snapped to the cell), so a weight reads with the query row and the key column it came from — in the
browser, with no rerun of the page."""

from __future__ import annotations

import plotly.graph_objects as go

__all__ = ["crosshair"]

LINE = dict(showspikes=True, spikemode="across", spikesnap="data", spikethickness=1, spikedash="solid",
            spikecolor="#202020")


def crosshair(fig: go.Figure) -> go.Figure:
    """``fig`` with every x and y axis drawing the row and column of the hovered cell (changed in place)."""
    fig.update_xaxes(**LINE)
    fig.update_yaxes(**LINE)
    fig.update_layout(hovermode="closest", spikedistance=-1)
    return fig
