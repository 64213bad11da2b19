"""Above the tabs: the model's status line and reference note, the opened file's controls, the banners, and the
header with its step slider (settled over a burst of arrow keys).
"""

from __future__ import annotations

import time

import streamlit as st

from gpt_shape_tracer.figures import tokens as token_views
from gpt_shape_tracer.figures.common import facts_of, positions, prompt_positions, size_names
from gpt_shape_tracer.figures.common import inert as plain  # everything the app did not write passes through this
from gpt_shape_tracer.gui.common import current_model, state
from gpt_shape_tracer.gui.server import reserve_memory
from gpt_shape_tracer.model import ModelLoadError
from gpt_shape_tracer.model.gpt import identity_of
from gpt_shape_tracer.session import (
    DEFAULT_MODEL,
    AppState,
    Settings,
    SettingsError,
    describe_model,
)
from gpt_shape_tracer.tracer import Finite, Trace


# -- above the tabs ------------------------------------------------------------------------------------
def reference_note(model) -> None:
    """Which of transformers' forwards the trace equals, where they disagree (``HFDecoder.reference_note``, written
    by load_hf's guard from the numbers it measured)."""
    note = getattr(model, "reference_note", None)
    if note:
        st.caption(f"Reference: {plain(note)}")


def status(settings: Settings | None, refused: SettingsError | None) -> bool:
    """The notices of the last action, the model's line and what the settings mean for the generation;
    False when the selected model cannot be loaded (then nothing else is drawn)."""
    app = state()
    if st.session_state.get("stop_run"):
        app.notices.append(("info", "Stopped: every step finished before the Stop is kept."))
    for level, message in app.notices:
        getattr(st, level)(message)
    app.notices = []
    trace = app.viewed_trace
    if trace is not None and trace.model is not None:
        where = f" — from the file {plain(app.loaded.file_name)}" if app.viewing_file and app.loaded else ""
        st.caption(f"Model: **{plain(trace.model.describe())}**{where}")
        if app.live_generation is not None:  # the live generation's model made the trace on view
            reference_note(app.live_generation.model)
    else:
        try:
            model, _ = current_model()
            st.caption(f"Model: **{plain(identity_of(model).describe())}** — {describe_model(model)}")
            reference_note(model)
        except ModelLoadError as e:
            st.error(f"The selected model cannot be loaded: {plain(e)}")
            app.model = DEFAULT_MODEL
            return False
    gen = app.live.generation
    if gen is not None and not app.viewing_file and app.model_changed:
        st.info(f"You chose {plain(app.model.describe())}; this generation runs "
                f"{plain((app.live.started_model or app.model).describe())} and Step continues it so. "
                "Reset starts a new generation with the model you chose.")
    if refused is not None:
        st.warning(f"These settings cannot be used: {plain(refused)}"
                   + (" — Step keeps continuing the current generation with its own settings." if gen else ""))
    if gen is not None and not app.viewing_file:
        if settings is not None and settings != app.live.started_with:
            st.info("The settings changed since this generation started: Step continues it as it was; "
                    "Reset applies the new settings.")
        if gen.trace.error is not None:
            st.error(plain(gen.trace.error.describe()))
    file_controls(app)
    return True


def file_controls(app: AppState) -> None:
    """An opened trace file stays open until the person closes it: a line saying what is on view, with the way
    to the other view and to closing the file."""
    if app.loaded is None:
        return
    name = plain(app.loaded.file_name)
    live = app.live.generation is not None and app.live.generation.n_steps > 0
    cols = st.columns([6, 2, 1])
    if app.viewing_file:
        cols[0].info(f"Viewing the trace file {name}. Step or Run N go on with the live generation; the file stays "
                     "open until you close it.")
        if live and cols[1].button("Show the live generation", key="show_live"):
            app.show_file(False)
            st.rerun()
    else:
        cols[0].caption(f"The trace file {name} is open too.")
        if cols[1].button("View the file", key="show_file"):
            app.show_file(True)
            st.rerun()
    cols[2].button("Close the file", key="close_file", disabled=app.confirm_close, on_click=ask_close)
    if app.confirm_close:
        close_question(app, name)


def ask_close() -> None:
    """"Close the file"'s callback: the page asks first (``close_question``); the file is let go only on yes."""
    state().confirm_close = True


def answer_close(close: bool) -> None:
    app = state()
    app.confirm_close = False
    if not close or app.loaded is None:
        return
    name = plain(app.loaded.file_name)
    app.close_file()
    reserve_memory()  # the file's share goes back to the server
    app.notices = [("info", f"Closed {name}.")]


def close_question(app: AppState, name: str) -> None:
    """The question "Close the file" asks, as Reset asks before it discards a generation."""
    assert app.loaded is not None
    back = ("reloading the page (its address names the run)" if app.loaded.file_id.startswith("run:") else
            "loading the file again (Export tab)")
    box = st.container(border=True, key="close_question")
    shown = "what the page shows now" if app.viewing_file else "the file kept beside the live generation"
    box.warning(f"Close the file {name}? This lets go of {shown}; {back} brings it back.")
    cols = box.columns([1, 1, 4])
    cols[0].button("Close it", key="close_confirm", type="primary", width="stretch",
                   on_click=answer_close, args=(True,))
    cols[1].button("Cancel", key="close_cancel", width="stretch", on_click=answer_close, args=(False,))


