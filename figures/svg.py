"""A diagram figure drawn as SVG: the boxes-and-arrows figures (``figures.flow``'s shape flow and multi-head reshape),
written from the same plotly figure the report and the notebook show, for a page that redraws them on every Step.

plotly redraws a figure whose data changed in 0.05–0.09 s of the browser's main thread on the machine
``docs/benchmarks.md`` names (the shape flow alone on an empty page: a Step 0.21 s against 0.12 s without it; the
same figure as this SVG 0.14 s): the Shapes tab paid that twice a Step. The browser draws an SVG of the same boxes,
arrows and labels without any script.

What is drawn, and nothing else (anything else raises ``ValueError``: such a figure stays a plotly chart): the
layout's rectangles and paths in data coordinates (``shapes``), scatter traces of lines with an arrowhead marker at a
segment's end (``plot.arrow_trace``), of text centred at, above or below its point (``plot.text_trace``: plotly's
``<b>``, ``<i>``, ``<br>`` and ``<span style='color:…'>``), and of invisible markers carrying a hover
(``hovertemplate`` over ``customdata``), which become each point's ``<title>`` — the browser's own tooltip. Axes are
hidden in these figures; their ranges place everything (a reversed y range draws downwards, as plotly does). A
figure with annotations, a title, hidden traces or a dash plotly does not name is refused.

The text of a label can come from the model (a module's name, its class): it is shown through ``st.markdown``, so
every character markdown or HTML would read is written as a character reference, control characters as spaces
(a raw line break would end the HTML block markdown leaves alone), and a colour is drawn only where it reads as
one (``#rrggbb``, a name, ``rgb(…)``).
"""

from __future__ import annotations

import re
from typing import Any

import plotly.graph_objects as go

from gpt_shape_tracer.figures.plot import CSS_COLOUR, markup_runs

WIDTH = 900  # the drawing's own width in px; the page scales it to the column (viewBox), never above this: at 900 its
# 10 px labels stay 9 px or more in the 820 px column of a 1280 px window
LINE = 1.25  # a label's line height, in font sizes (plotly's own spacing of <br> lines)
_POSITIONS = ("middle center", "bottom center", "top center")


def _colour(value: Any, default: str) -> str:
    """``value`` where it reads as a CSS colour, else ``default``: nothing else reaches an attribute."""
    return value if isinstance(value, str) and CSS_COLOUR.fullmatch(value) else default
_HOVER = re.compile(r"%\{customdata\[(\d+)\]\}")


def label_lines(text: str) -> list[str]:
    """A label's lines as a reader sees them (markup dropped)."""
    return ["".join(run["t"] for run in line) for line in markup_runs(text)]


# characters markdown or Streamlit's markdown would read (emphasis, math, links, emoji short codes, code), written
# as character references: the drawing is shown through st.markdown, whose HTML sanitiser would drop an SVG from
# st.html, inside an HTML block that markdown leaves alone — this keeps a label the same even outside one
_MARKDOWN = str.maketrans({**{c: f"&#{ord(c)};" for c in "$:*_`~[]\\#|<>&\"'!()\n"},
                           **{chr(c): " " for c in [*range(32), 127, 0x85, 0x2028, 0x2029] if c != 10}})


def _words(text: str) -> str:
    """Text content of the drawing: every character markdown or HTML would read written as a reference."""
    return text.translate(_MARKDOWN)


def _number(value: Any) -> float:
    return float(value)


class _Place:
    """Data coordinates to the drawing's pixels, from the axes' ranges and the layout's margins."""

    def __init__(self, layout: dict, width: int) -> None:
        margin = layout.get("margin") or {}
        self.left, self.top = _number(margin.get("l", 0)), _number(margin.get("t", 0))
        self.width = width - self.left - _number(margin.get("r", 0))
        self.height = _number(layout["height"]) - self.top - _number(margin.get("b", 0))
        (self.x0, self.x1) = (_number(v) for v in layout["xaxis"]["range"])
        (self.y0, self.y1) = (_number(v) for v in layout["yaxis"]["range"])  # bottom, top (reversed: top below)

    def x(self, value: float) -> float:
        return self.left + (value - self.x0) / (self.x1 - self.x0) * self.width

    def y(self, value: float) -> float:
        return self.top + (self.y1 - value) / (self.y1 - self.y0) * self.height


def _f(v: float) -> str:
    return f"{v:.1f}"


