"""The app's prefill against the library's, like for like: ``python bench/bench_app_vs_library.py [--rounds 2]``.

GPT-2 small (random weights, loaded from a local directory) and a 1000-token prompt. Each case runs in a fresh
process, alternated, so that each prefill is its process's first traced forward (the one that pays for fresh
pages: docs/benchmarks.md) and machine drift hits both alike:

- **app**: the real app script under AppTest — "Local Hugging Face directory", Load, Step — timed by the click;
- **library**: ``TracedGeneration(model, tokenizer, [prompt], capture="values").step()``.

Each process first times an untraced forward of the same prompt with freed memory kept for reuse, as the app
and the command line set it (``gpt_shape_tracer/memory.py``). Target (issue 28, item 2): the app's prefill
within ×1.15 of the library's. Figures go to ``bench/results/app_vs_library.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from common import ROOT, machine, save

PROBE = r"""
import json, statistics, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
import torch
from bench_app_long import app_with_directory, prompt_of, untraced_forward
from common import gpt2_small_dir
from gpt_shape_tracer.memory import reuse_freed_memory
from model import load_model

directory = gpt2_small_dir()
model, tokenizer = load_model(str(directory))
prompt = prompt_of(tokenizer, 1000)
ids = torch.tensor([tokenizer.encode(prompt)])
reuse_freed_memory()
untraced_forward(model, ids, 1)
floor = statistics.median(untraced_forward(model, ids, 3))
if {mode!r} == "app":
    at = app_with_directory(directory, prompt)
    at.sidebar.button(key="step_button").click()
    started = time.perf_counter()
    at.run()
    step = time.perf_counter() - started
    assert not at.exception, [e.value for e in at.exception]
    traced = at.session_state["app"].generation.trace.steps[0].seconds
else:
    from tracer import TracedGeneration
    gen = TracedGeneration(model, tokenizer, [prompt], temperature=0, capture="values")
    started = time.perf_counter()
    gen.step()
    step = time.perf_counter() - started
    traced = gen.trace.steps[0].seconds
print("RESULT", json.dumps({{"untraced_s": floor, "step_s": step, "traced_forward_s": traced}}))
"""


def once(mode: str) -> dict:
    code = PROBE.format(root=str(ROOT), bench=str(ROOT / "bench"), mode=mode)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=900)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"app": [], "library": []}
    for i in range(args.rounds):
        for mode in (("app", "library") if i % 2 == 0 else ("library", "app")):
            runs[mode].append(once(mode))
            print(mode, {k: round(v, 3) for k, v in runs[mode][-1].items()}, flush=True)
    medians = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for mode, rs in runs.items()}
    ratio = medians["app"]["step_s"] / medians["library"]["step_s"]
    floor = statistics.median(r["untraced_s"] for rs in runs.values() for r in rs)
    payload = {"machine": machine(), "tokens": 1000, "medians": medians, "runs": runs,
               "app_step_over_library_step": ratio, "untraced_forward_s": floor,
               "app_step_minus_untraced_s": medians["app"]["step_s"] - floor}
    print(f"app Step {medians['app']['step_s']:.2f} s, library step {medians['library']['step_s']:.2f} s: "
          f"×{ratio:.2f} (target ≤ 1.15); untraced forward {floor:.2f} s, the app's Step = forward + "
          f"{payload['app_step_minus_untraced_s']:.2f} s")
    save("app_vs_library", payload)


if __name__ == "__main__":
    main()
