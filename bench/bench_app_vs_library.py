"""The app's prefill against the library's, like for like: ``python bench/bench_app_vs_library.py [--rounds 5]``.

GPT-2 small (random weights, loaded from a local directory) and a 1000-token prompt. Each case runs in a fresh
process, each round in a rotated order, so that machine drift hits every case alike:

- **app, one arena** and **app, default arenas**: the real app script under AppTest — "Local Hugging Face
  directory", Load, Step — timed by the click, in a process started with ``MALLOC_ARENA_MAX=1`` (one malloc
  arena for every thread) or with glibc's default (an arena per thread: Streamlit runs each rerun on a thread
  of its own). Issue 28 named the script thread's own arena as the cause of the app's slower prefill; the two
  cases test that;
- **library**: ``TracedGeneration(model, tokenizer, [prompt], capture="values").step()``.

Each prefill is its process's first forward, as a user's first Step or first traced call is, with freed memory
kept for reuse, as the app and the command line set it (``gpt_shape_tracer/memory.py``); the untraced forward
of the same prompt (the floor) is timed after it. (Timed before, it warmed the main thread's heap, and the app's
model, loaded after it, took that memory back: the library's prefill then faulted in 500–660 MiB, the app's
820–1170 MiB, which no user's session does.) Each case reports the pages the kernel faulted in, the CPU time
and the involuntary context switches of its prefill.

AppTest waits for the script by polling every millisecond, where the server waits on an event: on this 2-core
machine that gave the app's prefill 2 300–2 500 involuntary context switches against the library's 300–450,
which no user's server pays. The probe polls every 50 ms instead (``require_widgets_deltas``, replaced below).

``--browser N`` then serves the real app (``streamlit run app.py``) N times, alternately with one arena and
with the default, and reads the prefill's traced forward time off the page in headless Chromium, with the CPU
time the server and Chromium each spent during the Step click (they share this machine's two cores).

Target (issue 28, item 2): the app's prefill within ×1.15 of the library's. Figures go to
``bench/results/app_vs_library.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, gpt2_small_dir, machine, save

PROBE = r"""
import json, resource, statistics, sys, time
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
import torch
import streamlit.testing.v1.local_script_runner as local_runner


def wait_like_the_server(runner, timeout=3):  # AppTest's own, polling every 50 ms instead of every 1 ms
    started = time.time()
    while time.time() - started < timeout:
        time.sleep(0.05)
        if runner.script_stopped():
            return
    runner.request_stop()
    runner.join()
    raise RuntimeError(f"AppTest script run timed out after {{timeout}} s")


local_runner.require_widgets_deltas = wait_like_the_server
from bench_app_long import app_with_directory, prompt_of, untraced_forward
from common import gpt2_small_dir
from gpt_shape_tracer.session.memory import reuse_freed_memory
from gpt_shape_tracer.model import load_model

directory = gpt2_small_dir()
model, tokenizer = load_model(str(directory))
prompt = prompt_of(tokenizer, 1000)
ids = torch.tensor([tokenizer.encode(prompt)])
reuse_freed_memory()


def measured(prefill):
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    traced = prefill()
    step = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {{"step_s": step, "traced_forward_s": traced,
             "faulted_mib": (after.ru_minflt - before.ru_minflt) * resource.getpagesize() / 2**20,
             "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
             "system_cpu_s": after.ru_stime - before.ru_stime,
             "involuntary_switches": after.ru_nivcsw - before.ru_nivcsw}}


if {mode!r} == "app":
    at = app_with_directory(directory, prompt)

    def prefill():  # a Step: the first, or the first after Reset
        at.sidebar.button(key="step_button").click()
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        return at.session_state["app"].generation.trace.steps[0].seconds

    def reset():
        at.sidebar.button(key="reset_button").click()
        at.run()
        if any(b.key == "reset_confirm" for b in at.sidebar.button):  # Reset asks when there are steps to discard
            at.sidebar.button(key="reset_confirm").click()
        at.run()
else:
    from gpt_shape_tracer.tracer import TracedGeneration
    gen = None

    def prefill():
        global gen
        gen = TracedGeneration(model, tokenizer, [prompt], temperature=0, capture="values")
        gen.step()
        return gen.trace.steps[0].seconds

    def reset():
        global gen
        gen = None
first = measured(prefill)
reset()
second = measured(prefill)
floor = statistics.median(untraced_forward(model, ids, 3))  # after: a forward before would warm one case's heap
print("RESULT", json.dumps({{"untraced_s": floor, **{{"first_" + k: v for k, v in first.items()}},
                             **{{"second_" + k: v for k, v in second.items()}}}}))
