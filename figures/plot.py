"""New plotly figures, checked by plotly property by property only where a test asks for it.

plotly validates every layout property as it is set; for the shape-flow figure (40 shapes and annotations)
that was 46 of its 59 ms to build, and a Step on the Shapes tab builds it and the reshape strip again.
The figures are built from fixed code, so the app skips the check. ``tests/test_figures.py`` sets
``GPT_TRACER_VALIDATE_FIGURES=1``: there every figure is built checked (a misspelt property raises), and
one test builds each figure both ways and asserts the browser is sent the same JSON — the checks also
normalise (an axis title given as text becomes ``{"text": …}``, the only form plotly.js 3 reads).
"""

from __future__ import annotations

import os

import plotly.graph_objects as go
from plotly.subplots import make_subplots

VALIDATE_ENV = "GPT_TRACER_VALIDATE_FIGURES"


def validating() -> bool:
    return os.environ.get(VALIDATE_ENV) == "1"


def figure(data=None, **kwargs) -> go.Figure:
    """``go.Figure(data, **kwargs)``, validated only when ``GPT_TRACER_VALIDATE_FIGURES=1``."""
    return go.Figure(data, _validate=validating(), **kwargs)


def subplots(**kwargs) -> go.Figure:
    """``make_subplots(**kwargs)`` on a figure from ``figure()``."""
    return make_subplots(figure=figure(), **kwargs)


# Text and arrows as traces, not layout annotations: plotly lays out and measures each annotation on its own,
# so the shape flow with its 57 annotations took 42 ms to draw, and 16 ms with them as two scatter traces
# (``python bench/bench_figures.py --browser --against REV`` draws both in one run).
def text_trace(xs: list[float], ys: list[float], texts: list[str], size: int = 10, color: str = "#1a1a1a",
               position: str = "middle center") -> go.Scatter:
    """Labels at (x, y), each written with plotly's HTML subset (<b>, <i>, <br>, <span style>)."""
    return go.Scatter(x=xs, y=ys, text=texts, mode="text", textposition=position,
                      textfont={"size": size, "color": color}, hoverinfo="skip", showlegend=False)


def arrow_trace(segments: list[tuple[float, float, float, float]], color: str = "#888",
                width: float = 1.2) -> go.Scatter:
    """Arrows from (x0, y0) to (x1, y1): one line trace, an arrowhead marker at each end turned along its
    segment (``angleref="previous"``), nothing at the starts."""
    xs: list[float | None] = []
    ys: list[float | None] = []
    sizes: list[int] = []
    for x0, y0, x1, y1 in segments:
        xs += [x0, x1, None]
        ys += [y0, y1, None]
        sizes += [0, 9, 0]
    return go.Scatter(x=xs, y=ys, mode="lines+markers", line={"color": color, "width": width},
                      marker={"symbol": "arrow", "size": sizes, "color": color, "angleref": "previous",
                              "line": {"width": 0}},
                      hoverinfo="skip", showlegend=False)
