"""Attention: the stages of one head, O = A·V, the pitfalls, RoPE, all heads at once, the history, and a zoom
that works at any length."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.figures import attention as attn_views
from gpt_shape_tracer.figures import flash as flash_views
from gpt_shape_tracer.figures import gradients as grad_views
from gpt_shape_tracer.figures import long_attention as long_views
from gpt_shape_tracer.figures import pitfalls as pitfall_views
from gpt_shape_tracer.figures import rope as rope_views
from gpt_shape_tracer.figures.common import (
    attention_layers,
    bidirectional,
    facts_of,
    key_labels,
    positions,
    prompt_positions,
    prompt_sentence,
    query_labels,
    scores_formula,
    stream_sentence,
)
from gpt_shape_tracer.figures.differential import (
    differential_figure,
    differential_head,
    differential_sentence,
    is_differential,
)
from gpt_shape_tracer.figures.indexed import (
    cache_sentence,
    indexed_layers,
    indexer_step,
    selection_figure,
    selection_sentence,
)
from gpt_shape_tracer.gui.common import (
    chart,
    explain_missing_values,
    layer_head_batch,
    live_model_for,
    panels,
    plain,
    remembered_tabs,
    said_no_attention,
    state,
    values_kept,
)
from gpt_shape_tracer.gui.hover import crosshair
from gpt_shape_tracer.gui.server import reserve_memory
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.model.gpt import act_name, identity_of
from gpt_shape_tracer.session import first_token
from gpt_shape_tracer.tracer import (
    GRADIENT_LOSSES,
    RegionError,
    Trace,
    archive_bytes,
    attention_gradients,
    can_recompute,
    check_output,
    gradient_trace,
    head_scores,
    head_statistics,
    is_derived,
    pattern_digest,
)


def attention_tab(trace: Trace, step: int) -> None:
    layer, head, batch = layer_head_batch(trace, "attn")
    attending = attention_layers(trace)
    if said_no_attention(trace, layer, f"Its mixer's input and output are recorded as blocks.{layer}.hook_mixer_in and "
                         "hook_mixer_out (Shapes and Inspector tabs); "
                         + (f"pick an attention layer ({', '.join(map(str, attending))}) to see Q, K, V and the "
                            "pattern." if attending else "no layer of this model has softmax attention (a state-space "
                            "model), so there is no Q, K, V or pattern to show at any layer.")):
        return
    origins = getattr(trace.live_model, "block_origins", None)  # HRM, LongCat-Flash: several blocks per layer
    if origins is not None and layer < len(origins) and origins[layer] is not None:
        st.caption(f"{origins[layer]}.")
    prompt = prompt_sentence(trace, step)  # CPM-Ant: learned prompt positions before the text, no causal mask
    if prompt is not None:
        st.caption(prompt)
    st.latex(attn_views.attention_latex(trace, step, layer))
    usual = scores_formula(trace, trace.record(act_name("q", layer), step).shape[-1]) == "QKᵀ/√d_k"
    bias_note = (f" B is {attn_views.score_bias_kind(trace)}, added to the scores before M (a stage of its own below)."
                 if trace.has(attn_views.score_bias_name(layer), step) else "")
    if usual:
        st.caption(attn_views.M_NOTE + " (Vaswani et al., 2017, “Attention Is All You Need”.)" + bias_note)
    else:
        st.caption("This model scores its keys its own way — the scale s from its config instead of 1/√d_k"
                   + (", then a soft-cap c·tanh(·/c) that keeps every score inside (−c, c)"
                      if getattr(trace.config, "attn_softcap", None) else "")
                   + " — and adds M after, as in Vaswani et al. (2017). The stages below are its own numbers."
                   + bias_note)
    rope = trace.has(act_name("rot_q", layer), step)
    rope_elsewhere = rope_views.rope_not_drawn(trace) is not None and trace.config.positions == "rope"
    indexed = indexed_layers(trace, step)
    differential = is_differential(trace, step, layer)
    parts = ["Stages", "O = A·V", "Pitfalls"] + (["Indexer"] if indexed else []) + (
        ["Differential"] if differential else []) + (
        ["RoPE"] if rope or rope_elsewhere else []) + ["All heads", "History", "Gradients", "FlashAttention", "Zoom"]
    sub = dict(zip(parts, remembered_tabs(parts, "attn_view")))
    pattern_kept = trace.get(act_name("pattern", layer), step) is not None or recomputable(trace, step, layer)
    with sub["Stages"]:
        if sub["Stages"].open:
            stages = attn_views.attention_stages(trace, step, layer, head, batch)
            if all(s.matrix is None for s in stages):
                explain_missing_values(trace, step, "attention heatmaps")
                st.markdown("\n".join(f"- **{s.title}**: `{s.shapes}`" for s in stages))
            else:
                said = attn_views.stages_takeaway(trace, step, layer, head, batch)
                if said is not None:
                    takeaway(said[0], said[1])
                shared = st.toggle("one colour scale for the scores" if not usual else
                                   "one colour scale for QKᵀ, ÷√d_k and + M", key="attn_shared", persist_state="page",
                                   help="With one scale, the scaling shows as what it does: every score "
                                        "shrinks by the same factor")
                # drawn on the canvas of gui/panels.js: hover reads a cell in every stage of the same cells and draws
                # its query row and key column across them (O = A·V, a plotly chart, cannot follow: Streamlit sends
                # no hover events to the app)
                panels(attn_views.attention_stages_figure(trace, step, layer, head, batch, shared),
                       key="stages_chart")
            sink = pitfall_views.sink_sentence(trace, step, layer, head, batch)
            if sink is not None:
                st.caption(sink)
            bias = attn_views.score_bias_sentence(trace, step, layer, head, batch)
            if bias is not None:
                st.caption(bias)
            if pattern_kept:
                query_picker(trace, step, layer, head, batch)
    with sub["O = A·V"]:
        if sub["O = A·V"].open and values_kept(trace, step, act_name("v_all", layer), "values V and outputs O"):
            query = query_picker(trace, step, layer, head, batch, show=False)
            result = attn_views.weighted_sum_figure(trace, step, layer, head, query, batch)
            if result is not None:
                st.caption("For the picked query: each value row vᵢ times its weight αᵢ, and their sum "
                           "o = Σᵢ αᵢ vᵢ — one row of O = A·V.")
                chart(crosshair(result[0]), key="av_chart")  # a key row vᵢ under the pointer, across its panel
    with sub["Pitfalls"]:
        if sub["Pitfalls"].open:
            table = pitfall_views.pitfall_table(trace, step, layer, head, batch)
            if table is None:
                explain_missing_values(trace, step, "Q, K and M values")
            else:
                scaling = "÷√d_k" if usual else "the scale s"
                st.caption("This head recomputed from its recorded Q, K and M, four ways, with the model's own "
                           "scaling. " + pitfall_views.pitfall_sentence(trace, step, layer, head, batch, scaling))
                st.dataframe(table.round(4), hide_index=True, key="pitfall_table")
                chart(pitfall_views.pitfall_figure(trace, step, layer, head, batch), key="pitfall_chart")
    if "Differential" in sub:
        with sub["Differential"]:
            if sub["Differential"].open:
                differential_section(trace, step, layer, head, batch)
    if "Indexer" in sub:
        with sub["Indexer"]:
            if sub["Indexer"].open:
                indexer_section(trace, step, layer, batch, indexed)
    if "RoPE" in sub:
        with sub["RoPE"]:
            if sub["RoPE"].open:
                rope_section(trace, step, layer, head, batch)
    with sub["All heads"]:
        if sub["All heads"].open:
            heads_grid(trace, step, batch, (layer, head))
    with sub["History"]:
        if sub["History"].open:
            if facts_of(trace).info.use_cache and step > 0 and pattern_kept:
                st.caption("With the cache a decode step computes one query row; stacking the rows of steps 0…s "
                           "rebuilds the lower-triangular pattern token by token (this step's row outlined).")
                panels(attn_views.attention_history_figure(trace, layer, head, step, batch),
                       key="history_chart")
            else:
                st.info("The history stacks the one row each cached decode step computes; it needs the KV cache on, "
                        "a step after the prefill, and kept values.")
    with sub["Gradients"]:
        if sub["Gradients"].open:
            gradients_section(trace, step, layer, head, batch)
    own = stream_sentence(trace, step, layer)  # BLT: a block over streams of its own, not the text's positions
    with sub["FlashAttention"]:
        if sub["FlashAttention"].open:
            if own is not None:
                st.info(f"{own} This view tiles a causal pass over the text's rows and keys: not drawn here.")
            else:
                flash_section(trace, step, layer, head, batch)
    with sub["Zoom"]:
        if sub["Zoom"].open:
            if own is not None:
                st.info(f"{own} This view reads rows and keys as the text's positions: not drawn here.")
            else:
                zoom_section(trace, step, layer, head, batch)


def differential_section(trace: Trace, step: int, layer: int, head: int, batch: int) -> None:
    """Differential attention: a head's two softmaxes and the difference it applies to its values."""
    st.caption("Differential attention (Ye et al. 2024, “Differential Transformer”): each differential head computes "
               "two softmaxes with the same queries and keys and applies A₁ − λ·A₂ to its values, λ learned, so that "
               "weight both softmaxes put on the same keys cancels. The head picker counts all H query heads: heads "
               "j and j + H/2 are differential head j's two softmaxes.")
    d = differential_head(trace, step, layer, head, batch)
    if d is None:
        explain_missing_values(trace, step, "differential patterns")
        return
    takeaway(differential_sentence(d), (("λ", f"{d.lam:.3f}"), ("negative weights", f"{d.negative} of {d.cells}")))
    chart(differential_figure(trace, d), key="differential_chart")


