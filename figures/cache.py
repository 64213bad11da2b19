"""KV cache views: per-layer K/V shapes, growth over steps, one head's keys, cache on vs off."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from figures.common import (
    HEATMAP_SCALE,
    facts_of,
    finite_or_none,
    gen_step,
    key_labels,
    safe_text,
    shape_text,
    tick_step,
)
from model.hook_table import act_name
from tracer import Trace


def _ran_with_cache(trace: Trace) -> bool:
    return facts_of(trace).info.use_cache


def _n_layer(trace: Trace, step: int) -> int:
    return len(trace.filter(step=step, name="*attn.hook_k_all"))


def cache_table(trace: Trace, step: int) -> pd.DataFrame:
    """One row per layer: K and V [B, H, t, d_head] at ``step``, rows new this step, bytes."""
    use_cache = _ran_with_cache(trace)
    rows = []
    for layer in range(_n_layer(trace, step)):
        k = trace.record(act_name("k_all", layer), step)
        v = trace.record(act_name("v_all", layer), step)
        k_new = trace.record(act_name("k", layer), step)
        rows.append({
            "layer": layer,
            "K": shape_text(k.shape),
            "V": shape_text(v.shape),
            "rows from the cache": k.shape[2] - k_new.shape[2] if use_cache else 0,
            "rows computed this step": k_new.shape[2],
            "bytes (K+V)": k.nbytes + v.nbytes,
        })
    return pd.DataFrame(rows)


def cache_growth(trace: Trace) -> pd.DataFrame:
    """Per step: cache length after the step and bytes of K+V held over all layers."""
    rows = []
    facts = facts_of(trace)
    use_cache = facts.info.use_cache
    for gs in facts.steps:
        total = sum(trace.record(act_name(kind, layer), gs.step).nbytes
                    for layer in range(_n_layer(trace, gs.step)) for kind in ("k_all", "v_all"))
        rows.append({"step": gs.step, "cache length": gs.forward.cache_after if use_cache else 0,
                     "t (keys attended)": gs.forward.t, "K+V bytes (all layers)": total if use_cache else 0,
                     "K+V bytes computed": total})
    return pd.DataFrame(rows)


def cache_growth_figure(trace: Trace, selected_step: int | None = None) -> go.Figure:
    """Cache length and bytes held per step; with the cache off, what each step recomputed instead."""
    growth = cache_growth(trace)
    use_cache = _ran_with_cache(trace)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    if use_cache:
        bars = ("cache length", "cache length (positions)")
        line = ("K+V bytes (all layers)", "KiB held (K+V, all layers)")
    else:  # nothing is held between steps: show the work that replaces the cache
        bars = ("t (keys attended)", "K, V rows recomputed (t), none cached")
        line = ("K+V bytes computed", "K+V KiB computed this step (all layers)")
        fig.update_layout(title_text="KV cache off: nothing is kept between steps; every step recomputes all t rows")
    fig.add_trace(go.Bar(x=growth["step"], y=growth[bars[0]], name=bars[1], marker_color="#9ecae1"),
                  secondary_y=False)
    fig.add_trace(go.Scatter(x=growth["step"], y=growth[line[0]] / 1024, mode="lines+markers", name=line[1],
                             line={"dash": "dot", "color": "#d62728"}, marker={"color": "#d62728"}), secondary_y=True)
    if selected_step is not None:
        fig.add_vline(x=selected_step, line={"color": "#ff4b4b", "width": 1})
    fig.update_xaxes(title_text="step", dtick=1 if len(growth) <= 30 else None)
    fig.update_yaxes(title_text="positions cached" if use_cache else "positions recomputed", rangemode="tozero",
                     secondary_y=False)
    fig.update_yaxes(title_text="KiB", rangemode="tozero", showgrid=False, secondary_y=True)
    fig.update_layout(height=320, margin={"t": 30, "l": 10, "r": 10, "b": 10}, legend={"orientation": "h", "y": 1.15})
    return fig


def key_heatmap_figure(trace: Trace, step: int, layer: int, head: int, batch: int = 0, which: str = "K") -> go.Figure:
    """One head's cached keys (or values): positions × d_head, the rows added at ``step`` outlined."""
    hook = "hook_k_all" if which == "K" else "hook_v_all"
    value = trace.get(act_name(hook, layer), step)
    fig = go.Figure()
    if value is None:
        fig.add_annotation(text=f"{which} values not kept for this step", showarrow=False)
        return fig
    m = value[batch, head]  # [t, d_head]
    t, d_head = m.shape
    use_cache = _ran_with_cache(trace)
    labels = key_labels(trace, step, batch)
    fig.add_trace(go.Heatmap(z=finite_or_none(m), colorscale=HEATMAP_SCALE, colorbar={"title": which},
                             hovertemplate="position %{y}, dim %{x}: %{z:.4f}<extra></extra>"))
    s = tick_step(t)
    fig.update_yaxes(tickvals=list(range(0, t, s)), ticktext=[safe_text(labels[i]) for i in range(0, t, s)],
                     autorange="reversed", title_text="position")
    fig.update_xaxes(title_text="d_head")
    new = gen_step(trace, step).forward.n if use_cache else t
    fig.add_shape(type="rect", x0=-0.5, x1=d_head - 0.5, y0=t - new - 0.5, y1=t - 0.5,
                  line={"color": "#ff4b4b", "width": 3})
    rows = f"row {t - 1}" if new == 1 else f"rows {t - new}…{t - 1}"
    what = f"{rows} added at step {step}" if use_cache else f"all {t} rows recomputed at step {step}, no cache"
    fig.update_layout(title_text=f"{which} of layer {layer}, head {head}: {shape_text(tuple(m.shape))} = [t, d_head]"
                                 f" — <span style='color:#ff4b4b'>{what} (outlined)</span>",
                      height=max(300, min(900, 110 + 16 * t)), margin={"t": 50, "l": 10, "r": 10, "b": 10})
    return fig


