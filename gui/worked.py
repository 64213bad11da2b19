"""Worked example: a two-token attention edited number by number, and its gradient checked by autograd."""

from __future__ import annotations

import functools

import plotly.graph_objects as go
import streamlit as st

from gpt_shape_tracer.figures import worked as worked_views
from gpt_shape_tracer.figures.view_takeaways import worked_takeaway
from gpt_shape_tracer.gui.common import chart, plain
from gpt_shape_tracer.gui.hover import crosshair
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.tracer import Trace

Rows = tuple[tuple[float, ...], ...]  # the data editor's numbers (an empty cell: None, refused by compute)


@functools.lru_cache(maxsize=16)
def worked(q: Rows, k: Rows, v: Rows, grad_o: Rows, causal: bool) -> tuple[worked_views.Worked, go.Figure, go.Figure]:
    """The example for these numbers and its two figures, made once per distinct input (they are pure functions of
    it, and nothing changes them after: ``st.plotly_chart`` copies a figure before it sends it). Made on every rerun
    they took about 0.27 s, and the first page draws this tab beside the Engine tab, so every move of the engine
    step slider paid for them (bench/bench_engine_views.py)."""
    def rows(m: Rows) -> list[list[float]]:
        return [list(row) for row in m]  # compute checks each number (WorkedInputError)

    w = worked_views.compute(rows(q), rows(k), rows(v), rows(grad_o), causal=causal)
    return w, crosshair(worked_views.forward_figure(w)), crosshair(worked_views.backward_figure(w))


@st.fragment
def worked_tab(trace: Trace | None = None, step: int = 0) -> None:
    said_here = st.container()  # the takeaway goes first, once the tables below give its numbers
    st.markdown("A two-token attention you can check by hand (edit any number). Every stage runs through the "
                "same `attention` function the model runs; the gradient ∂L/∂V = Aᵀ·∂L/∂O is checked against "
                "autograd's.")
    cols = st.columns(4)
    tables = {}
    for col, (name, default) in zip(cols, (("Q", worked_views.DEFAULT_Q), ("K", worked_views.DEFAULT_K),
                                           ("V", worked_views.DEFAULT_V), ("∂L/∂O", worked_views.DEFAULT_GRAD_O))):
        col.markdown(f"**{name}**")
        tables[name] = col.data_editor(default, key=f"worked_{name}", num_rows="dynamic", width="stretch")
    causal = st.toggle("add the causal mask M", key="worked_causal", persist_state="page")
    try:
        q, k, v, grad_o = (tuple(map(tuple, tables[name])) for name in ("Q", "K", "V", "∂L/∂O"))
        w, forward, backward = worked(q, k, v, grad_o, bool(causal))
    except worked_views.WorkedInputError as e:
        st.error(plain(e))
        return
    said = worked_takeaway(w)
    with said_here:
        takeaway(said.sentence, said.metrics)
    chart(forward, key="worked_forward")
    st.markdown(f"Row q0 of A (the first query): e^{w.scores[0, 0]:.3f} and e^{w.scores[0, 1]:.3f} normalised to "
                f"{w.a[0, 0]:.3f} and {w.a[0, 1]:.3f}." if w.a.shape[1] >= 2 and not causal else "")
    chart(backward, key="worked_backward")
