"""Nothing lost by a reload: each session's generation is a run, kept under an unguessable id in the page's
address (``?run=…``) and written to the server's private runs folder as it goes (session/runs.py).

Opening an address with a run id this session does not hold — a reload, a reconnect after the server dropped
the session, a restarted server, a click in "Recent runs" — starts that run again: its model and settings go
back into the sidebar and its steps are run again (the bundled models take ~20 ms a decode step), which gives
a live generation that Step continues and the experiments run on; the tokens are then checked against the
trace written at the time. Where the run cannot be made again (its model is gone, or it gives other tokens),
the written trace is opened as a file instead, so what was seen is still there.

Whose runs "Recent runs" lists: the page's address also holds an owner token (``?owner=…``, made on the page's
first rerun), and each run records its hash; the list shows only the runs of this owner, so on a shared server
one person never sees another's prompts. The address is what survives a reload, a dropped connection and a
restarted server, so the token does too (Streamlit keeps nothing in the browser a script can read back, and a
cookie would need a component of our own). ``GPT_SHAPE_TRACER_LIST_ALL_RUNS=1`` (a single-user server) lists
every run. A run opened by its id alone still opens — the id is the capability — and a Step on a run another
page made writes a new run of this page's own, so one person never changes another's.

The Engine tab's run is a run of the folder too (kind "engine"), under an id of its own in the address
(``?engine=…``): written when it finishes — in a thread of its own, so that writing its values (seconds for the
largest) never holds up the page — and reopened from its written file by a reload, a restarted server or a click
in "Recent runs" (it is a finished record, not a generation to continue: nothing is run again). The engine step
and the request, layer and head picked go back to where they were.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import streamlit as st

from gpt_shape_tracer.figures.common import inert as plain
from gpt_shape_tracer.gui.common import current_model, state
from gpt_shape_tracer.gui.server import reserve_memory
from gpt_shape_tracer.session import (
    SETTING_KEYS,
    AppState,
    LoadedTrace,
    ModelChoice,
    SettingsError,
    settings_from,
)
from gpt_shape_tracer.session.engine import EngineView, valid_engine_picks
from gpt_shape_tracer.session.runs import (
    ENGINE_FILE,
    RunError,
    RunRecord,
    RunsSettings,
    RunStore,
    checked_owner_token,
    checked_run_id,
    new_owner_token,
    new_run_id,
    owner_tag,
)
from gpt_shape_tracer.tracer import TraceFileError

PARAM = "run"  # the address's query parameter
ENGINE_PARAM = "engine"  # …and the one naming the Engine tab's run
ENGINE_PICKS = ("engine_request", "engine_layer", "engine_head")  # the Engine tab's pickers, kept with its run
ENGINE_FORM = ("engine_requests", "engine_arrivals", "engine_page_size", "engine_pages", "engine_batch_tokens",
               "engine_new_tokens")  # its form's widgets, as they were when it ran
WRITE_WAIT_S = 120  # how long a reopen waits for this server's own write of the run to finish
_writing: dict[str, threading.Thread] = {}  # engine run id → the thread writing it (this server process's)
_write_failed: dict[str, str] = {}  # engine run id → why its write failed, said on the page's next rerun
OWNER_PARAM = "owner"  # …and the one naming whose runs the page lists
RECENT_SHOWN = 8
LABELS = {"story-gpt": "Bundled GPT-2-style story model",  # gui/sidebar.py SOURCES, by bundled name or kind
          "story-llama": "Bundled Llama-style story model",
          "directory": "Local Hugging Face directory", "factory": "Your own module (package.module:function)"}


def run_store() -> RunStore | None:
    """The runs folder the server's settings name, or None (with the reason, once per session) when they are
    wrong: the app then works as before, without keeping runs."""
    try:
        return RunStore(RunsSettings.from_environment())
    except RunError as e:
        app = state()
        if not app.runs_refused:
            app.runs_refused = True
            app.notices.append(("error", f"Runs are not kept: {plain(e)}"))
        return None


def owner_of_page(app: AppState) -> str:
    """This page's owner token: the address's when it holds one (a reload, a reconnect, a restarted server),
    else the session's, else a new one; put in the address, where the next reload finds it."""
    token = checked_owner_token(st.query_params.get(OWNER_PARAM)) or app.owner_token or new_owner_token()
    app.owner_token = token
    if st.query_params.get(OWNER_PARAM) != token:
        st.query_params[OWNER_PARAM] = token
    return token


