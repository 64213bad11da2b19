"""The guided tour: a bar above the tabs with numbered stops, "← Back" and "Next →". Each stop opens its view —
the tab, the sub-view, the step and the head it names — through the tabs' own keys (``st.tabs(key=…)`` takes its
open tab from the session state) and the same hand-overs a click on the all-heads grid uses (``pending_head``).
What a stop says and which head it opens are ``figures.tour``'s: the heads are the best-scoring ones of
``tracer.head_scores`` for whatever model is loaded."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.figures.common import MASK_TAB_NAMES
from gpt_shape_tracer.figures.tour import Stop, shown_stops, skipped_sentence, tour_context, tour_stops
from gpt_shape_tracer.gui.common import live_model_for, plain, state
from gpt_shape_tracer.session import caches, no_cache_reason
from gpt_shape_tracer.tracer import Trace

TOUR_KEY = "tour_stop"  # the index, among the shown stops, of the stop on view; absent when no tour is going


def tour_bar(trace: Trace) -> None:
    """The tour's start button, or, during the tour, the stop on view and the way on."""
    index = st.session_state.get(TOUR_KEY)
    if index is None:  # the plan (its heads measured on the model) is made only once the tour is asked for
        st.button("Guided tour →", key="tour_start", on_click=start,
                  help="A path through the views for someone who has read the math: numbered stops, each "
                       "opening its view and saying in one sentence what to look at.")
        return
    stops = plan(trace)
    shown = shown_stops(stops)
    index = min(index, len(shown) - 1)
    stop = shown[index]
    with st.container(border=True, key="tour_bar"):
        st.markdown(f"**Guided tour · stop {index + 1} of {len(shown)}: {stop.title}**")
        st.markdown(plain(stop.look))
        if stop.waiting:
            st.info(stop.waiting)
        with st.container(horizontal=True, key="tour_buttons"):
            st.button("← Back", key="tour_back", disabled=index == 0,
                      on_click=go, args=(index - 1, shown[index - 1]) if index else (0, stop))
            last = index == len(shown) - 1
            st.button("Next →", key="tour_next", disabled=last, type="primary",
                      on_click=go, args=(index + 1, shown[index + 1]) if not last else (index, stop))
            st.button("End the tour", key="tour_end", on_click=end)
        st.caption(" · ".join(f"**{i + 1} {s.title}**" if i == index else f"{i + 1} {s.title}"
                              for i, s in enumerate(shown)))
        skipped = skipped_sentence(stops)
        if skipped:
            st.caption(plain(skipped))


def plan(trace: Trace) -> tuple[Stop, ...]:
    """Every stop for this trace, its heads measured on the model that made it (when that model is here)."""
    model = live_model_for(trace)
    scores = None
    if model is not None:
        from gpt_shape_tracer.gui.attention import (
            scores_for,  # the all-heads grid's cached scores: measured once per model
        )

        try:
            scores = scores_for(model)
        except Exception:  # noqa: BLE001 - a model the probe cannot score (its patterns not kept, a module of
            scores = None  # your own without our hook points): the tour names no head rather than failing
    app = state()
    return tour_stops(tour_context(trace, scores, live=model is not None, caches=model is not None and caches(model),
                                   engine=app.engine.view.run if app.engine.view is not None else None,
                                   engine_refused=engine_refused(app, model),
                                   no_cache_reason=(no_cache_reason(model) or "") if model is not None else ""))


def engine_refused(app, model) -> str:
    """Why the sidebar's model cannot run the Engine tab ("" when it can: transformers runs it, or its files can be
    loaded through transformers — session.engine's rule, which the tab itself follows)."""
    from gpt_shape_tracer.session.engine import directory_of, engine_refusal

    if model is None or directory_of(app.model) is not None:
        return ""  # no model here to ask (the tab says why when it is opened), or files transformers can load
    return engine_refusal(model, app.model) or ""


def go(index: int, stop: Stop) -> None:
    """Open ``stop`` (a button's callback: it runs before the page is drawn, so the tabs open where it says)."""
    st.session_state[TOUR_KEY] = index
    app = state()
    opened = [("view", stop.tab)] + ([stop.sub] if stop.sub else [])
    for key, label in opened:
        app.open_tabs[key] = label  # remembered_tabs gives this back when the tabs are drawn again
        st.session_state[key] = label
    if stop.step is not None:
        st.session_state["pending_step_view"] = stop.step  # the header moves the step slider there
    if stop.head is not None:
        layer, head = stop.head
        if stop.tab == "Attention":
            app.pending_head = (layer, head)  # applied by the Attention tab's pickers
            if stop.query is not None and stop.step is not None:
                app.live.query_picks[(stop.step, 0)] = stop.query  # the query picker's remembered pick (sequence 0)
        elif stop.tab in MASK_TAB_NAMES:
            st.session_state["mask_layer"], st.session_state["mask_head"] = layer, head
    if stop.engine_step is not None:
        st.session_state["engine_step"] = stop.engine_step  # the Engine tab's slider (gui/engine.py)


def start() -> None:
    """Open the first stop (a callback: the trace is the one on view)."""
    trace = state().viewed_trace
    if trace is not None:
        go(0, shown_stops(plan(trace))[0])  # the shape flow: every model and generation has it


def end() -> None:
    st.session_state.pop(TOUR_KEY, None)