def indexer_section(trace: Trace, step: int, layer: int, batch: int, indexed: list[int]) -> None:
    """Indexed (sparse) attention: which keys the layer's indexer chose for each query, out of those it could see."""
    st.caption("Indexed attention (DeepSeek-AI 2025, “DeepSeek-V3.2”): a small learned indexer scores every key the "
               "mask lets a query see, and the query attends only to the keys it ranks highest — the rest are −∞ in "
               "M. The indexer keeps keys of its own in the cache beside K and V.")
    s = indexer_step(trace, step, layer, batch)
    if s is None:
        st.info(f"Layer {layer} is not indexed; pick one of the indexed layers ({', '.join(map(str, indexed))}).")
        return
    takeaway(selection_sentence(s), (("keys visible", str(s.seen)), ("chosen", str(s.chosen)),
                                     ("skipped", str(s.seen - s.chosen))))
    chart(selection_figure(trace, s), key="indexer_chart")
    said = cache_sentence(s)
    if said is not None:
        st.caption(said)


def recomputable(trace: Trace, step: int, layer: int) -> bool:
    """Whether this layer's pattern is derived (the fused kernel ran) and its Q and K are kept."""
    return can_recompute(trace, act_name("pattern", layer), step)


def zoom_section(trace: Trace, step: int, layer: int, head: int, batch: int) -> None:
    """One head at any length: the overview (block mean / max, computed tile by tile), a zoomed region exact down
    to single cells, one query row over every key, and the layer's long-context statistics."""
    name = act_name("pattern", layer)
    if trace.get(name, step) is None and not recomputable(trace, step, layer):
        explain_missing_values(trace, step, "attention weights")
        return
    _, _, n, t = trace.record(name, step).shape
    zoom_defaults(n, t)
    st.caption(long_views.derived_sentence(trace, step, layer))
    if is_derived(trace, name, step) and st.toggle("check A·V against the kernel's O", key="zoom_check",
                                                   persist_state="page"):
        try:
            st.caption(f"max |A·V − O| over this layer = {check_output(trace, name, step):.2e}")
        except RegionError as e:
            st.caption(str(e))
    statistic = st.radio("overview cells", ["mean", "max"], horizontal=True, key="zoom_stat",
                         persist_state="page")
    view = long_views.overview(trace, step, layer, head, batch)
    picked = chart(long_views.overview_figure(view, statistic), key="zoom_overview", on_select="rerun",
                   selection_mode="box")
    if zoom_box(picked, "zoom_overview", n, t):
        zoom_defaults(n, t)  # the inputs are drawn below: they can still take the box
    c1, c2, c3, c4 = st.columns(4)
    r0 = c1.number_input("first query row", 0, n - 1, key="zoom_r0")
    r1 = c2.number_input("last query row", 0, n - 1, key="zoom_r1")
    k0 = c3.number_input("first key", 0, t - 1, key="zoom_k0")
    k1 = c4.number_input("last key", 0, t - 1, key="zoom_k1")
    rows, cols = (int(min(r0, r1)), int(max(r0, r1)) + 1), (int(min(k0, k1)), int(max(k0, k1)) + 1)
    matrix, exact = long_views.zoom(trace, step, layer, head, batch, rows, cols)
    picked = chart(long_views.zoom_figure(matrix, rows, cols, exact), key="zoom_region", on_select="rerun",
                   selection_mode="box")
    if zoom_box(picked, "zoom_region", n, t):
        st.rerun()  # the inputs above were drawn before this box narrowed them
    row = st.number_input("query row for the strip", 0, n - 1, n - 1, key="zoom_row")
    chart(long_views.row_strip_figure(trace, step, layer, head, batch, int(row)), key="zoom_strip")
    if st.toggle("long-context statistics of this layer (entropy, sinks, distance, top keys)", key="zoom_stats",
                 persist_state="page"):
        stats = head_statistics(trace, name, step, batch=batch)
        st.caption(long_views.statistics_sentence(stats, n, t)
                   + (" This model's queries weigh the keys after them too (its mask is not causal); the distances "
                      "count back from each query only, so that weight is in no bucket of the distance plot."
                      if bidirectional(trace) else ""))
        st.dataframe(long_views.statistics_frame(stats).round(4), hide_index=True, key="zoom_stats_table")
        chart(long_views.distance_figure(stats), key="zoom_distance")


