"""Heatmap panels drawn on a canvas: the drawing spec of a figure of heatmaps side by side (the attention Stages),
written from the same plotly figure the report and the notebook show, for a page that redraws it on every Step.

Why: Streamlit 1.67 mounts a plotly chart afresh whenever its figure changes and plots it twice (once before its
column's width is measured, hidden, once after), and the Stages figure's four heatmaps with their tick labels,
colour bars and titles cost the browser's main thread about 0.1 s a Step on the machine ``docs/benchmarks.md`` names.
The same panels drawn on a canvas by ``gui/panels.js`` (one component that stays mounted and redraws) cost 0.01 s.

What is drawn, and nothing else (anything else raises ``ValueError``: such a figure stays a plotly chart): heatmap
traces on category axes, one per panel, a reversed y axis (row 0 on top), each with its colour scale (plotly's limits:
``zmin``/``zmax``, else the data's, made symmetric about ``zmid``), colour bar, cell numbers (``texttemplate``
"%{text}"), and hover "row … column … value"; a grey layer under a panel's missing cells (``heatmap.masked_layer``);
the axes' tick labels, titles and ``tickangle``; the figure's title and its annotations (the panels' titles, a
"not formed" note), written in plotly's markup (``<b>``, ``<i>``, ``<br>``, ``<span style='font-size:…'>``,
``<span style='color:…'>``), which becomes runs of plain text: the page writes every label as text, never as HTML.
"""

from __future__ import annotations

import base64
import html
import math
import re
from typing import Any

import numpy as np
import plotly.colors
import plotly.graph_objects as go

from gpt_shape_tracer.figures.plot import AXIS, FONT, TEMPLATE, markup_runs

FONT_SIZE = float(FONT["size"])  # type: ignore[arg-type]
MUTED = str(AXIS["tickfont"]["color"])  # type: ignore[index]  # tick labels' colour, as the template's axes
HOVER = "row %{y}<br>column %{x}<br>%{z:.4g}<extra></extra>"  # the one hover figures.heatmap writes


def runs(text: str) -> list[list[dict]]:
    """Plotly's label markup as lines of runs (``plot.markup_runs``); a tag outside its subset raises
    ``ValueError``: the canvas writes text, never markup."""
    return markup_runs(text, strict=True)


def _colours(scale: Any) -> list[list]:
    """A trace's colour scale as ``[[position, "rgb(r, g, b)"], …]`` (a named scale resolved as plotly does)."""
    stops = plotly.colors.get_colorscale(scale) if isinstance(scale, str) else [list(s) for s in scale]
    out = []
    for position, colour in stops:
        if isinstance(colour, str) and colour.startswith("#"):
            colour = "rgb({}, {}, {})".format(*plotly.colors.hex_to_rgb(colour))
        if not (isinstance(colour, str) and re.fullmatch(r"rgba?\(\s*[0-9.]+\s*,\s*[0-9.]+\s*,\s*[0-9.]+.*\)", colour)):
            raise ValueError(f"a colour this drawing does not read: {colour!r} (it reads #rrggbb and rgb(…))")
        out.append([float(position), colour])
    return out


