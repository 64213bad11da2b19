"""figures/panels.py: the attention Stages drawn on a canvas hold what their plotly figure holds — every cell's value
(a gap where plotly leaves one), every label and tick, the colour limits plotly sets, each title's lines — and a
figure it cannot draw is refused. The colour limits and colour bar ticks are checked against plotly.js itself in
tests/browser/test_panels_browser.py."""

from __future__ import annotations

import html
import math
import re

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

from gpt_shape_tracer.figures import attention
from gpt_shape_tracer.figures.panels import limits, nice_ticks, panels_spec, runs, tick_label
from gpt_shape_tracer.tracer import TracedGeneration

PROMPT = "Tom had a big red kite. One day, Tom went to the park."
TAG = re.compile(r"<[^>]+>")


def _generation(name: str, prompt, steps: int = 3, **options) -> TracedGeneration:
    from gpt_shape_tracer.model import load_bundled

    model, tok = load_bundled(name)
    gen = TracedGeneration(model, tok, prompt, temperature=0.0, **options)
    gen.run(steps)
    return gen


@pytest.fixture(scope="module", params=["story-gpt", "story-llama"])
def traces(request):
    """The settings the Stages view meets: a prefill and decode steps with the cache, without it, a left-padded
    batch of two, a prompt short enough for numbers in the cells, a shapes capture (no values)."""
    return {
        "cached": _generation(request.param, PROMPT).trace,
        "uncached": _generation(request.param, PROMPT, use_cache=False).trace,
        "padded": _generation(request.param, [PROMPT, "Tom had"]).trace,
        "short": _generation(request.param, "Tom had a", steps=2).trace,
        "marks": _generation(request.param, "Tom & Lily <3 the park.", steps=2).trace,  # <, & in the labels
        "shapes": _generation(request.param, PROMPT, capture="shapes").trace,
        # 192 tokens: the prefill's panels pooled into blocks, a decode row's weights on a clipped colour scale
        "long": _generation(request.param, " ".join([PROMPT] * 12), steps=2).trace,
    }


def _figures(trace):
    last = len(trace.steps) - 1
    for step in (0, last):
        for layer, head in ((0, 0), (1, 2)):
            for shared in (False, True):
                for batch in range(trace.record(f"blocks.{layer}.attn.hook_q", step).shape[0]):
                    yield (step, layer, head, shared, batch), attention.attention_stages_figure(
                        trace, step, layer, head, batch, shared)


def _values(fig: go.Figure) -> list:
    return [t for t in fig.data if not (t.hoverinfo == "skip" and t.showscale is False)]


def _lines(text: str) -> list[str]:
    return [TAG.sub("", line) for line in text.split("<br>")]


