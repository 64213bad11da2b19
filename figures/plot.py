"""New plotly figures, checked by plotly property by property only where a test asks for it.

plotly validates every layout property as it is set; for the shape-flow figure (40 shapes and annotations)
that was 46 of its 59 ms to build, and a Step on the Shapes tab builds it and the reshape strip again.
The figures are built from fixed code, so the app skips the check. ``tests/figures/test_figures.py`` sets
``GPT_TRACER_VALIDATE_FIGURES=1``: there every figure is built checked (a misspelt property raises), and
one test builds each figure both ways and asserts the browser is sent the same JSON — the checks also
normalise (an axis title given as text becomes ``{"text": …}``, the only form plotly.js 3 reads).
"""

from __future__ import annotations

import functools
import html
import math
import os
import re

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

VALIDATE_ENV = "GPT_TRACER_VALIDATE_FIGURES"


def validating() -> bool:
    return os.environ.get(VALIDATE_ENV) == "1"


# The look of every figure, set here rather than by Streamlit's chart theme: the app draws charts with
# theme=None, because Streamlit re-themes a new chart after drawing it, which costs the browser one more full
# plot of every chart on every Step (3 plots per new chart instead of 2, V8's call counts; docs/benchmarks.md).
# Small on purpose: a figure carries its template to the browser (plotly's default one is 7 KB of JSON).
FONT = {"family": '"Source Sans", "Source Sans Pro", sans-serif', "size": 12, "color": "#31333F"}
AXIS = {"gridcolor": "#e6eaf1", "zerolinecolor": "#d5dae5", "linecolor": "#d5dae5",
        "title": {"standoff": 8, "font": {"color": "#808495"}}, "tickfont": {"color": "#808495"}}
TEMPLATE = go.layout.Template(layout={
    "font": FONT, "paper_bgcolor": "white", "plot_bgcolor": "white",
    "colorway": ["#0068c9", "#83c9ff", "#ff2b2b", "#ffabab", "#29b09d", "#7defa1", "#ff8700", "#ffd16a",
                 "#6d3fc0", "#d5dae5"],  # Streamlit's categorical colours
    "title": {"font": {"size": 14, "weight": 600}, "x": 0, "xanchor": "left", "xref": "paper"},
    "xaxis": AXIS, "yaxis": AXIS, "legend": {"font": {"size": 12}}, "hoverlabel": {"font": {"family": FONT["family"]}},
})


def figure(data=None, **kwargs) -> go.Figure:
    """``go.Figure(data, **kwargs)`` with the app's template, validated only when
    ``GPT_TRACER_VALIDATE_FIGURES=1``."""
    fig = go.Figure(data, _validate=validating(), **kwargs)
    fig.layout.template = TEMPLATE
    return fig


def set_layout(fig: go.Figure, changes: dict) -> go.Figure:
    """``fig.update_layout(changes)``, done by assigning each top-level property its merged value. plotly's
    ``update_layout`` runs as a batched relayout that parses every key path and checks it against the figure's
    property tree: 3–6 ms a call on a four-panel figure, 26.6 ms of the attention Stages figure's 41 ms build; an
    assigned property ~0.15 ms (a four-panel figure's 12 axis properties: 1.7 ms, against 15–25 ms updated). A dict
    is merged into the property's current value key by key, nested dicts too, as ``update_layout`` merges (``merged``);
    anything else (lists included) replaces it. Takes no ``title_font_size``-style shorthands: nested dicts only."""
    layout = fig.layout
    for key, value in changes.items():
        if isinstance(value, dict):
            current = layout[key]
            value = merged(current.to_plotly_json() if current is not None else {}, value)
        layout[key] = value
    return fig


def merged(old: dict, new: dict) -> dict:
    """``new`` merged into ``old`` key by key, nested dicts too (as plotly's updates merge); a new dict. A value of
    None takes the key out, as an update's None unsets a property (an unchecked figure would keep it as null)."""
    out = dict(old)
    for key, value in new.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def subplots(**kwargs) -> go.Figure:
    """``make_subplots(**kwargs)`` on a figure from ``figure()``."""
    return make_subplots(figure=figure(), **kwargs)


# -- plotly's label markup, read by the drawings that stand in for plotly (figures/svg.py, figures/panels.py) --------
MARKUP = re.compile(r"(<br>|<b>|</b>|<i>|</i>|<span style='[^']*'>|</span>)")
CSS_COLOUR = re.compile(r"#[0-9a-fA-F]{3,8}|[a-zA-Z]{3,20}|rgba?\([0-9.,% ]{5,40}\)")
_PX = re.compile(r"(\d+(?:\.\d+)?)px")