def limits(z: np.ndarray, zmin: float | None, zmax: float | None, zmid: float | None,
           zauto: bool | None = None) -> tuple[float, float]:
    """The values at the two ends of a heatmap's colour scale, as plotly sets them: ``zmin`` and ``zmax`` where both
    are given (and ``zauto`` is not True), else the finite data's — made symmetric about ``zmid`` where given; equal
    ends ±0.5."""
    if zmin is not None and zmax is not None and zauto is not True:
        lo, hi = float(zmin), float(zmax)
    else:
        finite = z[np.isfinite(z)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        if zmid is not None:
            half = max(hi - zmid, zmid - lo)
            lo, hi = zmid - half, zmid + half
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    return lo, hi


def nice_ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """The ticks plotly puts on a colour bar of ``nticks = most`` over [lo, hi]: a spacing of 2, 5 or 10 × 10^k, the
    first above (hi − lo) / most in those units (plotly's ``autoTicks`` and ``roundUp``, which goes to the next value
    even from an equal one: 0 … 1 gets 0, 0.5, 1), every multiple of it within the range."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    rough = (hi - lo) / max(1, most)
    base = 10 ** math.floor(math.log(rough) / math.log(10))
    step = base * next((m for m in (2, 5) if m > rough / base), 10)
    first = math.ceil(lo / step - 1e-9)
    return [round(k * step, 12) for k in range(first, math.floor(hi / step + 1e-9) + 1)]


SI_PREFIXES = ("f", "p", "n", "μ", "m", "", "k", "M", "G", "T")
SUPERSCRIPT = str.maketrans("0123456789−", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


def _js_string(v: float) -> str:
    """``String(v)`` in JavaScript for the mantissas plotly writes (Python's shortest repr, without its ``.0``)."""
    text = repr(float(v))
    return text[:-2] if text.endswith(".0") else text


def tick_label(value: float, ticks: list[float], lo: float, hi: float) -> str:
    """A colour bar tick's label as plotly.js writes it (``numFormat`` with its default exponent format "B"): rounded
    to two digits past the spacing's largest, a common power of ten taken out when the range's largest end is past
    10³ or below 10⁻³ — an SI prefix (k, M, B for 10⁹, T; m, μ, n, p, f), ×10ⁿ beyond them —, a minus sign (−)."""
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    tick_round = 2 - math.floor(math.log(step) / math.log(10) + 0.01)
    biggest = max(abs(lo), abs(hi))
    range_exp = math.floor(math.log(biggest) / math.log(10) + 0.01) if biggest > 0 else 0
    beyond = range_exp > 14 or range_exp < -15
    # (range_exp - 1) / 3 is never halfway between two integers, so Python's round is JavaScript's Math.round here
    exponent = (3 * round((range_exp - 1) / 3) if not beyond else range_exp) if abs(range_exp) > 3 else 0
    negative = value < 0
    v = abs(value)
    e = 10 ** -tick_round / 2
    if v < e:
        return "0"
    v += e
    if exponent:
        v *= 10 ** -exponent
        tick_round += exponent
    if tick_round == 0:
        text = str(math.floor(v))
    elif tick_round < 0:
        text = str(math.floor(v + 0.5))  # Math.round
        text = text[:len(text) + tick_round] + "0" * -tick_round
    else:
        text = _js_string(v)
        dot = text.find(".") + 1
        if dot:
            text = re.sub(r"\.?0+$", "", text[:dot + tick_round])
    if exponent:
        if beyond:  # past the SI prefixes: plotly writes a power of ten
            text += "×10" + (f"−{-exponent}" if exponent < 0 else str(exponent)).translate(SUPERSCRIPT)
        elif exponent == 9:
            text += "B"
        else:
            text += SI_PREFIXES[exponent // 3 + 5]
    return ("−" if negative else "") + text


def _array(value: Any) -> Any:
    """plotly's JSON form of a numpy array (a base64 typed array: ``{"dtype", "bdata", "shape"}``) as the array."""
    if isinstance(value, dict) and "bdata" in value:
        out = np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
        shape = value.get("shape")
        return out.reshape([int(v) for v in str(shape).split(",")]) if shape else out
    return value


def _labels(values: Any) -> list[str]:
    """Axis labels as a reader sees them: ``heatmap.grid`` escapes a token's <, > and & for plotly's markup, which
    plotly shows as the characters; the canvas writes text, so it is handed the characters."""
    values = _array(values)
    return [html.unescape(str(v)) for v in (values.tolist() if isinstance(values, np.ndarray) else list(values))]


def _matrix(z: Any) -> np.ndarray:
    z = _array(z)
    return np.asarray(z, dtype=np.float64).reshape(len(z), -1) if len(z) else np.zeros((0, 0))


def _ticks(letter: str, axis: dict, labels: list[str], where: dict, shown: bool) -> dict:
    """An axis's ticks as (cell index, label) pairs: the tick values that name a cell, each with its own text."""
    values = list(_array(axis.get("tickvals", list(where))))
    texts = _labels(axis.get("ticktext", values))
    pairs = [(where[v], t) for v, t in zip(values, texts) if v in where] if shown else []
    return {f"{letter}ticks": [i for i, _ in pairs], f"{letter}ticktext": [t for _, t in pairs]}


def _outline(shape: dict, traces: list[dict]) -> dict:
    """A rectangle outlined over a panel's cells (History's step row, the KV cache's new row), in cell units: a
    category axis puts cell j at j, so [j − 0.5, j + 0.5] is its extent. Anything else raises ``ValueError``."""
    xref, yref = shape.get("xref", "x"), shape.get("yref", "y")
    panel = next((k for k, t in enumerate(traces) if t.get("xaxis", "x") == xref and t.get("yaxis", "y") == yref), None)
    fill = shape.get("fillcolor")
    line = shape.get("line") or {}
    if shape.get("type") != "rect" or panel is None or (fill and fill not in ("rgba(0,0,0,0)", "transparent")) \
            or line.get("dash", "solid") != "solid" or shape.get("layer") == "below":
        raise ValueError("a shape other than an outlined rectangle over a panel's cells: this drawing does not draw it")
    return {"panel": panel, "x0": float(shape["x0"]), "x1": float(shape["x1"]), "y0": float(shape["y0"]),
            "y1": float(shape["y1"]), "colour": _colours([[0, line.get("color") or "#444"]])[0][1],
            "width": float(line.get("width", 2))}


def _axis(layout: dict, name: str) -> dict:
    axis = layout.get(name) or {}
    if axis.get("type") != "category":
        raise ValueError(f"{name} is not a category axis: this drawing places cells by their labels")
    return axis


def _bar(trace: dict, lo: float, hi: float, layout: dict) -> dict | None:
    if trace.get("showscale") is False:
        return None
    bar = trace.get("colorbar") or {}
    title = (bar.get("title") or {}).get("text") or ""
    if bar.get("tickvals") is not None:
        ticks = [float(v) for v in bar["tickvals"]]
        labels = [str(v) for v in bar.get("ticktext") or ticks]
    else:
        ticks = nice_ticks(lo, hi, int(bar.get("nticks") or 5))
        labels = [tick_label(v, ticks, lo, hi) for v in ticks]
    slack = 1e-9 * abs(hi - lo)
    inside = [(v, label) for v, label in zip(ticks, labels) if lo - slack <= v <= hi + slack]
    return {"x": float(bar.get("x", 1.02)), "len": float(bar.get("len", 1.0)),
            "thickness": float(bar.get("thickness", 30)), "title": runs(title), "ticks": [v for v, _ in inside],
            "labels": [label for _, label in inside], "size": _size(bar.get("tickfont"))}


def _size(font: dict | None) -> float:
    """A font's size, the template's where it sets none."""
    return float((font or {}).get("size") or FONT_SIZE)


def panels_spec(fig: go.Figure) -> dict:
    """``fig`` (heatmaps side by side, from ``figures.heatmap``) as the JSON-ready spec ``gui/panels.js`` draws.
    Raises ``ValueError`` for anything it holds that the drawing does not draw."""
    spec = fig.to_plotly_json()
    layout = spec["layout"]
    if "height" not in layout:
        raise ValueError("a panels drawing is drawn at its layout's height: this figure sets none")
    if layout.get("images"):
        raise ValueError("layout images: this drawing draws heatmaps, their labels, outlines and annotations only")
    masked: dict[str, str] = {}
    values: list[dict] = []
    for trace in spec["data"]:
        if trace.get("type") != "heatmap":
            raise ValueError(f"a {trace.get('type')} trace: this drawing draws heatmaps")
        if trace.get("visible", True) is not True:
            raise ValueError("a hidden trace: this drawing draws every trace it is given")
        if trace.get("hoverinfo") == "skip" and trace.get("showscale") is False:  # heatmap.masked_layer
            masked[trace.get("xaxis", "x")] = _colours(trace["colorscale"])[0][1]
        else:
            values.append(trace)
    panels = []
    for trace in values:
        xname, yname = trace.get("xaxis", "x"), trace.get("yaxis", "y")
        xaxis, yaxis = _axis(layout, "xaxis" + xname[1:]), _axis(layout, "yaxis" + yname[1:])
        if yaxis.get("autorange") != "reversed":
            raise ValueError("a y axis not reversed: this drawing puts the first row on top")
        if trace.get("hovertemplate", HOVER) != HOVER or trace.get("coloraxis"):
            raise ValueError("a hover or a shared colour axis this drawing does not write")
        z = _matrix(trace["z"])
        xs, ys = _labels(trace["x"]), _labels(trace["y"])
        if z.shape != (len(ys), len(xs)):
            raise ValueError(f"a heatmap of {z.shape} cells with {len(ys)} × {len(xs)} labels")
        lo, hi = limits(z, trace.get("zmin"), trace.get("zmax"), trace.get("zmid"), trace.get("zauto"))
        column = {label: i for i, label in enumerate(_array(trace["x"]))}
        row = {label: i for i, label in enumerate(_array(trace["y"]))}
        text = trace.get("text") if trace.get("texttemplate") == "%{text}" else None
        panels.append({
            "domain": [float(v) for v in xaxis.get("domain", (0, 1))],
            "ydomain": [float(v) for v in yaxis.get("domain", (0, 1))],
            "z": [[v if math.isfinite(v) else None for v in r] for r in z.tolist()],
            "x": xs, "y": ys,
            **_ticks("x", xaxis, xs, column, True), **_ticks("y", yaxis, ys, row, yaxis.get("showticklabels", True)),
            "tickangle": float(xaxis.get("tickangle", 0) or 0),
            "xtitle": ((xaxis.get("title") or {}).get("text") or ""),
            "ytitle": ((yaxis.get("title") or {}).get("text") or ""),
            "colours": _colours(trace["colorscale"]), "zmin": lo, "zmax": hi,
            "text": [[str(v) for v in r] for r in text] if text is not None else None,
            "text_size": _size(trace.get("textfont")),
            "masked": masked.get(xname),
            "bar": _bar(trace, lo, hi, layout),
        })
    # each panel's name, for the hover that reads a cell in every panel: its title's first line (a subplot title sits
    # centred over its panel's domain, above it)
    # A panel's title wraps at its words within its panel's width (wide_as, a fraction of the plot's width): a shapes
    # line of four panels ran into the colour bar title beside the panel at 1280 px
    titles: dict[int, float] = {}
    for panel in panels:
        middle, top = sum(panel["domain"]) / 2, panel["ydomain"][1]
        for k, note in enumerate(layout.get("annotations") or ()):
            if abs(float(note.get("x", -1)) - middle) < 1e-6 and abs(float(note.get("y", -1)) - top) < 1e-6 \
                    and note.get("yanchor") == "bottom":
                panel["name"] = "".join(run["t"] for run in runs(note.get("text", ""))[0]).strip()
                titles[k] = panel["domain"][1] - panel["domain"][0]
                break
        else:
            panel["name"] = ""
    outlines = [_outline(shape, values) for shape in layout.get("shapes") or ()]
    title = layout.get("title") or {}
    notes = []
    for k, note in enumerate(layout.get("annotations") or ()):
        if note.get("xref") != "paper" or note.get("yref") != "paper" or note.get("showarrow", True):
            raise ValueError("an annotation not placed on the page without an arrow: this drawing does not write it")
        notes.append({"x": float(note["x"]), "y": float(note["y"]), "xanchor": note.get("xanchor", "center"),
                      "yanchor": note.get("yanchor", "middle"), "lines": runs(note.get("text", "")),
                      "size": _size(note.get("font")), "wide_as": titles.get(k)})
    margin = layout.get("margin") or {}
    return {
        "height": float(layout["height"]),
        "margin": {k: float(margin.get(k, 80 if k != "t" else 100)) for k in ("l", "r", "t", "b")},
        "font": FONT["family"], "colour": FONT["color"], "muted": MUTED,
        "background": layout.get("plot_bgcolor") or "white",
        "title": {"lines": runs(title.get("text") or ""), "y": float(title.get("y", 1.0)),
                  "size": float((title.get("font") or {}).get("size") or TEMPLATE.layout.title.font.size)},
        "panels": panels, "notes": notes, "outlines": outlines,
    }
