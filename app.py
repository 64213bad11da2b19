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
from gpt_shape_tracer.gui.runs import finish_restoring, follow_the_address, recent_runs, save_run, save_view
from gpt_shape_tracer.gui.server import admitted, freed_memory_reused, imports_frozen
from gpt_shape_tracer.gui.shapes import shapes_tab
from gpt_shape_tracer.gui.sidebar import advance, reset, sidebar
from gpt_shape_tracer.gui.tour import tour_bar
from gpt_shape_tracer.gui.whatif import whatif_tab
from gpt_shape_tracer.gui.worked import worked_tab
from gpt_shape_tracer.session import DEFAULT_RUN_N, AppState, SettingsError, settings_from
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
    action, values = sidebar()
    st.title("GPT shape tracer")
    if st.session_state.get("source") == DRY_LABEL:  # config only: its own page (gui/dry_run.py)
        dry_run_page()
        return
    try:  # the widgets' values, read once: every use below sees the same settings or the same refusal
        settings, refused = settings_from(values), None
    except SettingsError as e:
        settings, refused = None, e
    if action == "reset":
        app.steps_owed = 0
        reset(refused)
    elif action == "run":
        app.steps_owed = 0  # Run N goes on from wherever the Steps clicked before it had got
        advance(st.session_state.get("run_n", DEFAULT_RUN_N), settings, refused)
    elif app.steps_owed:
        # a Step is owed from its click (its callback counts it) until it has run: a click that interrupts the
        # run before its step (any click: Streamlit stops the old run at its next call) leaves it owed
        advance(app.steps_owed, settings, refused, owed=True)
    finish_restoring(app)
    save_run(app, values)  # the run's record and trace, when it has new steps
    recent_runs()  # at the foot of the sidebar, drawn after the action it may reflect
    if not status(settings, refused):
        return
    trace = app.viewed_trace
    if trace is None:
        st.info("Press **Step** (top of the sidebar) to run the prompt: step 0 runs the whole prompt (the "
                "prefill), every further step one new token.")
        # the Engine runs the model, not a generation; an engine run on the page (one reopened by a reload) opens it
        tabs = st.tabs(["Worked example", "Engine", "Export"],
                       default="Engine" if app.engine.view is not None else None)
        with tabs[0]:
            worked_tab()
        with tabs[1]:
            engine_tab()
        with tabs[2]:
            export_tab(None)
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
