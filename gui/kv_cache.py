"""KV cache: this step's K and V, their memory, and the latest step redone with and without the cache; the
cache over the steps."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.figures import cache as cache_views
from gpt_shape_tracer.figures import cache_classes as class_views
from gpt_shape_tracer.figures import cache_precision as precision_views
from gpt_shape_tracer.figures import common as common_views
from gpt_shape_tracer.figures import compressed_cache as compressed_views
from gpt_shape_tracer.figures.common import attention_layers, facts_of, positions
from gpt_shape_tracer.gui.common import (
    chart,
    layer_head_batch,
    panels,
    plain,
    remembered_tabs,
    said_no_attention,
    state,
    values_kept,
)
from gpt_shape_tracer.gui.server import reserve_memory
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.model.sources import HFDecoder
from gpt_shape_tracer.session import caches, no_cache_reason
from gpt_shape_tracer.tracer import CACHE_CLASSES, CacheClassError, Trace, cache_class_run, cache_precision

RECOMPUTE_REPEATS = 5  # timings of the cache comparison on demand: the fastest of this many runs


def cache_tab(trace: Trace, step: int) -> None:
    gen = state().live_generation
    reason = no_cache_reason(gen.model) if gen is not None and gen.trace is trace else None
    if reason is not None:  # a model that keeps no cache at all (OpenAI GPT, your own module)
        st.warning(f"{_capital(reason)}: every step recomputes K and V for all positions, and so does this trace. "
                   "The table shows what each step computed.")
    elif not facts_of(trace).info.use_cache:
        st.warning("The KV cache is off for this generation: every step recomputes K and V for all positions. "
                   "The table shows what each step computed.")
    # two views, drawn only when open: a Step then redraws one chart of this tab, not two
    this_step, over_steps, cheaper, classes, growth = remembered_tabs(
        ["This step", "Over the steps", "A cheaper cache", "transformers' cache classes", "What grows with n"],
        "kv_view")
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
            if compressed_views.compressed_layers(trace):  # DeepSeek-V4: its cache compresses K and V
                compressed_section(trace, step)
    with cheaper:
        if cheaper.open:
            cheaper_cache()
    with classes:
        if classes.open:
            cache_classes()
    with growth:
        if growth.open and trace.config is not None and not attention_layers(trace):
            st.info("This model has no softmax attention (every layer keeps a fixed-size state): nothing here grows "
                    "with n as attention's scores and a KV cache do. What it keeps instead is under This step.")
        elif growth.open and trace.config is not None:
            q = trace.record(act_name("q", attention_layers(trace)[0]), step)
            itemsize = q.nbytes // max(1, q.numel)  # the model's dtype: 4 B in float32, 2 in bfloat16
            n, t = positions(trace, step)  # with CPM-Ant's learned prompt positions, which every step runs too
            figure, sentence = cache_views.growth_figure(trace.config, t, itemsize, n,
                                                         cache_views.window_layers(trace, step))
            line, metrics = cache_views.growth_takeaway(trace.config, t, itemsize, n, facts_of(trace).batch_size)
            takeaway(line, metrics, details=(
                "Counted from this model's widths for a full forward of n positions (no cache), n from 1 to its n_ctx, "
                "both axes logarithmic: the time of attention is O(n²·d), of everything else O(n·d²); its memory "
                "O(n²) for the scores against O(n·d) for the cache (Vaswani et al., 2017).\n\n" + sentence))
            chart(figure, key="growth_chart")


def compressed_section(trace: Trace, step: int) -> None:
    """Compressed attention (DeepSeek-V4): the bytes its cache held per step against K and V of every position,
    and the compressed entries of each layer (figures/compressed_cache.py)."""
    st.subheader("Compressed K and V")
    st.caption("This model's compressed layers pool every m positions into one entry of K = V, which the attention "
               "reads after a sliding window of recent rows (a CSA layer's indexer picks which entries each query "
               "reads). The bytes are the sum of what its cache layers held after each step — window, compressed "
               "entries, the indexer's keys, rows of a window not yet full —; the uncompressed cache is K and V of "
               "every position in every layer at the model's head sizes.")
    table = compressed_views.compressed_table(trace)
    st.markdown(f"**{compressed_views.compressed_sentence(table, step)}**")
    chart(compressed_views.compressed_figure(table, step), key="compressed_chart")
    st.dataframe(table, hide_index=True, key="compressed_table")


def cheaper_cache() -> None:
    """The same prompt with K and V stored at a lower precision, against the model's own (tracer.cache_precision)."""
    app = state()
    gen = app.live_generation
    if gen is None:
        st.info("This experiment runs the live model on this generation's prompt: Step once (or leave the file view).")
        return
    if not caches(gen.model):
        st.info(f"{_capital(str(no_cache_reason(gen.model)))}: there is no cache to store more cheaply.")
        return
    st.markdown("A cache can store its keys and values in fewer bytes: bfloat16 or float16 (2 bytes a number), or "
                "int8 (1 byte a number and one float32 scale per row of each head: q = round(x/s), s = max|x|/127, "
                "read back as q·s). Below, this generation's prompt runs greedily twice side by side — with the "
                "cache in the model's own precision and with the cheaper one — both fed the same tokens, so each "
                "step compares the same context.")
    cols = st.columns([2, 1, 1])
    storage = cols[0].selectbox("store K and V as", ["bfloat16", "float16", "int8"], index=2, key="kv_storage",
                                persist_state="page")
    steps = int(cols[1].number_input("steps", min_value=1, max_value=64, value=16, key="kv_storage_steps",
                                     persist_state="page"))
    if cols[2].button("Run both", key="kv_storage_run", type="primary"):
        try:
            with st.spinner("running both caches…"):
                app.live.precision = cache_precision(gen, storage, steps)
        except ValueError as e:
            st.error(plain(e))
    run = app.live.precision
    if run is None:
        st.caption("Choose a format and the number of steps, then run.")
        return
    first = run.first_difference
    st.markdown(f"**{cache_views.precision_takeaway(run)}**")
    metrics = st.columns(3)
    metrics[0].metric(f"{run.storage} cache after {len(run.steps)} steps", f"{run.stored_bytes:,} B",
                      f"{run.stored_bytes / run.reference_bytes - 1:+.0%} against {run.reference_bytes:,} B",
                      delta_color="inverse")
    metrics[1].metric("largest |Δ logits|", f"{max(s.max_abs_delta for s in run.steps):.3g}")
    metrics[2].metric("first step whose choice differs", "none" if first is None else str(first))
    st.caption(precision_views.sharing_sentence(run))
    chart(precision_views.precision_figure(run), key="precision_chart")