def follow_the_address() -> None:
    """Before the sidebar is drawn: open the run the address names, when this session does not hold it; put
    this session's own run id (and owner token) back in the address when it is missing there. The same for the
    Engine tab's run (``?engine=``)."""
    app = state()
    owner_of_page(app)
    follow_generation(app)
    follow_engine(app)


def report_failed_write(app: AppState) -> None:
    """A write of this session's run that failed in its thread (``RunWrite``), said once, on the next rerun: of the
    page or of its view (a Step reruns the view alone)."""
    why = _run_write_failed.pop(app.run_id, None) if app.run_id is not None else None
    if why is not None:
        app.notices.append(("warning", f"This run could not be written to the runs folder: {plain(why)}"))


def follow_generation(app: AppState) -> None:
    report_failed_write(app)
    wanted = st.query_params.get(PARAM)
    if wanted == app.run_id:
        return
    if wanted is None:
        if app.run_id is not None:
            st.query_params[PARAM] = app.run_id
        return
    store = run_store()
    if store is None:
        return
    try:
        run_id = checked_run_id(wanted)
        run_written(run_id, WRITE_WAIT_S)  # this server may still be writing it (a reload just after a Step)
        record = store.record(run_id)
    except RunError as e:
        app.notices.append(("error", f"The run in the address cannot be opened: {plain(e)}. Nothing else changed."))
        record = None
    else:
        if record is None:
            app.notices.append(("warning", f"This server keeps no run {plain(wanted)}: it keeps the newest "
                                           f"{store.settings.keep} runs (and at most "
                                           f"{store.settings.budget_bytes // 2**20:,} MiB of them) in "
                                           f"{plain(store.directory)}. Nothing else changed."))
    if record is None:
        if app.run_id is not None:
            st.query_params[PARAM] = app.run_id
        else:
            del st.query_params[PARAM]
        return
    restore(app, record, store)


def restore(app: AppState, record: RunRecord, store: RunStore) -> None:
    """Make ``record``'s run this session's: the current generation (already written under its own id) is let
    go, the run's model and settings go into the sidebar, and its steps are owed (the next part of this rerun
    makes them; ``finish_restoring`` then checks them)."""
    widgets = {key: record.widgets[key] for key in SETTING_KEYS if key in record.widgets}
    write_pending_runs(app)  # the generation let go here is written first
    app.reset(keep_engine=True)  # the Engine tab's run is the address's ?engine=, not this run's
    app.close_file()
    app.run_id, app.run_widgets = record.run_id, widgets
    app.run_foreign = not store.settings.list_all and record.owner != owner_tag(owner_of_page(app))
    app.saved_view = (record.step, record.view)
    try:
        settings_from(widgets)
    except SettingsError as e:
        return open_written_trace(app, record, store, f"its settings are refused ({e})")
    previous = app.model
    app.model = record.model
    try:
        current_model()
    except Exception as e:  # noqa: BLE001 - a directory gone, a module that no longer imports: show the file
        app.model = previous
        return open_written_trace(app, record, store, f"its model cannot be loaded ({type(e).__name__}: {e})")
    set_model_widgets(record.model)
    for key, value in widgets.items():
        st.session_state[key] = value
    st.session_state["view"] = app.open_tabs["view"] = record.view
    app.restoring = record
    app.steps_owed = record.n_steps


def set_model_widgets(choice: ModelChoice) -> None:
    """The sidebar's model widgets as they were when ``choice`` was made."""
    st.session_state["model_device"] = choice.device
    if choice.kind == "bundled":
        st.session_state["source"] = LABELS.get(choice.where, LABELS["story-gpt"])
    elif choice.kind == "factory":
        st.session_state["source"] = LABELS["factory"]
        st.session_state["model_factory"] = choice.where
    else:
        st.session_state["source"] = LABELS["directory"]
        st.session_state["model_dir"] = choice.where
        st.session_state["model_dtype"] = choice.dtype
        st.session_state["model_memory_gib"] = choice.memory_gib


