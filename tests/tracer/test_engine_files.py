"""An engine run on disk (tracer/engine/_files.py) and in the app's runs folder (session/runs.py): written and read
back equal, through a path, through bytes and through the runs folder; and engine-run files built to hurt — every
manifest field set to each of nine wrong values, a decompression bomb, members that are not ours, tensors of the
wrong shape, a step naming a request or more pages than the run holds — each loads (and then every view's numbers
and sentences can be made from it) or is refused with a ``TraceFileError`` naming what is wrong, never another
exception. Nothing is unpickled: the loader reads JSON and safetensors only."""

from __future__ import annotations

import io
import json
import os
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.figures import engine as views
from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR
from gpt_shape_tracer.session import ModelChoice
from gpt_shape_tracer.session.runs import ENGINE_FILE, RUN_FILE, RunError, RunRecord, RunsSettings, RunStore
from gpt_shape_tracer.tracer import TraceFileError
from gpt_shape_tracer.tracer.engine import EngineRun, load_engine_run, save_engine_run, trace_engine
from tests.hf_architectures import build
from tests.tracer.test_hostile_files import WRONG_VALUES, leaves, replaced

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)

PREFIX = list(range(100, 108))  # two full pages of 4: shared by the first two requests


@pytest.fixture(scope="module")
def small_run() -> EngineRun:
    """Three requests on a tiny random Llama — two sharing a prefix, one arriving at engine step 2 — values kept."""
    directory = build("llama", Path(tempfile.mkdtemp(prefix="engine-files-")) / "llama", BUNDLED_DIR / "tokenizer.json")
    model, tokenizer = load_hf(directory, implementation="transformers")
    return trace_engine(model, tokenizer, [PREFIX + [1, 2], PREFIX + [3], [7, 8, 9]], page_size=4, pages=16,
                        max_batch_tokens=32, max_new_tokens=3, arrivals=[0, 0, 2])


@pytest.fixture(scope="module")
def archive(small_run, tmp_path_factory) -> bytes:
    return save_engine_run(small_run, tmp_path_factory.mktemp("engine") / "run.zip").read_bytes()


def assert_equal_runs(a: EngineRun, b: EngineRun) -> None:
    assert (a.pool, a.requests, a.steps, a.notes, a.budget_bytes) == (b.pool, b.requests, b.steps, b.notes,
                                                                       b.budget_bytes)
    ours, theirs = list(a.attentions()), list(b.attentions())
    assert len(ours) == len(theirs)
    for x, y in zip(ours, theirs):
        assert (x.step, x.request_id, x.layer, x.past) == (y.step, y.request_id, y.layer, y.past)
        assert all(torch.equal(getattr(x, part), getattr(y, part)) for part in ("q", "k", "v", "pattern"))


def members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def build_zip(parts: dict[str, bytes], deflate: tuple[str, ...] = ("engine.json",)) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, data in parts.items():
            zf.writestr(name, data, compress_type=zipfile.ZIP_DEFLATED if name in deflate else zipfile.ZIP_STORED)
    return out.getvalue()


def with_manifest(data: bytes, manifest: dict) -> bytes:
    return build_zip({**members(data), "engine.json": json.dumps(manifest).encode()})


def refused(data: bytes, match: str) -> TraceFileError:
    with pytest.raises(TraceFileError, match=match) as info:
        load_engine_run(data)
    return info.value


def every_view(run: EngineRun) -> None:
    """What the Engine tab computes for each step from a run (the figures' numbers and every sentence), plotly's
    figure objects aside: a run that loads must not break any of it."""
    views.run_takeaway(run)
    views.pool_grid(run)
    views.timeline_events(run)
    for step in range(len(run.steps)):
        views.step_sentence(run, step)
        views.pool_caption(run, step)
        views.memory_at(run, step)
        views.memory_sentence(run, step)
        for r in run.requests:
            views.block_table_rows(run, step, r.request_id)
            views.block_table_sentence(run, step, r.request_id)
            views.request_sentence(run, r.request_id)
            for layer in range(run.pool.n_layer):
                views.attention_caption(run, step, r.request_id, layer)


