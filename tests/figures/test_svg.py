"""figures/svg.py: the shape flow and the reshape drawn as SVG hold what their plotly figures hold — every label,
box, path, arrowhead and hover — at the places the figures' axis ranges give, and refuse a figure they cannot draw."""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET

import plotly.graph_objects as go
import pytest

from gpt_shape_tracer.figures import flow
from gpt_shape_tracer.figures.plot import text_trace
from gpt_shape_tracer.figures.svg import WIDTH, diagram_svg, label_lines
from gpt_shape_tracer.tracer import TracedGeneration

SVG = "{http://www.w3.org/2000/svg}"
PROMPT = "Tom had a big red kite. One day, Tom went to the park."


@pytest.fixture(scope="module", params=["story-gpt", "story-llama"])
def trace(request):
    from gpt_shape_tracer.model import load_bundled

    model, tok = load_bundled(request.param)
    gen = TracedGeneration(model, tok, PROMPT, temperature=0.0)
    gen.run(3)
    return gen.trace


def _parsed(svg: str) -> ET.Element:
    return ET.fromstring(svg)  # well-formed XML, or this raises


def _texts(root: ET.Element) -> list[list[str]]:
    """Each <text>'s lines: a tspan with its own y starts a line."""
    out = []
    for text in root.iter(f"{SVG}text"):
        lines: list[str] = []
        for span in text.iter(f"{SVG}tspan"):
            if "y" in span.attrib or not lines:
                lines.append("")
            lines[-1] += span.text or ""
        out.append(lines)
    return out


@pytest.mark.parametrize("which", ["flow", "reshape"])
def test_the_drawing_holds_every_label_box_path_arrow_and_hover_of_the_figure(trace, which):
    fig = flow.shape_flow_figure(trace, 2, 0) if which == "flow" else flow.reshape_figure(trace, 2, 0)
    spec = fig.to_plotly_json()
    root = _parsed(diagram_svg(fig, which))
    labels = [str(t) for trace_ in spec["data"] if trace_.get("mode") == "text" for t in trace_["text"] if t]
    assert _texts(root) == [label_lines(t) for t in labels]
    # the same, read from the markup without the drawing's own parser: plotly's <br> lines, tags dropped
    assert _texts(root) == [[html.unescape(re.sub(r"<[^>]+>", "", line)) for line in t.split("<br>")]
                            for t in labels]
    assert any("[" in line for lines in _texts(root) for line in lines)  # the live shapes are among them
    shapes = spec["layout"]["shapes"]
    rects = [s for s in shapes if s["type"] == "rect"]
    assert len(list(root.iter(f"{SVG}rect"))) == len(rects) + 1  # and the background
    segments = sum(len([x for x in t["x"] if x is None]) for t in spec["data"] if "lines" in str(t.get("mode")))
    heads_defined = {p for marker in root.iter(f"{SVG}marker") for p in marker.iter(f"{SVG}path")}
    paths = [p for p in root.iter(f"{SVG}path") if p not in heads_defined]
    drawn_paths = len([s for s in shapes if s["type"] == "path"])
    assert len(paths) - drawn_paths == segments  # one path per arrow segment
    heads = [p for p in root.iter(f"{SVG}path") if p.get("marker-end")]
    assert len(heads) == sum(1 for t in spec["data"] if "lines" in str(t.get("mode"))
                             for size in t["marker"]["size"] if size)
    hovers = [t for t in spec["data"] if t.get("mode") == "markers"]
    titles = [title.text for title in root.iter(f"{SVG}title")]
    assert titles == [f"{name}\n{html.unescape(summary)}" for t in hovers for name, summary in t["customdata"]]
    for circle, (x, y) in zip(root.iter(f"{SVG}circle"), [(x, y) for t in hovers for x, y in zip(t["x"], t["y"])]):
        assert float(circle.get("cx")) == pytest.approx(_px(spec["layout"], x, "x"), abs=0.06)
        assert float(circle.get("cy")) == pytest.approx(_px(spec["layout"], y, "y"), abs=0.06)


