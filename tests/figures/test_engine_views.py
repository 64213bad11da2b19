"""The Engine view (figures/engine.py, gui/engine.py): the pool grid, the block table, the timeline, the memory
comparison and the attention over pages, and every sentence they say, checked against the engine run's own records
over a matrix of runs — a shared prefix and a late arrival, no sharing, a preemption, other page sizes — on a tiny
random Llama; then the app's Engine tab (AppTest) on the same directory."""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

import pytest
import torch

from gpt_shape_tracer.figures import engine as views
from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR
from gpt_shape_tracer.tracer.engine import trace_engine
from tests.hf_architectures import build

PREFIX = list(range(100, 108))
RUNS = {  # name → trace_engine's requests and options
    "shared, late arrival": ([PREFIX + [1, 2, 3], PREFIX + [4, 5], [7, 8, 9, 10, 11]],
                             {"page_size": 4, "pages": 32, "max_new_tokens": [6, 6, 3], "arrivals": [0, 0, 3]}),
    "no sharing": ([PREFIX + [1, 2, 3], PREFIX + [4, 5], [7, 8, 9]],
                   {"page_size": 4, "pages": 32, "max_new_tokens": 5, "arrivals": [0, 1, 2], "share_prefixes": False}),
    "preemption": ([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]],
                   {"page_size": 4, "pages": 8, "max_new_tokens": 12, "share_prefixes": False}),
    "pages of 8": ([PREFIX * 2 + [1], PREFIX * 2 + [2], [3, 4]],
                   {"page_size": 8, "pages": 16, "max_new_tokens": 4, "arrivals": [0, 2, 5]}),
    "pages of 5, chunked": ([list(range(200, 220)), [5, 6, 7]],
                            {"page_size": 5, "pages": 40, "max_new_tokens": 3, "max_batch_tokens": 8}),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)


@pytest.fixture(scope="module")
def llama_dir():
    return build("llama", Path(tempfile.mkdtemp(prefix="engine-views-")) / "llama", BUNDLED_DIR / "tokenizer.json")


@pytest.fixture(scope="module")
def runs(llama_dir):
    model, tokenizer = load_hf(llama_dir, implementation="transformers")
    out = {}
    for name, (prompts, options) in RUNS.items():
        out[name] = trace_engine(model, tokenizer, prompts, **{"max_batch_tokens": 64, **options})
    return out


def test_the_matrix_holds_what_it_is_named_for(runs):
    assert {p for s in runs["shared, late arrival"].steps for p, _ in s.shared}
    assert not any(s.shared for s in runs["no sharing"].steps)
    assert any(s.preempted for s in runs["preemption"].steps)
    assert runs["shared, late arrival"].requests[2].first_step == 3
    chunked = runs["pages of 5, chunked"]
    assert sum(1 for s in chunked.steps for r in s.requests if r.request_id == "r0" and r.contribution == "prefill") > 1


@pytest.mark.parametrize("name", list(RUNS))
def test_the_pool_grid_holds_each_steps_records(runs, name):
    run = runs[name]
    grid = views.pool_grid(run)
    fig = views.pool_grid_figure(run, 0, "r0")
    heat = next(t for t in fig.data if t.type == "heatmap")
    order = {r.request_id: i for i, r in enumerate(run.requests)}
    assert len(grid.pages) + grid.untouched == run.pool.pages
    for col, s in enumerate(run.steps):
        assert grid.held(col) == s.pages_in_use
        assert grid.cached_count(col) == len(s.cached)
        assert grid.held(col) + grid.cached_count(col) + s.pages_free == s.pages_total
        held = {p: rid for rid, table in s.tables for p in table}
        for row, page in enumerate(grid.pages):
            z = heat.z[row][col]
            if page in held:
                holders = [rid for rid, table in s.tables if page in table]
                assert z == 1 + min(order[r] for r in holders)
            elif page in s.cached:
                assert z == 0
            else:
                assert math.isnan(z)  # free: an empty cell (NaN is a gap to plotly.js, as None was)
        # every page the ledger counts as shared is a cell marked ×k with k its holders (table entries can
        # outnumber the ledger's count only for a page shared by more than one request of the same table)
        assert sorted(grid.shared(col)) == sorted(s.shared)
    marks = [t for t in fig.data if t.type == "scatter" and t.mode == "text"]
    assert sum(len(t.text) for t in marks) == sum(len(s.shared) for s in run.steps)
    caption = views.pool_caption(run, len(run.steps) - 1)
    last = run.steps[-1]
    assert f"{last.pages_free} free" in caption and f"the {len(grid.pages)} page" in caption