def open_written_trace(app: AppState, record: RunRecord, store: RunStore, why: str) -> None:
    """Show the run's written trace as an opened file, saying why it was not run again."""
    try:
        trace = store.trace(record.run_id)
    except (TraceFileError, RunError, OSError) as e:
        trace, why = None, f"{why}, and its trace file is damaged and cannot be read ({e})"
    if trace is None:
        app.notices.append(("error", f"Run {record.run_id} cannot be restored: {plain(why)}."))
        return
    app.open_file(LoadedTrace(trace, f"run {record.run_id} ({record.title})", f"run:{record.run_id}"))
    st.session_state["pending_step_view"] = min(record.step, trace.n_steps - 1)
    app.notices.append(("warning", f"Run “{plain(record.title)}” is shown from the trace written at the time, not "
                                   f"run again: {plain(why)}."))


def tokens_of(trace) -> tuple:
    """Every token a traced generation holds: its prompts' and each step's choice."""
    facts = trace.generation
    if facts is None:
        return ()
    return facts.info.prompt_tokens, tuple(s.sampling.tokens if s.sampling else None for s in facts.steps)


def written_tokens_agree(written, trace) -> bool:
    """Whether the written trace's tokens are the live one's: the prompts, and each step both hold. A server stopped
    between a run's files leaves them a step or more apart — the trace written without its last steps (while its
    parts were replaced), or with a step more than the run's record (written before it) — not other tokens."""
    if written.generation is None or trace.generation is None:
        return tokens_of(written) == tokens_of(trace)
    (prompts, steps), (live_prompts, live_steps) = tokens_of(written), tokens_of(trace)
    return prompts == live_prompts and all(a == b for a, b in zip(steps, live_steps))


def finish_restoring(app: AppState) -> None:
    """After the owed steps of a restored run: back to its step and view, its tokens checked against the trace
    written at the time."""
    record = app.restoring
    if record is None or app.steps_owed:
        return
    app.restoring = None
    gen = app.live.generation
    store = run_store()
    if store is None:
        return
    damaged = None  # why the trace written at the time cannot be read, when it cannot
    try:
        written = store.trace(record.run_id) if record.trace_saved else None
    except (TraceFileError, RunError, OSError) as e:
        written, damaged = None, str(e)
    if written is None and record.trace_saved and damaged is None:
        damaged = "it is missing"
    if gen is None or gen.n_steps < record.n_steps:
        done = gen.n_steps if gen is not None else 0
        app.reset(keep_engine=True)
        app.run_id = record.run_id
        open_written_trace(app, record, store, f"running it again stopped after {done} of its {record.n_steps} "
                                               "steps")
        return
    if written is not None and not written_tokens_agree(written, gen.trace):
        app.reset(keep_engine=True)
        app.run_id = record.run_id
        open_written_trace(app, record, store, "run again, it chose other tokens than it did then (other weights "
                                               "under the same name?)")
        return
    st.session_state["pending_step_view"] = record.step
    app.saved_steps = record.n_steps  # the run folder holds these steps already
    held = written.n_steps if written is not None else record.n_steps
    checked = ((f"; its trace file holds only the first {held} (the server stopped while it wrote the "
                "rest), and every token of those equals the trace written then") if held < record.n_steps else
               "; every token equals the trace written then" if written is not None else
               f"; its trace file is damaged ({plain(damaged)}), so nothing was compared" if damaged is not None else
               "; its trace was larger than the runs folder's budget and was not written, so nothing was compared")
    app.notices.append(("success", f"Restored run “{plain(record.title)}”: its {record.n_steps} step(s) were run "
                                   f"again from its model and settings{checked}."))