def test_every_cell_label_tick_and_title_of_the_figure_is_in_the_drawing(traces):
    seen_masked = seen_numbers = seen_notes = seen_clipped = seen_marks = 0
    for setting, trace in traces.items():
        for where, fig in _figures(trace):
            spec = panels_spec(fig)
            values = _values(fig)
            assert len(spec["panels"]) == len(values), (setting, where)
            layout = fig.layout
            for panel, trace_ in zip(spec["panels"], values):
                z = np.asarray(trace_.z, dtype=np.float64)
                drawn = np.array([[math.nan if v is None else v for v in row] for row in panel["z"]], dtype=np.float64)
                np.testing.assert_array_equal(drawn, z)  # NaN where plotly leaves a gap
                # the labels as plotly shows them: grid() escapes <, > and & for plotly's markup, the canvas writes text
                assert panel["x"] == [html.unescape(str(v)) for v in trace_.x]
                assert panel["y"] == [html.unescape(str(v)) for v in trace_.y]
                seen_marks += any("&" in v or "<" in v for v in panel["x"])
                xaxis = layout["xaxis" + trace_.xaxis[1:]]
                yaxis = layout["yaxis" + trace_.yaxis[1:]]
                assert [panel["x"][j] for j in panel["xticks"]] == [html.unescape(str(v)) for v in xaxis.tickvals]
                assert panel["xticktext"] == [html.unescape(str(v)) for v in xaxis.ticktext]
                shown = yaxis.showticklabels is not False
                assert [panel["y"][i] for i in panel["yticks"]] == (
                    [html.unescape(str(v)) for v in yaxis.tickvals] if shown else [])
                assert panel["domain"] == list(xaxis.domain) and panel["tickangle"] == xaxis.tickangle
                under = [t for t in fig.data if t.hoverinfo == "skip" and t.xaxis == trace_.xaxis]
                assert (panel["masked"] is not None) == bool(under), (setting, where)
                seen_masked += bool(under)
                if trace_.zmin is not None:
                    assert (panel["zmin"], panel["zmax"]) == (trace_.zmin, trace_.zmax)
                else:  # symmetric about 0, reaching the largest magnitude drawn
                    finite = np.abs(z[np.isfinite(z)])
                    assert panel["zmin"] == -panel["zmax"] and panel["zmax"] == pytest.approx(float(finite.max()))
                if trace_.texttemplate:
                    assert panel["text"] == [[str(v) for v in row] for row in trace_.text]
                    seen_numbers += 1
                else:
                    assert panel["text"] is None
                if trace_.showscale is False:
                    assert panel["bar"] is None
                else:
                    bar = panel["bar"]
                    assert all(panel["zmin"] - 1e-9 <= v <= panel["zmax"] + 1e-9 for v in bar["ticks"])
                    if trace_.colorbar.tickvals is not None:
                        assert bar["labels"] == list(trace_.colorbar.ticktext)
                        seen_clipped += 1
                    assert ["".join(r["t"] for r in line) for line in bar["title"]] == _lines(
                        trace_.colorbar.title.text)
            notes = layout.annotations
            # each panel named by its title's first line (subplot titles come first among the annotations)
            assert [p["name"] for p in spec["panels"]] == [_lines(a.text)[0].strip() for a in notes[:len(values)]]
            assert [["".join(r["t"] for r in line) for line in n["lines"]] for n in spec["notes"]] == [
                _lines(a.text) for a in notes]
            seen_notes += any(a.text.startswith(("not formed", "values not kept")) for a in notes)
            assert ["".join(r["t"] for r in line) for line in spec["title"]["lines"]] == _lines(layout.title.text)
            assert spec["height"] == layout.height
    # the matrix reached a gap, numbers, a panel with no values and a clipped colour scale
    assert seen_masked and seen_numbers and seen_notes and seen_clipped and seen_marks


def test_markup_becomes_runs_of_plain_text():
    lines = runs("<b>QKᵀ</b><br><span style='font-size:10px'>[1, 4] &amp; <i>n</i></span><br>")
    assert lines == [[{"t": "QKᵀ", "b": True, "i": False, "s": None, "c": None}],
                     [{"t": "[1, 4] & ", "b": False, "i": False, "s": 10.0, "c": None},
                      {"t": "n", "b": False, "i": True, "s": 10.0, "c": None}],
                     []]
    assert runs("<span style='color:#ff0000'>red <span style='font-size:9px'>small</span></span>")[0] == [
        {"t": "red ", "b": False, "i": False, "s": None, "c": "#ff0000"},
        {"t": "small", "b": False, "i": False, "s": 9.0, "c": "#ff0000"}]
    with pytest.raises(ValueError, match="markup"):
        runs("a <a href='x'>link</a>")


def test_colour_limits_and_ticks_follow_plotly():
    z = np.array([[1.0, -3.0, np.nan], [2.0, 0.5, -np.inf]])
    assert limits(z, None, None, 0.0) == (-3.0, 3.0)
    assert limits(z, None, None, None) == (-3.0, 2.0)
    assert limits(z, 0.0, 1.0, None) == (0.0, 1.0)
    assert limits(z, 0.0, None, None) == (-3.0, 2.0)  # one end given: plotly takes both from the data (zauto)
    assert limits(z, 0.0, 1.0, None, zauto=True) == (-3.0, 2.0)
    assert limits(np.full((1, 1), 2.0), None, None, None) == (1.5, 2.5)
    assert nice_ticks(0.0, 1.0) == [0.0, 0.5, 1.0]
    assert nice_ticks(-12.36, 12.36) == [-10.0, -5.0, 0.0, 5.0, 10.0]
    def labels(lo, hi):
        ticks = nice_ticks(lo, hi)
        return [tick_label(v, ticks, lo, hi) for v in ticks]

    # as plotly.js writes them (tests/browser/test_panels_browser.py compares more ranges with plotly.js itself)
    assert labels(-79.04, 79.04) == ["−50", "0", "50"]
    assert labels(0.0, 0.00249) == ["0", "0.0005", "0.001", "0.0015", "0.002"]
    assert labels(-5e-4, 5e-4) == ["−500μ", "0", "500μ"]
    assert labels(-4e4, 4e4) == ["−40k", "−20k", "0", "20k", "40k"]
    assert labels(0.0, 2e9) == ["0", "0.5B", "1B", "1.5B", "2B"]
    assert labels(-3.4e38, 3.4e38) == ["−2×10³⁸", "0", "2×10³⁸"]


