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
