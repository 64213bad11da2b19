"""What every tab shares: the session's state, the models, charts, the layer/head pickers, the header with the
step slider, and the banners and notices above the tabs."""

from __future__ import annotations

import gc
import sys
import threading
import time
import weakref

import streamlit as st
from streamlit.runtime.scriptrunner import get_script_run_ctx

from gpt_shape_tracer.figures import tokens as token_views
from gpt_shape_tracer.figures.common import facts_of, no_attention
from gpt_shape_tracer.figures.common import inert as plain  # everything the app did not write passes through this
from gpt_shape_tracer.model import ModelLoadError
from gpt_shape_tracer.model.gpt import identity_of
from gpt_shape_tracer.session import (
    DEFAULT_MODEL,
    AppState,
    ModelChoice,
    Settings,
    SettingsError,
    adopt_model,
    describe_model,
    load,
)
from gpt_shape_tracer.session.memory import return_freed_memory, reuse_freed_memory
from gpt_shape_tracer.session.server_limits import SessionLedger
from gpt_shape_tracer.tracer import Finite, Trace, TraceFileError, load_trace

UPLOAD_MB = 1024  # MiB, as .streamlit/config.toml server.maxUploadSize (Streamlit labels the dropzone "1GB")

__all__ = ["UPLOAD_MB", "admitted", "banners", "chart", "current_model", "explain_missing_values",
           "freed_memory_reused", "header", "layer_head_batch", "live_model_for", "loaded_model", "n_layer_head",
           "plain", "read_uploaded_trace", "remembered_tabs", "reserve_memory", "session_ledger", "state", "status",
           "values_kept", "viewed_step"]


@st.cache_resource
def freed_memory_reused() -> bool:
    """Once per server process: a long prefill frees gigabytes, and glibc's malloc would hand each new tensor
    fresh pages to fault in again (session/memory.py)."""
    return reuse_freed_memory()


# -- the server's sessions: how many, and what their traces hold together (session/server_limits.py) --
REAP_SECONDS = 10  # how often ended sessions are looked for (with the server's 30 s disconnect TTL: < 1 min)


@st.cache_resource
def session_ledger() -> SessionLedger:
    """One ledger per server process, and the thread that forgets the sessions Streamlit has ended and gives
    the memory their traces freed back to the system."""
    ledger = SessionLedger()
    threading.Thread(target=_forget_ended_sessions, args=(ledger,), daemon=True,
                     name="gpt-shape-tracer-sessions").start()
    return ledger


def _server_sessions() -> set[str] | None:
    """The ids of every session the server still holds (connected, or disconnected within its TTL); None
    where there is no such server (AppTest runs one script with no session manager)."""
    from streamlit.runtime import Runtime

    try:
        if not Runtime.exists():
            return None
        manager = getattr(Runtime.instance(), "_session_mgr", None)  # Streamlit's own; not its public API
        list_sessions = getattr(manager, "list_sessions", None)
        if not callable(list_sessions):
            return None
        return {info.session.id for info in list_sessions()}
    except Exception:  # noqa: BLE001 - no runtime (any more), or a Streamlit of another shape: nothing is forgotten
        return None


# each session's state, by session id, held weakly: an ended session's trace is let go by us, not only when
# Streamlit's session store gets round to dropping the session (it expires entries lazily, on its next use)
_STATES: weakref.WeakValueDictionary[str, AppState] = weakref.WeakValueDictionary()


def _forget_ended_sessions(ledger: SessionLedger) -> None:
    while True:
        time.sleep(REAP_SECONDS)
        alive = _server_sessions()
        if alive is None:
            continue
        gone = ledger.forget_all_but(alive)
        for session in gone:
            app = _STATES.pop(session, None)
            if app is not None:
                app.reset()  # the generation and its trace
                app.close_file()
        if gone:
            gc.collect()  # an ended session's state may hold cycles: free its trace now, then
            return_freed_memory()  # hand the memory back (the app keeps freed memory for reuse otherwise)
            print(f"gpt-shape-tracer: {len(gone)} ended session(s) released", file=sys.stderr, flush=True)


def this_session() -> str:
    ctx = get_script_run_ctx()
    return ctx.session_id if ctx is not None else "no session"


