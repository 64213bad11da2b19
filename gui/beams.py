"""Beam search: k hypotheses per prompt on the live generation's model, the tree of what was kept, dropped and
finished at every step, and the KV cache's reorder that lets a beam continue another beam's history."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from gpt_shape_tracer.figures import beams as beam_views
from gpt_shape_tracer.figures.common import inert
from gpt_shape_tracer.gui.common import chart, reserve_memory, state
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.session.decoding import MAX_APP_BEAMS, MAX_APP_NEW_TOKENS, beam_run
from gpt_shape_tracer.tracer import BeamSearchError, Trace

# transformers' early_stopping: False (its default heuristic), True (stop once k hypotheses finished), "never"
EARLY: dict[str, bool | str] = {"no (default)": False, "yes: once k finished": True, "never": "never"}


def beams_tab(trace: Trace, step: int) -> None:
    app = state()
    gen = app.live_generation
    if gen is None:
        st.info("Beam search runs the live model: it is not offered for an opened trace file (Close the file, or "
                "press Step first).")
        return
    cols = st.columns(4)
    k = cols[0].number_input("beams k", 2, MAX_APP_BEAMS, 4, key="beam_k")
    new = cols[1].number_input("new tokens", 1, MAX_APP_NEW_TOKENS, 8, key="beam_new")
    penalty = cols[2].number_input("length penalty", -4.0, 4.0, 1.0, 0.5, key="beam_penalty")
    early = cols[3].selectbox("early stopping", list(EARLY), key="beam_early")
    if st.button("Run beam search", key="beam_run", type="primary"):
        refused = reserve_memory()
        if refused:
            st.error(refused)
            return
        try:
            with st.spinner("searching…"):
                app.beams = beam_run(gen.model, gen.tokenizer, gen.info.prompts, int(k), int(new), float(penalty),
                                     EARLY[early])
        except BeamSearchError as e:
            st.error(inert(e))
            return
    run = app.beams
    if run is None:
        st.caption("Beam search keeps the k best hypotheses per prompt instead of one token per step: every step "
                   "ranks the 2k best continuations of all k beams, and when a surviving beam continues another "
                   "beam's history, the KV cache's rows are copied to follow it (transformers' generate(num_beams=k); "
                   "the sequences and scores equal it).")
        return
    search = run.search
    prompt = st.selectbox("prompt", list(range(search.batch_size)), key="beam_prompt") if search.batch_size > 1 else 0
    per = search.num_return_sequences
    texts, result = search.texts(), search.result()
    sentence, metrics = beam_views.run_sentence(search.steps, texts[prompt * per], result.scores[prompt * per],
                                                run.greedy_texts[prompt], prompt)
    takeaway(sentence, metrics, "Each node is one of a step's 2k best continuations (its running score: the sum of "
             "its tokens' log-probabilities). Orange ones go on as the k beams; a star ended and joined the finished "
             "hypotheses, ranked by score / length ** length penalty; red ones ended below every kept hypothesis; "
             "grey ones were dropped. An edge joins a candidate to the beam whose history it continues.")
    shown = st.slider("beam step", 0, len(search.steps) - 1, len(search.steps) - 1, key="beam_step") \
        if len(search.steps) > 1 else 0
    chart(beam_views.beam_tree_figure(search.steps, gen.tokenizer.token_label, prompt, shown_step=shown),
          key="beam_tree")
    chosen = search.steps[shown]
    st.markdown(beam_views.step_sentence(chosen, gen.tokenizer.token_label, prompt))
    st.dataframe(pd.DataFrame(beam_views.candidates_rows(chosen, gen.tokenizer.token_label, prompt)),
                 hide_index=True, key="beam_candidates")
    if chosen.keys_before is None:
        st.info(f"Step {chosen.step} kept no copy of the cache's keys (the snapshots' memory cap was reached).")
    else:
        chart(beam_views.reorder_figure(chosen), key="beam_reorder")
