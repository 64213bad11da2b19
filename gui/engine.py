"""Engine: the KV cache as serving engines hold it. Several requests, some arriving at later engine steps, run through
transformers' continuous batching on the sidebar's model (its files loaded through transformers where our own GPT
holds them: ours cannot take the paged path); the page pool over engine steps with a request's block table, the
requests' timeline, memory against a padded contiguous cache, a request's attention over its pages. A saved engine
run (.zip) opens here too. A run made here is kept in the runs folder and named in the page's address (gui/runs.py),
so a reload or a restarted server brings it back with the engine step and the picks on screen.

A tab of its own rather than a page like the dry run: it runs the model the sidebar chose, as the other tabs do, and
it needs no generation — so it is offered before the first Step as well."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
import streamlit as st

from gpt_shape_tracer.figures import engine as views
from gpt_shape_tracer.gui.common import chart, loaded_model, plain, state
from gpt_shape_tracer.gui.runs import forget_engine_run, keep_engine_run, save_engine_view
from gpt_shape_tracer.gui.server import reserve_memory
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.model import ModelLoadError
from gpt_shape_tracer.session import ModelChoice, SettingsError
from gpt_shape_tracer.session.engine import (
    DEFAULT_REQUESTS,
    ENGINE_BUDGET_BYTES,
    MAX_APP_BATCH_TOKENS,
    MAX_APP_NEW_TOKENS,
    MAX_APP_PAGE_SIZE,
    MAX_APP_PAGES,
    MAX_POOL_BYTES,
    MIN_PAGE_SIZE,
    EngineView,
    directory_of,
    engine_model,
    engine_refusal,
    engine_run,
    open_engine_file,
    parse_engine_form,
    pool_bytes,
    view_of,
)
from gpt_shape_tracer.tracer import EngineError, Trace, TraceFileError, save_engine_run

HOW = ("Choose a bundled model or **Local Hugging Face directory** under Weights in the sidebar (a folder that "
       "save_pretrained wrote: Llama, Qwen2, GPT-2, Mistral or any decoder transformers runs): the Engine tab loads "
       "its files through transformers.")


@st.cache_resource(show_spinner="Loading the model through transformers…", max_entries=1)
def engine_model_of(choice: ModelChoice):
    """The model the engine runs for ``choice`` (``session.engine.engine_model``), loaded once and kept while it is
    the newest asked for."""
    model, tokenizer = loaded_model(choice)
    return engine_model(model, tokenizer, choice)


def engine_tab(trace: Trace | None = None, step: int = 0) -> None:
    """The tab (``trace`` and ``step`` are the generation's: the engine runs on its own)."""
    app = state()
    st.caption("Serving engines keep the KV cache in a pool of fixed-size **pages**; each request's **block table** "
               "maps its logical positions to pages; requests arrive and finish mid-run, so one **engine step** mixes "
               "prefill chunks of new requests with decode tokens of old ones; identical prompt prefixes share pages. "
               "This runs transformers' own continuous batching, one engine step at a time, traced.")
    runnable = model_note(app.model)
    with st.form("engine_form", border=False):
        requests = st.text_area("Requests (one prompt per line)", DEFAULT_REQUESTS, key="engine_requests", height=96)
        arrivals = st.text_input("Arrival step of each request (comma-separated; missing ones arrive at step 0)",
                                 "0, 0, 3", key="engine_arrivals")
        cols = st.columns(4)
        page_size = cols[0].number_input("page size (positions)", MIN_PAGE_SIZE, MAX_APP_PAGE_SIZE, 4,
                                         key="engine_page_size")
        pages = cols[1].number_input("pages in the pool", 1, MAX_APP_PAGES, 32, key="engine_pages")
        batch = cols[2].number_input("max batch tokens", 1, MAX_APP_BATCH_TOKENS, 16, key="engine_batch_tokens",
                                     help="query tokens one engine step may hold: prefill chunks + decode tokens")
        new = cols[3].number_input("new tokens per request", 1, MAX_APP_NEW_TOKENS, 6, key="engine_new_tokens")
        submitted = st.form_submit_button("Run the engine", type="primary", disabled=not runnable, key="engine_run")
    if submitted:
        run_it(app, requests, arrivals, int(page_size), int(pages), int(batch), int(new))
    with st.expander("Open a saved engine run (.zip)"):
        upload = st.file_uploader("An engine run written by gpt-shape-tracer trace --continuous-batching --out, or "
                                  "saved here", type=["zip"], key="engine_file")
        if upload is not None and st.button("Open it", key="engine_open"):
            open_file(app, upload)
    view = app.engine.view
    if view is None:
        return
    engine_views(view)


def model_note(choice: ModelChoice) -> bool:
    """Say what the engine will run for the sidebar's choice; False (with the reason and what to do) when nothing."""
    try:
        model, _ = loaded_model(choice)
    except ModelLoadError as e:
        st.error(f"The sidebar's model cannot be loaded: {plain(e)}")
        return False
    refusal = engine_refusal(model, choice)
    if refusal is None:
        return True
    directory = directory_of(choice)
    if directory is None:
        st.error(f"This model cannot run the engine: {plain(refusal)}. {HOW}")
        return False
    st.info(f"The sidebar's model is our own GPT, which the engine refuses: {plain(refusal)}. The Engine tab loads "
            f"the same files ({plain(directory)}) through transformers instead: the same weights, a second "
            "copy of them in memory.")
    return True


def run_it(app, requests: str, arrivals: str, page_size: int, pages: int, batch: int, new: int) -> None:
    try:
        form = parse_engine_form(requests, arrivals, page_size, pages, batch, new)
    except SettingsError as e:
        st.error(f"These requests cannot run: {plain(e)}")
        return
    try:
        model, tokenizer = engine_model_of(app.model)
    except (ModelLoadError, EngineError) as e:
        st.error(f"{plain(e)}. {HOW}")
        return
    if tokenizer is None:
        st.error("This model has no tokenizer, so its requests cannot be typed as text. " + HOW)
        return
    size = pool_bytes(model, form)
    if size > MAX_POOL_BYTES:
        st.error(f"A pool of {form.pages} pages of {form.page_size} positions takes {size:,} B on this model, over the "
                 f"{MAX_POOL_BYTES:,} B a traced run may hold: give fewer pages or a smaller page size.")
        return
    refused = reserve_memory(engine_bytes=size + ENGINE_BUDGET_BYTES)  # the pool while it runs, and its values
    if refused:
        st.error(refused)
        return
    try:
        with st.spinner("running the engine…"):
            run = engine_run(model, tokenizer, form)
    except EngineError as e:
        st.error(f"The engine refused or stopped: {plain(e)}")
        reserve_memory()
        return
    app.engine.view = view_of(run, tokenizer, app.model.describe())
    reserve_memory()  # the pool is gone: what the run keeps
    st.session_state["engine_step"] = peak_step(app.engine.view)
    form_values = dict(zip(("engine_requests", "engine_arrivals", "engine_page_size", "engine_pages",
                            "engine_batch_tokens", "engine_new_tokens"),
                           (requests, arrivals, page_size, pages, batch, new)))
    keep_engine_run(app, form_values, peak_step(app.engine.view))  # a reload brings it back (gui/runs.py)


def open_file(app, upload) -> None:
    refused = reserve_memory(engine_bytes=upload.size)
    if refused:
        st.error(refused)
        return
    try:
        app.engine.view = open_engine_file(upload.getvalue(), upload.name)
    except TraceFileError as e:
        st.error(f"Could not open {plain(upload.name)}: {plain(e)}")
        return
    finally:
        reserve_memory()
    forget_engine_run(app)  # the file is not a run of the runs folder: the person holds it
    st.session_state["engine_step"] = peak_step(app.engine.view)


def peak_step(view: EngineView) -> int:
    """The engine step with the most pages held (the first of them): where the pool says the most."""
    steps = view.run.steps
    return max(range(len(steps)), key=lambda i: (steps[i].pages_in_use, -i)) if steps else 0


def engine_views(view: EngineView) -> None:
    run = view.run
    if not run.steps:
        st.info("No engine step ran.")
        return
    summary = views.run_takeaway(run)
    takeaway(summary.sentence, summary.metrics)
    st.caption(f"Run on {plain(view.source)}: a pool of {run.pool.pages} pages × {run.pool.page_size} positions "
               f"({run.pool.pool_bytes:,} B), {run.pool.max_batch_tokens} tokens per engine step, "
               f"{run.pool.dtype}." + (" " + " ".join(plain(n) for n in run.notes) if run.notes else ""))
    last = len(run.steps) - 1
    if st.session_state.get("engine_step", 0) > last:
        st.session_state["engine_step"] = last
    step = st.slider("Engine step", 0, last, key="engine_step") if last else 0
    ids = [r.request_id for r in run.requests]
    rid = st.selectbox("Request", ids, key="engine_request",
                       format_func=lambda r: f"{r}: {run.request(r).prompt or ''}"[:80])
    s = run.steps[step]
    st.markdown(views.step_sentence(run, step))
    cols = st.columns(4)
    cols[0].metric("held after this step", f"{s.pages_in_use} pages")
    cols[1].metric("shared after it", f"{len(s.shared)} pages")
    cols[2].metric("cached after it", f"{len(s.cached)} pages")
    cols[3].metric("free after it", f"{s.pages_free} pages")
    left, right = st.columns([3, 2])
    with left:
        chart(views.pool_grid_figure(run, step, rid), key="engine_pool")
    with right:
        st.markdown(f"**{rid}'s block table**")
        st.caption(views.block_table_sentence(run, step, rid))
        rows = views.block_table_rows(run, step, rid)
        if rows:
            st.dataframe(pd.DataFrame(rows), hide_index=True, key="engine_table")
    st.caption(views.pool_caption(run, step))
    chart(views.timeline_figure(run, step), key="engine_timeline")
    st.markdown(views.request_sentence(run, rid))
    text = view.texts.get(rid)
    request = run.request(rid)
    if text is not None:
        st.caption(f"{rid} asked {plain(request.prompt or '')!s} and generated: {plain(text)}")
    else:
        st.caption(f"{rid} generated the token ids {', '.join(map(str, request.generated_ids))}.")
    chart(views.memory_figure(run, step), key="engine_memory")
    st.markdown(views.memory_sentence(run, step))
    layer, head = attention_part(run, step, rid)
    save_engine_view(state(), step, {"engine_request": rid, "engine_layer": layer, "engine_head": head})
    if st.button("Save this engine run (.zip)", key="engine_save"):  # written on demand: not at every step's draw
        with tempfile.TemporaryDirectory() as folder:
            path = save_engine_run(run, Path(folder) / "engine-run.zip")
            st.download_button("Download engine-run.zip", path.read_bytes(), "engine-run.zip",
                               mime="application/zip", key="engine_download")


def attention_part(run, step: int, rid: str) -> tuple[int, int]:
    """The attention of the picked request at the step; returns the layer and head picked."""
    cols = st.columns(2)
    layer = cols[0].selectbox("layer", list(range(run.pool.n_layer)), key="engine_layer")
    head = cols[1].selectbox("head", list(range(run.pool.n_head)), key="engine_head")
    if run.attention(step, rid, layer) is not None:
        chart(views.attention_figure(run, step, rid, layer, head), key="engine_attention")
    st.caption(views.attention_caption(run, step, rid, layer))
    return layer, head


__all__ = ["engine_tab"]