def cache_classes() -> None:
    """This generation's prompt decoded greedily with one of transformers' own cache classes, step by step
    (tracer.cache_class_run), beside a full-precision dynamic cache."""
    gen = state().live_generation
    if gen is None:
        st.info("This experiment runs the live model on this generation's prompt: Step once (or leave the file view).")
        return
    if isinstance(gen.model, HFDecoder) and not caches(gen.model):
        st.info(f"{_capital(str(no_cache_reason(gen.model)))}: there is no cache for transformers' cache classes to "
                "hold.")
        return
    if not isinstance(gen.model, HFDecoder):
        st.info("This model runs our own forward and our own KV cache (the rounding of **A cheaper cache** is "
                "ours), not transformers' cache classes: load a model directory with the transformers "
                "implementation to run them.")
        return
    st.markdown("transformers' own cache classes, as `generate()` builds them: **dynamic** grows a row a step; "
                "**static** reserves every row up front and fills it; **sliding** (a model with sliding-window "
                "layers) keeps the window and drops the rest; **quantized-fp8** (`Fp8QuantizedLayer`) stores K and V "
                "in 8 bits with one scale per tensor — transformers' real fp8 cache, where **A cheaper cache** is "
                "our own rounding —; **offloaded** keeps each layer on the CPU between uses (CUDA only). The prompt "
                "runs greedily with the class and, fed the same tokens, with a full-precision dynamic cache.")
    cols = st.columns([2, 1, 1])
    choice = cols[0].selectbox("cache class", list(CACHE_CLASSES), key="kv_class", persist_state="page")
    steps = int(cols[1].number_input("steps", min_value=1, max_value=64, value=8, key="kv_class_steps",
                                     persist_state="page"))
    app = state()
    if cols[2].button("Run", key="kv_class_run", type="primary"):
        # each step keeps its logits row [V] in float32 (the rest is a few numbers per layer)
        refused = reserve_memory(decoding_bytes=app.held_bytes()["decoding"] + steps * gen.model.config.vocab_size * 4)
        if refused:
            st.error(refused)
            return
        try:
            with st.spinner(f"decoding with the {choice} cache…"):
                app.live.cache_class = cache_class_run(gen.model, gen.tokenizer, gen.info.prompts[0], choice, steps)
        except CacheClassError as e:
            st.error(plain(e))
        finally:
            reserve_memory()  # what the run keeps, now it is done
    run = app.live.cache_class
    if run is None:
        st.caption("Choose a class and the number of steps, then run.")
        return
    if run.note:
        st.warning(run.note)
    sentence, metrics = class_views.cache_class_takeaway(run)
    takeaway(sentence, metrics)
    layer = 0
    if run.cache in ("static", "sliding") and run.n_layer > 1:
        layer = int(st.number_input("layer", min_value=0, max_value=run.n_layer - 1, value=0, key="kv_class_layer"))
    chart(class_views.cache_class_figure(run, layer), key="kv_class_chart")
    st.dataframe([{"step": e.step, "event": e.kind, "layer": "all" if e.layer is None else e.layer,
                   "what": e.sentence()} for e in run.events], hide_index=True, key="kv_class_events")