# -- written and read back -------------------------------------------------------------------------------------
def test_a_run_reads_back_equal_from_its_path_and_from_its_bytes(small_run, archive, tmp_path):
    assert small_run.bytes_kept > 0 and any(s.shared for s in small_run.steps)
    path = tmp_path / "run.zip"
    path.write_bytes(archive)
    assert_equal_runs(load_engine_run(path), small_run)
    assert_equal_runs(load_engine_run(archive), small_run)


def test_the_runs_folder_writes_an_engine_run_and_reads_it_back_equal(small_run, tmp_path):
    store = RunStore(RunsSettings(tmp_path / "runs", keep=5, budget_bytes=64 * 2**20))
    record = RunRecord("e" * 22, ModelChoice(), {"engine_requests": "Lily had\nTom had\n", "engine_request": "r1"},
                       len(small_run.steps), 2, "Engine", 1.0, kind="engine", texts={"r0": "a", "r1": "b", "r2": "c"})
    store.save(record, engine=small_run)
    folder = store.run_dir(record.run_id)
    assert sorted(p.name for p in folder.iterdir()) == [ENGINE_FILE, RUN_FILE]
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in folder.iterdir())
    back = store.record(record.run_id)
    assert back == record and back.kind == "engine" and back.texts == record.texts
    assert back.listed_as() == f"Engine: Lily had · 2 requests · {len(small_run.steps)} engine steps · story-gpt"
    assert_equal_runs(store.engine(record.run_id), small_run)
    assert store.update_view(record.run_id, 0, "Engine", {"engine_request": "r2"})
    assert store.record(record.run_id).widgets["engine_request"] == "r2"
    assert [r.run_id for r in store.recent()] == [record.run_id]
    assert not store.update_view("f" * 22, 0, "Engine")  # no such run: nothing written


def test_an_engine_run_over_the_folders_budget_is_written_without_its_values(small_run, tmp_path):
    store = RunStore(RunsSettings(tmp_path / "runs", keep=5, budget_bytes=small_run.bytes_kept - 1))
    record = RunRecord("e" * 22, ModelChoice(), {}, len(small_run.steps), 0, "Engine", 1.0, kind="engine")
    store.save(record, engine=small_run)
    back = store.engine(record.run_id)
    assert not store.record(record.run_id).trace_saved
    assert back.steps == small_run.steps and back.bytes_kept == 0
    assert f"({small_run.bytes_kept:,} B) were larger than the runs folder's budget" in back.notes[-1]


def test_a_run_being_written_is_not_pruned_by_another_save_and_a_stale_one_is(small_run, tmp_path):
    """An engine run's file is written in a thread, its record last: meanwhile another page's save prunes the
    folder (here it keeps one run: the one just written), and a folder without a record is not a run, the first
    to go — unless it is being written (changed in the last ``WRITING_S`` seconds)."""
    from gpt_shape_tracer.session.runs import WRITING_S

    store = RunStore(RunsSettings(tmp_path / "runs", keep=1, budget_bytes=64 * 2**20))
    writing, stale = store.run_dir("w" * 22), store.run_dir("s" * 22)
    for folder in (writing, stale):
        folder.mkdir(parents=True)
        save_engine_run(small_run, folder / ENGINE_FILE)
    old = time.time() - WRITING_S - 5
    for path in (stale / ENGINE_FILE, stale):
        os.utime(path, (old, old))
    store.save(RunRecord("g" * 22, ModelChoice(), {"prompt": "Mia"}, 1, 0, "Shapes", 1.0))
    assert writing.is_dir() and not stale.exists()


def test_a_generation_record_lists_as_before_and_a_kind_not_ours_is_refused():
    record = RunRecord("g" * 22, ModelChoice(), {"prompt": "Mia had a boat."}, 3, 1, "Shapes", 1.0)
    assert record.listed_as() == "Mia had a boat. · 3 steps · story-gpt"
    raw = json.loads(record.to_json())
    assert RunRecord.from_json(json.dumps(raw), record.run_id) == record
    for field, value in (("kind", "pickle"), ("kind", 3), ("texts", {"r0": 5}), ("texts", ["r0"]),
                         ("texts", {f"r{i}": "" for i in range(65)})):
        with pytest.raises(RunError):
            RunRecord.from_json(json.dumps({**raw, field: value}), record.run_id)


