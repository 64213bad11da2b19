"""Compare runs: this run against a trace file or a rerun (cache toggled, heads off), record by record."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.figures import whatif as whatif_views
from gpt_shape_tracer.figures.view_takeaways import compare_takeaway
from gpt_shape_tracer.gui.common import UPLOAD_MB, chart, plain, read_uploaded_trace, state
from gpt_shape_tracer.gui.hover import crosshair
from gpt_shape_tracer.gui.server import reserve_memory
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.session import Comparison, caches, rerun_and_compare
from gpt_shape_tracer.tracer import Trace, aligned_values, diff_traces


def compare_tab(trace: Trace, step: int) -> None:
    app = state()
    gen = app.live_generation
    options = ["a trace file"]
    if gen is not None:  # a module of your own runs without our cache: there is no cached run to make
        options += (["this prompt with the KV cache " + ("off" if gen.use_cache else "on")] if caches(gen.model)
                    else []) + ["this prompt with the heads chosen under What if switched off"]
    other = st.radio("compare this run with", options, key="compare_with", persist_state="page", horizontal=True)
    if other == "a trace file":
        upload = st.file_uploader(f"a trace (.zip, up to {UPLOAD_MB // 1024} GiB)", type=["zip"],
                                  max_upload_size=UPLOAD_MB, key="compare_upload")
        if upload is not None and app.last_compare_upload_id != upload.file_id:
            app.last_compare_upload_id = upload.file_id
            loaded = read_uploaded_trace(upload)
            if loaded is None:
                return
            # held beside everything else, in place of the run compared before: reserved as an opened file is
            refusal = reserve_memory(comparison_bytes=loaded.log.bytes_kept)
            if refusal:
                st.error(f"{plain(upload.name)} was not compared: {refusal}")
                return
            app.live.comparison = Comparison(f"the file {upload.name}", loaded, diff_traces(trace, loaded))
    # the reruns are offered only with a live generation (options above)
    elif gen is not None and st.button("Run it and compare", key="compare_run", type="primary"):
        toggle_cache = not other.endswith("switched off")
        # the heads as What if offers them: (layer, head) pairs
        heads_off = [] if toggle_cache else st.session_state.get("ablate_heads", [])
        if not toggle_cache and not heads_off:
            st.warning("Choose heads under What if → Switch heads off first.")
            return
        # the rerun keeps up to the generation's budget of values, held beside this run once it is done
        refusal = reserve_memory(comparison_bytes=app.live.started_with.budget_bytes if app.live.started_with
                                 else trace.budget_bytes)
        if refusal:
            st.error(f"Not run: {refusal}")
            return
        with st.spinner("running…"):
            app.live.comparison = rerun_and_compare(gen, trace, other, app.live.started_with, toggle_cache=toggle_cache,
                                               heads_off=heads_off, how=st.session_state.get("ablate_how", "zero"))
    comparison = app.live.comparison
    if comparison is None:
        return
    frame = comparison.frame
    first = frame[frame["first_divergence"]]
    said = compare_takeaway(frame, comparison.label,
                            whatif_views.divergence_sentence(first.iloc[0]).replace("**", "") if len(first) else None)
    takeaway(said.sentence, said.metrics)
    at_step = frame[frame["step"] == step].copy()
    at_step["shape_a"] = [str(list(s)) if s is not None else "" for s in at_step["shape_a"]]
    at_step["shape_b"] = [str(list(s)) if s is not None else "" for s in at_step["shape_b"]]
    st.dataframe(at_step[["name", "shape_a", "shape_b", "max_abs_delta", "rel_delta", "diverged", "first_divergence",
                          "note"]], hide_index=True, key="diff_table", height=360)
    names = [n for n in at_step.loc[at_step["compared"], "name"]]
    if names:
        name = st.selectbox("difference of one record (b − a), its last two dimensions", names, key="diff_record",
                            persist_state="page")
        pair = aligned_values(trace, comparison.trace, name, step)
        if pair is None or pair[0].dim() < 2:
            st.info("This record's values cannot be drawn as a difference here (not kept in both runs, or fewer than "
                    "two dimensions).")
            return
        a, b, where = pair
        if not a.is_floating_point():
            st.info(f"{plain(name)} holds integers (token ids, flags): the table says which differ; a difference "
                    "b − a of ids means nothing, so none is drawn.")
            return
        index = (0,) * (a.dim() - 2)
        first_row = 0
        if where:
            st.caption(f"The runs hold different numbers of positions for this record at step {step} (one with the "
                       f"KV cache computes only the new ones): compared on {where}.")
            longer = max(trace.record(name, step).shape[-2], comparison.trace.record(name, step).shape[-2])
            first_row = longer - a.shape[-2]  # the rows drawn are the last positions
        chart(crosshair(whatif_views.difference_figure(a[index], b[index], f"{name} at step {step}",
                                                       first_row=first_row)), key="diff_chart")
