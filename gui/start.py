"""What the page shows before its first Step: how to start, and the tabs that need no generation."""

from __future__ import annotations

import streamlit as st

from gpt_shape_tracer.gui.engine import engine_tab
from gpt_shape_tracer.gui.export import export_tab
from gpt_shape_tracer.gui.worked import worked_tab
from gpt_shape_tracer.session import AppState


def before_the_first_step(app: AppState) -> None:
    st.info("Press **Step** (top of the sidebar) to run the prompt: step 0 runs the whole prompt (the "
            "prefill), every further step one new token.")
    # the Engine runs the model, not a generation; an engine run on the page (one reopened by a reload) opens it
    tabs = st.tabs(["Worked example", "Engine", "Export"], default="Engine" if app.engine.view is not None else None)
    with tabs[0]:
        worked_tab()
    with tabs[1]:
        engine_tab()
    with tabs[2]:
        export_tab(None)