def save_run(app: AppState, values: dict[str, object]) -> None:
    """After steps: write the generation under its run id (a new id, put in the address, for a new one). The
    writing is a thread's (``RunWrite``): writing the whole trace takes 0.1–0.5 s and grows with the run, and a
    Step's page waited for it before it drew."""
    gen = app.live.generation
    if gen is None or not gen.n_steps or gen.n_steps == app.saved_steps or app.restoring is not None:
        return
    store = run_store()
    if store is None:
        return
    if app.run_id is None:
        app.run_id = new_run_id()
        app.run_widgets = {key: values[key] for key in SETTING_KEYS if key in values}
    elif app.run_foreign:  # another page's run, opened by its id: its steps go on in a run of this page's own
        app.run_id, app.run_foreign = new_run_id(), False
    if st.query_params.get(PARAM) != app.run_id:  # each change of the address is a history entry
        st.query_params[PARAM] = app.run_id
    step = min(st.session_state.get("step_view", gen.n_steps - 1), gen.n_steps - 1)
    view = view_on_screen(app)
    record = RunRecord(app.run_id, app.live.started_model or app.model, dict(app.run_widgets), gen.n_steps,
                       step, view, time.time(), owner=owner_tag(owner_of_page(app)))
    app.saved_view, app.saved_steps = (step, view), gen.n_steps
    waiting = waiting_write(app)
    if waiting is not None:  # Steps in a row: the one write waits for them to pause
        waiting.record, waiting.due = record, time.monotonic() + WRITE_AFTER_S
        _pending_records[app.run_id] = record
    else:
        RunWrite(app, store, record, gen).start()


# how long a run's Steps must pause before its write starts. 0: the write starts as soon as the Step's page is
# drawn, so a server killed outright loses no more than the write under way (docs/runs.md: nothing computed is
# lost by a crash); a pause would write Steps in a row once, but a crash in it would lose them
WRITE_AFTER_S = 0.0


class RunWrite:
    """A generation's run written to the runs folder by a thread of its own, off the Step's path: the whole trace is
    written, which takes longer as the run grows, and a Step clicked while it was being written waited for it. So
    the thread waits until the run's Steps have paused for ``WRITE_AFTER_S`` (a Step meanwhile pushes the time on:
    Steps in a row are written once, after the last), then takes the session's ``run_lock`` (never reading the
    trace while a step changes it) and writes the steps the generation holds then; a second write of the same
    steps is skipped. Not a daemon, so that a server exiting normally (SIGTERM) finishes the write first. A reload
    does not wait out the pause (``run_written`` says "now" and joins), and Reset or opening another run writes it
    first, inline (``write_pending_runs``)."""

    def __init__(self, app: AppState, store: RunStore, record: RunRecord, generation) -> None:
        self.app, self.store, self.record, self.generation = app, store, record, generation
        self.due = time.monotonic() + WRITE_AFTER_S
        self.now = threading.Event()  # set: write without waiting for the pause
        self.writing = False  # set under run_lock once the write has begun: later Steps start a write of their own
        self.thread = threading.Thread(target=self._in_thread, daemon=False,
                                       name=f"gpt-shape-tracer-run-{record.run_id[:6]}")

    def start(self) -> None:
        _run_writes.setdefault(self.record.run_id, []).append(self)
        _pending_records[self.record.run_id] = self.record
        self.thread.start()

    def _in_thread(self) -> None:
        try:
            while True:
                while (wait := self.due - time.monotonic()) > 0 and not self.now.wait(wait):
                    pass
                with self.app.run_lock:
                    if self.due > time.monotonic() and not self.now.is_set():
                        continue  # a Step came while this waited for the lock: wait for the pause again
                    self.writing = True
                    self.write()
                    return
        finally:
            writes = _run_writes.get(self.record.run_id, [])
            if self in writes:
                writes.remove(self)
            if not writes:
                _run_writes.pop(self.record.run_id, None)
                _pending_records.pop(self.record.run_id, None)

    def write(self) -> None:
        """Write the run as the generation holds it now (the caller holds the session's ``run_lock``): the steps
        written before are not written again (``RunStore.save_steps``)."""
        app, gen, run_id = self.app, self.generation, self.record.run_id
        done = (id(gen), gen.n_steps)
        if _written.get(run_id) == done:
            return
        step, view = self.record.step, self.record.view
        if app.run_id == run_id and app.saved_view is not None:  # the slider or the tab moved since
            step, view = app.saved_view
        record = replace(self.record, n_steps=gen.n_steps, step=min(step, gen.n_steps - 1), view=view,
                         updated=time.time())
        try:
            self.store.save_steps(record, gen.trace)
        except Exception as e:  # noqa: BLE001 - a thread's failure is said on the page's next rerun, never lost
            _run_write_failed[run_id] = f"{type(e).__name__}: {e}"
            if app.run_id == run_id:
                app.saved_steps = 0  # the next Step writes the whole run again
            return
        _written[run_id] = done