ZOOM_INPUTS = ("zoom_r0", "zoom_r1", "zoom_k0", "zoom_k1")


def zoom_defaults(n: int, t: int) -> None:
    """Before the region's inputs are drawn: a box drawn since is given to them; they start on the last 64
    queries × the last 64 keys, and are kept inside a new trace's n × t (Streamlit refuses a number input whose
    remembered value is out of its range)."""
    boxed = st.session_state.pop("zoom_boxed", None)
    limits = (n - 1, n - 1, t - 1, t - 1)
    for i, (key, default, top) in enumerate(zip(ZOOM_INPUTS, (max(0, n - 64), n - 1, max(0, t - 64), t - 1),
                                                limits)):
        value = boxed[i] if boxed is not None else st.session_state.get(key)
        st.session_state[key] = default if not isinstance(value, int | float) else min(int(value), top)


def zoom_box(event, chart_key: str, n: int, t: int) -> bool:
    """A box drawn on the overview or the region chart is the region's next rows and keys (once per box: the chart
    keeps its selection over reruns, and the inputs may have been typed since); ``zoom_defaults`` gives it to the
    inputs before they are drawn. Whether there is a new box."""
    boxes = event.selection.box if event is not None and hasattr(event, "selection") else []
    if not boxes:
        return False
    box = boxes[-1]
    rows = long_views.box_range(box["y"][0], box["y"][1], n) if len(box.get("y", ())) >= 2 else None
    cols = long_views.box_range(box["x"][0], box["x"][1], t) if len(box.get("x", ())) >= 2 else None
    seen = (rows, cols)
    if rows is None or cols is None or st.session_state.get(f"{chart_key}_applied") == seen:
        return False
    st.session_state[f"{chart_key}_applied"] = seen
    st.session_state["zoom_boxed"] = (rows[0], rows[1] - 1, cols[0], cols[1] - 1)
    return True