def _path(path: str, at: _Place) -> str:
    points = re.findall(r"([MLZ])\s*([-+\d.eE]+)?\s*,?\s*([-+\d.eE]+)?", path)
    if not points or any(cmd != "Z" and (not a or not b) for cmd, a, b in points):
        raise ValueError(f"a path this drawing does not know: {path[:80]!r}")
    return " ".join("Z" if cmd == "Z" else f"{cmd} {_f(at.x(float(a)))} {_f(at.y(float(b)))}" for cmd, a, b in points)


# plotly's named dashes, as its SVG writes them (px at a line width of 1)
_DASHES = {"dot": "3,3", "dash": "9,9", "longdash": "15,15", "dashdot": "9,3,3,3", "longdashdot": "15,3,3,3"}


def _stroke(line: dict, default: str) -> str:
    named = line.get("dash") or "solid"
    if named != "solid" and named not in _DASHES:
        raise ValueError(f"a dash this drawing does not know: {named!r}")
    dash = _DASHES.get(named, "")
    return (f'stroke="{_colour(line.get("color"), default)}" stroke-width="{_number(line.get("width", 1)):g}"'
            + (f' stroke-dasharray="{dash}"' if dash else ""))


def _shape(shape: dict, at: _Place) -> str:
    stroke = _stroke(shape.get("line") or {}, "#444")
    if shape.get("xref", "x") != "x" or shape.get("yref", "y") != "y":
        raise ValueError("a shape placed outside the data's coordinates (xref/yref): this drawing places by the axes")
    if shape.get("type") == "rect":
        x0, x1 = sorted((at.x(_number(shape["x0"])), at.x(_number(shape["x1"]))))
        y0, y1 = sorted((at.y(_number(shape["y0"])), at.y(_number(shape["y1"]))))
        fill = _colour(shape.get("fillcolor"), "none")
        return f'<rect x="{_f(x0)}" y="{_f(y0)}" width="{_f(x1 - x0)}" height="{_f(y1 - y0)}" fill="{fill}" {stroke}/>'
    if shape.get("type") == "path":
        return f'<path d="{_path(str(shape["path"]), at)}" fill="none" {stroke}/>'
    raise ValueError(f"a layout shape this drawing does not know: {shape.get('type')!r}")


def _arrows(trace: dict, at: _Place, heads: dict[str, str], key: str) -> list[str]:
    """Segments separated by None; a segment's last point with a marker size > 0 gets the arrowhead (one
    ``<marker>`` per colour, named in ``heads``)."""
    xs, ys = list(trace.get("x") or []), list(trace.get("y") or [])
    sizes = (trace.get("marker") or {}).get("size")
    sizes = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes or 0] * len(xs)
    line = trace.get("line") or {}
    colour = _colour(line.get("color"), "#888")
    marker_id = heads.setdefault(colour, f"{key}-arrow-{len(heads)}")
    out: list[str] = []
    points: list[tuple[float, float, float]] = []
    for x, y, size in [*zip(xs, ys, sizes), (None, None, 0)]:
        if x is None or y is None:
            if len(points) >= 2:
                d = " ".join(f"{'M' if i == 0 else 'L'} {_f(at.x(px))} {_f(at.y(py))}" for i, (px, py, _) in
                             enumerate(points))
                head = f' marker-end="url(#{marker_id})"' if points[-1][2] else ""
                out.append(f'<path d="{d}" fill="none" {_stroke(line, "#888")}{head}/>')
            points = []
        else:
            points.append((float(x), float(y), size or 0))
    return out


def _texts(trace: dict, at: _Place) -> list[str]:
    font = trace.get("textfont") or {}
    size, colour = float(font.get("size", 12)), _colour(font.get("color"), "#1a1a1a")
    position = str(trace.get("textposition") or "middle center")
    if position not in _POSITIONS:
        raise ValueError(f"text placed {position!r}: this drawing centres a label at, above or below its point")
    out = []
    for x, y, text in zip(trace.get("x") or [], trace.get("y") or [], trace.get("text") or []):
        if x is None or y is None or not text:
            continue
        lines = markup_runs(str(text))
        step = size * LINE
        if position.startswith("bottom"):  # below the point, as plotly places it
            first = at.y(float(y)) + size
        elif position.startswith("top"):
            first = at.y(float(y)) - step * (len(lines) - 1) - size * 0.4
        else:
            first = at.y(float(y)) - step * (len(lines) - 1) / 2 + size * 0.35
        cx = _f(at.x(float(x)))
        tspans = []
        for i, runs in enumerate(lines):
            for j, run in enumerate(runs):
                where = f' x="{cx}" y="{_f(first + i * step)}"' if j == 0 else ""
                style = (' font-weight="bold"' if run["b"] else "") + (' font-style="italic"' if run["i"] else "") + (
                    f' fill="{run["c"]}"' if run["c"] else "")  # the run's font size is the label's here
                tspans.append(f"<tspan{where}{style}>{_words(run['t'])}</tspan>")
        out.append(f'<text text-anchor="middle" font-size="{size:g}" fill="{colour}">'
                   + "".join(tspans) + "</text>")
    return out