@pytest.mark.parametrize("change, reason", [
    (lambda f: f.add_trace(go.Scatter(x=[0], y=[0])), "scatter"),
    (lambda f: f.update_yaxes(autorange=True), "reversed"),
    (lambda f: f.update_xaxes(type="linear"), "category"),
    (lambda f: f.update_traces(hovertemplate="%{z}"), "hover"),
    (lambda f: f.add_annotation(text="look", x=0, y=0, xref="x", yref="y"), "annotation"),
    (lambda f: f.update_traces(colorscale=[[0, "red"], [1, "blue"]]), "colour"),
    (lambda f: f.add_shape(type="circle", x0=0, x1=1, y0=0, y1=1), "outlined rectangle"),
    (lambda f: f.add_shape(type="rect", x0=0, x1=1, y0=0, y1=1, fillcolor="red"), "outlined rectangle"),
    (lambda f: f.add_layout_image(source="x.png", x=0, y=0), "images"),
])
def test_a_figure_it_cannot_draw_is_refused(change, reason):
    from gpt_shape_tracer.figures.heatmap import add, grid, style_axes

    fig = go.Figure()
    g = grid(torch.arange(6, dtype=torch.float32).reshape(2, 3), ["a", "b", "c"], ["p", "q"])
    add(fig, g, "signed")
    style_axes(fig, g)
    fig.update_layout(height=300)
    panels_spec(fig)  # drawn as it is
    change(fig)
    with pytest.raises(ValueError, match=reason):
        panels_spec(fig)


def test_a_panel_with_no_matrix_says_why(traces):
    """A shapes trace keeps no values: its fused layers' stages were never formed and cannot be recomputed (no Q and K
    kept), and the panel says that — not that the app's Zoom would recompute them, which it cannot."""
    from gpt_shape_tracer.tracer import can_recompute, is_derived

    trace = traces["shapes"]
    fig = attention.attention_stages_figure(trace, 1, 0, 0)
    notes = [a.text for a in fig.layout.annotations if not a.text.startswith("<b>")]
    assert len(notes) == 4 and is_derived(trace, "blocks.0.attn.hook_pattern", 1)
    assert not can_recompute(trace, "blocks.0.attn.hook_pattern", 1)
    assert all("Q and K<br>were not kept" in n and "Zoom" not in n for n in notes), notes
    assert can_recompute(traces["cached"], "blocks.0.attn.hook_pattern", 1)  # values kept: Zoom can, the panels draw
    assert not [a for a in attention.attention_stages_figure(traces["cached"], 1, 0, 0).layout.annotations
                if not a.text.startswith("<b>")]


def test_history_and_the_kv_cache_heatmap_keep_their_outlined_row(traces):
    """The History (this step's row outlined) and the KV cache tab's keys of one head (the row this step added
    outlined) are drawn on the canvas too: each outline in cell units, over its panel, in its own colour and width."""
    from gpt_shape_tracer.figures import cache, mask

    trace = traces["cached"]
    figures = (attention.attention_history_figure(trace, 1, 2, 2, 0), cache.key_heatmap_figure(trace, 2, 1, 0, 0, "V"))
    for fig in figures:
        spec = panels_spec(fig)
        (shape,) = fig.layout.shapes
        assert spec["outlines"] == [{"panel": 0, "x0": shape.x0, "x1": shape.x1, "y0": shape.y0, "y1": shape.y1,
                                     "colour": "rgb(245, 133, 24)", "width": shape.line.width}]
        assert len(spec["panels"]) == 1 and spec["panels"][0]["z"]
    before_after = panels_spec(mask.scores_before_after_figure(trace, 0, 1, 0, 0))
    assert [p["name"] for p in before_after["panels"]] == ["before: QKᵀ/√d_k", "after: QKᵀ/√d_k + M  (−∞ grey)"]
