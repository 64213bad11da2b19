"""The server's side of a page: how many sessions it admits, the memory ledger every session's traces are
reserved in before they are made (session/server_limits.py), and returning freed memory to the system.
"""

from __future__ import annotations

import gc
import sys
import threading
import time

import streamlit as st

from gpt_shape_tracer.figures.common import inert as plain  # everything the app did not write passes through this
from gpt_shape_tracer.gui.common import _STATES, state, this_session
from gpt_shape_tracer.session.memory import freeze_imports, return_freed_memory, reuse_freed_memory
from gpt_shape_tracer.session.server_limits import SessionLedger


@st.cache_resource
def freed_memory_reused() -> bool:
    """Once per server process: a long prefill frees gigabytes, and glibc's malloc would hand each new tensor
    fresh pages to fault in again (session/memory.py)."""
    return reuse_freed_memory()


@st.cache_resource(show_spinner=False)  # the server's own housekeeping: nothing for the page to show
def imports_frozen() -> int:
    """Once per server process, after the app's imports: the objects they made left out of every later full garbage
    collection, each a 0.2 s pause of the Step that triggered it (session/memory.py)."""
    return freeze_imports()


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
    runs, of the run Compare runs holds and of the attention stages its views recomputed — each as the session
    holds it now (``AppState.held_bytes``) unless given; "" when granted, else why not."""
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
    file_bytes += engine_bytes + decoding_bytes + comparison_bytes + held["recomputed"]
    # what follows the sidebar's Budget (MB): the generation's share, and a gradients recording asked for now (at
    # most the budget); an opened file and a gradients trace already recorded do not
    budget_times = int(generation_bytes > 0) + int(asked_gradients and gradient_bytes > 0)
    fixed = file_bytes + (0 if asked_gradients else gradient_bytes)
    try:
        return session_ledger().reserve(this_session(), generation_bytes + file_bytes + gradient_bytes,
                                        budget_times=budget_times, fixed=fixed)
    except ValueError as e:
        return f"The server's limits are set wrongly: {plain(e)}"