def _px(layout: dict, value: float, axis: str) -> float:
    """Where plotly puts ``value`` on a plot of the drawing's size: the axis range across the plot area inside
    the margins; y from the range's second value at the top (a reversed range, as the shape flow's, runs down)."""
    margin = layout.get("margin", {})
    low, high = layout[f"{axis}axis"]["range"]
    if axis == "x":
        width = WIDTH - margin.get("l", 0) - margin.get("r", 0)
        return margin.get("l", 0) + (value - low) / (high - low) * width
    height = layout["height"] - margin.get("t", 0) - margin.get("b", 0)
    return margin.get("t", 0) + (high - value) / (high - low) * height


def test_each_box_sits_where_its_label_and_hover_do(trace):
    """The layout's rectangles and the text traces are placed by one mapping: every box of the shape flow has its
    label's x at its middle and its label's lines within it."""
    fig = flow.shape_flow_figure(trace, 1, 0)
    root = _parsed(diagram_svg(fig, "flow"))
    boxes = [(float(r.get("x")), float(r.get("y")), float(r.get("width")), float(r.get("height")))
             for r in root.iter(f"{SVG}rect")][1:]
    firsts = [t.find(f"{SVG}tspan") for t in root.iter(f"{SVG}text")]
    centred = 0
    for x, y, w, h in boxes:
        inside = [s for s in firsts if abs(float(s.get("x")) - (x + w / 2)) < 0.2 and y < float(s.get("y")) < y + h]
        centred += len(inside) == 1
    assert centred == len(boxes)


def test_markup_and_characters_markdown_reads_are_drawn_as_written():
    """Bold, italic and a colour carried over a line break; $, _, *, :, [ ] and < written so that neither markdown
    (the drawing is shown through st.markdown) nor the SVG reads them."""
    said = "<b>two<br>lines</b> and <i>$x_1$ *a* :smile: [B, n] a<b</i><br><span style='color:#6b5b95'>W_Q</span>"
    fig = go.Figure([text_trace([1.0], [1.0], [html.escape(said, quote=False).replace("&lt;b&gt;", "<b>")
                                                 .replace("&lt;/b&gt;", "</b>").replace("&lt;i&gt;", "<i>")
                                                 .replace("&lt;/i&gt;", "</i>").replace("&lt;br&gt;", "<br>")
                                                 .replace("&lt;span style='color:#6b5b95'&gt;",
                                                          "<span style='color:#6b5b95'>")
                                                 .replace("&lt;/span&gt;", "</span>")])])
    fig.update_layout(height=200, xaxis={"range": [0, 2]}, yaxis={"range": [0, 2]})
    svg = diagram_svg(fig, "t")
    for raw in ("$x", "_1", "*a*", ":smile:", "[B", "a<b"):
        assert raw not in svg.split("<text", 1)[1], raw
    lines = _texts(_parsed(svg))[0]
    assert lines == ["two", "lines and $x_1$ *a* :smile: [B, n] a<b", "W_Q"]
    spans = list(_parsed(svg).iter(f"{SVG}tspan"))
    assert [s.get("font-weight") for s in spans][:3] == ["bold", "bold", None]
    assert spans[-1].get("fill") == "#6b5b95" and spans[-2].get("font-style") == "italic"


def test_a_figure_it_cannot_draw_is_refused():
    with pytest.raises(ValueError, match="heatmap"):
        diagram_svg(go.Figure(go.Heatmap(z=[[1, 2]])), "h")


def _label(text: str, colour: str = "#1a1a1a", position: str = "middle center") -> go.Figure:
    fig = go.Figure([text_trace([1.0], [1.0], [text], color=colour, position=position)])
    fig.update_layout(height=200, xaxis={"range": [0, 2]}, yaxis={"range": [0, 2]})
    return fig


