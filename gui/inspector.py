"""Inspector: any record of the step — its summary, a 2-D slice, a histogram, raw numbers, the ops inside."""

from __future__ import annotations

import streamlit as st
import torch

from gpt_shape_tracer.figures import inspector as inspect_views
from gpt_shape_tracer.figures.common import attention_layers, shape_with_axes
from gpt_shape_tracer.figures.view_takeaways import inspector_takeaway
from gpt_shape_tracer.gui.common import chart, explain_missing_values, plain, state
from gpt_shape_tracer.gui.hover import crosshair
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.session import ops_module
from gpt_shape_tracer.tracer import Trace


def inspector_tab(trace: Trace, step: int) -> None:
    names = trace.names(step)
    default = state().inspect_name or act_name("pattern", (attention_layers(trace) or [0])[0])  # Mamba: none
    index = names.index(default) if default in names else 0
    name = st.selectbox("record", names, index=index, key="inspect_select")  # kept in the app state
    state().inspect_name = name
    rec = trace.record(name, step)
    said = inspector_takeaway(trace, step, name)
    takeaway(said.sentence, said.metrics)
    st.code(trace.summary(rec), language=None)
    note = trace.value_note(rec)
    st.caption(f"record {rec.index_in_step} of step {step} · {plain(rec.module_type)} {plain(rec.module or 'model')} · "
               f"{rec.kind} · {rec.module_params:,} parameters · {shape_with_axes(rec)}"
               + (f" · {plain(note)}" if note else "") + (f" · {plain(rec.axes_note)}" if rec.axes_note else ""))
    value = trace.value(rec)
    if value is None:
        explain_missing_values(trace, step, "values (heatmap, histogram, raw numbers)")
    else:
        show_tensor(value, name, list(rec.axes) if rec.axes else None)
    if trace.capture == "ops":
        module = ops_module(rec)
        st.subheader(f"Ops inside `{module or 'model'}` at step {step}, in call order")
        st.dataframe(inspect_views.module_ops(trace, step, module or None), hide_index=True, key="ops_table")


def show_tensor(value: torch.Tensor, name: str, dim_symbols: list[str] | None = None) -> None:
    if value.dim() >= 2:
        # keyed by record: another record has other dims and starts from its own default (its last two
        # dims). Options are named by symbol, not size: a widget's labels would not follow t as it grows.
        dims = list(range(value.dim()))
        cols = st.columns(2)
        label = (lambda d: f"dim {d} ({dim_symbols[d]})") if dim_symbols else (lambda d: f"dim {d}")
        rows_dim = cols[0].selectbox("rows", dims, index=value.dim() - 2, key=f"insp_rows_{name}",
                                     persist_state="page", format_func=label)
        cols_dim = cols[1].selectbox("columns", dims, index=value.dim() - 1, key=f"insp_cols_{name}",
                                     persist_state="page", format_func=label)
        if rows_dim == cols_dim:
            st.warning("Pick two different dimensions for rows and columns.")
            return
        fixed = {}
        others = [d for d in dims if d not in (rows_dim, cols_dim)]
        if others:
            sel = st.columns(len(others))
            for col, d in zip(sel, others):
                fixed[d] = col.number_input(f"index in {label(d)}, 0 … {value.shape[d] - 1}", min_value=0,
                                            max_value=value.shape[d] - 1,
                                            value=0, key=f"insp_fix_{name}_{d}_{value.shape[d]}", persist_state="page")
        matrix = inspect_views.slice_2d(value, rows_dim, cols_dim, fixed)
        offset = (0, 0)
        if max(matrix.shape) > 256:
            st.caption(f"The slice is {matrix.shape[0]} × {matrix.shape[1]}: the heatmap pools it for the page. "
                       "Pick a window to see at full resolution:")
            wcols = st.columns(2)
            r0 = wcols[0].number_input("first row", 0, max(0, matrix.shape[0] - 1), 0, key=f"insp_r0_{name}",
                                       persist_state="page")
            c0 = wcols[1].number_input("first column", 0, max(0, matrix.shape[1] - 1), 0, key=f"insp_c0_{name}",
                                       persist_state="page")
            full = st.toggle("show the window (256 × 256) at full resolution", key=f"insp_window_{name}",
                             persist_state="page")
            if full:
                matrix, offset = matrix[r0:r0 + 256, c0:c0 + 256], (int(r0), int(c0))
        chart(crosshair(inspect_views.tensor_heatmap_figure(matrix, name, offset=offset)), key="insp_heatmap")
    every = value.numel() > inspect_views.HISTOGRAM_SAMPLE and st.toggle(
        f"count all {value.numel():,} values in the histogram (slower)", key=f"insp_every_{name}", persist_state="page")
    chart(inspect_views.histogram_figure(value, f"values of {name}", every_value=every), key="insp_hist")
    raw = inspect_views.raw_frame(value)
    if raw is not None:
        st.dataframe(raw, key="insp_raw")
