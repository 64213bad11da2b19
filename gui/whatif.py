"""What if: switch heads off, activation patching, direct logit attribution, the logit lens."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.figures import whatif as whatif_views
from gpt_shape_tracer.figures.common import attention_layers, facts_of
from gpt_shape_tracer.figures.view_takeaways import ablation_takeaway, patching_takeaway
from gpt_shape_tracer.gui.common import chart, live_model_for, n_layer_head, plain, remembered_tabs, state
from gpt_shape_tracer.gui.hover import crosshair
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.session import ablation_run, all_heads, head_ablations, head_label, patching_run
from gpt_shape_tracer.tracer import ABLATIONS, Trace, TracedGeneration, direct_logit_attribution, logit_lens


def whatif_tab(trace: Trace, step: int) -> None:
    app = state()
    model = live_model_for(trace)
    if model is None:
        st.info("These experiments run the model that made the trace; the model selected in the sidebar has "
                "other weights (its digest differs). Load the same model to use them on this file.")
        return
    parts = remembered_tabs(["Switch heads off", "Activation patching", "Logit attribution", "Logit lens"],
                            "whatif_view")
    gen = app.live_generation
    with parts[0]:
        if parts[0].open:
            ablation_section(trace, step, model, gen)
    with parts[1]:
        if parts[1].open:
            patching_section(trace, model, gen)
    with parts[2]:
        if parts[2].open:
            attribution_section(trace, step, model)
    with parts[3]:
        if parts[3].open:
            lens_section(trace, step, model)


def ablation_section(trace: Trace, step: int, model, gen: TracedGeneration | None) -> None:
    app = state()
    n_layer, n_head = n_layer_head(trace)
    cols = st.columns([3, 1, 2])
    # options are (layer, head) pairs, shown as "L3 H2": the choice is read as numbers, never parsed back
    # a hybrid model's layers without attention have no heads to offer
    chosen = cols[0].multiselect("heads to switch off (their output O_h)",
                                 all_heads(n_layer, n_head, attention_layers(trace)),
                                 format_func=head_label, key="ablate_heads", persist_state="page")
    how = cols[1].radio("how", list(ABLATIONS), key="ablate_how", persist_state="page",
                        help="zero: O_h = 0 · mean: O_h replaced by its mean over the positions seen so far")
    text = cols[2].radio("loss measured on", ["a random sequence repeated twice", "the prompt"], key="ablate_text",
                         persist_state="page",
                         help="On a random token sequence followed by itself, only induction predicts the second "
                              "half: the loss there shows what the induction circuit is worth")
    interventions = head_ablations(chosen, how)
    if gen is None:
        st.info("Re-running a step needs the live generation (Step once, or leave the file view).")
        return
    wanted = (step, tuple(chosen), how, text)
    if st.button("Re-run this step with these heads switched off", key="ablate_run", disabled=not chosen,
                 type="primary"):
        with st.spinner("re-running…"):
            app.live.ablations.keep(wanted, ablation_run(gen, step, model, interventions,
                                                         on_prompt=text == "the prompt"))
    res = app.live.ablations.get(wanted)  # kept per (step, heads, how, text): returning to them brings it back
    if res is None:
        again = ("the step runs again from the same cache" if gen.cache is not None else
                 "the step runs again (every position: this generation keeps no cache)")
        st.caption(f"Pick heads, then re-run: {again} with them switched off, and the loss on a text is measured with "
                   "and without. Nothing in the generation changes.")
        return
    said = ablation_takeaway(res.loss_before, res.loss_after, tuple(res.described), res.loss_text, len(res.moved),
                             len(res.changes))
    takeaway(said.sentence, said.metrics, f"Re-ran step {res.step} "
             + ("from the same cache" if gen.cache is not None else "over every position") + " with: "
             + "; ".join(plain(d) for d in res.described) + f". Loss measured on {plain(res.loss_text)}. Below: how "
             "the next token's candidates moved, and how far each head's pattern moved.")
    frame = whatif_views.next_token_change(res.replay.original[0], res.replay.logits[0], gen.tokenizer.token_label)
    chart(whatif_views.next_token_change_figure(frame, f"next token at step {res.step}, sequence 0"),
          key="ablate_next_chart")
    chart(whatif_views.pattern_change_figure(list(res.changes), n_layer, n_head), key="ablate_heads_chart")
    if st.button("Keep these heads off for the next steps", key="ablate_keep"):
        gen.set_interventions(interventions)
        st.rerun()
    if gen.interventions and st.button("Switch every head back on for the next steps", key="ablate_clear"):
        gen.set_interventions([])
        st.rerun()


def patching_section(trace: Trace, model, gen: TracedGeneration | None) -> None:
    app = state()
    if gen is None:
        st.info("Patching runs the live model on two prompts; Step once (or leave the file view).")
        return
    tok = gen.tokenizer
    clean = gen.info.prompts[0]
    st.caption("The clean prompt is this generation's (sequence 0). Type a corrupted one with the same number of "
               "tokens — change a name, say. Each cell patches the clean run's activation into the corrupted run "
               "and measures how much of the clean answer's logit difference comes back.")
    corrupted = st.text_input("corrupted prompt (same number of tokens)", key="patch_corrupted", persist_state="page")
    kind = st.radio("patch", ["the residual stream (layer × position)", "each head's output (layer × head)"],
                    key="patch_kind", persist_state="page", horizontal=True)
    n_clean, n_corrupt = len(tok.encode(clean)), len(tok.encode(corrupted)) if corrupted else 0
    if corrupted and n_clean != n_corrupt:
        st.error(f"The clean prompt has {n_clean} tokens and this one {n_corrupt}: patching needs the same count.")
    ready = bool(corrupted) and n_clean == n_corrupt
    if st.button("Run activation patching", key="patch_run", disabled=not ready, type="primary"):
        holder = st.empty()  # the bar lives while patching runs
        bar = holder.progress(0.0, text="patching…")

        def progress(f: float) -> None:
            bar.progress(f, text=f"patching… {f:.0%}")

        try:
            app.live.patching = patching_run(model, tok, clean, corrupted,
                                        "resid_pre" if kind.startswith("the residual") else "z", progress=progress)
        finally:
            holder.empty()
    run = app.live.patching
    if run is None:
        return
    res = run.result
    said = patching_takeaway(res, run.labels, tok.token_label(res.clean_answer), tok.token_label(res.corrupted_answer))
    if res.clean_answer == res.corrupted_answer:
        st.warning(said.sentence)
        return
    takeaway(said.sentence, said.metrics, details="Each cell runs the corrupted prompt with one activation taken from "
             "the clean run, and measures (patched − corrupted) / (clean − corrupted) of the logit difference between "
             "the two answers at the last position: 1 restores all of it, 0 none, below 0 pushes the wrong way.")
    chart(whatif_views.patching_figure(res.restored, list(run.labels), res.kind), key="patching_chart")


def attribution_section(trace: Trace, step: int, model) -> None:
    facts = facts_of(trace)
    row = st.selectbox("sequence", list(range(facts.batch_size)), key="dla_row",
                       persist_state="page") if facts.batch_size > 1 else 0
    choice = facts.step(step).sampling
    if choice is None:
        st.error("This step chose no token (its logits were not finite).")
        return
    try:
        frame = direct_logit_attribution(trace, step, row, model=model)
    except ValueError as e:
        st.info(plain(e))
        return
    sentence, metrics = whatif_views.attribution_takeaway(frame, choice.labels[row])
    takeaway(sentence, metrics, details="How much each head (through W_O), each MLP and the embeddings add directly "
             "to the chosen token's logit z, reading the final norm with its scale frozen at this position.")
    chart(whatif_views.attribution_figure(frame, choice.labels[row]), key="dla_chart")


def lens_section(trace: Trace, step: int, model) -> None:
    facts = facts_of(trace)
    row = st.selectbox("sequence", list(range(facts.batch_size)), key="lens_row",
                       persist_state="page") if facts.batch_size > 1 else 0
    gen = state().live.generation
    tok = gen.tokenizer if gen is not None else None
    try:
        frame = logit_lens(trace, step, row, model=model, label=tok.token_label if tok else None)
    except ValueError as e:
        st.info(plain(e))
        return
    figure, note = whatif_views.lens_figure(frame, model.config.n_layer)
    sentence, metrics = whatif_views.lens_takeaway(frame)
    takeaway(sentence, metrics, details="What each layer already predicts: its residual stream put through the final "
             "norm and W_U. Colour: the probability of the token the model finally chose there; text: that layer's "
             "own top token. Columns are numbered as in every other view (the step's own columns)."
             + (f" Showing {note}." if note else ""))
    chart(crosshair(figure), key="lens_chart")