def gradients_section(trace: Trace, step: int, layer: int, head: int, batch: int) -> None:
    app = state()
    gen = app.live_generation
    if gen is None:
        st.info("The backward pass runs the live model on this generation's tokens: Step once (or leave the file "
                "view).")
        return
    loss = st.radio("loss L", list(GRADIENT_LOSSES), horizontal=True, key="grad_loss", persist_state="page",
                    help="next-token cross-entropy: the mean over every pair of consecutive real tokens of every "
                         "sequence of the batch, pooled (padding skipped, on either side) · "
                         "−log p(chosen token): the mean over the batch's sequences of the token this step chose")
    head_gradients(trace, gen, step, layer, head, batch, loss)
    gradient_capture(gen, step, loss)


def head_gradients(trace: Trace, gen, step: int, layer: int, head: int, batch: int, loss: str) -> None:
    """Computed when the view opens (one forward and backward, about a second on the bundled models) and kept
    per (step, layer, head, sequence, loss): coming back to a head shows it again at once."""
    app = state()
    wanted = (step, layer, head, batch, loss)
    kept = app.live.gradients
    if kept.get(wanted) is None:
        try:
            with st.spinner("forward and backward…"):
                kept.keep(wanted, attention_gradients(gen, step, layer, head, batch, loss))
        except ValueError as e:
            st.error(plain(e))
            return
    result = kept.get(wanted)  # kept per (step, layer, head, sequence, loss): a Step loses none
    level, text = grad_views.agreement(result)
    keys = key_labels(trace, step, batch, layer)
    takeaway(text, [("loss L, all sequences" if result.pooled_over > 1 else "loss L", f"{result.loss:.4f}"),
                    ("largest |formula − autograd|", f"{max(result.max_abs_delta(n) for n in result.computed):.1e}"),
                    ("query rows", str(result.formula["G_P"].shape[0]))],
             details=("Backpropagation through attention: from a loss L, the gradient of every stage of this head, "
                      "O = P·V, P = softmax(S), S = s·QKᵀ + M. Given G_O = ∂L/∂O (autograd's: everything after O is "
                      "the rest of the model): G_V = Pᵀ·G_O, G_P = G_O·Vᵀ, row by row G_S,r = (diag(P_r) − "
                      "P_r P_rᵀ)·G_P,r (the softmax's Jacobian), G_Q = s·G_S·K and G_K = s·G_Sᵀ·Q"
                      + (" — with a soft-cap S = c·tanh(s·QKᵀ/c) + M, G_S is first multiplied element by element by "
                         "the cap's derivative 1 − tanh²(s·QKᵀ/c)" if result.softcap else "")
                      + ". Each is computed here from its formula and compared with autograd's on the same forward. "
                      + grad_views.scope_sentence(gen.facts, step, prompt_positions(trace))))
    if level == "error":
        st.error(text)
    if step > 0 and gen.facts.step(step).forward.n < gen.facts.width(step):
        st.caption(grad_views.scope_sentence(gen.facts, step, prompt_positions(trace)))
    H, G = trace.config.n_head, trace.config.n_kv_head or trace.config.n_head
    if G < H:
        st.caption(f"K and V serve {H // G} query heads each here, so G_K and G_V are the sums over those heads, as "
                   "autograd's are.")
    chart(grad_views.gradients_figure(result, keys), key="grad_chart")
    rows = result.formula["G_P"].shape[0]
    row = st.selectbox("follow one query row: G_O → G_P → G_S", list(range(rows)), index=grad_views.default_row(result),
                       format_func=lambda i: keys[i] if i < len(keys) else str(i), key=f"grad_follow_{step}")
    st.caption(grad_views.row_sentence(result, row, keys))
    st.dataframe(grad_views.row_table(result, row, keys), hide_index=True, key="grad_row_table",
                 column_config={c: st.column_config.NumberColumn(format="%.3e") for c in (
                     "G_P,rj = G_O,r·v_j", "G_P,rj − Σ P·G_P", "G_S,rj = P_rj·(G_P,rj − Σ P·G_P)",
                     "G_S,rj (autograd)")})
    st.caption(grad_views.norms_sentence(result))
    chart(grad_views.gradient_norms_figure(result), key="grad_norms_chart")