def banners(trace: Trace, step: int) -> None:
    """What every tab must know: a non-finite value, interventions in force, a file being viewed."""
    bad = trace.first_anomaly(step)
    if bad is not None:
        flag = trace.finite_flag(bad)
        what = "NaN or +∞" if flag == Finite.BAD else "−∞ that no mask explains"
        op = trace.op_before(bad) if trace.capture == "ops" else None
        made = f", made by the op {op.op} (inputs {', '.join(map(str, op.input_shapes))})" if op else ""
        partial = "" if trace.checked_everywhere(step) else (
            " Shapes capture checks only the residual stream and the logits: the value went bad inside this "
            "block, before this record; capture values to name the exact record.")
        cols = st.columns([5, 1])
        cols[0].error(f"**{what}** first appears at step {step} in **{plain(bad.name)}** (record "
                      f"{bad.index_in_step} of the step){made}.{partial}")
        if cols[1].button("Open in Inspector", key="open_anomaly"):
            state().inspect_name = bad.name
            st.session_state["view"] = "Inspector"
            st.rerun()
    active = trace.steps[step].interventions
    if active:
        st.warning("Interventions in force at this step: " + "; ".join(plain(i.describe()) for i in active))
    gen = state().live.generation
    if gen is not None and not state().viewing_file and gen.interventions and not active:
        st.warning("Later steps will run with: " + "; ".join(plain(i.describe()) for i in gen.interventions))


def header(trace: Trace) -> int:
    """The step slider, the generated text and the step's sizes; returns the step every tab shows."""
    settle_the_slider(state())  # a burst of slider changes draws once, for its last value
    n_steps = trace.n_steps
    if "pending_step_view" in st.session_state:
        st.session_state["step_view"] = st.session_state.pop("pending_step_view")
    if n_steps > 1:
        place_the_slider(state(), trace)
        step = st.slider("Step (time travel: every view shows this step)", 0, n_steps - 1, key="step_view",
                         on_change=slider_moved)
    else:
        step = 0
        st.caption("Step 0, the prefill" + (": the file holds this one step." if state().viewing_file else
                                             ". Step again to generate more tokens."))
    facts = facts_of(trace)
    forward = facts.step(step).forward
    for row in range(facts.batch_size):
        prefix = f"**Sequence {row}** " if facts.batch_size > 1 else ""
        st.markdown(prefix + token_views.generated_text_html(trace, row, upto_step=step), unsafe_allow_html=True)
    st.markdown(token_views.text_legend(), unsafe_allow_html=True)
    cols = st.columns(5)
    n, t = positions(trace, step)  # CPM-Ant: its learned prompt positions run before the text in every forward
    prompt = prompt_positions(trace)
    with_prompt = (f"the model's {prompt} learned prompt positions included: every forward runs them before the "
                   "text") if prompt else None
    n_label, t_label = size_names(trace, step)
    cols[0].metric(n_label, n, help=with_prompt)
    cols[1].metric(t_label, t, help=with_prompt)
    cols[2].metric("cached after step", forward.cache_after if facts.info.use_cache else 0,
                   help="0 when the KV cache is off")
    cols[3].metric("query rows computed", f"{n} of {t}")
    cols[4].metric("traced forward time", f"{trace.steps[step].seconds * 1000:.1f} ms",
                   help="wall time of the traced forward on this (shared) machine: an estimate")
    banners(trace, step)
    return step


SLIDER_SETTLE_S = 0.3  # a slider change this recent may be one of a burst (arrow keys held or pressed fast)


def slider_moved() -> None:
    """The step slider's callback (run before the rerun's script): when it moved."""
    state().slider_moved_at = time.monotonic()


def settle_the_slider(app: AppState) -> None:
    """Coalesce a burst of step-slider changes into one drawn rerun, for the last value. Each arrow key is a
    value the browser sends, and each starts a rerun that draws every chart of the open tab; 200 keys pressed
    fast made 200 reruns in flight, and the page died (issue 41). Here a rerun that starts within
    ``SLIDER_SETTLE_S`` of a slider change waits until the slider has been still that long before it draws.
    The slider is in the page's view (app.py, a fragment), whose run Streamlit lets finish: the changes that
    come meanwhile are merged into one rerun, for the newest value, which waits in turn; the older run draws
    without moving the browser's slider (``place_the_slider``). In a full run of the page a newer change stops
    this one at its next Streamlit call, the ``placeholder.empty()`` below."""
    placeholder = st.empty()
    while (wait := SLIDER_SETTLE_S - (time.monotonic() - app.slider_moved_at)) > 0:
        time.sleep(min(wait, 0.05))
        placeholder.empty()  # a Streamlit call: where a newer rerun stops this one


def place_the_slider(app: AppState, trace: Trace) -> None:
    """Set the slider's value only where it must move — a new step count (its range changed), a value out of range,
    none yet, or a step asked for (``pending_step_view``, applied above). A value set here is pushed to the browser's
    slider; set on every rerun, a rerun of the page's view for an older value of a burst of arrow keys (Streamlit
    lets a fragment's run finish before the next) would put the browser's slider back to that value mid-burst."""
    last = trace.n_steps - 1
    wanted = viewed_step(trace)
    if st.session_state.get("step_view") != wanted or app.slider_last != last:
        st.session_state["step_view"] = wanted
    app.slider_last = last


def viewed_step(trace: Trace) -> int:
    """The step the slider shows (the latest when it has not been moved; 0 when there is one step)."""
    n_steps = trace.n_steps
    return min(st.session_state.get("step_view", n_steps - 1), n_steps - 1) if n_steps > 1 else 0
