"""transformers' cache classes drawn from a run (``tracer.CacheClassRun``): for each class the figure of what it
does to the rows — a dynamic cache's growth, a static cache's reserved slots filling, a sliding window's dropped or
overwritten positions, an fp8 cache's error per row, the device each offloaded layer lives on between uses — and
one takeaway sentence built from the run's numbers."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from gpt_shape_tracer.figures.palette import ACCENT, ALARM, MASKED, NEUTRAL
from gpt_shape_tracer.figures.plot import figure, fitted
from gpt_shape_tracer.tracer import CacheClassRun

# a position's state in a layer at a step (the map the static and sliding figures draw)
POSITION_STATES = ("not yet written", "held", "reserved, free", "dropped", "overwritten", "never kept")
STATE_COLOURS = ("#ffffff", ACCENT, "#e8eef7", MASKED, ALARM, "#bdbdbd")


def position_states(run: CacheClassRun, layer: int = 0) -> list[list[int]]:
    """``[step][slot]``: the state (index into ``POSITION_STATES``) of every position 0 … the last one written,
    then of a static layer's free slots, in ``layer`` after each step's forward."""
    last = run.steps[-1].layers[layer]
    width = max(last.seen, max(s.layers[layer].reserved for s in run.steps))
    gone: dict[int, int] = {}  # position -> its state once it left the layer
    rows = []
    for s in run.steps:
        for e in s.events:
            if e.kind in ("drop", "overwrite") and e.layer in (None, layer):
                state = "never kept" if "never kept" in e.detail else ("dropped" if e.kind == "drop" else "overwritten")
                for p in e.indices:
                    gone[p] = POSITION_STATES.index(state)
        h = s.layers[layer]
        row = []
        for p in range(width):
            if p < h.first_held:
                row.append(gone.get(p, POSITION_STATES.index("dropped")))
            elif p < h.seen:
                row.append(POSITION_STATES.index("held"))
            elif p < h.first_held + h.reserved and h.reserved > h.held:
                row.append(POSITION_STATES.index("reserved, free"))
            else:
                row.append(POSITION_STATES.index("not yet written"))
        rows.append(row)
    return rows


def _state_heatmap(run: CacheClassRun, layer: int, title: str) -> go.Figure:
    states = position_states(run, layer)
    n = len(POSITION_STATES)
    scale = []
    for i, colour in enumerate(STATE_COLOURS):
        scale += [[i / n, colour], [(i + 1) / n, colour]]
    words = [[POSITION_STATES[v] for v in row] for row in states]
    fig = figure(go.Heatmap(z=states, zmin=0, zmax=n, colorscale=scale, showscale=False, customdata=words, xgap=1,
                            ygap=1, hovertemplate="after step %{y}, position %{x}: %{customdata}<extra></extra>"))
    for name, colour in zip(POSITION_STATES, STATE_COLOURS):  # the legend: one entry per state that occurs
        if any(POSITION_STATES.index(name) in row for row in states):
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                     marker={"size": 10, "symbol": "square", "color": colour,
                                             "line": {"width": 1, "color": "#999"}}))
    fig.update_layout(title_text=title, height=max(260, 110 + 26 * len(states)), legend={"orientation": "h", "y": -0.3},
                      margin={"t": 50, "l": 10, "r": 10, "b": 80})
    fig.update_xaxes(title_text="position (a static layer: its slots past the last written)", dtick=1)
    fig.update_yaxes(title_text="after step", autorange="reversed", dtick=1)
    return fig


def _growth(run: CacheClassRun) -> go.Figure:
    steps = [s.step for s in run.steps]
    fig = figure(go.Bar(x=steps, y=[s.layers[0].held for s in run.steps], marker_color=NEUTRAL, name="rows held",
                        hovertemplate="after step %{x}: %{y} rows a layer<extra></extra>"))
    fig.add_trace(go.Scatter(x=steps, y=[s.nbytes for s in run.steps], yaxis="y2", mode="lines+markers",
                             line={"color": ACCENT}, name="bytes, all layers",
                             hovertemplate="after step %{x}: %{y:,} B<extra></extra>"))
    fig.update_layout(title_text=f"{run.class_name}: rows held per layer, one more each step",
                      yaxis2={"overlaying": "y", "side": "right", "title": {"text": "bytes"}, "showgrid": False},
                      legend={"orientation": "h", "y": -0.25}, height=320)
    fig.update_xaxes(title_text="step (0: the prefill)", dtick=1)
    fig.update_yaxes(title_text="rows held")
    return fig


def _fp8_errors(run: CacheClassRun) -> go.Figure:
    last = run.steps[-1]
    fig = figure()
    for h in last.layers:
        fig.add_trace(go.Scatter(x=list(range(h.first_held, h.seen)), y=list(h.row_error), mode="lines+markers",
                                 name=f"layer {h.layer}",
                                 hovertemplate=f"layer {h.layer}, position %{{x}}: max |error| %{{y:.3g}}"
                                               "<extra></extra>"))
        if h.overflowed:  # past the range the prefill's scale gave: clipped (CPU) or NaN (CUDA)
            errs = {h.first_held + i: e for i, e in enumerate(h.row_error)}
            fig.add_trace(go.Scatter(x=list(h.overflowed), y=[errs[p] if math.isfinite(errs[p]) else 0.0
                                                               for p in h.overflowed], mode="markers",
                                     name=f"layer {h.layer}: past the frozen scale's range",
                                     marker={"symbol": "x", "size": 12, "color": ALARM}))
    fig.update_layout(title_text="fp8: each stored row's largest |dequantized − full precision| (K and V)",
                      legend={"orientation": "h", "y": -0.25}, height=320)
    fig.update_xaxes(title_text="position", dtick=1)
    fig.update_yaxes(title_text="max |error| of the row", rangemode="tozero")
    return fig


def _devices(run: CacheClassRun) -> go.Figure:
    devices = sorted({h.device for s in run.steps for h in s.layers})
    z = [[devices.index(h.device) for s in run.steps] for h in run.steps[0].layers]
    colours = [ACCENT if d == run.device else NEUTRAL for d in devices]
    scale = [[0.0, colours[0]], [1.0, colours[-1]]] if len(devices) > 1 else [[0.0, colours[0]], [1.0, colours[0]]]
    text = [[run.steps[j].layers[i].device for j in range(len(run.steps))] for i in range(len(z))]
    fig = figure(go.Heatmap(z=z, zmin=0, zmax=max(1, len(devices) - 1), colorscale=scale, showscale=False,
                            text=text, texttemplate="%{text}", xgap=2, ygap=2,
                            hovertemplate="layer %{y} after step %{x}: on %{text}<extra></extra>"))
    where = "nothing moved: " if len(devices) == 1 else ""
    fig.update_layout(title_text=f"where each layer's K and V live between uses ({where}computing on {run.device})",
                      height=max(220, 110 + 34 * len(z)))
    fig.update_xaxes(title_text="after step", dtick=1)
    fig.update_yaxes(title_text="layer", autorange="reversed", dtick=1)
    return fig


@fitted
def cache_class_figure(run: CacheClassRun, layer: int = 0) -> go.Figure:
    """The figure of ``run``'s class: static and sliding, the map of positions (held, reserved and free, dropped,
    overwritten) in ``layer`` after each step; fp8, the error of every stored row; offloaded, each layer's device
    between uses; dynamic, the rows held and bytes per step."""
    if not run.steps:
        raise ValueError("the run has no step")
    if run.cache == "static":
        return _state_heatmap(run, layer, f"{run.class_name}, layer {layer}: rows filled vs reserved"
                              + (" (a sliding layer: the window's slots, overwritten once full)"
                                 if run.steps[-1].layers[layer].kind.startswith("StaticSliding") else ""))
    if run.cache == "sliding":
        return _state_heatmap(run, layer, f"{run.steps[-1].layers[layer].kind}, layer {layer}: the positions held "
                              "and those dropped out of the window")
    if run.cache == "quantized-fp8":
        return _fp8_errors(run)
    if run.cache == "offloaded":
        return _devices(run)
    return _growth(run)


def _b(n: int) -> str:
    return f"{n:,} B"


def cache_class_takeaway(run: CacheClassRun) -> tuple[str, list[tuple[str, str]]]:
    """One sentence from ``run``'s numbers saying what its class did to the cache, and the metrics beside it."""
    if not run.steps:
        raise ValueError("the run has no step")
    first, last = run.steps[0], run.steps[-1]
    n, L = len(run.steps), len(last.layers)
    worst = max(s.max_abs_delta for s in run.steps)
    held, seen = last.layers[0].held, last.layers[0].seen
    metrics = [("forwards", str(n)), ("cache after the last", _b(last.nbytes)),
               ("full dynamic cache", _b(last.reference_bytes))]
    same = ""
    if all(s.token == s.reference_token for s in run.steps) and worst < 1e-3:
        same = (" Its logits equal the full-precision dynamic cache's " +
                ("exactly." if worst == 0 else f"within {worst:.2g}."))
    if run.cache == "static":
        sliding = [h for h in last.layers if h.kind.startswith("StaticSliding")]
        reserved = sum(h.reserved for h in last.layers)
        filled = sum(h.held for h in last.layers)
        sentence = (f"{run.class_name} reserved {reserved} rows over its {L} layers ({_b(first.nbytes)}) at the "
                    f"prefill and holds {filled} of them after {n} forward(s) ({filled / reserved:.0%} full); its "
                    f"bytes never changed, while the dynamic cache grew from {_b(first.reference_bytes)} to "
                    f"{_b(last.reference_bytes)}.")
        if sliding:
            over = sum(len(e.indices) for e in run.events if e.kind == "overwrite" and e.layer in (None, 0))
            sentence += (f" {len(sliding)} of its layers slide: they reserve the window of {sliding[0].reserved} "
                         f"and overwrote {over} slot(s) of layer {sliding[0].layer} as positions left it.")
        metrics.append(("rows filled / reserved", f"{filled} / {reserved}"))
        return sentence + same, metrics
    if run.cache == "sliding":
        drops = [e for e in run.events if e.kind == "drop" and e.layer in (None, 0)]
        dropped = sum(len(e.indices) for e in drops)
        never = sum(len(e.indices) for e in drops if "never kept" in e.detail)
        sentence = (f"{last.layers[0].kind} keeps only the last {held} of the {seen} positions seen: "
                    f"{dropped - never} position(s) dropped as they left the window over {n} forward(s)"
                    + (f" and {never} of the prompt's never kept" if never else "")
                    + f", so it holds {_b(last.nbytes)} against {_b(last.reference_bytes)} for a cache that keeps "
                    f"every row ({last.nbytes / last.reference_bytes:.0%}).")
        metrics.append(("positions dropped (layer 0)", str(dropped)))
        return sentence + same, metrics
    if run.cache == "quantized-fp8":
        errors = [(e, h.layer, h.first_held + i) for h in last.layers for i, e in enumerate(h.row_error)]
        finite = [x for x in errors if math.isfinite(x[0])]
        err, at_layer, at_pos = max(finite) if finite else (0.0, 0, 0)
        nan_rows = len(errors) - len(finite)
        over = sum(len(h.overflowed) for h in last.layers)
        nan_steps = sum(1 for s in run.steps if not math.isfinite(s.max_abs_delta))
        worst = max((s.max_abs_delta for s in run.steps if math.isfinite(s.max_abs_delta)), default=0.0)
        changed = sum(1 for s in run.steps if s.token != s.reference_token)
        sentence = (f"{run.class_name} stores K and V as {last.layers[0].dtype}, 1 byte a number and one scale per "
                    f"tensor: {_b(last.nbytes)} against {_b(last.reference_bytes)} at full precision "
                    f"({last.nbytes / last.reference_bytes:.0%}). The largest error of a stored row is {err:.3g} "
                    f"(layer {at_layer}, position {at_pos}), and the logits differ from the full-precision cache's "
                    f"by up to {worst:.3g}: ")
        sentence += (f"each of the {n} forward(s) still chose the same token." if not changed else
                     f"{changed} of {n} forward(s) would have chosen another token.")
        if over:
            sentence += (f" {over} stored row(s) held values past the range the prefill's frozen scale gives "
                         "(|x| > 448 · scale): the cast clips them on the CPU and makes them NaN on CUDA"
                         + (f"; {nan_rows} row(s) read back as NaN here." if nan_rows else "."))
        if nan_steps:
            sentence += f" {nan_steps} of {n} forward(s) gave NaN logits."
        metrics += [("largest row error", f"{err:.3g}"), ("largest |Δ logits|", f"{worst:.3g}")]
        return sentence, metrics
    if run.cache == "offloaded":
        away = [h.layer for h in last.layers if h.device != run.device]
        if run.note:
            sentence = (f"The model computes on {run.device}, where its layers' rows already live, so nothing moved: "
                        f"all {L} layers stayed on {run.device} at every one of the {n} forward(s) "
                        f"({_b(last.nbytes)}), the same as the dynamic cache.")
        else:
            moves = sum(1 for e in run.events if e.kind == "move")
            sentence = (f"After the last forward {len(away)} of {L} layers live on the CPU between uses "
                        f"({moves} move event(s) over {n} forward(s)); the one kept on {run.device} is the next to "
                        "be used, fetched back ahead of time.")
        metrics.append(("layers off the compute device", f"{len(away)} of {L}"))
        return sentence + same, metrics
    sentence = (f"{run.class_name} grew from {first.layers[0].held} to {held} positions over {n} forward(s), one "
                f"row a step after the prefill: {_b(last.nbytes)} after the last, "
                f"{last.nbytes // max(1, held * L):,} B a position in each of its {L} layers.")
    return sentence + same, metrics


__all__ = ["POSITION_STATES", "STATE_COLOURS", "cache_class_figure", "cache_class_takeaway", "position_states"]
