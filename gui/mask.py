"""Causal mask: M for the step, the scores before and after adding it, and the masked cells counted by cause."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.figures import mask as mask_views
from gpt_shape_tracer.figures.view_takeaways import mask_takeaway
from gpt_shape_tracer.gui.common import chart, layer_head_batch, panels, plain, said_no_attention, values_kept
from gpt_shape_tracer.gui.hover import crosshair
from gpt_shape_tracer.gui.takeaway import takeaway
from gpt_shape_tracer.model.gpt import act_name
from gpt_shape_tracer.tracer import Trace


def mask_tab(trace: Trace, step: int) -> None:
    layer, head, batch = layer_head_batch(trace, "mask")
    if said_no_attention(trace, layer, "There is no attention mask at this layer: its mixer reads the positions in "
                         "order, each step updating its state from the new token only."):
        return
    facts = mask_views.mask_facts(trace, step, layer, batch)
    said = mask_takeaway(facts)
    takeaway(said.sentence, said.metrics, plain_paragraphs(said.details or ""),
             # BLT, CPM-Ant: no cause by a cell's place
             details_label="What this block's mask holds" if facts.stream or facts.bidirectional else
             "Every −∞ cell by its cause, and why a cached step needs (almost) no mask")
    if not values_kept(trace, step, act_name("mask", layer), "mask and score heatmaps"):
        return
    st.caption("Hover a cell: the lines through it mark its query row and its key column.")
    chart(crosshair(mask_views.mask_figure(trace, step, layer, batch)), key="mask_chart")
    panels(mask_views.scores_before_after_figure(trace, step, layer, head, batch), key="before_after_chart")


def plain_paragraphs(text: str) -> str:
    return "\n\n".join(plain(p) for p in text.split("\n\n"))