def test_a_label_from_the_model_cannot_end_the_markdown_block_or_set_an_attribute():
    """A module's name reaches a label unescaped (the recorded flow names modules): a carriage return, a line
    separator or a colour written with line breaks would end the HTML block st.markdown leaves alone, the rest of
    the drawing read as markdown (links, images fetched). The drawing stays one line, its text the label's, and a
    colour that is no colour is not drawn."""
    for said in ("x\r\r- www.example.com http://example.com/a", "x\u2028\u2028![i](http://example.com/i.png)",
                 "x\n\n[click](javascript:alert(1))", "</text><script>alert(1)</script>", '"><img src=x onerror=1>'):
        svg = diagram_svg(_label(html.escape(said, quote=False)), "t")
        assert "\n" not in svg and "\r" not in svg and "\u2028" not in svg
        drawn_part = svg.split("<text", 1)[1]  # (the svg element's own xmlns names an http address)
        assert not any(raw in drawn_part for raw in ("<script", "<img", "](", "http:"))
        assert {e.tag.removeprefix(SVG) for e in _parsed(svg).iter()} == {"svg", "defs", "rect", "text", "tspan"}
        assert all(set(e.attrib) <= {"x", "y", "text-anchor", "font-size", "fill"}
                   for e in _parsed(svg).iter() if e.tag in (f"{SVG}text", f"{SVG}tspan"))
        drawn = " ".join(_texts(_parsed(svg))[0])
        assert drawn == re.sub(r"[\r\u2028]", " ", said), (drawn, said)
    svg = diagram_svg(_label("<span style='color:\n\n![](//x)'>x</span> <span style='color:#6b5b95'>W</span>"), "t")
    spans = list(_parsed(svg).iter(f"{SVG}tspan"))
    assert [s.get("fill") for s in spans] == [None, None, "#6b5b95"] and "\n" not in svg and "//x" not in svg


def test_dashes_and_text_below_its_point_are_drawn_as_plotly_draws_them():
    fig = _label("<b>box</b><br>under", position="bottom center")
    fig.update_layout(shapes=[{"type": "path", "path": "M 0.5 0.5 L 1.5 0.5", "line": {"dash": "dash"}},
                              {"type": "rect", "x0": 0.2, "x1": 0.4, "y0": 0.2, "y1": 0.4}])
    root = _parsed(diagram_svg(fig, "t"))
    dashed = [p for p in root.iter(f"{SVG}path") if p.get("stroke-dasharray")]
    assert [p.get("stroke-dasharray") for p in dashed] == ["9,9"]  # plotly's "dash"
    assert root.find(f"{SVG}rect[@width]") is not None
    first = float(root.find(f"{SVG}text").find(f"{SVG}tspan").get("y"))
    assert first > _px(fig.to_plotly_json()["layout"], 1.0, "y")  # below the point, y growing downwards
    centred = float(_parsed(diagram_svg(_label("a<br>b"), "t")).find(f"{SVG}text").find(f"{SVG}tspan").get("y"))
    assert centred < _px(fig.to_plotly_json()["layout"], 1.0, "y")  # two lines centred: the first above it


@pytest.mark.parametrize("change", ["annotation", "title", "hidden", "paper", "dash", "position"])
def test_what_it_does_not_draw_is_refused(change):
    fig = _label("x")
    if change == "annotation":
        fig.add_annotation(x=1, y=1, text="said")
    elif change == "title":
        fig.update_layout(title="a title")
    elif change == "hidden":
        fig.data[0].visible = False
    elif change == "paper":
        fig.update_layout(shapes=[{"type": "rect", "xref": "paper", "x0": 0, "x1": 1, "y0": 0, "y1": 1}])
    elif change == "dash":
        fig.update_layout(shapes=[{"type": "path", "path": "M 0 0 L 1 1", "line": {"dash": "5px,2px"}}])
    else:
        fig = _label("x", position="middle right")
    with pytest.raises(ValueError):
        diagram_svg(fig, "t")
