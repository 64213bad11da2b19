"""What the runs folder and Compare runs refuse or count (session/runs.py, gui/runs.py, gui/compare.py): a FIFO named
run.json (it hung every new page, since Recent runs opens each run's file), a run folder that is a symbolic link out
of the runs folder, a run whose trace.zip is damaged (said to be damaged, not "larger than the budget"), and the run
Compare runs holds, reserved in the server's memory budget like an opened file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from gpt_shape_tracer.session.runs import RUN_FILE, TRACE_FILE, RunError, RunsSettings, RunStore, new_run_id
from gpt_shape_tracer.session.server_limits import BUDGET_ENV, MiB
from gpt_shape_tracer.tracer import TracedGeneration, archive_bytes
from tests.app.test_app import APP, page_text, press, run, show_tab
from tests.app.test_runs import app_at, record, runs_store

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_trace(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Tom had a kite.", temperature=0)
    gen.run(2)
    return gen.trace


def test_a_fifo_named_run_json_is_skipped_by_the_list_and_refused_by_id(tmp_path):
    """In a child process with a time limit: an open() of the FIFO would wait for a writer for ever."""
    probe = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from dataclasses import replace
        from gpt_shape_tracer.session import ModelChoice
        from gpt_shape_tracer.session.runs import RunError, RunRecord, RunsSettings, RunStore, new_run_id
        store = RunStore(RunsSettings(__import__("pathlib").Path(sys.argv[1]), keep=5, budget_bytes=2**26))
        good, bad = new_run_id(), new_run_id()
        store.save(RunRecord(good, ModelChoice(), {{"prompt": "Lily"}}, 1, 0, "Shapes", 1.0))
        os.mkdir(store.run_dir(bad), 0o700)
        os.mkfifo(store.run_dir(bad) / "run.json")
        print("LISTED", [r.run_id for r in store.recent()] == [good])
        try:
            store.record(bad)
            print("READ")
        except RunError as e:
            print("REFUSED", e)
    """)
    done = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "LISTED True" in done.stdout and "REFUSED" in done.stdout, done.stdout
    assert "run.json is not a regular file" in done.stdout, done.stdout


def test_a_run_folder_that_is_a_link_out_of_the_runs_folder_is_not_followed(tmp_path, small_trace):
    elsewhere = RunStore(RunsSettings(tmp_path / "elsewhere", keep=5, budget_bytes=2**26))
    run_id = new_run_id()
    elsewhere.save(record(run_id), small_trace)
    store = RunStore(RunsSettings(tmp_path / "runs", keep=5, budget_bytes=2**26))
    store.save(record(new_run_id()))  # the folder exists, with one run of its own
    os.symlink(elsewhere.run_dir(run_id), store.run_dir(run_id))
    assert elsewhere.record(run_id) is not None  # a run that reads where it is
    assert run_id not in [r.run_id for r in store.recent()] and len(store.recent()) == 1
    with pytest.raises(RunError, match="its folder is a symbolic link, which is not followed"):
        store.record(run_id)
    with pytest.raises(RunError, match="symbolic link"):
        store.trace(run_id)
    store.prune()
    assert elsewhere.record(run_id) is not None  # pruning never reaches through the link


def test_a_trace_zip_that_is_a_link_or_a_fifo_is_refused(tmp_path, small_trace):
    store = RunStore(RunsSettings(tmp_path / "runs", keep=5, budget_bytes=2**26))
    linked, fifo = new_run_id(), new_run_id()
    store.save(record(linked))
    store.save(record(fifo))
    target = tmp_path / "outside.zip"
    target.write_bytes(archive_bytes(small_trace))
    os.symlink(target, store.run_dir(linked) / TRACE_FILE)
    os.mkfifo(store.run_dir(fifo) / TRACE_FILE)
    with pytest.raises(RunError, match="a link is not followed"):
        store.trace(linked)
    with pytest.raises(RunError, match="trace.zip is not a regular file"):
        store.trace(fifo)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_restored_run_whose_trace_is_damaged_says_so(small_trace, damage):
    """The run is made again from its settings; what could not be compared is said to be damaged, not "larger
    than the runs folder's budget" (which is what a run written without its trace says)."""
    run_id = new_run_id()
    store = runs_store()
    store.save(record(run_id), small_trace)
    path = store.run_dir(run_id) / TRACE_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"PK\x03\x04" + os.urandom(4096))
    assert (store.run_dir(run_id) / RUN_FILE).is_file()
    at = app_at(run_id)
    said = " ".join(s.value for s in at.success)
    assert "Restored run" in said and "its trace file is damaged" in said, page_text(at)
    assert "larger than the runs folder's budget" not in said


def test_compare_runs_reserves_what_it_holds_in_the_servers_budget(monkeypatch):
    """A rerun to compare keeps up to the generation's budget beside it: on a 300 MiB server with a 200 MB
    generation it is refused with the numbers, and nothing is held for it; a compared file is counted."""
    from gpt_shape_tracer.gui.server import session_ledger

    monkeypatch.setenv(BUDGET_ENV, "300")
    at = AppTest.from_file(APP, default_timeout=240)
    run(at)
    at.sidebar.number_input(key="budget_mb").set_value(200)
    press(at, "step_button")
    app = at.session_state["app"]
    held = session_ledger().held()
    assert app.live.generation is not None and held >= 200 * MiB
    show_tab(at, "Compare runs")
    at.radio(key="compare_with").set_value("this prompt with the KV cache off")
    run(at)
    at.button(key="compare_run").click()
    run(at)
    errors = " ".join(e.value for e in at.error)
    assert "Not run: This server keeps at most 300 MiB of traces" in errors, page_text(at)
    assert app.live.comparison is None and session_ledger().held() == held
    at.radio(key="compare_with").set_value("a trace file")
    run(at)
    data = archive_bytes(app.live.generation.trace)
    at.file_uploader(key="compare_upload").upload("mine.zip", data, "application/zip")
    run(at)
    assert app.live.comparison is not None and not at.error, page_text(at)
    kept = app.live.comparison.trace.log.bytes_kept
    assert kept > 0 and app.held_bytes()["comparison"] == kept
    assert session_ledger().held() >= 200 * MiB + kept
    press(at, "reset_button")


def test_a_run_json_nested_too_deeply_is_refused_by_name(tmp_path):
    store = RunStore(RunsSettings(tmp_path / "runs", keep=5, budget_bytes=2**26))
    run_id = new_run_id()
    store.save(record(run_id))
    (store.run_dir(run_id) / RUN_FILE).write_text("[" * 100_000 + "]" * 100_000)  # 200 KB: under the size cap
    with pytest.raises(RunError, match="run.json is nested too deeply to be one of ours"):
        store.record(run_id)
    assert store.recent() == []