_run_writes: dict[str, list[RunWrite]] = {}  # generation run id → its writes not yet finished (this process's)
_pending_records: dict[str, RunRecord] = {}  # …and the record of the newest, listed in Recent runs meanwhile
_written: dict[str, tuple[int, int]] = {}  # run id → (its generation's id(), steps) last written
_run_write_failed: dict[str, str] = {}  # run id → why its write failed, said on its page's next rerun


def waiting_write(app: AppState) -> RunWrite | None:
    """The write of this session's run that has not begun (the caller holds ``run_lock``), if any."""
    gen = app.live.generation
    return next((w for w in _run_writes.get(app.run_id or "", ()) if w.app is app and w.generation is gen
                 and not w.writing), None)


def write_pending_runs(app: AppState) -> None:
    """Before the session's generation is let go (Reset, another run opened): its pending writes, made now in this
    rerun (which holds ``run_lock``; the threads then find them written)."""
    with app.run_lock:
        for writes in list(_run_writes.values()):
            for write in list(writes):
                if write.app is app:
                    write.write()


def runs_written(timeout: float | None = None) -> bool:
    """Wait for every run write in flight in this process (tests read the folder after a rerun); True once none is."""
    for run_id in list(_run_writes):
        run_written(run_id, timeout)
    return not _run_writes


def run_written(run_id: str, timeout: float | None = None) -> bool:
    """Have this server's writes of the run made now, and wait for them (a reload, and tests); True once none is in
    flight."""
    writes = list(_run_writes.get(run_id, []))
    for write in writes:
        write.now.set()
    for write in writes:
        write.thread.join(timeout)
    return run_id not in _run_writes


def view_on_screen(app: AppState) -> str:
    """The tab open now (the tabs' widget holds it from the start of the rerun that opened it)."""
    view = st.session_state.get("view")
    return view if isinstance(view, str) else app.open_tabs.get("view", "Shapes")


def save_view(app: AppState, step: int) -> None:
    """Where the person is looking, written when it changed (a reload comes back to it)."""
    view = view_on_screen(app)
    if app.run_id is None or app.run_foreign or app.viewing_file or app.saved_view == (step, view):
        return  # (another page's run is not changed by this one: its Step writes a run of this page's own)
    if waiting_write(app) is not None:  # the run's write is yet to come: it writes this view (RunWrite.write)
        app.saved_view = (step, view)
        return
    store = run_store()
    if store is None:
        return
    try:
        store.update_view(app.run_id, step, view)
    except (RunError, OSError):
        return  # the next Step writes the whole run again
    app.saved_view = (step, view)


def forget_run() -> None:
    """After Reset: the address names no run (the old one stays in Recent runs)."""
    app = state()
    app.run_id, app.saved_view, app.saved_steps, app.run_foreign = None, None, 0, False
    for param in (PARAM, ENGINE_PARAM):  # Reset forgets the Engine tab's run too (AppState.reset)
        if param in st.query_params:
            del st.query_params[param]


OPENING = "opening_run"  # session_state: a Recent runs button was clicked, and the page is to open what it names


def open_run(run_id: str) -> None:
    """A Recent runs button's callback: the address names the run, which the page's next full run opens (the
    button is drawn by the page's view, whose rerun alone does not: it asks for one, ``opening_a_run``)."""
    st.query_params[PARAM] = run_id
    st.session_state[OPENING] = True


def open_engine_run(run_id: str) -> None:
    """…for an engine run: the address's ?engine= names it, and the Engine tab opens."""
    st.query_params[ENGINE_PARAM] = run_id
    st.session_state["view"] = state().open_tabs["view"] = "Engine"
    st.session_state[OPENING] = True


def opening_a_run() -> bool:
    """Whether a Recent runs button asked for the page's full run, which opens the run the address names now (once:
    asking clears it)."""
    return bool(st.session_state.pop(OPENING, False))


def ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds // 3600:.0f} h ago"
    return f"{seconds // 86400:.0f} d ago"


