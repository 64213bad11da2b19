"""GPT shape tracer — `streamlit run app.py`.

The page's main: page config, the sidebar, its action, the tabs. Each tab's wiring is a module of ``gui/``;
what the buttons compute, the settings and the session's state are in ``session``; traces and experiments
come from ``tracer``, figures and tables from ``figures`` (pure functions).
"""

from __future__ import annotations

from collections.abc import Callable

import streamlit as st

from gpt_shape_tracer.figures.common import MASK_TAB_NAMES, bidirectional, mask_tab_name
from gpt_shape_tracer.gui.attention import attention_tab
from gpt_shape_tracer.gui.beams import decoding_tab
from gpt_shape_tracer.gui.common import remembered_tabs, state
from gpt_shape_tracer.gui.compare import compare_tab
from gpt_shape_tracer.gui.dry_run import LABEL as DRY_LABEL
from gpt_shape_tracer.gui.dry_run import dry_run_page
from gpt_shape_tracer.gui.engine import engine_tab
from gpt_shape_tracer.gui.export import export_tab
from gpt_shape_tracer.gui.header import header, status, viewed_step
from gpt_shape_tracer.gui.inspector import inspector_tab
from gpt_shape_tracer.gui.kv_cache import cache_tab
from gpt_shape_tracer.gui.mask import mask_tab
from gpt_shape_tracer.gui.next_token import next_token_tab
from gpt_shape_tracer.gui.runs import (
    finish_restoring,
    follow_the_address,
    opening_a_run,
    recent_runs,
    report_failed_write,
    save_run,
    save_view,
)
from gpt_shape_tracer.gui.server import admitted, freed_memory_reused, imports_frozen
from gpt_shape_tracer.gui.shapes import shapes_tab
from gpt_shape_tracer.gui.sidebar import (
    advance,
    read_settings,
    reset,
    sidebar,
    sidebar_values,
    step_button,
)
from gpt_shape_tracer.gui.start import before_the_first_step
from gpt_shape_tracer.gui.tour import tour_bar
from gpt_shape_tracer.gui.whatif import whatif_tab
from gpt_shape_tracer.gui.worked import worked_tab
from gpt_shape_tracer.session import DEFAULT_RUN_N, AppState
from gpt_shape_tracer.tracer import Trace

PANELS: dict[str, Callable[[Trace, int], None]] = {
    "Shapes": shapes_tab, "Attention": attention_tab, "Causal mask": mask_tab, "KV cache": cache_tab,
    "Next token": next_token_tab, "Decoding": decoding_tab, "What if": whatif_tab, "Compare runs": compare_tab,
    "Worked example": worked_tab, "Inspector": inspector_tab, "Engine": engine_tab, "Export": export_tab}
TABS = list(PANELS)
MASK_TAB = MASK_TAB_NAMES[0]  # drawn as mask_tab_name(…): "Attention mask" for a model whose mask is not causal

st.set_page_config(page_title="GPT shape tracer", page_icon="🔎", layout="wide")
st.markdown("<style>.block-container {padding-top: 2.2rem;} h1 {font-size: 1.9rem !important;}</style>",
            unsafe_allow_html=True)
freed_memory_reused()
imports_frozen()  # every module above imported: their objects out of the garbage collector's full walks


def main() -> None:
    if not admitted():  # the server's cap on sessions
        return
    app = state()
    with app.run_lock:  # a run that a click interrupted finishes its step first (AppState.run_lock)
        run(app)


def run(app: AppState) -> None:
    follow_the_address()  # a run id in the address this session does not hold: restore it (gui/runs.py)
    action, values, step_slot = sidebar()
    foot = st.sidebar.container()  # the sidebar's foot: Recent runs, drawn by the view (their list follows a Step)
    st.title("GPT shape tracer")
    if st.session_state.get("source") == DRY_LABEL:  # config only: its own page (gui/dry_run.py)
        step_button(step_slot)
        dry_run_page()
        return
    settings, refused = read_settings(values)
    if action == "reset":
        app.steps_owed = 0
        reset(refused)
    elif action == "run":
        app.steps_owed = 0  # Run N goes on from wherever the Steps clicked before it had got
        step_button(step_slot, by_the_run=True)  # a Step clicked during the run stops it (gui/sidebar.py)
        advance(st.session_state.get("run_n", DEFAULT_RUN_N), settings, refused)
    elif app.steps_owed:
        # a Step is owed from its click (its callback counts it) until it has run: a click that interrupts the run
        # before its step (a click outside the view: Streamlit stops the old run at its next call) leaves it owed
        advance(app.steps_owed, settings, refused, owed=True)
    view(step_slot, foot)


@st.fragment
def view(step_slot, foot) -> None:
    """What a Step changes: the Step button (in the sidebar), the Step made, the run written, Recent runs (the
    sidebar's foot), the header and the tabs. A fragment: a Step, the step slider or a tab reruns this alone, not the
    sidebar it does not change (a page redraws every element a rerun draws: ~0.05 s a Step, bench_step_floor.py);
    a full run runs it too. A full run opens a run from Recent runs (follow_the_address) and makes several Steps
    owed, with a Stop button that stops them (a click in a fragment waits for a run to end). Given only containers
    (a fragment's arguments live as long as the session)."""
    app = state()
    with app.run_lock:  # a fragment run can start beside a full run that is still stopping
        if opening_a_run() or app.steps_owed > 1:  # made by a full run: a run opened, or steps with a Stop button
            st.rerun()
        step_button(step_slot)
        values = sidebar_values()
        settings, refused = read_settings(values)
        if app.steps_owed:  # one Step, clicked: made by this rerun of the view alone
            advance(app.steps_owed, settings, refused, owed=True)
        finish_restoring(app)
        save_run(app, values)  # the run's record and trace, when it has new steps
        report_failed_write(app)  # a write of an earlier Step that failed in its thread
        with foot:
            recent_runs()  # at the foot of the sidebar, drawn after the action it may reflect
        if not status(settings, refused):
            return
        trace = app.viewed_trace
        if trace is None:
            before_the_first_step(app)
            return
        save_view(app, header(trace))  # the step slider: each tab reads the step it set (viewed_step)
        tour_bar(trace)  # the guided tour: its stop opens the tabs below (gui/tour.py)
        mask = mask_tab_name(bidirectional(trace))  # "Causal mask", or "Attention mask" where M is not causal
        tabs = remembered_tabs([mask if name == MASK_TAB else name for name in TABS], "view", MASK_TAB_NAMES)
        for tab, name in zip(tabs, TABS):
            with tab:
                if tab.open:
                    panel(name)


@st.fragment
def panel(name: str) -> None:
    """One tab, rerun on its own when a widget in it changes. The fragment is given only the tab's name and
    reads the trace and step when it runs: Streamlit keeps a fragment's arguments for the session's life, and
    a trace passed here would outlive Reset and the session's end (measured: its memory never came back)."""
    app = state()
    with app.run_lock:  # a fragment run too can start beside a full run that is still stopping
        trace = app.viewed_trace
        if trace is not None:
            PANELS[name](trace, viewed_step(trace))


main()
