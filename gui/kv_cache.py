"""KV cache: this step's K and V, their memory, and the latest step redone with and without the cache; the
cache over the steps."""

from __future__ import annotations

import streamlit as st

from figures import attention as attn_views
from figures import cache as cache_views
from figures.common import facts_of
from gui.common import chart, layer_head_batch, remembered_tabs, state, values_kept
from model.hook_table import act_name
from session import caches
from tracer import Trace

RECOMPUTE_REPEATS = 5  # timings of the cache comparison on demand: the fastest of this many runs


def cache_tab(trace: Trace, step: int) -> None:
    if not facts_of(trace).info.use_cache:
        st.warning("The KV cache is off for this generation: every step recomputes K and V for all positions. "
                   "The table shows what each step computed.")
    # two views, drawn only when open: a Step then redraws one chart of this tab, not two
    this_step, over_steps = remembered_tabs(["This step", "Over the steps"], "kv_view")
    with this_step:
        if this_step.open:
            cache_this_step(trace, step)
    with over_steps:
        if over_steps.open:
            ran = ("this run used the cache" if facts_of(trace).info.use_cache else
                   "this run has the cache off, so it computed the rows without")
            st.caption("Every step so far, counted: what the cache holds, the query rows a step computes with the "
                       f"cache and without it ({ran}), and the multiply-adds of both paths at the steps compared "
                       "with a recompute. The step shown is marked.")
            chart(cache_views.cache_steps_figure(trace, step), key="steps_chart")


def cache_this_step(trace: Trace, step: int) -> None:
    app = state()
    facts = facts_of(trace)
    st.dataframe(cache_views.cache_table(trace, step), hide_index=True, key="cache_table")
    if facts.info.use_cache:
        latex, sentence = cache_views.memory_formula(trace, step)
        st.latex(latex)
        st.caption(sentence)
    cols = st.columns([3, 1])
    with cols[0]:
        layer, head, batch = layer_head_batch(trace, "kv")
    which = cols[1].radio("tensor", ["K", "V"], horizontal=True, key="kv_which", persist_state="page")
    kv = attn_views.kv_head(trace, layer, head, step)
    if values_kept(trace, step, act_name("k_all" if which == "K" else "v_all", layer), f"{which} values"):
        chart(cache_views.key_heatmap_figure(trace, step, layer, kv, batch, which), key="kv_chart")
    st.subheader("Cache on vs off")
    comparisons = facts.comparisons
    gen = app.generation if not app.viewing_file else None
    latest = gen is not None and step == gen.n_steps - 1
    if gen is not None and not caches(gen.model):
        st.info("Your module runs its own forward, without our KV cache: every step recomputes all positions, "
                "and there is no cached path to compare it with.")
    elif latest and st.button("Measure this step again, timing each path 5 times", key="measure_recompute",
                            help="Redo the latest step untraced with the cache and as a full recompute; count, "
                                 "time (fastest of 5) and compare the logits"):
        gen.compare_with_recompute(timing_repeats=RECOMPUTE_REPEATS)
        comparisons = facts_of(trace).comparisons
    if step in comparisons:
        c = comparisons[step]
        level, text = cache_views.verdict(c)
        getattr(st, level)(text)
        st.dataframe(cache_views.evidence_table(c), hide_index=True, key="evidence_table")
        if c.cached_rows_delta:
            st.caption("The rows the cache held, layer by layer, against the same rows recomputed from every token:")
            rows = len(c.cached_rows_delta)
            st.dataframe(cache_views.cached_rows_table(c), hide_index=True, key="cached_rows_table",
                         height=min(400, 38 + 35 * rows))  # as tall as its rows, scrolling past 10
        warning = cache_views.timing_warning(c)
        if warning:
            st.warning(warning)
    elif gen is not None and not latest:
        st.caption("This step was not compared with a recompute; go to the latest step to measure it.")
    elif gen is not None:
        st.caption("Press the button to redo this step both ways and compare.")
    else:
        st.caption("The file holds no comparison for this step.")
    st.caption("The query rows and multiply-adds of every step are under **Over the steps**.")