"""


def once(mode: str, arenas: str) -> dict:
    """One fresh process; ``arenas`` "one" starts it with one malloc arena for all its threads."""
    code = PROBE.format(root=str(ROOT), bench=str(ROOT / "bench"), mode=mode)
    env = {**os.environ, **ONE_ARENA} if arenas == "one" else dict(os.environ)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=900,
                         env=env)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def cpu_seconds(match: bytes) -> float:
    """User + system CPU seconds of every process whose command line contains ``match`` (Linux /proc)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if match in (Path("/proc") / pid / "cmdline").read_bytes():
                fields = (Path("/proc") / pid / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue  # the process ended
    return total


def in_the_browser(env: dict[str, str], prompt: str) -> dict:
    """One fresh server of the real app in ``env``: the directory loaded, the prompt set, Step clicked; the
    traced forward time the page shows, the click, and the CPU the server and Chromium spent during it."""
    sys.path.insert(0, str(ROOT))
    from tests.app_in_browser import chromium_page, click, load_directory, open_app, set_prompt, streamlit_server

    with streamlit_server(env=env) as url, chromium_page(1600, 1000) as page:
        open_app(page, url)
        load_directory(page, gpt2_small_dir())
        set_prompt(page, prompt)
        server, chromium = cpu_seconds(b"streamlit"), cpu_seconds(b"chrom")
        started = time.perf_counter()
        click(page, "Step")
        click_s = time.perf_counter() - started
        server, chromium = cpu_seconds(b"streamlit") - server, cpu_seconds(b"chrom") - chromium
        metric = page.locator('[data-testid="stMetric"]').filter(has_text="traced forward time").first.inner_text()
        found = re.search(r"([\d.]+) ms", metric)
        assert found, metric
    return {"traced_forward_s": float(found.group(1)) / 1000, "click_s": click_s, "server_cpu_s": server,
            "chromium_cpu_s": chromium}


ONE_ARENA = {"MALLOC_ARENA_MAX": "1"}  # glibc reads it when a process starts: one arena for every thread
CASES = {"app, one arena": ("app", "one"), "app, default arenas": ("app", "default"), "library": ("library", "")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5, help="each round runs the three cases, in a rotated order")
    ap.add_argument("--browser", type=int, default=0, metavar="N",
                    help="also serve the real app N times, alternating one malloc arena and the default")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {case: [] for case in CASES}
    names = list(CASES)
    for i in range(args.rounds):
        for case in names[i % 3:] + names[:i % 3]:
            runs[case].append(once(*CASES[case]))
            print(case, {k: round(v, 3) for k, v in runs[case][-1].items()}, flush=True)
    medians = {case: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for case, rs in runs.items()}
    floor = statistics.median(r["untraced_s"] for rs in runs.values() for r in rs)
    payload = {"machine": machine(), "tokens": 1000, "medians": medians, "runs": runs, "untraced_forward_s": floor,
               "app_step_over_library_step": {
                   which: {case: medians[case][f"{which}_step_s"] / medians["library"][f"{which}_step_s"]
                           for case in CASES if case != "library"} for which in ("first", "second")}}
    print(f"untraced forward {floor:.2f} s")
    for which in ("first", "second"):
        lib = medians["library"]
        print(f"{which} prefill: library {lib[f'{which}_step_s']:.2f} s ({lib[f'{which}_system_cpu_s']:.2f} s in "
              f"the kernel, {lib[f'{which}_faulted_mib']:.0f} MiB faulted in)")
        for case, ratio in payload["app_step_over_library_step"][which].items():
            m = medians[case]
            print(f"  {case}: Step {m[f'{which}_step_s']:.2f} s, ×{ratio:.2f} the library's (target ≤ 1.15), "
                  f"{m[f'{which}_system_cpu_s']:.2f} s in the kernel, {m[f'{which}_faulted_mib']:.0f} MiB")
    if args.browser:
        from bench_app_long import prompt_of

        from gpt_shape_tracer.model import load_model

        prompt = prompt_of(load_model(str(gpt2_small_dir()))[1], 1000)
        served: dict[str, list[dict]] = {"one arena": [], "default arenas": []}
        envs = {"one arena": ONE_ARENA, "default arenas": {}}
        for i in range(args.browser):
            name = list(served)[i % 2]
            served[name].append(in_the_browser(envs[name], prompt))
            print("browser", name, {k: round(v, 3) for k, v in served[name][-1].items()}, flush=True)
        library = medians["library"]["first_traced_forward_s"]  # the library's first forward: no warm-up either
        payload["browser"] = {name: {"runs": rs, "median_traced_forward_s": statistics.median(
            r["traced_forward_s"] for r in rs), "over_library": statistics.median(
            r["traced_forward_s"] for r in rs) / library} for name, rs in served.items() if rs}
        for name, result in payload["browser"].items():
            print(f"browser, {name}: traced forward {result['median_traced_forward_s']:.2f} s, "
                  f"×{result['over_library']:.2f} the library's")
    save("app_vs_library", payload)


if __name__ == "__main__":
    main()
