"""Next token: the top candidates with the chosen one marked, and each sampling stage's distribution."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.figures import tokens as token_views
from gpt_shape_tracer.figures.common import facts_of
from gpt_shape_tracer.figures.view_takeaways import next_token_takeaway
from gpt_shape_tracer.gui.common import chart
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.tracer import Trace


def next_token_tab(trace: Trace, step: int) -> None:
    facts = facts_of(trace)
    row = st.selectbox("sequence", list(range(facts.batch_size)), key="next_row",
                       persist_state="page") if facts.batch_size > 1 else 0
    said = next_token_takeaway(trace, step, row)
    if said is None:
        st.error(f"No token was chosen at step {step}: the logits held NaN or +∞ (see the banner above).")
        return
    takeaway(said.sentence, said.metrics,
             "Sampling: " + facts.info.sampling.describe() + ". The bars are the candidates with the highest "
             "probability, the chosen one marked; “tokens left to choose from” counts the vocabulary after the "
             "last filter (top-k, top-p), all V of it when none applies.")
    log_scale = st.toggle("log scale (every candidate visible, however small)", key="next_log",
                          persist_state="page")
    chart(token_views.next_token_figure(trace, step, row, log_scale=log_scale), key="next_chart")
    if facts.info.sampling.greedy:
        st.info("Greedy decoding takes the argmax of the logits: temperature, top-k and top-p play no part, so "
                "there is no reshaping to show. Choose **sample** in the sidebar (and Reset) to see it.")
    else:
        chart(token_views.distribution_stages_figure(trace, step, row), key="stages_dist_chart")
