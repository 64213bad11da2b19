"""Decoding as generate() runs it, on the live generation's model: beam search (k hypotheses per prompt, the tree
of what was kept, dropped and finished at every step, and the KV cache's reorder that lets a beam continue
another beam's history) and speculative decoding (drafts verified in one forward, the rejected rows cropped)."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from gpt_shape_tracer.figures import beams as beam_views
from gpt_shape_tracer.figures import speculative as speculative_views
from gpt_shape_tracer.figures.common import inert
from gpt_shape_tracer.gui.common import chart, loaded_model, state
from gpt_shape_tracer.gui.server import reserve_memory
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.model import BUNDLED_MODELS, ModelLoadError
from gpt_shape_tracer.session import ModelChoice
from gpt_shape_tracer.session.decoding import (
    DECODING_RESERVE_BYTES,
    MAX_APP_BEAMS,
    MAX_APP_DRAFT_TOKENS,
    MAX_APP_NEW_TOKENS,
    beam_run,
    speculative_run,
)
from gpt_shape_tracer.tracer import BeamSearchError, SpeculativeError, Trace

STRATEGIES = ("beam search", "speculative decoding")
LOOKUP = "prompt lookup (no second model)"

# transformers' early_stopping: False (its default heuristic), True (stop once k hypotheses finished), "never"
EARLY: dict[str, bool | str] = {"no (default)": False, "yes: once k finished": True, "never": "never"}


def decoding_tab(trace: Trace, step: int) -> None:
    gen = state().live_generation
    if gen is None:
        st.info("Beam search and speculative decoding run the live model: they are not offered for an opened trace "
                "file (Close the file, or press Step first).")
        return
    if st.radio("strategy", STRATEGIES, key="decoding_strategy", horizontal=True) == STRATEGIES[0]:
        beams_section(gen)
    else:
        speculative_section(gen)


def beams_section(gen) -> None:
    app = state()
    cols = st.columns(4)
    k = cols[0].number_input("beams k", 2, MAX_APP_BEAMS, 4, key="beam_k")
    new = cols[1].number_input("new tokens", 1, MAX_APP_NEW_TOKENS, 8, key="beam_new")
    penalty = cols[2].number_input("length penalty", -4.0, 4.0, 1.0, 0.5, key="beam_penalty")
    early = cols[3].selectbox("early stopping", list(EARLY), key="beam_early")
    if st.button("Run beam search", key="beam_run", type="primary"):
        refused = reserve_memory(decoding_bytes=DECODING_RESERVE_BYTES)  # at most this while it runs
        if refused:
            st.error(refused)
            return
        try:
            with st.spinner("searching…"):
                app.live.beams = beam_run(gen.model, gen.tokenizer, gen.info.prompts, int(k), int(new), float(penalty),
                                     EARLY[early])
        except BeamSearchError as e:
            st.error(inert(e))
            return
        finally:
            reserve_memory()  # what the runs keep, now this one is done
    run = app.live.beams
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


def speculative_section(gen) -> None:
    app = state()
    cols = st.columns(4)
    source = cols[0].selectbox("drafts from", [LOOKUP, *(f"the bundled {name}" for name in BUNDLED_MODELS)],
                               key="spec_source")
    draft = cols[1].number_input("draft tokens", 1, MAX_APP_DRAFT_TOKENS, 4, key="spec_draft")
    new = cols[2].number_input("new tokens", 1, MAX_APP_NEW_TOKENS, 12, key="spec_new")
    schedule = cols[3].selectbox("draft count", ["constant", "heuristic"], key="spec_schedule",
                                 help="transformers' num_assistant_tokens_schedule: heuristic drafts 2 more after a "
                                      "step that accepted every draft, 1 fewer after one that did not")
    if gen.batch_size > 1:
        st.caption("Speculative decoding takes one prompt (as transformers' assisted generate does): the first.")
    if st.button("Run speculative decoding", key="spec_run", type="primary"):
        refused = reserve_memory(decoding_bytes=DECODING_RESERVE_BYTES)  # at most this while it runs
        if refused:
            st.error(refused)
            return
        try:
            assistant = None
            if source != LOOKUP:
                assistant, _ = loaded_model(ModelChoice("bundled", source.removeprefix("the bundled ")))
            with st.spinner("drafting and verifying…"):
                app.live.speculative = speculative_run(gen.model, gen.tokenizer, gen.info.prompts[0], int(new),
                                                  int(draft), assistant=assistant, schedule=schedule)
        except (SpeculativeError, ModelLoadError) as e:
            st.error(inert(e))
            return
        finally:
            reserve_memory()  # what the runs keep, now this one is done
    run = app.live.speculative
    if run is None:
        st.caption("Speculative decoding lets a cheap source draft several tokens (a small model sharing the "
                   "vocabulary, or the prompt itself: prompt lookup), checks them all in one forward of the main "
                   "model, keeps the longest prefix it agrees with plus one token of its own, and crops the rejected "
                   "drafts' rows from the KV cache (transformers' generate(assistant_model=…) / "
                   "prompt_lookup_num_tokens; the output equals greedy decoding).")
        return
    label = gen.tokenizer.token_label
    sentence, metrics = speculative_views.run_sentence(run.steps, run.source)
    takeaway(sentence, metrics, "Each column is one step: one forward of the main model over the drafts. Green "
             "drafts were accepted (the main model would have chosen them too), red ones rejected; the star is the "
             "main model's own token at the first disagreement (or after the last draft). The bars show the main "
             "cache growing by every draft in the verify forward, then cropped back to the accepted prefix.")
    chart(speculative_views.acceptance_figure(run.steps, label), key="spec_tokens")
    shown = st.slider("speculative step", 0, len(run.steps) - 1, len(run.steps) - 1, key="spec_step") \
        if len(run.steps) > 1 else 0
    st.markdown(speculative_views.step_sentence(run.steps[shown], label))
    chart(speculative_views.cache_figure(run.steps), key="spec_cache")
