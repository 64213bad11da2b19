"""The Engine tab's views with 32 requests, as the app draws them after an engine step:
``python bench/bench_engine_views.py [--repeats 7] [--threads 1]``.

A tiny random Llama directory (``tests.hf_architectures.build("llama")``: 2 layers, 4 query / 2 key/value heads)
runs 32 requests through ``trace_engine`` (prompts of 6 … 20 tokens, four pairs sharing an 8-token prefix, arriving
over engine steps 0 … 7, 12 new tokens each, pages of 4 positions, 256 pages, 64 tokens per engine step). The run is
saved (``save_engine_run``) and put on view as the tab's ``Open a saved engine run`` does (``open_engine_file``:
the app's form takes at most ``MAX_APP_REQUESTS`` = 16 prompts, a file has no such cap). Then, under AppTest, with
the same directory chosen in the sidebar:

* ``rerun, nothing moved`` — a rerun of the page as it stands (the page's own cost around the tab);
* ``rerun after the engine step slider moved`` — ``engine_step`` set to another step and the page rerun, the
  median over ``--repeats`` moves across the run's steps;
* the same two with a generation on view (one Step, the Engine tab opened: only its panel is drawn, in a
  fragment, as a person sees it after a Step);
* the pure figure and sentence functions of ``figures.engine`` for one step (what the tab calls), each timed.

Prints the medians, the machine and its load (``os.getloadavg()`` before and after). Writes
``bench/results/engine_views.json``. Not a timed test: the machine's load moves these numbers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import machine, save

from gpt_shape_tracer.figures import engine as views
from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR
from gpt_shape_tracer.session.engine import open_engine_file
from gpt_shape_tracer.tracer.engine import save_engine_run, trace_engine
from tests.hf_architectures import build

REQUESTS = 32


def requests() -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(2)
    prompts: list[list[int]] = []
    for _ in range(REQUESTS):
        n = int(torch.randint(6, 21, (1,), generator=g))
        prompts.append(torch.randint(3, 1000, (n,), generator=g).tolist())
    for a in range(0, 8, 2):  # four pairs sharing an 8-token prefix
        prefix = torch.randint(3, 1000, (8,), generator=g).tolist()
        prompts[a] = prefix + prompts[a][:6]
        prompts[a + 1] = prefix + prompts[a + 1][:5]
    arrivals = [i % 8 for i in range(REQUESTS)]
    return prompts, arrivals


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def app_times(at, run, steps: list[int]) -> dict[str, list[float]]:
    from tests.app.test_app import run as rerun

    still = timed(lambda: rerun(at), len(steps))
    moved = []
    for step in steps:
        at.slider(key="engine_step").set_value(step)
        t0 = time.perf_counter()
        rerun(at)
        moved.append(time.perf_counter() - t0)
        metrics = {m.label: m.value for m in at.metric}  # the step drawn is the one asked for
        assert metrics["held after this step"] == f"{run.steps[step].pages_in_use} pages", (step, metrics)
    return {"rerun_still_s": still, "rerun_moved_s": moved}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    folder = Path(tempfile.mkdtemp(prefix="bench-engine-views-"))
    directory = build("llama", folder / "llama", BUNDLED_DIR / "tokenizer.json")
    model, tokenizer = load_hf(directory, implementation="transformers")
    prompts, arrivals = requests()
    t0 = time.perf_counter()
    run = trace_engine(model, tokenizer, prompts, page_size=4, pages=256, max_batch_tokens=64, max_new_tokens=12,
                       arrivals=arrivals)
    run_s = time.perf_counter() - t0
    path = save_engine_run(run, folder / "engine-run.zip")
    peak = max(s.pages_in_use for s in run.steps)
    print(f"{len(run.requests)} requests, {len(run.steps)} engine steps, peak {peak} of {run.pool.pages} pages, "
          f"{sum(len(s.shared) > 0 for s in run.steps)} steps with shared pages; traced in {run_s:.2f} s; "
          f"{path.stat().st_size:,} B saved")
    last = len(run.steps) - 1
    steps = [round(last * (i + 1) / (args.repeats + 1)) for i in range(args.repeats)]

    from tests.app.test_app import new_app, press
    from tests.app.test_app import run as rerun

    results: dict[str, dict[str, list[float]]] = {}
    at = new_app()
    at.sidebar.radio(key="source").set_value("Local Hugging Face directory")
    rerun(at)
    at.sidebar.text_input(key="model_dir").set_value(str(directory))
    press(at, "load_model")
    at.session_state["app"].engine = open_engine_file(path.read_bytes(), path.name)
    at.session_state["engine_step"] = 0
    rerun(at)
    results["no generation (Worked example, Engine, Export drawn)"] = app_times(at, run, steps)
    press(at, "step_button")  # the first Step starts a generation, which clears the engine run: put it back
    at.session_state["app"].engine = open_engine_file(path.read_bytes(), path.name)
    at.session_state["app"].open_tabs["view"] = "Engine"  # as the tour's stop opens it (gui/tour.py go)
    at.session_state["view"] = "Engine"
    at.session_state["engine_step"] = 0
    rerun(at)
    results["after a Step, the Engine tab open"] = app_times(at, run, steps)

    step, rid = steps[len(steps) // 2], run.requests[0].request_id
    pure = {
        "run_takeaway": lambda: views.run_takeaway(run),
        "step_sentence": lambda: views.step_sentence(run, step),
        "pool_grid_figure": lambda: views.pool_grid_figure(run, step, rid),
        "block_table (sentence + rows)": lambda: (views.block_table_sentence(run, step, rid),
                                                  views.block_table_rows(run, step, rid)),
        "pool_caption": lambda: views.pool_caption(run, step),
        "timeline_figure": lambda: views.timeline_figure(run, step),
        "request_sentence": lambda: views.request_sentence(run, rid),
        "memory_figure": lambda: views.memory_figure(run, step),
        "memory_sentence": lambda: views.memory_sentence(run, step),
        "attention_figure + caption": lambda: (views.attention_figure(run, step, rid, 0, 0),
                                               views.attention_caption(run, step, rid, 0)),
    }
    figures = {name: timed(fn, args.repeats) for name, fn in pure.items()}
    load_after = os.getloadavg()

    print(f"machine: {machine()}")
    print(f"load average (1, 5, 15 min) before {tuple(round(x, 2) for x in load_before)}, after "
          f"{tuple(round(x, 2) for x in load_after)}")
    for where, times in results.items():
        print(f"{where}:")
        for name, xs in times.items():
            print(f"  {name:16s} median {statistics.median(xs):.3f} s  (min {min(xs):.3f}, max {max(xs):.3f})")
    total = 0.0
    print(f"figures.engine at step {step} (median of {args.repeats}):")
    for name, xs in figures.items():
        total += statistics.median(xs)
        print(f"  {name:30s} {statistics.median(xs) * 1000:7.1f} ms")
    print(f"  {'all of them':30s} {total * 1000:7.1f} ms")
    save("engine_views", {
        "machine": machine(), "load_before": load_before, "load_after": load_after, "requests": len(run.requests),
        "engine_steps": len(run.steps), "steps_moved_to": steps, "app": results, "figures": figures,
        "figures_total_s": total, "trace_s": run_s})


if __name__ == "__main__":
    main()