def _hovers(trace: dict, at: _Place) -> list[str]:
    template = str(trace.get("hovertemplate") or "").replace("<extra></extra>", "")
    radius = float((trace.get("marker") or {}).get("size", 20)) / 2
    out = []
    for x, y, data in zip(trace.get("x") or [], trace.get("y") or [], trace.get("customdata") or []):
        said = _HOVER.sub(lambda m, d=data: str(d[int(m.group(1))]), template)  # type: ignore[misc]
        said = "\n".join(label_lines(said))
        out.append(f'<circle cx="{_f(at.x(float(x)))}" cy="{_f(at.y(float(y)))}" r="{radius:g}" fill="white" '
                   f'fill-opacity="0"><title>{_words(said)}</title></circle>')
    return out


def diagram_svg(fig: go.Figure, key: str, width: int = WIDTH) -> str:
    """``fig`` (a figure of boxes, paths, arrows, labels and hover points) as one SVG element, ``width`` px wide at
    most and scaled down to a narrower column; ``key`` names its arrowheads (unique on the page). Raises
    ``ValueError`` for anything else it holds."""
    spec = fig.to_plotly_json()
    layout = spec["layout"]
    key = re.sub(r"[^a-z0-9-]", "-", key.lower())
    for trace in spec["data"]:
        if trace.get("type", "scatter") != "scatter":
            raise ValueError(f"a {trace.get('type')} trace: this drawing knows scatter lines, text and hover points")
        if trace.get("visible", True) is not True:
            raise ValueError("a hidden trace: this drawing draws every trace it is given")
    if layout.get("annotations") or (layout.get("title") or {}).get("text"):
        raise ValueError("annotations or a title: this drawing writes labels from text traces only")
    if not all(isinstance(layout.get(k), dict) and "range" in layout[k] for k in ("xaxis", "yaxis")) or \
            "height" not in layout:
        raise ValueError("a diagram is drawn at its layout's height over its axes' ranges: this figure sets none")
    at = _Place(layout, width)
    height = _number(layout["height"])
    heads: dict[str, str] = {}
    below: list[str] = []
    above: list[str] = []
    for shape in layout.get("shapes") or ():
        (below if shape.get("layer") == "below" else above).append(_shape(shape, at))
    body, hovers = [], []
    for trace in spec["data"]:
        mode = str(trace.get("mode") or "")
        if "lines" in mode:
            body += _arrows(trace, at, heads, key)
        elif mode == "text":
            body += _texts(trace, at)
        elif mode == "markers" and trace.get("hovertemplate") and trace.get("customdata") is not None:
            hovers += _hovers(trace, at)
        else:
            raise ValueError(f"a scatter trace of mode {mode!r} this drawing does not know")
    background = _colour(layout.get("plot_bgcolor"), "white")
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height:g}" width="100%" '
            f'style="max-width: {width}px; height: auto; display: block" font-family="\'Source Sans Pro\', '
            f'\'Source Sans 3\', sans-serif" role="img">'
            + "<defs>" + "".join(f'<marker id="{name}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                                 f'markerHeight="7" orient="auto"><path d="M 0 0 L 10 5 L 0 10 z" fill="{colour}"/>'
                                 "</marker>" for colour, name in heads.items()) + "</defs>"
            f'<rect x="0" y="0" width="{width}" height="{height:g}" fill="{background}"/>'
            + "".join(below) + "".join(body) + "".join(above) + "".join(hovers) + "</svg>")
    # one line: a line break would end the HTML block st.markdown shows it in (every text's breaks are references)
    return svg.replace("\r", " ").replace("\n", " ")