def admitted() -> bool:
    """Whether the server serves this session (its cap on sessions); if not, says why."""
    try:
        refusal = session_ledger().admit(this_session())
    except ValueError as e:  # a bad setting in the environment
        st.error(f"The server's limits are set wrongly: {plain(e)}")
        return False
    if refusal:
        st.error(refusal)
    return not refusal


def reserve_memory(generation_bytes: int | None = None, file_bytes: int | None = None,
                   gradient_bytes: int | None = None, engine_bytes: int | None = None,
                   decoding_bytes: int | None = None, comparison_bytes: int | None = None) -> str:
    """Reserve this session's share of the server's trace memory: the budget of its generation, the values of
    its opened file, of its gradients trace, of its Engine run (or its pool while it runs), of its Decoding
    runs and of the run Compare runs holds — each as the session holds it now (``AppState.held_bytes``) unless
    given; "" when granted, else why not."""
    app = state()
    held = app.held_bytes()
    asked_gradients = gradient_bytes is not None
    generation_bytes = held["generation"] if generation_bytes is None else generation_bytes
    file_bytes = held["file"] if file_bytes is None else file_bytes
    gradient_bytes = held["gradients"] if gradient_bytes is None else gradient_bytes
    engine_bytes = held["engine"] if engine_bytes is None else engine_bytes
    decoding_bytes = held["decoding"] if decoding_bytes is None else decoding_bytes
    comparison_bytes = held["comparison"] if comparison_bytes is None else comparison_bytes
    # fixed, as an opened file: they do not follow the sidebar's budget
    file_bytes += engine_bytes + decoding_bytes + comparison_bytes
    # what follows the sidebar's Budget (MB): the generation's share, and a gradients recording asked for now (at
    # most the budget); an opened file and a gradients trace already recorded do not
    budget_times = int(generation_bytes > 0) + int(asked_gradients and gradient_bytes > 0)
    fixed = file_bytes + (0 if asked_gradients else gradient_bytes)
    try:
        return session_ledger().reserve(this_session(), generation_bytes + file_bytes + gradient_bytes,
                                        budget_times=budget_times, fixed=fixed)
    except ValueError as e:
        return f"The server's limits are set wrongly: {plain(e)}"


# -- models (shared by every session; tracing and interventions route per thread, so sharing is safe) --
MODELS_KEPT = 3  # the bundled model a page starts with and two others loaded (each may be gigabytes)


@st.cache_resource(show_spinner="Loading the model…", max_entries=MODELS_KEPT)
def loaded_model(choice: ModelChoice):
    """``(model, tokenizer)`` of ``choice`` (``session.load``: the one loader), loaded once per server process and
    kept while it is among the newest ``MODELS_KEPT`` used; a load that fails is not kept, so the next try loads
    again."""
    return load(choice)


def chart(fig, key: str, **kwargs):
    """``st.plotly_chart`` with the figure's own look (``figures.plot.TEMPLATE``): Streamlit's theme would
    re-theme each new chart after drawing it, one more full plot per chart on every Step."""
    return st.plotly_chart(fig, key=key, theme=None, **kwargs)


def remembered_tabs(names: list[str], key: str) -> list:
    """``st.tabs`` that reopens where the person left it. Streamlit forgets a widget's state on a rerun that does
    not draw it (a sub-tab inside another open tab, every tab after Reset), so the open tab is kept in the app
    state and given back before the tabs are drawn again."""
    app = state()
    if key not in st.session_state and app.open_tabs.get(key) in names:
        st.session_state[key] = app.open_tabs[key]
    drawn = st.tabs(names, key=key, on_change="rerun")
    opened = st.session_state.get(key)
    if isinstance(opened, str):
        app.open_tabs[key] = opened
    return list(drawn)


def state() -> AppState:
    """This session's state: one typed object, not loose keys."""
    app = st.session_state.setdefault("app", AppState())
    _STATES[this_session()] = app
    return app


def current_model():
    """(model, tokenizer) of the sidebar's choice, loaded once per process."""
    return loaded_model(state().model)


def live_model_for(trace: Trace):
    """The model whose weights made ``trace`` (its own, or the loaded one when the digests match), or None."""
    model = trace.live_model
    if model is not None:
        return model
    try:
        model, _ = current_model()
    except ModelLoadError:
        return None
    return adopt_model(trace, model)