def gradient_capture(gen, step: int, loss: str) -> None:
    """The gradients capture level: ∂L/∂x at every hook point, kept within the budget, saved like a values trace."""
    app = state()
    st.subheader("∂L/∂x at every hook point")
    budget = gen.trace.log.budget_bytes
    st.markdown(f"The same backward pass, read at every hook point of the model: one record per tensor x, named "
                f"by its hook point, holding ∂L/∂x with x's shape. The values are kept within this generation's "
                f"budget ({budget / 2**20:.0f} MiB; past it, the oldest are summarised) and saved in the trace "
                "file format of a values trace, which tracer.load_trace reads back.")
    wanted = (step, loss)
    if st.button("Record ∂L/∂x at every hook point", key="grad_capture"):
        refusal = reserve_memory(gradient_bytes=budget)  # at most the budget: the server's total, shared
        if refusal:
            st.error(f"Not recorded: {refusal}")
            return
        try:
            with st.spinner("forward and backward…"):
                app.live.gradient_trace = (wanted, gradient_trace(gen, step, loss))
        except ValueError as e:
            app.live.gradient_trace = None
            st.error(plain(e))
            return
        finally:
            reserve_memory()  # what it holds now, not the budget
    if app.live.gradient_trace is None or app.live.gradient_trace[0] != wanted:
        st.caption(f"Press the button to record step {step}'s gradients for L = {loss}.")
        return
    grads = app.live.gradient_trace[1]
    note = grads.value_note(grads.records[0]) if grads.records else "the backward pass reached no hook point"
    st.caption(plain(note))
    table = grads.to_frame(0)
    st.dataframe(table[[c for c in ("name", "shape", "axes", "dtype", "has_value", "min", "max", "std")
                        if c in table.columns]], hide_index=True, height=320, key="grad_capture_table")
    st.download_button(f"Download the gradients trace of step {step} (.zip, the trace file format)",
                       data=lambda: archive_bytes(grads), file_name=f"gradients-step{step}.zip",
                       mime="application/zip", key="grad_capture_download", on_click="ignore")


