"""gui.common.panels under AppTest: a figure the canvas draws is sent as the canvas's spec (named by a revision of
its content), one it does not draw is shown as the plotly chart it is."""

from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest


def _page(kind: str) -> None:
    import plotly.graph_objects as go
    import torch

    from gpt_shape_tracer.figures.heatmap import add, grid, style_axes
    from gpt_shape_tracer.figures.plot import figure
    from gpt_shape_tracer.gui.common import panels

    fig = figure()
    g = grid(torch.arange(6, dtype=torch.float32).reshape(2, 3), ["a", "b", "c"], ["p", "q"])
    add(fig, g, "signed", colorbar="score")
    style_axes(fig, g)
    fig.update_layout(height=300)
    if kind == "scatter":  # a trace the canvas does not draw
        fig.add_trace(go.Scatter(x=["a"], y=["p"]))
    panels(fig, key="test_chart")


def _run(kind: str) -> AppTest:
    at = AppTest.from_function(_page, args=(kind,), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def test_a_figure_the_canvas_draws_is_sent_as_its_spec():
    at = _run("heatmaps")
    (element,) = at.get("bidi_component")
    spec = json.loads(element.proto.json)
    assert element.proto.component_name == "gpt_shape_tracer.panels" and not at.get("plotly_chart")
    assert spec["panels"][0]["z"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and len(spec["revision"]) == 16
    assert json.loads(_run("heatmaps").get("bidi_component")[0].proto.json)["revision"] == spec["revision"]


def test_a_figure_it_does_not_draw_stays_a_plotly_chart():
    at = _run("scatter")
    assert not at.get("bidi_component")
    (chart,) = at.get("plotly_chart")
    assert [t["type"] for t in json.loads(chart.proto.spec)["data"]] == ["heatmap", "scatter"]