def read_uploaded_trace(upload) -> Trace | None:
    """The trace in an uploaded file, or None after saying why it could not be read (nothing else changes)."""
    try:
        return load_trace(upload.getvalue())
    except TraceFileError as e:
        st.error(f"Could not load {plain(upload.name)}: {plain(e)}. Nothing else changed.")
        return None


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
        st.session_state["step_view"] = viewed_step(trace)
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
    cols[0].metric("new positions n", forward.n)
    cols[1].metric("key positions t", forward.t)
    cols[2].metric("cached after step", forward.cache_after if facts.info.use_cache else 0,
                   help="0 when the KV cache is off")
    cols[3].metric("query rows computed", f"{forward.n} of {forward.t}")
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
    ``SLIDER_SETTLE_S`` of a slider change waits until the slider has been still that long before it draws:
    a newer change meanwhile stops this rerun at its next Streamlit call (Streamlit merges the queued changes
    into one rerun, which waits in turn), so only the rerun for the last value draws the tabs."""
    placeholder = st.empty()
    while (wait := SLIDER_SETTLE_S - (time.monotonic() - app.slider_moved_at)) > 0:
        time.sleep(min(wait, 0.05))
        placeholder.empty()  # a Streamlit call: where a newer rerun stops this one


def viewed_step(trace: Trace) -> int:
    """The step the slider shows (the latest when it has not been moved; 0 when there is one step)."""
    n_steps = trace.n_steps
    return min(st.session_state.get("step_view", n_steps - 1), n_steps - 1) if n_steps > 1 else 0


# -- shared pickers and messages -----------------------------------------------------------------------
def n_layer_head(trace: Trace) -> tuple[int, int]:
    config = trace.config
    return (config.n_layer, config.n_head) if config is not None else (1, 1)


def layer_head_batch(trace: Trace, prefix: str, heads: bool = True) -> tuple[int, int, int]:
    """Layer, head and sequence pickers keyed by ``prefix``; a head clicked on the grid applies to "attn"."""
    n_layer, n_head = n_layer_head(trace)
    app = state()
    if app.pending_head is not None and prefix == "attn":
        st.session_state["attn_layer"], st.session_state["attn_head"] = app.pending_head
        app.pending_head = None
    cols = st.columns(3)
    layer = cols[0].selectbox("layer", list(range(n_layer)), key=f"{prefix}_layer", persist_state="page")
    head = cols[1].selectbox("head", list(range(n_head)), key=f"{prefix}_head", persist_state="page") if heads else 0
    batch_size = facts_of(trace).batch_size
    batch = cols[2].selectbox("sequence", list(range(batch_size)), key=f"{prefix}_batch",
                              persist_state="page") if batch_size > 1 else 0
    return layer, head, batch


def said_no_attention(trace: Trace, layer: int, instead: str = "") -> bool:
    """Whether ``layer`` has no attention (a hybrid model's state layer); if so, say what it is — the model's own
    sentence, "layer L has no softmax attention: it is a <mixer> layer whose state does not grow with t …" — and what
    this view shows ``instead``, rather than drawing an empty chart."""
    sentence = no_attention(trace, layer)
    if sentence is None:
        return False
    st.info(f"{sentence[0].upper()}{sentence[1:]}." + (f" {instead}" if instead else ""))
    return True


def values_kept(trace: Trace, step: int, name: str, what: str) -> bool:
    """Whether ``name``'s values exist at ``step``; if not, say why instead of drawing empty charts."""
    if trace.get(name, step) is not None:
        return True
    explain_missing_values(trace, step, what)
    return False


def explain_missing_values(trace: Trace, step: int, what: str) -> None:
    if trace.capture == "shapes":
        st.info(f"Capture is **shapes**: only shapes, dtypes and sizes were recorded, so there are no {what} to "
                "draw. Choose **values** (or ops) under Tracing in the sidebar and Reset.")
    elif trace.log.spill_bytes:
        st.info(f"The values of step {step} were evicted by the memory budget (the oldest steps go first) after "
                f"the disk spill had filled its {trace.log.spill_bytes / 2**20:,.0f} MB; its shapes and statistics "
                f"are kept, its {what} are not. Raise “Keep every value on disk” and Reset, or view a later step.")
    else:
        st.info(f"The values of step {step} were evicted by the memory budget (the oldest steps go first); "
                f"its shapes and statistics are kept, its {what} are not. Raise the budget, keep every value on "
                "disk (under Tracing), or view a later step.")
