"""An Engine tab's run survives a reload (issue 49): run under AppTest on the bundled story model, written to the runs
folder (session/runs.py, gui/runs.py), then a new session on the same address — what a reload, a dropped connection
or a restarted server opens — shows the same run: every chart, metric, sentence and table of the Engine tab equal,
the engine step and the picks where they were; Recent runs lists it as an engine run and a click reopens it; a file
of the folder that is not one of ours is refused with the reason, and nothing else changes."""

from __future__ import annotations

from html import unescape

import pytest
from streamlit.testing.v1 import AppTest

from gpt_shape_tracer.gui.runs import engine_run_written
from gpt_shape_tracer.session.runs import ENGINE_FILE, RunsSettings, RunStore
from tests.app.test_app import APP, charts, press, run, show_tab
from tests.app.test_runs import address_run, listed

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)

REQUESTS = "Once upon a time, there was a little girl named Lily.\nOnce upon a time, there was a little girl who\n" \
           "The cat sat on the mat."


def page_at(**params: str | None) -> AppTest:
    """A new session with ``params`` (run, engine, owner) in its address."""
    at = AppTest.from_file(APP, default_timeout=240)
    for key, value in params.items():
        if value is not None:
            at.query_params[key] = value
    return run(at)


def reload(at: AppTest) -> AppTest:
    """The same address in a new session."""
    return page_at(**{key: address_run(at, key) for key in ("run", "engine", "owner")})


def engine_page(at: AppTest) -> dict:
    """Everything the Engine tab shows of its run: the charts, the metrics, the sentences and captions, the block
    table, the slider and the pickers (the page's notices aside)."""
    return {"charts": [c for c in charts(at) if "engine step" in str(c) or "logical position" in str(c)],
            "metrics": [(m.label, m.value) for m in at.metric],
            "markdown": [m.value for m in at.markdown], "captions": [c.value for c in at.caption],
            "tables": [d.value.to_dict() for d in at.dataframe],
            "step": at.slider(key="engine_step").value,
            "picks": [at.selectbox(key=k).value for k in ("engine_request", "engine_layer", "engine_head")]}


def run_the_engine(at: AppTest) -> str:
    at.text_area(key="engine_requests").set_value(REQUESTS)
    at.text_input(key="engine_arrivals").set_value("0, 0, 2")
    at.number_input(key="engine_new_tokens").set_value(4)
    at.button(key="engine_run").click()
    run(at)
    assert not at.error, [e.value for e in at.error]
    engine_id = address_run(at, "engine")
    assert engine_id and at.session_state["app"].engine.run_id == engine_id
    assert engine_run_written(engine_id, timeout=120)  # written in a thread of its own: wait for it here
    return engine_id


def test_an_engine_run_survives_a_reload_with_every_view_equal():
    at = page_at()
    engine_id = run_the_engine(at)
    engine = at.session_state["app"].engine.view
    assert engine.run.requests[2].arrival == 2 and any(s.shared for s in engine.run.steps)
    at.slider(key="engine_step").set_value(2)
    at.selectbox(key="engine_request").set_value("r2")
    at.selectbox(key="engine_layer").set_value(1)
    run(at)
    run(at)  # the picks are written once the record is there: this rerun writes them
    store = RunStore(RunsSettings.from_environment())
    record = store.record(engine_id)
    assert (record.kind, record.n_steps, record.step, record.view) == ("engine", len(engine.run.steps), 2, "Engine")
    assert record.widgets["engine_request"] == "r2" and record.widgets["engine_layer"] == 1
    assert record.widgets["engine_requests"] == REQUESTS
    before = engine_page(at)
    assert before["metrics"] and len(before["charts"]) >= 4 and before["step"] == 2

    again = reload(at)  # a new session with the same address
    app = again.session_state["app"]
    assert app.engine.run_id == engine_id and app.engine.view is not None and app.engine.view is not engine
    assert engine_page(again) == before
    assert again.text_area(key="engine_requests").value == REQUESTS
    assert any("Reopened engine run" in unescape(s.value) and record.listed_as() in unescape(s.value)
               for s in again.success)
    assert engine_id in listed(again)
    label = unescape(again.sidebar.button(key=f"open_run_{engine_id}").label)
    first = REQUESTS.split("\n")[0]  # 53 characters: the list shows 47 and an ellipsis
    assert label == (f"Engine: {first[:47]}… · 3 requests · {len(engine.run.steps)} engine steps · story-gpt · "
                     "just now (this page)")

    press(again, "step_button")  # a Step keeps the engine run, and the address names both
    assert app.live.generation is not None and app.engine.run_id == engine_id
    assert address_run(again, "engine") == engine_id and address_run(again, "run")
    show_tab(again, "Engine")
    both = reload(again)  # the generation run and the engine run, both back
    assert both.session_state["app"].live.generation.n_steps == 1
    assert both.session_state["app"].engine.run_id == engine_id


def test_recent_runs_reopens_an_engine_run_and_reset_lets_it_go():
    at = page_at()
    engine_id = run_the_engine(at)
    steps = len(at.session_state["app"].engine.view.run.steps)
    fresh = page_at(owner=address_run(at, "owner"))  # the same person, the address without the run
    assert fresh.session_state["app"].engine.view is None and engine_id in listed(fresh)
    fresh.sidebar.button(key=f"open_run_{engine_id}").click()
    run(fresh)
    app = fresh.session_state["app"]
    assert app.engine.run_id == engine_id and len(app.engine.view.run.steps) == steps
    assert address_run(fresh, "engine") == engine_id
    press(fresh, "reset_button")
    assert app.engine.view is None and address_run(fresh, "engine") is None
    assert engine_id in listed(fresh)  # still kept, one click away


def test_an_engine_file_of_the_folder_that_is_not_ours_is_refused_and_nothing_else_changes():
    at = page_at()
    engine_id = run_the_engine(at)
    store = RunStore(RunsSettings.from_environment())
    (store.run_dir(engine_id) / ENGINE_FILE).write_bytes(b"\x80\x04\x95 a pickle, not an engine run")
    again = reload(at)
    app = again.session_state["app"]
    assert app.engine.view is None and app.engine.run_id is None and address_run(again, "engine") is None
    assert any("The engine run in the address cannot be opened: its file is refused" in unescape(e.value)
               and "not a readable engine run" in unescape(e.value) for e in again.error)
    other = page_at(engine=address_run(at, "owner"))  # a well-formed id that names no run
    assert other.session_state["app"].engine.view is None
    assert any("keeps no run" in unescape(e.value) for e in other.error)
    malformed = page_at(engine="../../etc/passwd")
    assert malformed.session_state["app"].engine.view is None and address_run(malformed, "engine") is None
    assert any("that is not a run id of this app" in unescape(e.value) for e in malformed.error)