def flash_section(trace: Trace, step: int, layer: int, head: int, batch: int) -> None:
    cols = st.columns(3)
    block = cols[0].selectbox("tile size (keys per tile, rows per query block)", list(flash_views.BLOCK_SIZES),
                              index=1, key="flash_block", persist_state="page")
    n = trace.record(act_name("q", layer), step).shape[2]
    first = positions(trace, step)[1] - n  # this step's query rows are the last n columns
    blocks = -(-n // block)
    default = flash_views.default_query_block(trace, step, batch, block)  # the last real row's block
    query_block = cols[1].selectbox(  # keyed by the size: the blocks differ
        "query block", list(range(blocks)),
        format_func=lambda i: f"columns {first + i * block}…{first + min(n, (i + 1) * block) - 1}",
        index=default, key=f"flash_rows_{block}") if blocks > 1 else 0
    run = flash_views.flash_attention(trace, step, layer, head, batch, block=block, query_block=query_block)
    if run is None:
        explain_missing_values(trace, step, "Q, K, V, M and O values")
        return
    sentence, metrics = flash_views.flash_takeaway(run)
    takeaway(sentence, metrics, details=(
        "FlashAttention (Dao et al., 2022) computes the same O = softmax(S)·V without ever holding the n × t "
        "scores S: it reads K and V one tile of keys at a time and keeps, for each query row, a running max m, a "
        "running sum ℓ = Σ exp(s − m) and an unnormalised output. When a tile raises a row's max, what was summed "
        "so far is multiplied by exp(m_old − m_new) (the online softmax); after the last tile, output / ℓ is the "
        "softmax-weighted sum exactly. A tile whose every cell is masked (above the causal diagonal, or all "
        "padding) is skipped, as FlashAttention-2 does. Below, this head's own Q, K, V and M, tile by tile, "
        "recomputed in float64.\n\n" + flash_views.memory_sentence(run)))
    padding = flash_views.padding_rows_note(trace, step, batch, run)
    if padding:
        st.caption(padding)
    last = len(run.tiles) - 1
    tile = cols[2].slider("tiles read", 0, last, last, key=f"flash_tile_{block}_{query_block}") if last else 0
    chart(flash_views.flash_figure(trace, step, run, tile), key="flash_chart")
    st.caption(flash_views.tile_sentence(run, tile))
    rows = run.rows[1] - run.rows[0]
    labels = query_labels(trace, step, batch)[run.rows[0]:run.rows[1]]
    row = st.selectbox("follow one query row, tile by tile", list(range(rows)), index=rows - 1,
                       format_func=lambda i: f"column {first + run.rows[0] + i}: {labels[i]}",
                       key=f"flash_follow_{block}_{query_block}") if rows > 1 else 0
    st.dataframe(flash_views.row_table(run, row), hide_index=True, key="flash_row_table",
                 column_config={name: st.column_config.NumberColumn(format="%.4g") for name in (
                     "m_old", "m_new", "exp(m_old − m_new)", "ℓ before", "Σ exp(s − m_new) of the tile", "ℓ after",
                     "max |Δ output|")})
    st.caption("Each read tile: m_new = max(m_old, the tile's largest score); ℓ after = exp(m_old − m_new)·ℓ before "
               "+ Σ exp(s − m_new) over the tile; the output so far is rescaled by the same factor and the tile's "
               "exp(s − m_new)·v added, then divided by ℓ.")


def query_picker(trace: Trace, step: int, layer: int, head: int, batch: int, show: bool = True) -> int:
    queries = query_labels(trace, step, batch, layer)
    # keyed by step and sequence: the query rows differ between steps (n0 at the prefill, 1 after); the pick
    # per step is remembered in the app state, since Streamlit forgets a widget that was not drawn
    picks = state().live.query_picks
    remembered = picks.get((step, batch), len(queries) - 1)
    index = remembered if remembered < len(queries) else len(queries) - 1
    if len(queries) <= attn_views.QUERY_ROW_LIMIT:
        pick = st.selectbox("query token: which keys does it attend to?", list(range(len(queries))), index=index,
                            format_func=lambda i: queries[i], key=f"attn_query_s{step}_b{batch}_{int(show)}")
    else:  # a long prompt: a list of every row would send each label to the browser; a number names one row
        pick = int(st.number_input(f"query row (0 … {len(queries) - 1:,}): which keys does it attend to?", 0,
                                   len(queries) - 1, index, key=f"attn_query_n{step}_b{batch}_{int(show)}"))
        st.caption(f"query row {pick:,}: {queries[pick]}")
    picks[(step, batch)] = pick
    if show:
        st.markdown(attn_views.query_attention_html(trace, step, layer, head, pick, batch), unsafe_allow_html=True)
    return pick


def rope_section(trace: Trace, step: int, layer: int, head: int, batch: int) -> None:
    reason = rope_views.rope_not_drawn(trace)
    if reason is not None:
        st.info(reason)
        return
    details = ("RoPE turns position into rotation: q at position m becomes R(m)q and k at position n becomes "
               "R(n)k, rotating each pair of dimensions i by the angle m·θᵢ. Since R(m)ᵀR(n) = R(n − m), the "
               "score R(m)q · R(n)k depends on the positions only through m − n (Su et al., 2021, RoFormer). "
               "This model, like Hugging Face's Llama, pairs dimension i with i + d_head/2 (the two halves); the "
               "RoFormer paper writes the rotation on consecutive pairs (2i, 2i + 1) — the same rotations on "
               "a permuted order of dimensions. Rows are labelled by column, as in every view; the position a "
               "token is rotated with counts the real tokens before it (padding does not move it).")
    relative = rope_views.rope_relative_figure(trace, step, layer, head, batch)
    if relative is not None:
        takeaway(rope_views.rope_takeaway(relative), details=details)
    else:
        st.markdown(details)
    figure = rope_views.rope_figure(trace, step, layer, head, batch)
    if figure is None:
        explain_missing_values(trace, step, "Q and K before and after the rotation")
        return
    chart(figure, key="rope_chart")
    if relative is not None:
        chart(relative, key="rope_relative_chart")
    else:
        st.caption(f"Sequence {batch} has no token among this step's rows (only padding), so there is no query and "
                   "key of its own to rotate.")


def heads_grid(trace: Trace, step: int, batch: int, picked: tuple[int, int]) -> None:
    attending = attention_layers(trace)
    if not attending:  # a state-space model (Mamba): said once by attention_tab
        return
    first = act_name("pattern", attending[0])  # a hybrid model's layer 0 may have no attention
    if trace.get(first, step) is None and pattern_digest(trace, trace.record(first, step)) is None:
        explain_missing_values(trace, step, "attention patterns")
        return
    model = live_model_for(trace)
    scores = scores_for(model) if model is not None else None
    grid = attn_views.all_heads_figure(trace, step, batch, scores=scores, picked=picked)
    st.caption("Layers × heads at this step (click a head to open it above)."
               + (f" {grid.note[0].upper()}{grid.note[1:]}." if grid.note else "")
               + (" Each tile names the head's clearest role where its score reaches 0.3, measured on 4 random token "
                  "sequences each repeated twice: previous-token (weight on the key just before), induction (in "
                  "the repeat, weight on the key after the earlier occurrence of the same token), duplicate-token "
                  "(on that earlier occurrence), first-token (on key 0). Hover a head for all four."
                  if scores else ""))
    event = chart(grid.figure, key="all_heads_chart", on_select="rerun", selection_mode="points")
    points = event.selection.points if event is not None and hasattr(event, "selection") else []
    if points and "customdata" in points[0]:
        layer, head = points[0]["customdata"][:2]
        if (layer, head) != picked:
            state().pending_head = (int(layer), int(head))
            st.rerun(scope="fragment")


def scores_for(model) -> dict:
    """Head scores of ``model``, computed once per model and process (a probe forward)."""
    gen = state().live.generation
    return cached_head_scores(identity_of(model).weights_digest, first_token(gen.tokenizer if gen else None), model)


@st.cache_resource(show_spinner="Measuring what each head does…", max_entries=4)
def cached_head_scores(digest: str, first: int, _model) -> dict:
    return head_scores(_model, first_token=first)
