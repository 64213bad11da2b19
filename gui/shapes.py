"""Shapes: the architecture as a flow with this step's live shapes, the multi-head reshape, every record."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.figures import flow as flow_views
from gpt_shape_tracer.figures.common import layer_labels, no_attention
from gpt_shape_tracer.figures.view_takeaways import shapes_takeaway
from gpt_shape_tracer.gui.common import diagram, n_layer_head, plain, state
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.tracer import TENSOR_KINDS, Trace

LEGEND = "B batch · n new positions · t key positions (cache incl.) · d d_model · H query heads · G key/value " \
         "heads · d_head = d_k · V vocab"


def legend(config) -> str:
    """The shapes legend for one model: a model whose value heads differ from its query/key heads (latent
    attention) names the two sizes, d_qk and d_v, with their values, and what its cache holds (d_c, d_R)."""
    d_v = getattr(config, "d_v", None)
    if config is None or d_v is None or d_v == config.d_head:
        return LEGEND
    text = LEGEND.replace("d_head = d_k", f"d_qk = d_k = {config.d_head} query/key head size · d_v = {d_v} value "
                                           "head size")
    if getattr(config, "kv_latent_dim", None) is not None:
        text += (f" · d_c = {config.kv_latent_dim} width of the compressed KV latent c_KV · d_R = "
                 f"{config.rope_key_dim} width of the rotary key k_R (the cache holds c_KV and k_R)")
    return text


def shapes_tab(trace: Trace, step: int) -> None:
    n_layer, _ = n_layer_head(trace)
    symbols = legend(trace.config)
    said = shapes_takeaway(trace, step)
    if flow_views.recorded_flow(trace):
        details = (f"Live shapes at step {step}, numerically and in symbols — {symbols}. This model runs its own "
                   "code, so the flow is read from the trace: the block's hook points and the model's own modules "
                   "(named as in the model, with their class), in the order the forward ran them.")
    else:
        details = (f"Live shapes at step {step}, numerically and in symbols — {symbols}. In purple, the weight a "
                   "stage multiplies by (the per-head W_Q^i, W_K^i, W_V^i of [d, d_k] are W_QKV's column blocks, "
                   "d_k columns per head).")
    takeaway(said.sentence, said.metrics, details)
    layer = st.selectbox("block shown in the flow", list(range(n_layer)), key="flow_layer", persist_state="page",
                         # BLT: its list of layers; strings only, a widget kept between reruns must not hold the trace
                         format_func=layer_labels(trace, n_layer).__getitem__)
    diagram(flow_views.shape_flow_figure(trace, step, layer), key="flow")
    st.subheader("The multi-head reshape, op by op")
    without = no_attention(trace, layer)
    if without is not None:  # a hybrid model's state layer: no heads to split or merge
        st.info(f"{without[0].upper()}{without[1:]}: no queries to split into heads, no heads' outputs to merge.")
    else:
        st.caption("How Q is split into heads and the heads' outputs merged back; green boxes are views (the same "
                   "numbers, new shape and strides), orange ones new memory"
                   + (", grey ones not measured (values not kept)." if flow_views.recorded_flow(trace) else "."))
        diagram(flow_views.reshape_figure(trace, step, layer), key="reshape")
    st.subheader("Every record of this step")
    cols = st.columns([1, 2, 1, 2])
    layer_filter = cols[0].selectbox("layer", ["all"] + list(range(n_layer)), key="table_layer", persist_state="page")
    module_filter = cols[1].text_input("module (path prefix)", key="table_module", persist_state="page",
                                       placeholder="blocks.0.attn")
    kind_filter = cols[2].selectbox("kind", ["all", *TENSOR_KINDS], key="table_kind", persist_state="page")
    name_filter = cols[3].text_input("name contains (or glob)", key="table_name", persist_state="page")
    frame = trace.to_frame(
        step=step, layer=None if layer_filter == "all" else int(layer_filter),
        module=module_filter.strip() or None, kind=None if kind_filter == "all" else kind_filter,
        name=name_filter.strip() or None,
    )
    frame["shape"] = [str(list(s)) for s in frame["shape"]]
    shown = frame[["index_in_step", "name", "shape", "axes", "kind", "module_type", "dtype", "nbytes", "summary"]]
    shown = shown.rename(columns={"index_in_step": "#"})
    column = st.column_config
    event = st.dataframe(shown, key="records_table", hide_index=True, on_select="rerun",
                         selection_mode="single-row", height=560,
                         column_config={"#": column.NumberColumn(width=40),
                                        "name": column.TextColumn(width=300), "shape": column.TextColumn(width=120),
                                        "axes": column.TextColumn(width=130), "kind": column.TextColumn(width=60),
                                        "module_type": column.TextColumn("module type", width=120),
                                        "dtype": column.TextColumn(width=70), "nbytes": column.NumberColumn(width=80),
                                        "summary": column.TextColumn(width=520)})
    rows = event.selection.rows if event is not None and hasattr(event, "selection") else []
    if rows:
        state().inspect_name = shown.iloc[rows[0]]["name"]
        st.info(f"Opened **{plain(shown.iloc[rows[0]]['name'])}** in the Inspector tab.")
    st.caption(f"{len(frame)} record(s) at step {step}, numbered from 0 within the step. Select a row to open it in "
               "the Inspector.")