def key_heatmap(trace: Trace, step: int, layer: int, head: int, batch: int, column) -> None:
    """One head's cached K or V (or a latent-attention layer's c_KV, k_R) at an attention layer."""
    latent = cache_views.latent_records(trace, step, layer) is not None
    tensors = ["K", "V", "c_KV", "k_R"] if latent else ["K", "V"]  # latent attention: what its cache holds too
    which = column.radio("tensor", tensors, horizontal=True, key="kv_which", persist_state="page")
    which = which if which in tensors else "K"
    kv = 0 if which in ("c_KV", "k_R") else common_views.kv_head(trace, layer, head, step)
    if values_kept(trace, step, act_name(cache_views.HEATMAP_HOOKS[which], layer), f"{which} values"):
        panels(cache_views.key_heatmap_figure(trace, step, layer, kv, batch, which), key="kv_chart")


def cache_this_step(trace: Trace, step: int) -> None:
    app = state()
    facts = facts_of(trace)
    st.dataframe(cache_views.cache_table(trace, step), hide_index=True, key="cache_table")
    if facts.info.use_cache and compressed_views.compressed_layers(trace):
        # compressed attention: K, V above are what the attention read (window, new rows, compressed entries); what
        # the cache holds is counted from its own records, not by 2·B·G·t·d_head
        st.caption(compressed_views.compressed_sentence(compressed_views.compressed_table(trace), step)
                   + " (Over the steps: every step, and K and V of every position for comparison.)")
    elif facts.info.use_cache:
        latex, sentence = cache_views.memory_formula(trace, step)
        st.latex(latex)
        st.caption(sentence)
        held_state = cache_views.state_sentence(trace, step)
        if held_state is not None:
            st.caption(held_state)
    cols = st.columns([3, 1])
    with cols[0]:
        layer, head, batch = layer_head_batch(trace, "kv")
    if not said_no_attention(trace, layer, "Its state's shapes and bytes are in the table above (state, state "
                             "bytes): no K or V rows to draw."):
        key_heatmap(trace, step, layer, head, batch, cols[1])
    st.subheader("Cache on vs off")
    comparisons = facts.comparisons
    gen = app.live_generation
    latest = gen is not None and step == gen.n_steps - 1
    if gen is not None and not caches(gen.model):
        st.info(f"{_capital(str(no_cache_reason(gen.model)))}: every step recomputes all positions, and there is no "
                "cached path to compare it with.")
    elif gen is not None and latest and st.button(
            "Measure this step again, timing each path 5 times", key="measure_recompute",
            help="Redo the latest step untraced with the cache and as a full recompute; count, time (fastest of 5) "
                 "and compare the logits"):
        gen.compare_with_recompute(timing_repeats=RECOMPUTE_REPEATS)
        comparisons = facts_of(trace).comparisons
    if step in comparisons:
        c = comparisons[step]
        level, text = cache_views.verdict(c, trace)
        getattr(st, level)(text)
        st.dataframe(cache_views.evidence_table(c), hide_index=True, key="evidence_table")
        if c.cached_rows_delta:
            st.caption("The rows the cache held, layer by layer, against the same rows recomputed from every token:")
            rows = len(c.cached_rows_delta)
            st.dataframe(cache_views.cached_rows_table(c, trace), hide_index=True, key="cached_rows_table",
                         height=min(400, 38 + 35 * rows))  # as tall as its rows, scrolling past 10
        warning = cache_views.timing_warning(c)
        if warning:
            st.warning(warning)
    elif gen is not None and not latest:
        st.caption("This step was not compared with a recompute; go to the latest step to measure it.")
    elif gen is not None:
        if caches(gen.model):  # no button for a model that keeps no cache (said above)
            st.caption("Press the button to redo this step both ways and compare.")
    else:
        st.caption("The file holds no comparison for this step.")
    st.caption("The query rows and multiply-adds of every step are under **Over the steps**.")


def _capital(clause: str) -> str:
    """A clause that starts in lower case (``no_cache_reason``) at the start of a sentence."""
    return clause[:1].upper() + clause[1:]