def recent_runs() -> None:
    """The sidebar's list of the newest runs this page's owner made (every run of the server when its settings
    say so): a click opens one (this session's own run is kept under its id, so nothing is lost by opening
    another)."""
    store = run_store()
    if store is None:
        return
    app = state()
    sb = st.container()  # the sidebar's foot, where the caller draws it (the view's own container there)
    whose = ("every run of this server (GPT_SHAPE_TRACER_LIST_ALL_RUNS is on: a server for one person)"
             if store.settings.list_all else
             "only the runs made under this page's address (its owner=… part): another person's runs are not "
             "listed, and yours are not listed on theirs")
    sb.header("Recent runs", help=f"Kept in {plain(store.directory)}, a folder only the server's user can read "
                                  f"(GPT_SHAPE_TRACER_RUNS_DIR sets another). Listed here: {whose}. To show one "
                                  f"run to someone, send its ?{PARAM}=… alone: the {OWNER_PARAM}=… part lists "
                                  "your runs.")
    records = store.recent(RECENT_SHOWN, owner=owner_tag(owner_of_page(app)))
    pending = _pending_records.get(app.run_id) if app.run_id is not None else None
    if pending is not None:  # its write is under way: listed as the page holds it, not as the folder held it before
        records = [pending, *(r for r in records if r.run_id != pending.run_id)][:RECENT_SHOWN]
    if not records:
        sb.caption("None yet: each generation is kept here, under the run id in the page's address, from its "
                   "first Step.")
        return
    listed = "this server's runs" if store.settings.list_all else "the runs of this page's address"
    sb.caption(f"Listed: {listed}. The server keeps its newest {store.settings.keep} runs, at most "
               f"{store.settings.budget_bytes // 2**20:,} MiB of them, in a folder only its user can read. A reload "
               "or a restart reopens the run in the page's address.")
    now = time.time()
    for record in records:
        engine = record.kind == "engine"
        this = record.run_id == (app.engine.run_id if engine else app.run_id)
        label = f"{plain(record.listed_as())} · {ago(now - record.updated)}" + (" (this page)" if this else "")
        where = (f"engine run {record.run_id}, engine step {record.step}: opens in the Engine tab" if engine else
                 f"run {record.run_id}, step {record.step} on view {record.view}")
        sb.button(label, key=f"open_run_{record.run_id}", disabled=this, width="stretch",
                  on_click=open_engine_run if engine else open_run, args=(record.run_id,), help=where)


# -- the Engine tab's run ----------------------------------------------------------------------------------------
def follow_engine(app: AppState) -> None:
    """Open the engine run the address's ?engine= names when this session does not hold it (a reload, a restarted
    server, a click in Recent runs); put this session's own back in the address when it is missing there."""
    for run_id, why in list(_write_failed.items()):
        if run_id == app.engine.run_id:
            del _write_failed[run_id]
            app.notices.append(("warning", f"This engine run could not be written to the runs folder: {plain(why)}. "
                                           "It stays on the page until Reset, but a reload will not bring it back."))
    wanted = st.query_params.get(ENGINE_PARAM)
    if wanted == app.engine.run_id:
        return
    if wanted is None:
        if app.engine.run_id is not None:
            st.query_params[ENGINE_PARAM] = app.engine.run_id
        return
    store = run_store()
    if store is None:
        return
    view, record = None, None
    try:
        run_id = checked_run_id(wanted)
        writing = _writing.get(run_id)
        if writing is not None:  # this server is still writing it (a reload within seconds of its run)
            writing.join(WRITE_WAIT_S)
        record = store.record(run_id)
        if record is None:
            problem = (f"this server keeps no run {run_id}: it keeps the newest {store.settings.keep} runs (and at "
                       f"most {store.settings.budget_bytes // 2**20:,} MiB of them) in {store.directory}")
        elif record.kind != "engine":
            problem = f"run {run_id} is a generation, not an engine run"
        else:
            run = store.engine(run_id)
            problem = "" if run is not None else f"run {run_id} has no {ENGINE_FILE}"
            if run is not None:
                view = EngineView(run, record.model.describe(), dict(record.texts))
    except RunError as e:  # not a run id, or a run.json that is not one of ours
        problem = str(e)
    except (TraceFileError, OSError) as e:
        problem = f"its file is refused: {e}"
    if view is not None:
        refused = reserve_memory(engine_bytes=view.nbytes)
        problem = f"this server has no memory for it now: {refused}" if refused else ""
    if view is None or problem or record is None:
        app.notices.append(("error", f"The engine run in the address cannot be opened: {plain(problem)}. Nothing "
                                     "else changed."))
        if app.engine.run_id is not None:
            st.query_params[ENGINE_PARAM] = app.engine.run_id
        else:
            del st.query_params[ENGINE_PARAM]
        return
    reopen_engine(app, record, view, store)