# -- files built to hurt -----------------------------------------------------------------------------------------
def test_every_field_with_a_wrong_value_loads_or_is_refused_by_name(archive):
    manifest = json.loads(members(archive)["engine.json"])
    paths = sorted(set(leaves(manifest)), key=str)
    assert len(paths) > 60
    outcomes = {"loaded": 0, "refused": 0}
    for path in paths:
        for value in WRONG_VALUES:
            data = with_manifest(archive, replaced(manifest, path, value))
            try:
                run = load_engine_run(data)
            except TraceFileError as e:
                outcomes["refused"] += 1
                assert str(e), path
                continue
            except Exception as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"{'.'.join(map(str, path))} = {value!r}: {type(e).__name__}: {e}")
            outcomes["loaded"] += 1
            try:
                every_view(run)
            except Exception as e:  # noqa: BLE001
                pytest.fail(f"{'.'.join(map(str, path))} = {value!r} loads but a view fails: {type(e).__name__}: {e}")
    assert outcomes["refused"] > outcomes["loaded"]


def test_a_field_is_refused_by_its_name(archive):
    manifest = json.loads(members(archive)["engine.json"])
    err = refused(with_manifest(archive, replaced(manifest, ("steps", 1, "requests", 0, "past"), "seven")),
                  "expected a whole number")
    assert "steps[1].requests[0].past" in str(err)
    refused(with_manifest(archive, replaced(manifest, ("pool", "n_layer"), 2**40)), r"pool.n_layer: .* outside")


@pytest.mark.parametrize("change, match", [
    (lambda m: m["steps"][1].update(step=5), r"steps\[1\]: is numbered 5"),
    (lambda m: m["steps"][0]["tables"].append(["r9", [1]]), "names request 'r9'"),
    (lambda m: m["steps"][0]["cached"].extend(range(1000, 1020)), "names [0-9]+ pages, more than the pool's 16"),
    (lambda m: m["requests"][1].update(request_id="r0"), "two requests have the same id"),
    (lambda m: m["requests"][0].update(finished_step=400), r"requests\[0\]: names engine step 400"),
    (lambda m: m["pool"].update(n_head=3), "3 query heads do not share 2 key/value heads"),
    (lambda m: m["pool"].update(pages=2**21, bytes_per_page=2**20), "over the 1,073,741,824 B a run may hold"),
    (lambda m: m["values"][0].update(layer=7), "no such request part in the run"),
    (lambda m: m["values"].append(dict(m["values"][0])), "tensors for"),
    (lambda m: m.update(version=99), "version 99; this reads version 1"),
    (lambda m: m.update(format="something else"), "not a gpt-shape-tracer engine run"),
    (lambda m: m.update(extra=1), "unexpected field"),
])
def test_a_run_that_contradicts_itself_is_refused(archive, change, match):
    manifest = json.loads(members(archive)["engine.json"])
    change(manifest)
    refused(with_manifest(archive, manifest), match)


def test_tensors_of_another_shape_or_kind_are_refused(archive):
    from safetensors.torch import load, save

    parts = members(archive)
    tensors = load(parts["values.safetensors"])
    for name, bad in (("0.q", tensors["0.q"][:, :, :-1]), ("0.pattern", tensors["0.pattern"].to(torch.int32))):
        changed = build_zip({**parts, "values.safetensors": save({**tensors, name: bad.contiguous()})})
        refused(changed, f"values\\[0\\]: {name[2:]} is torch.")
    refused(build_zip({**parts, "values.safetensors": b"\x10\0\0\0\0\0\0\0{not a header}"}),
            "values.safetensors cannot be read")


def test_archives_that_are_not_ours_are_refused_before_inflating(archive):
    parts = members(archive)
    bomb = build_zip({**parts, "values.safetensors": b"\0" * (64 * 2**20)}, deflate=("values.safetensors",))
    assert len(bomb) < 2**20
    refused(bomb, r"would inflate \d+ bytes to 67108864")
    refused(build_zip({**parts, "x.pkl": b"\x80\x04K\x01."}), "unexpected member 'x.pkl'")
    refused(build_zip({"engine.json": parts["engine.json"]}), "has no values.safetensors")
    refused(b"PK\x03\x04 not a zip", "not a readable engine run")
    refused(build_zip({**parts, "engine.json": b"\xff{"}), "engine.json is not JSON")


def test_a_missing_file_is_refused_by_name(tmp_path):
    with pytest.raises(TraceFileError, match="no such file"):
        load_engine_run(tmp_path / "nothing.zip")