def rows_computed(trace: Trace) -> pd.DataFrame:
    """Query rows of attention computed per step with the cache (n) and without it (all t)."""
    facts = facts_of(trace)
    rows = []
    for gs in facts.steps:
        width = facts.width(gs.step)
        rows.append({"step": gs.step, "with cache": 1 if gs.step > 0 else width, "without cache": width,
                     "this run": gs.forward.n, "seconds": trace.steps[gs.step].seconds})
    return pd.DataFrame(rows)


def cache_on_off_figure(trace: Trace) -> go.Figure:
    """Rows computed per step (cache on vs off) and, where measured, untraced seconds of both paths.

    The run's own traced step time is drawn too, faint: it includes recording the
    tensors, so it is not what the cache saves."""
    table = rows_computed(trace)
    comparisons = facts_of(trace).comparisons
    fig = make_subplots(rows=1, cols=2, subplot_titles=("query rows computed per step",
                                                        "seconds per step (untraced, an estimate)"))
    fig.add_trace(go.Bar(x=table["step"], y=table["with cache"], name="with cache"), row=1, col=1)
    fig.add_trace(go.Bar(x=table["step"], y=table["without cache"], name="without cache"), row=1, col=1)
    if comparisons:
        steps = sorted(comparisons)
        fig.add_trace(go.Scatter(x=steps, y=[comparisons[s].cached.seconds for s in steps], mode="lines+markers",
                                 name="cached path", marker={"color": "#1f77b4"}), row=1, col=2)
        fig.add_trace(go.Scatter(x=steps, y=[comparisons[s].full.seconds for s in steps], mode="lines+markers",
                                 name="full recompute", marker={"symbol": "x", "size": 9, "color": "#ff7f0e"}),
                      row=1, col=2)
    use_cache = _ran_with_cache(trace)
    # hidden until clicked in the legend: it includes recording every tensor (and the first step's warm-up),
    # which would flatten the two lines that compare the paths themselves
    fig.add_trace(go.Scatter(x=table["step"], y=table["seconds"], mode="lines", visible="legendonly",
                             line={"dash": "dot", "color": "#7f7f7f"},
                             name=f"this run, traced ({'cache on' if use_cache else 'cache off'}; incl. recording)"),
                  row=1, col=2)
    fig.update_layout(barmode="group", height=340, margin={"t": 40, "l": 10, "r": 10, "b": 10},
                      legend={"orientation": "h", "y": -0.25})
    fig.update_xaxes(title_text="step", dtick=1 if len(table) <= 30 else None)
    fig.update_yaxes(rangemode="tozero", row=1, col=2)
    return fig