def markup_runs(text: str, strict: bool = False) -> list[list[dict]]:
    """Plotly's label markup (<br>, <b>, <i>, <span style='color:…; font-size:…px'>) as lines of runs
    ``{"t": text, "b": bold, "i": italic, "s": size px or None, "c": colour or None}``; bold, italic, size and colour
    carry over a ``<br>`` as plotly's do. A span's colour that does not read as one (#rrggbb, a name, rgb(…)) is
    None: the label's own is drawn. Any other tag stays text, or raises ``ValueError`` where ``strict``."""
    lines: list[list[dict]] = [[]]
    bold = italic = False
    spans: list[tuple[float | None, str | None]] = []
    for part in MARKUP.split(str(text)):
        if part == "<br>":
            lines.append([])
        elif part in ("<b>", "</b>"):
            bold = part == "<b>"
        elif part in ("<i>", "</i>"):
            italic = part == "<i>"
        elif part == "</span>":
            if spans:
                spans.pop()
        elif part.startswith("<span style='"):
            size, colour = spans[-1] if spans else (None, None)
            for prop, _, value in (p.partition(":") for p in part[len("<span style='"):-2].split(";")):
                value = value.strip()
                if prop.strip() == "color":
                    colour = value if CSS_COLOUR.fullmatch(value) else None
                elif prop.strip() == "font-size" and (px := _PX.fullmatch(value)) is not None:
                    size = float(px.group(1))
            spans.append((size, colour))
        elif part:
            if strict and re.search(r"<[a-zA-Z/]", part):
                raise ValueError(f"markup this drawing does not write: {part!r}")
            size, colour = spans[-1] if spans else (None, None)
            lines[-1].append({"t": html.unescape(part), "b": bold, "i": italic, "s": size, "c": colour})
    return lines


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


# -- margins -------------------------------------------------------------------------------------------
# plotly's axis automargin measures the drawn tick labels and then plots the whole figure again with the
# new margins: the attention stages took 56 ms to draw with it and 36 without. So no axis uses it; each
# figure's margins are fitted here, before it leaves Python, from the labels and titles it will draw.
CHAR_PX = 0.6  # a character of tick label, as a fraction of the font size (Source Sans is narrower)
TAG = re.compile(r"<[^>]+>")
PLOT_PX = 1100  # about how wide a chart is drawn in the app's main column, for positions given as fractions


def _label_px(text: str, size: float) -> float:
    return len(TAG.sub("", str(text))) * size * CHAR_PX


def _numeric_chars(values: list) -> int:
    """How wide plotly's tick labels of these numbers get: at most 3 significant digits and an SI suffix."""
    numbers = np.asarray([v for v in values if not isinstance(v, str)], dtype=np.float64)
    numbers = np.abs(numbers[np.isfinite(numbers)])
    if numbers.size == 0:
        return 2
    top = float(numbers.max())
    digits = 1 if top < 10 else (2 if top < 100 else 3)
    fraction = top < 10 and not bool(np.all(numbers == np.round(numbers)))
    return min(6, digits + (2 if fraction else 0) + (1 if top >= 1000 else 0) + 1)  # + a sign


def _trace_values(trace: dict, letter: str) -> list:
    values = trace.get(letter)
    if values is None:  # a heatmap without coordinates: indices up to its size
        z = trace.get("z")
        shape: tuple[int, ...] = np.shape(z) if z is not None else ()
        if len(shape) == 2:
            return [shape[1] - 1 if letter == "x" else shape[0] - 1]
        return []
    if isinstance(values, np.ndarray) and values.dtype.kind in "fiub":
        finite = values[np.isfinite(values)] if values.dtype.kind == "f" else values
        if finite.size == 0:
            return []
        whole = bool(np.all(finite == np.round(finite)))
        return [float(np.abs(finite).max())] + ([] if whole else [0.5])
    return list(values)


