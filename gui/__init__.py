"""The Streamlit page, one module per tab: ``app.py`` draws the sidebar and the tabs by calling these.

Wiring only — widgets, layout, session state. What a button computes lives in ``session`` (settings, runs,
reruns, experiments' inputs), traces and experiments in ``tracer`` (imported through its front door) and
figures and tables in ``figures``. Nothing below this layer imports it (tests/app/test_gui_structure.py).
"""