@pytest.mark.parametrize("name", list(RUNS))
def test_each_block_table_and_its_sentence_follow_the_records(runs, name):
    run = runs[name]
    page = run.pool.page_size
    for s in run.steps:
        for r in run.requests:
            table, which = views.block_table_of(run, s.step, r.request_id)
            sentence = views.block_table_sentence(run, s.step, r.request_id)
            if which == "held":
                assert table == dict(s.tables)[r.request_id]
                rows = views.block_table_rows(run, s.step, r.request_id)
                assert [row["→ page"] for row in rows] == list(table)
                length = views.request_length(run, s.step, r.request_id)
                assert math.ceil(length / page) <= len(table)
                newest = re.search(r"its newest position, (\d+), is row (\d+) of page (\d+)", sentence)
                assert newest is not None, sentence
                p, row, pg = map(int, newest.groups())
                assert p == length - 1 and row == p % page and pg == table[p // page]
            elif which == "read":
                assert r.request_id in s.finished + s.preempted and "ended with this step" in sentence
            else:
                assert "holds no page" in sentence


@pytest.mark.parametrize("name", list(RUNS))
def test_memory_breaks_down_exactly_and_the_sentence_says_its_numbers(runs, name):
    run = runs[name]
    page = run.pool.page_size
    longest = max(len(r.prompt_ids) + r.max_new_tokens - 1 for r in run.requests)
    for s in run.steps:
        m = views.memory_at(run, s.step)
        assert m.paged == s.pages_in_use * page
        assert m.paged == m.live - m.shared + m.slack and min(m.shared, m.slack, m.padding, m.reserved) >= 0
        assert m.contiguous == longest * len(run.requests) == m.live + m.padding + m.reserved
        assert m.live == sum(views.request_length(run, s.step, rid) for rid, _ in s.tables)
        assert m.slack < page * max(1, len(s.tables))  # at most the last page of each request is not full
        if not s.shared:
            assert m.shared == 0
        said = views.memory_sentence(run, s.step)
        if m.requests_live:
            assert f"= {m.paged} positions" in said and f"{m.live} live, {m.padding} padding" in said
            assert (f"stores {m.shared} of them once" in said) == bool(m.shared)
            assert f"×{m.contiguous / m.paged:.1f}" in said
    fig = views.memory_figure(run, 0)
    held = next(t for t in fig.data if t.name == "pages held")
    assert list(held.y) == [s.pages_in_use * run.pool.bytes_per_page for s in run.steps]


@pytest.mark.parametrize("name", list(RUNS))
def test_the_timeline_and_the_sentences_of_the_run(runs, name):
    run = runs[name]
    fig = views.timeline_figure(run, 0)
    squares = [t for t in fig.data if t.name in ("prefill chunk", "decode token", "recompute after preemption")]
    assert sum(len(t.x) for t in squares) == sum(len(s.requests) for s in run.steps)
    crosses = [t for t in fig.data if t.name == "preempted: pages taken back"]
    preemptions = sum(len(s.preempted) for s in run.steps)
    assert sum(len(t.x) for t in crosses) == preemptions
    stars = next(t for t in fig.data if t.name == "finished: pages returned")
    assert len(stars.x) == sum(1 for r in run.requests if r.finished_step is not None)
    summary = views.run_takeaway(run)
    peak = max(s.pages_in_use for s in run.steps)
    shared = {p for s in run.steps for p, _ in s.shared}
    assert dict(summary.metrics) == {"engine steps": str(len(run.steps)), "peak pages held": f"{peak} of "
                                     f"{run.pool.pages}", "shared pages": str(len(shared)),
                                     "preemptions": str(preemptions)}
    assert ("shared by a common prefix" in summary.sentence) == bool(shared)
    assert ("no request was preempted" in summary.sentence) == (not preemptions)
    for s in run.steps:
        said = views.step_sentence(run, s.step)
        assert f"the pool now holds {s.pages_in_use} of {s.pages_total} pages" in said or "ran nothing" in said
        assert ("Preempted:" in said) == bool(s.preempted)
        assert ("Finished:" in said) == bool(s.finished)
        if s.requests:
            assert f"ran {s.query_tokens} query token" in said
    for r in run.requests:
        said = views.request_sentence(run, r.request_id)
        assert f"arrived before engine step {r.arrival}" in said
        assert ("preempted at step(s)" in said) == bool(r.preempted_at)
        assert f"finished at step {r.finished_step}" in said


def test_a_late_arrival_and_a_chunked_prefill_are_said_as_such(runs):
    run = runs["shared, late arrival"]
    assert "Arrived before it: r2" in views.step_sentence(run, 3)
    said = views.block_table_sentence(run, 0, "r2")
    assert said == "r2 holds no page after engine step 0: it arrives before engine step 3."
    chunked = runs["pages of 5, chunked"]
    chunks = [r.tokens for s in chunked.steps for r in s.requests
              if r.request_id == "r0" and r.contribution == "prefill"]
    said = views.request_sentence(chunked, "r0")
    assert f"went in {len(chunks)} prefill chunks ({', '.join(map(str, chunks))} tokens)" in said


@pytest.mark.parametrize("name", ["shared, late arrival", "pages of 5, chunked"])
def test_the_attention_is_drawn_over_logical_positions_with_the_page_boundaries(runs, name):
    run = runs[name]
    page = run.pool.page_size
    for s in run.steps:
        for part in s.requests:
            a = run.attention(s.step, part.request_id, 1)
            assert a is not None
            fig = views.attention_figure(run, s.step, part.request_id, 1, head=2)
            heat = fig.data[0]
            assert torch.allclose(torch.tensor(heat.z), a.pattern[2].float())
            assert list(heat.y) == list(range(part.past, part.past + part.tokens))
            length = part.length
            lines = [sh for sh in fig.layout.shapes if sh.type == "line"]
            assert sorted(sh.x0 for sh in lines) == [j * page - 0.5 for j in range(1, math.ceil(length / page))]
            labels = [an.text for an in fig.layout.annotations if an.text.startswith("page ")]
            table, _ = views.block_table_of(run, s.step, part.request_id)
            assert labels == [f"page {p}" for p in table[:math.ceil(length / page)]]
            said = views.attention_caption(run, s.step, part.request_id, 1)
            assert f"over its {length} logical positions" in said


@pytest.mark.parametrize("name", list(RUNS))
def test_every_engine_figure_is_the_same_with_and_without_plotlys_checks(runs, name, monkeypatch):
    """The engine figures give plotly their traces as dicts and numpy arrays (fast: plotly checks and copies a
    Python list cell by cell, figures/engine.py); built with plotly's checks on, the same dicts are checked and
    normalised — what reaches the browser must be the same either way, step by step, for every request."""
    from gpt_shape_tracer.figures.plot import VALIDATE_ENV
    from tests.app.test_app import unpack

    run = runs[name]
    step = len(run.steps) // 2
    builders = {"timeline": lambda: views.timeline_figure(run, step), "memory": lambda: views.memory_figure(run, step),
                "grid": lambda: views.pool_grid_figure(run)}
    for part in run.steps[step].requests:
        rid = part.request_id
        builders[f"pool, {rid}"] = lambda rid=rid: views.pool_grid_figure(run, step, rid)
        builders[f"attention, {rid}"] = lambda rid=rid: views.attention_figure(run, step, rid, 1, 1)

    def sent(make) -> dict:
        spec = unpack(json.loads(make().to_json()))  # numpy data as the browser decodes it
        for key in ("shapes", "annotations"):  # an empty list unchecked, absent checked: the same drawing
            if spec["layout"].get(key) == []:
                del spec["layout"][key]
        return spec

    monkeypatch.setenv(VALIDATE_ENV, "1")
    checked = {key: sent(make) for key, make in builders.items()}
    monkeypatch.setenv(VALIDATE_ENV, "0")
    for key, make in builders.items():
        assert sent(make) == checked[key], key


# -- the app ------------------------------------------------------------------------------------------------------
def test_the_engine_tab_runs_three_requests_and_its_pool_grid_equals_the_run(llama_dir):
    """A tiny Llama directory chosen in the sidebar (our GPT runs it: the tab says why the engine loads it through
    transformers), three requests — two sharing a prefix, one arriving at engine step 3 — run, and the slider
    stepped: the pool grid's column and the metrics at each step are the EngineRun's."""
    from tests.app.test_app import charts, new_app, press, run

    at = new_app()
    at.sidebar.radio(key="source").set_value("Local Hugging Face directory")
    run(at)
    at.sidebar.text_input(key="model_dir").set_value(str(llama_dir))
    press(at, "load_model")
    assert any("our GPT cannot take the paged path" in i.value for i in at.info)
    at.text_area(key="engine_requests").set_value(
        "Once upon a time, there was a little girl named Lily\nOnce upon a time, there was a little girl who\n"
        "The cat sat on the mat")
    at.text_input(key="engine_arrivals").set_value("0, 0, 3")
    at.number_input(key="engine_new_tokens").set_value(5)
    at.button(key="engine_run").click()
    run(at)
    assert not at.error, [e.value for e in at.error]
    engine = at.session_state["app"].engine.view
    assert engine is not None
    result = engine.run
    assert result.requests[2].arrival == 3 and result.requests[2].first_step >= 3
    assert any(s.shared for s in result.steps)  # the two requests with a common prefix share its pages
    for step in (0, 3, len(result.steps) - 1):
        at.slider(key="engine_step").set_value(step)
        run(at)
        s = result.steps[step]
        metrics = {m.label: m.value for m in at.metric}
        assert metrics["held after this step"] == f"{s.pages_in_use} pages"
        assert metrics["shared after it"] == f"{len(s.shared)} pages"
        assert metrics["free after it"] == f"{s.pages_free} pages"
        grid = next(c for c in charts(at) if "page pool" in str(c["layout"].get("title")))
        heat = next(d for d in grid["data"] if d["type"] == "heatmap")
        column = [row[step] for row in heat["z"]]
        assert sum(1 for z in column if z is not None and z >= 1) == s.pages_in_use
        assert sum(1 for z in column if z == 0) == len(s.cached)
        assert any(views.step_sentence(result, step) == m.value for m in at.markdown)
    press(at, "step_button")  # the first Step starts a generation: the engine run (the sidebar's model's) stays
    assert at.session_state["app"].live.generation is not None and at.session_state["app"].engine.view is engine
    at.session_state["app"].reset()  # Reset, asked for, forgets it
    assert at.session_state["app"].engine.view is None