def _axis_labels(layout: dict, data: list[dict], name: str) -> tuple[list, bool]:
    """(the tick labels the axis ``name`` will draw or their numbers, whether they are text)."""
    axis = layout.get(name, {})
    if axis.get("ticktext") is not None:
        return list(axis["ticktext"]), True
    letter, suffix = name[0], name[5:]
    ref = letter + suffix
    values = [v for t in data if (t.get(f"{letter}axis") or letter) == ref for v in _trace_values(t, letter)]
    if axis.get("range") is not None:
        values += list(axis["range"])
    texts = [v for v in values if isinstance(v, str)]
    return (texts, True) if texts or axis.get("type") == "category" else (values, False)


def fit_margins(fig: go.Figure, pad: int = 6) -> go.Figure:
    """Widen ``fig``'s margins to hold the tick labels and titles of its outer axes (never narrows them)."""
    spec = fig.to_plotly_json()
    layout, data = spec.get("layout", {}), spec.get("data", [])
    margin = {k: layout.get("margin", {}).get(k, 10) for k in ("l", "r", "t", "b")}
    need = dict.fromkeys(margin, 0.0)
    for name, axis in layout.items():
        if not name.startswith(("xaxis", "yaxis")) or axis.get("visible") is False:
            continue
        letter = name[0]
        other = layout.get(("y" if letter == "x" else "x") + "axis" + str(axis.get("anchor", "")[1:]), {})
        domain = other.get("domain", [0, 1])
        size = (axis.get("tickfont") or {}).get("size", 12)
        labels, text = _axis_labels(layout, data, name)
        widest = max((_label_px(v, size) for v in labels), default=0) if text else None  # None: numbers
        if axis.get("showticklabels") is False:
            extent = 0.0
        elif letter == "y":
            extent = widest if widest is not None else _numeric_chars(labels) * size * CHAR_PX
        elif axis.get("tickangle"):  # rotated labels: their height is their width turned
            angle = math.radians(abs(float(axis["tickangle"])))
            extent = ((widest if widest is not None else _numeric_chars(labels) * size) * math.sin(angle)
                      + size * math.cos(angle))
        else:
            extent = size * 1.3
        title = (axis.get("title") or {}).get("text")
        if title:
            extent += 14 * 1.3 + (axis.get("title") or {}).get("standoff", 8)
        extent += 8  # the tick and its gap
        if letter == "y":
            right = axis.get("side") == "right"
            # a secondary axis on the right: make_subplots ends the plot at 0.94, room the labels overflow
            if (right and domain[1] >= 0.9) or (not right and domain[0] <= 0.01):
                need["r" if right else "l"] = max(need["r" if right else "l"], extent)
        else:
            top = axis.get("side") == "top"
            if (top and domain[1] >= 0.99) or (not top and domain[0] <= 0.01):
                need["t" if top else "b"] = max(need["t" if top else "b"], extent)
    # colour bars push the margins too (plotly measures them and plots again): their room is counted here,
    # and the push switched off, unless a legend needs one (its wrapping is plotly's to measure)
    listed = [t for t in data if t.get("showlegend") is not False]
    legend = (layout.get("showlegend") is not False and len(listed) > 1
              and any(t.get("type") != "heatmap" for t in listed))
    for t in data:
        if t.get("type") != "heatmap" or t.get("showscale") is False or t.get("coloraxis"):
            continue
        bar = t.get("colorbar") or {}
        x = bar.get("x", 1.02)
        if x < 1:
            continue
        size = (bar.get("tickfont") or {}).get("size", 12)
        ticks = [v for v in (t.get("zmin"), t.get("zmax")) if v is not None] or [-99.9]
        labels = bar.get("thickness", 30) + 2 * bar.get("xpad", 10) + 5 + _numeric_chars(ticks) * size * CHAR_PX
        title = _label_px(((bar.get("title") or {}).get("text")) or "", 12) + 2 * bar.get("xpad", 10)
        need["r"] = max(need["r"], (x - 1) * PLOT_PX + max(labels, title))
    fitted_margin = {k: max(margin[k], math.ceil(need[k]) + pad) if need[k] else margin[k] for k in margin}
    return set_layout(fig, {"margin": {**fitted_margin, **({} if legend else {"autoexpand": False})}})


def fitted(builder):
    """Decorates a figure builder: the margins of the figure it returns (itself, the first item of a tuple,
    or its ``.figure``) are fitted by ``fit_margins``."""
    @functools.wraps(builder)
    def build(*args, **kwargs):
        out = builder(*args, **kwargs)
        fig = out[0] if isinstance(out, tuple) else getattr(out, "figure", out)
        if isinstance(fig, go.Figure):
            fit_margins(fig)
        return out
    return build
