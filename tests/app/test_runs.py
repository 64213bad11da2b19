"""Nothing lost (issue 41 item 1): the runs folder (gpt_shape_tracer/runs.py) and the app's use of it under
AppTest — a reload restores the run, Reset asks, experiment results are kept per step. The browser tests
(a real reload, 200 fast slider keys, Reset in a real page) are in tests/browser/test_browser_runs.py."""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import replace

import pytest
from streamlit.testing.v1 import AppTest

from gpt_shape_tracer.gui.runs import tokens_of
from gpt_shape_tracer.session import ModelChoice
from gpt_shape_tracer.session.runs import (
    CHECKOUT,
    LIST_ALL_RUNS_ENV,
    RUN_FILE,
    TRACE_FILE,
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
from gpt_shape_tracer.tracer import TracedGeneration, TraceFileError, load_trace
from tests.app.test_app import APP, page_text, press, run, show_tab


def record(run_id: str, updated: float = 1.0, **changes) -> RunRecord:
    base = RunRecord(run_id, ModelChoice(), {"prompt": "Lily had a ball.", "seed": "0", "use_cache": True,
                                                   "temperature": 1.0, "top_k": 0}, 2, 1, "Attention", updated)
    return replace(base, **changes)


@pytest.fixture
def store(tmp_path) -> RunStore:
    return RunStore(RunsSettings(tmp_path / "runs", keep=3, budget_bytes=64 * 2**20))


@pytest.fixture(scope="module")
def small_trace(bundled):
    model, tok = bundled
    gen = TracedGeneration(model, tok, "Tom had a kite.", temperature=0)
    gen.run(2)
    return gen.trace


# -- the folder --------------------------------------------------------------------------------------------
def test_run_ids_are_unguessable_and_name_no_other_path():
    ids = {new_run_id() for _ in range(100)}
    assert len(ids) == 100 and all(checked_run_id(i) == i for i in ids)
    for bad in ("../../etc/passwd", "a" * 21, "a" * 23, "a/" + "b" * 20, "", None, 7, "a" * 21 + "."):
        with pytest.raises(RunError, match="not a run id"):
            checked_run_id(bad)


def test_a_run_is_written_owner_only_and_read_back(store, small_trace):
    run_id = new_run_id()
    store.save(record(run_id), small_trace)
    folder = store.run_dir(run_id)
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in (RUN_FILE, TRACE_FILE):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    assert sorted(p.name for p in folder.iterdir()) == [RUN_FILE, TRACE_FILE]  # no temporary file left
    assert store.record(run_id) == record(run_id)
    back = store.trace(run_id)
    assert tokens_of(back) == tokens_of(small_trace) and back.n_steps == small_trace.n_steps


def test_a_folder_made_readable_by_others_is_made_private_again(store, small_trace):
    store.directory.mkdir(parents=True, mode=0o755)
    os.chmod(store.directory, 0o755)
    store.save(record(new_run_id()), small_trace)
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700


def test_the_view_is_rewritten_alone(store, small_trace):
    run_id = new_run_id()
    store.save(record(run_id), small_trace)
    before = (store.run_dir(run_id) / TRACE_FILE).stat().st_mtime_ns
    store.update_view(run_id, 0, "KV cache")
    assert (store.record(run_id).step, store.record(run_id).view) == (0, "KV cache")
    assert (store.run_dir(run_id) / TRACE_FILE).stat().st_mtime_ns == before


def test_the_folder_keeps_the_newest_runs_within_its_count_and_bytes(store, small_trace):
    ids = [new_run_id() for _ in range(5)]
    for age, run_id in enumerate(ids):
        removed = store.save(record(run_id, updated=float(age)), small_trace)
    assert removed == [ids[1]]  # the fifth write removes the oldest still there (keep = 3)
    assert [r.run_id for r in store.recent()] == ids[:1:-1]
    one_run = store.size(ids[-1])
    small = RunStore(RunsSettings(store.directory, keep=10, budget_bytes=2 * one_run + one_run // 2))
    small.save(record(new_run_id(), updated=10.0), small_trace)
    assert len(small.recent()) == 2  # bytes bound it now: two runs fit, not three


def test_a_run_written_after_each_step_writes_each_step_once(store, bundled):
    """A Step's write adds a part holding that step (tracer.save_trace_part) instead of the whole trace again;
    the run reads back as the trace, record by record; a whole write, or a write of another generation, removes
    the parts; after MAX_TRACE_PARTS files the whole trace is written again."""
    from gpt_shape_tracer.session.runs import MAX_TRACE_PARTS

    model, tok = bundled
    gen = TracedGeneration(model, tok, "Tom had a kite.", temperature=0.8, seed=2)
    run_id = new_run_id()
    folder = store.run_dir(run_id)
    for _ in range(4):
        gen.run(1)
        after = store.save_steps(record(run_id, n_steps=gen.n_steps, step=0), gen.trace)
    parts = ["trace-from-000001.zip", "trace-from-000002.zip", "trace-from-000003.zip"]
    assert sorted(p.name for p in folder.iterdir()) == sorted([RUN_FILE, TRACE_FILE, *parts])
    assert all(stat.S_IMODE((folder / name).stat().st_mode) == 0o600 for name in parts)
    assert load_trace(folder / TRACE_FILE).n_steps == 1  # the first write's, never rewritten
    back = store.trace(run_id)
    assert tokens_of(back) == tokens_of(gen.trace) and back.n_steps == 4
    assert back.to_frame().equals(gen.trace.to_frame())
    assert store.save_steps(record(run_id, n_steps=4, step=0), gen.trace) == after  # nothing new: nothing
    assert sorted(p.name for p in folder.iterdir()) == sorted([RUN_FILE, TRACE_FILE, *parts])
    # another generation under the same id (a second page on the address) writes its trace whole, parts gone;
    # and the first page's next write, whose files these no longer are, writes its own whole again
    other = TracedGeneration(model, tok, "Lily said,", temperature=0)
    other.run(2)
    whole = store.save_steps(record(run_id, n_steps=2, step=0), other.trace)
    assert whole.parts == 1 and sorted(p.name for p in folder.iterdir()) == [RUN_FILE, TRACE_FILE]
    assert tokens_of(store.trace(run_id)) == tokens_of(other.trace)
    gen.run(1)
    assert store.save_steps(record(run_id, n_steps=5, step=0), gen.trace).parts == 1
    assert tokens_of(store.trace(run_id)) == tokens_of(gen.trace)
    for _ in range(MAX_TRACE_PARTS + 2):  # the first write whole (the files are gen's), then 15 parts, ...
        other.run(1)
        whole = store.save_steps(record(run_id, n_steps=other.n_steps, step=0), other.trace)
    assert whole.parts == 2  # ... then the whole trace instead of a sixteenth part, then one part after it
    (part,) = folder.glob("trace-from-*.zip")
    assert part.name == f"trace-from-{other.n_steps - 1:06d}.zip"  # the last step's, after the whole trace
    assert tokens_of(store.trace(run_id)) == tokens_of(other.trace)
    part.write_bytes(part.read_bytes()[:-200])  # damaged: the reader names the file
    with pytest.raises(TraceFileError, match=f"^{part.name}: not a readable trace archive"):
        store.trace(run_id)
    store.save(record(run_id, n_steps=other.n_steps, step=0), other.trace)  # a whole write: no part left beside it
    assert sorted(p.name for p in folder.iterdir()) == [RUN_FILE, TRACE_FILE]


def test_a_trace_larger_than_the_whole_budget_is_not_written(tmp_path, small_trace):
    tiny = RunStore(RunsSettings(tmp_path / "runs", keep=3, budget_bytes=1024))
    run_id = new_run_id()
    tiny.save(record(run_id), small_trace)
    assert not tiny.record(run_id).trace_saved and tiny.trace(run_id) is None


@pytest.mark.parametrize("field, value", [("n_steps", "2"), ("step", 5), ("widgets", [1]), ("run_id", "x" * 22),
                                          ("updated", True), ("view", None), ("owner", "me"), ("owner", 7),
                                          ("model", "bundled:story-gpt"), ("model", {"kind": "gpu", "where": "x"}),
                                          ("model", {"kind": "bundled", "where": "story-gpt", "device": "tpu"}),
                                          ("model", None)])
def test_a_run_file_that_is_not_ours_is_refused_by_field(store, small_trace, field, value):
    run_id = new_run_id()
    store.save(record(run_id), small_trace)
    path = store.run_dir(run_id) / RUN_FILE
    raw = json.loads(path.read_text())
    raw[field] = value
    path.write_text(json.dumps(raw))
    with pytest.raises(RunError, match=RUN_FILE):
        store.record(run_id)
    assert run_id not in [r.run_id for r in store.recent()]


def test_the_runs_folder_is_never_inside_the_checkout(tmp_path):
    with pytest.raises(RunError, match="inside the app's own folder"):
        RunsSettings.from_environment({"GPT_SHAPE_TRACER_RUNS_DIR": str(CHECKOUT / "runs")})
    with pytest.raises(RunError, match="absolute"):
        RunsSettings.from_environment({"GPT_SHAPE_TRACER_RUNS_DIR": "runs"})
    with pytest.raises(RunError, match="KEEP_RUNS"):
        RunsSettings.from_environment({"GPT_SHAPE_TRACER_RUNS_DIR": str(tmp_path), "GPT_SHAPE_TRACER_KEEP_RUNS": "0"})
    default = RunsSettings.from_environment({"XDG_DATA_HOME": str(tmp_path)})
    assert default.directory == tmp_path.resolve() / "gpt-shape-tracer" / "runs" and default.keep == 20
    assert not default.list_all  # a page lists its own runs unless the server says otherwise


@pytest.mark.parametrize("raw, listed", [("1", True), ("yes", True), (" ON ", True), ("0", False), ("no", False),
                                         ("", False)])
def test_the_list_all_setting_is_read_as_yes_or_no(tmp_path, raw, listed):
    env = {"GPT_SHAPE_TRACER_RUNS_DIR": str(tmp_path), LIST_ALL_RUNS_ENV: raw}
    assert RunsSettings.from_environment(env).list_all is listed


def test_a_list_all_setting_that_is_not_yes_or_no_is_refused(tmp_path):
    with pytest.raises(RunError, match=LIST_ALL_RUNS_ENV):
        RunsSettings.from_environment({"GPT_SHAPE_TRACER_RUNS_DIR": str(tmp_path), LIST_ALL_RUNS_ENV: "everyone"})


def test_the_list_holds_only_the_owners_runs_unless_the_server_lists_all(store, small_trace):
    alice, bob = new_owner_token(), new_owner_token()
    assert alice != bob and checked_owner_token(alice) == alice and checked_owner_token("../x") is None
    # the whole token has the form, not a prefix of it: a well-formed 22 characters followed by more is refused
    assert checked_owner_token("A" * 22 + "/../x") is None and checked_owner_token(alice + "\n") is None
    hers = [new_run_id() for _ in range(2)]
    his = new_run_id()
    for age, run_id in enumerate(hers):
        store.save(record(run_id, updated=float(age), owner=owner_tag(alice)), small_trace)
    store.save(record(his, updated=5.0, owner=owner_tag(bob)), small_trace)
    assert [r.run_id for r in store.recent(owner=owner_tag(alice))] == hers[::-1]
    assert [r.run_id for r in store.recent(owner=owner_tag(bob))] == [his]
    assert store.recent(owner=owner_tag(new_owner_token())) == []
    shared = RunStore(replace(store.settings, list_all=True))
    assert [r.run_id for r in shared.recent(owner=owner_tag(alice))] == [his, *hers[::-1]]
    # the folder holds the owner's hash, never the token that lists the runs
    assert alice not in (store.run_dir(hers[0]) / RUN_FILE).read_text()


def test_a_run_written_before_runs_had_owners_reads_and_belongs_to_no_page(store, small_trace):
    run_id = new_run_id()
    store.save(record(run_id), small_trace)
    path = store.run_dir(run_id) / RUN_FILE
    raw = json.loads(path.read_text())
    del raw["owner"]
    path.write_text(json.dumps(raw))
    assert store.record(run_id).owner == ""
    assert store.recent(owner=owner_tag(new_owner_token())) == [] and len(store.recent()) == 1


def written_before(store: RunStore, run_id: str, key: str, trace) -> None:
    """A run as the version before ``ModelChoice`` wrote it: run.json names its model by a key string."""
    store.save(record(run_id), trace)
    path = store.run_dir(run_id) / RUN_FILE
    raw = json.loads(path.read_text())
    del raw["model"]
    path.write_text(json.dumps({**raw, "model_key": key}))


def test_a_run_file_of_the_version_before_reads_its_model_key_and_is_written_again_as_a_choice(store, small_trace):
    run_id = new_run_id()
    written_before(store, run_id, "cuda:1|dir:bfloat16:/models/a:b", small_trace)
    old = store.record(run_id)
    assert old.model == ModelChoice("directory", "/models/a:b", dtype="bfloat16", device="cuda:1")
    store.update_view(run_id, 0, "KV cache")  # written again: the model as today's object
    raw = json.loads((store.run_dir(run_id) / RUN_FILE).read_text())
    assert "model_key" not in raw and raw["model"] == old.model.to_json()
    assert store.record(run_id).model == old.model


# -- the app -----------------------------------------------------------------------------------------------
def app_at(run_id: str | None = None, owner: str | None = None) -> AppTest:
    """A new session, as a reload or another browser opens it: with ``run_id`` and ``owner`` in its address."""
    at = AppTest.from_file(APP, default_timeout=240)
    if run_id is not None:
        at.query_params["run"] = run_id
    if owner is not None:
        at.query_params["owner"] = owner
    return run(at)


def address_run(at: AppTest, param: str = "run") -> str | None:
    value = at.query_params.get(param)
    return value[0] if isinstance(value, list) else value


def reload(at: AppTest) -> AppTest:
    """The same address in a new session: what a reload, a dropped connection or a restarted server opens."""
    return app_at(address_run(at), address_run(at, "owner"))


def listed(at: AppTest) -> list[str]:
    """The run ids the sidebar's Recent runs offers."""
    return [b.key.removeprefix("open_run_") for b in at.sidebar.button if b.key and b.key.startswith("open_run_")]


def runs_store() -> RunStore:
    return RunStore(RunsSettings.from_environment())


def test_a_reload_restores_the_run_its_step_model_and_view():
    at = app_at()
    at.sidebar.radio(key="source").set_value("Bundled Llama-style story model")
    at.sidebar.text_area(key="prompt").set_value("Mia had a small blue boat.")
    run(at)
    for _ in range(4):
        press(at, "step_button")
    run_id = address_run(at)
    assert run_id and checked_run_id(run_id) == run_id
    at.slider(key="step_view").set_value(1)
    run(at)
    show_tab(at, "KV cache")
    saved = runs_store().record(run_id)
    assert (saved.n_steps, saved.step, saved.view) == (4, 1, "KV cache")
    before = tokens_of(at.session_state["app"].live.generation.trace)

    again = reload(at)  # a new session with the same address
    app = again.session_state["app"]
    assert app.run_id == run_id and app.model == ModelChoice("bundled", "story-llama")
    assert app.live.generation.n_steps == 4 and tokens_of(app.live.generation.trace) == before
    assert again.slider(key="step_view").value == 1 and again.session_state["view"] == "KV cache"
    assert again.sidebar.text_area(key="prompt").value == "Mia had a small blue boat."
    assert any("Restored run" in s.value and "every token equals the trace written then" in s.value
               for s in again.success)
    press(again, "step_button")  # Step continues the restored run, under the same id
    assert app.live.generation.n_steps == 5 and address_run(again) == run_id
    assert runs_store().record(run_id).n_steps == 5


def test_each_step_of_the_page_is_written_once_and_a_reload_reads_the_parts():
    from gpt_shape_tracer.gui.runs import runs_written

    at = app_at()
    for _ in range(3):
        press(at, "step_button")
        assert runs_written(60)  # each Step's write done before the next (Steps in a row would be written once)
    run_id = address_run(at)
    folder = runs_store().run_dir(run_id)
    assert sorted(p.name for p in folder.glob("trace*.zip")) == [
        "trace-from-000001.zip", "trace-from-000002.zip", TRACE_FILE]
    assert load_trace(folder / TRACE_FILE).n_steps == 1  # written at the first Step, never again
    again = reload(at)
    assert any("every token equals the trace written then" in s.value for s in again.success)
    press(again, "step_button")  # the restored run is a new generation: its first write is whole
    assert runs_written(60)
    assert sorted(p.name for p in folder.glob("trace*.zip")) == [TRACE_FILE]
    assert tokens_of(load_trace(folder / TRACE_FILE)) == tokens_of(again.session_state["app"].live.generation.trace)


def test_a_trace_file_missing_its_last_steps_is_compared_on_the_steps_it_holds():
    """A server stopped while it wrote a run's trace again (its parts removed, the whole trace not yet in place)
    leaves a trace file with fewer steps than the run's record: the restore says so, and compares those."""
    from gpt_shape_tracer.gui.runs import runs_written

    at = app_at()
    for _ in range(3):
        press(at, "step_button")
        assert runs_written(60)
    folder = runs_store().run_dir(address_run(at))
    (folder / "trace-from-000002.zip").unlink()
    again = reload(at)
    assert again.session_state["app"].live.generation.n_steps == 3
    assert any("its trace file holds only the first 2" in s.value and "every token of those equals" in s.value
               for s in again.success), [s.value for s in again.success]


def test_reset_asks_first_and_cancel_discards_nothing():
    at = app_at()
    press(at, "step_button")
    press(at, "step_button")
    run_id = address_run(at)
    press(at, "reset_button")
    app = at.session_state["app"]
    assert app.live.generation is not None and app.live.generation.n_steps == 2  # nothing discarded yet
    question = " ".join(w.value for w in at.sidebar.warning)
    assert "Reset discards this page's generation (2 steps)" in question and "Recent runs" in question
    press(at, "reset_cancel")
    assert app.live.generation.n_steps == 2 and not any(b.key == "reset_confirm" for b in at.sidebar.button)
    press(at, "reset_button")
    press(at, "reset_confirm")
    assert app.live.generation is None and address_run(at) is None
    assert runs_store().record(run_id).n_steps == 2  # still kept: Recent runs opens it again
    recent = [b for b in at.sidebar.button if b.key == f"open_run_{run_id}"]
    assert recent and not recent[0].disabled
    recent[0].click()
    run(at)
    assert app.live.generation.n_steps == 2 and app.run_id == run_id


def test_reset_with_nothing_to_discard_asks_nothing():
    at = app_at()
    press(at, "reset_button")
    assert not any(b.key == "reset_confirm" for b in at.sidebar.button)
    assert any("Reset: the next Step starts from the prompt" in i.value for i in at.info)


def test_an_unknown_or_malformed_run_in_the_address_changes_nothing():
    at = app_at(new_run_id())
    assert any("This server keeps no run" in w.value for w in at.warning)
    assert at.session_state["app"].live.generation is None and address_run(at) is None
    at = app_at("../../etc")
    assert any("not a run id" in e.value for e in at.error) and address_run(at) is None


def test_a_run_saved_by_the_version_before_still_reopens():
    """Its run.json names the model by the old key string: the run is made again and checked as any other."""
    from gpt_shape_tracer.model import load_bundled

    model, tok = load_bundled("story-llama")
    gen = TracedGeneration(model, tok, "Lily had a ball.", temperature=0)  # record()'s prompt, greedy as the app
    gen.run(2)
    run_id = new_run_id()
    written_before(runs_store(), run_id, "bundled:story-llama", gen.trace)
    at = app_at(run_id)
    app = at.session_state["app"]
    assert app.model == ModelChoice("bundled", "story-llama") and app.live.generation.n_steps == 2
    assert at.sidebar.radio(key="source").value == "Bundled Llama-style story model"
    assert any("Restored run" in s.value and "every token equals the trace written then" in s.value
               for s in at.success), page_text(at)


def test_a_run_whose_model_is_gone_opens_its_written_trace(tmp_path, small_trace):
    run_id = new_run_id()
    runs_store().save(record(run_id, model=ModelChoice("directory", str(tmp_path / "gone")), n_steps=2, step=1),
                      small_trace)
    at = app_at(run_id)
    app = at.session_state["app"]
    assert app.viewing_file and tokens_of(app.loaded.trace) == tokens_of(small_trace)
    assert any("shown from the trace written at the time" in w.value and "cannot be loaded" in w.value
               for w in at.warning)
    assert app.model == ModelChoice()  # the sidebar's model is left as it was


def test_a_gradients_result_comes_back_after_a_step():
    """The Gradients view computes its backward pass when it opens and keeps it per (step, layer, head, sequence,
    loss): after a Step the new step gets its own, and returning to the first shows the one kept, not a new one."""
    at = app_at()
    press(at, "step_button")
    press(at, "step_button")
    show_tab(at, "Attention", ("attn_view", "Gradients"))
    kept = at.session_state["app"].live.gradients
    assert [key[0] for key in kept.computed_for()] == [1]
    first = kept.get(kept.computed_for()[0])
    assert "gradients computed from their formulas" in page_text(at)
    press(at, "step_button")  # the slider moves to step 2: its own backward pass
    assert sorted(key[0] for key in kept.computed_for()) == [1, 2]
    at.slider(key="step_view").set_value(1)
    run(at)
    assert sorted(key[0] for key in kept.computed_for()) == [1, 2]
    assert kept.get(next(k for k in kept.computed_for() if k[0] == 1)) is first
    assert "gradients computed from their formulas" in page_text(at)


def test_a_what_if_result_comes_back_when_the_slider_returns_to_its_step():
    """docs/runs.md: a What if re-run is kept per (step, heads, how, text) and comes back when the slider returns
    to its step — after a Step moved the slider on, the same object is shown again, not a new run."""
    at = app_at()
    press(at, "step_button")
    press(at, "step_button")
    show_tab(at, "What if")
    at.multiselect(key="ablate_heads").select((0, 0))
    run(at)
    at.button(key="ablate_run").click()
    run(at)
    app = at.session_state["app"]
    (key,) = app.live.ablations.computed_for()
    first = app.live.ablations.get(key)
    assert key[0] == 1 and "Re-ran step 1" in page_text(at)
    press(at, "step_button")  # the slider moves to step 2: no result there yet
    assert at.slider(key="step_view").value == 2 and "Re-ran step" not in page_text(at)
    at.slider(key="step_view").set_value(1)
    run(at)
    assert "Re-ran step 1" in page_text(at) and app.live.ablations.computed_for() == [key]
    assert app.live.ablations.get(key) is first  # kept, not computed again


def test_a_written_trace_is_the_projects_trace_format():
    at = app_at()
    press(at, "step_button")
    run_id = address_run(at)
    path = runs_store().run_dir(run_id) / TRACE_FILE
    assert tokens_of(load_trace(path)) == tokens_of(at.session_state["app"].live.generation.trace)
    assert time.time() - runs_store().record(run_id).updated < 600


# -- whose runs the list shows --------------------------------------------------------------------------------
def test_two_pages_each_list_only_their_own_runs_and_a_reload_keeps_its_list():
    alice, bob = app_at(), app_at()
    alice.sidebar.text_area(key="prompt").set_value("Alice kept a secret diary.")
    bob.sidebar.text_area(key="prompt").set_value("Bob grew tall sunflowers.")
    for at in (alice, bob):
        run(at)
        press(at, "step_button")
    hers, his = address_run(alice), address_run(bob)
    assert address_run(alice, "owner") != address_run(bob, "owner")  # each page made its own owner token
    assert checked_owner_token(address_run(alice, "owner"))
    press(alice, "reset_button")
    press(alice, "reset_confirm")  # her run is no longer the page's: the list is what finds it now
    assert listed(alice) == [hers] and listed(bob) == [his]
    assert "Bob grew" not in " ".join(b.label for b in alice.sidebar.button)
    again = reload(alice)  # the address keeps the owner token: a reload lists her runs still
    assert listed(again) == [hers] and address_run(again, "owner") == address_run(alice, "owner")
    assert runs_store().record(hers).owner == owner_tag(address_run(alice, "owner"))


def test_a_run_opened_by_its_id_opens_and_a_step_on_it_writes_a_run_of_the_openers_own():
    alice = app_at()
    press(alice, "step_button")
    press(alice, "step_button")
    hers = address_run(alice)
    bob = app_at(hers)  # her address without her owner token: the run id alone opens it
    app = bob.session_state["app"]
    assert app.run_id == hers and app.live.generation.n_steps == 2
    assert any("Restored run" in s.value for s in bob.success)
    assert hers not in listed(bob)  # opened, not his: not in his list
    bob.slider(key="step_view").set_value(0)
    run(bob)
    assert runs_store().record(hers).step == 1  # his slider does not rewrite her run
    press(bob, "step_button")
    his = address_run(bob)
    assert his != hers and app.live.generation.n_steps == 3  # his Step went on in a run of his own
    assert runs_store().record(hers).n_steps == 2 and runs_store().record(his).n_steps == 3
    assert listed(bob) == [his]  # his own run, this page's (listed, its button disabled)
    assert runs_store().record(his).owner == owner_tag(address_run(bob, "owner"))
    assert his not in listed(alice.run())


def test_a_single_user_server_lists_every_run(monkeypatch):
    alice = app_at()
    press(alice, "step_button")
    monkeypatch.setenv(LIST_ALL_RUNS_ENV, "1")
    bob = app_at()
    assert address_run(alice) in listed(bob)
    assert "every run of this server" in bob.sidebar.header[-1].help


def test_recent_runs_lists_the_run_as_the_page_holds_it_while_its_write_is_under_way(monkeypatch):
    """After a Step, the run's write runs in a thread: until it ends the folder still holds the run's previous
    record. Recent runs lists the run as the page holds it (3 steps), not as the folder held it (2) — a browser
    review saw "2 steps" beside a slider of 3. The write is held here until the list has been drawn."""
    import threading

    from gpt_shape_tracer.gui.runs import runs_written

    at = app_at()
    press(at, "step_button")
    press(at, "step_button")
    run_id = address_run(at)
    assert runs_store().record(run_id).n_steps == 2
    held, save = threading.Event(), RunStore.save_steps

    def held_save(self, record, trace):
        assert held.wait(60)
        return save(self, record, trace)

    monkeypatch.setattr(RunStore, "save_steps", held_save)
    at.sidebar.button(key="step_button").click()
    at.run()  # not run(): it would wait for the write
    try:
        labels = [b.label for b in at.sidebar.button if b.key == f"open_run_{run_id}"]
        assert len(labels) == 1 and " · 3 steps · " in labels[0], labels
        assert runs_store().record(run_id).n_steps == 2  # the folder: the write has not ended
    finally:
        held.set()
        assert runs_written(60)
    assert runs_store().record(run_id).n_steps == 3