def reopen_engine(app: AppState, record: RunRecord, view: EngineView, store: RunStore) -> None:
    """``view`` (read from ``record``'s files) on the Engine tab, its form, engine step and picks as they were."""
    app.engine.view, app.engine.run_id = view, record.run_id
    app.engine.foreign = not store.settings.list_all and record.owner != owner_tag(owner_of_page(app))
    ids = [r.request_id for r in view.run.requests]
    picks = {key: record.widgets[key] for key in ENGINE_PICKS if key in record.widgets}
    if picks.get("engine_request") not in ids:
        picks.pop("engine_request", None)
    picks = valid_engine_picks(picks, view)
    for key in ENGINE_FORM:
        if key in record.widgets:
            st.session_state[key] = record.widgets[key]
    for key, value in picks.items():
        st.session_state[key] = value
    step = min(record.step, max(0, len(view.run.steps) - 1))
    st.session_state["engine_step"] = step
    app.engine.saved_view = (step, picks)
    app.notices.append(("success", f"Reopened engine run “{plain(record.title)}” from the runs folder: "
                                   f"{plain(record.listed_as())}, at engine step {step}."))


def keep_engine_run(app: AppState, form: dict[str, object], step: int) -> None:
    """After the Engine tab ran: the run under a new id in the address, written to the runs folder by a thread of its
    own (its values take seconds to compress at the largest), the record last."""
    view = app.engine.view
    store = run_store()
    if view is None or store is None:
        return
    run_id = new_run_id()
    app.engine.run_id, app.engine.foreign, app.engine.saved_view = run_id, False, None
    st.query_params[ENGINE_PARAM] = run_id
    widgets = {key: value for key, value in form.items() if isinstance(value, (str, int, float, bool))}
    record = RunRecord(run_id, app.model, widgets, len(view.run.steps), step, "Engine", time.time(),
                       owner=owner_tag(owner_of_page(app)), kind="engine", texts=dict(view.texts))

    def write() -> None:
        try:
            store.save(record, engine=view.run)
        except (RunError, OSError, ValueError) as e:
            _write_failed[run_id] = str(e)
        finally:
            _writing.pop(run_id, None)

    thread = threading.Thread(target=write, name=f"gpt-shape-tracer-engine-run-{run_id[:6]}")
    _writing[run_id] = thread
    thread.start()


def forget_engine_run(app: AppState) -> None:
    """The Engine tab shows what is not a run of the folder (an opened file): the address names no engine run."""
    app.engine.run_id, app.engine.foreign, app.engine.saved_view = None, False, None
    if ENGINE_PARAM in st.query_params:
        del st.query_params[ENGINE_PARAM]


def engine_run_written(run_id: str, timeout: float | None = None) -> bool:
    """Wait for this server's write of the engine run (tests, and a reopen); True once it is not being written."""
    thread = _writing.get(run_id)
    if thread is not None:
        thread.join(timeout)
    return run_id not in _writing


def save_engine_view(app: AppState, step: int, picks: dict[str, object]) -> None:
    """The Engine tab's engine step and picks, written to its run's record when they changed (a reload comes back to
    them). Not another page's run, and not before the run's own write has put its record in place."""
    if app.engine.run_id is None or app.engine.foreign or app.engine.saved_view == (step, picks):
        return
    if app.engine.run_id in _writing:
        return  # its record is not there yet: the next rerun after the write writes these
    store = run_store()
    if store is None:
        return
    try:
        written = store.update_view(app.engine.run_id, step, "Engine",
                                    {k: v for k, v in picks.items() if isinstance(v, (str, int, float, bool))})
    except (RunError, OSError):
        return
    if written:
        app.engine.saved_view = (step, dict(picks))
