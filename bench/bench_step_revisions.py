"""A Step in the browser, this checkout beside an older revision, alternating in one run:
``python bench/bench_step_revisions.py OLD [--rounds 3] [--steps 5] [TAB ...]``.

``OLD`` (a commit) is exported with ``git archive`` into a temporary folder; each round starts the server of each
checkout in turn (the order alternating by round, each with a fresh runs folder of its own), opens the page in
headless Chromium, Steps the bundled model once (the prefill), and on each tab Steps once untimed (its first draw)
and then ``--steps`` times, timing each from the click's pointerdown to the last chart drawn, in the three phases of
``bench_app.py``. The run grows as in a session: a tab's later Steps write a longer trace. Prints the medians per
revision and tab with the load average beside them; writes ``bench/results/step_revisions.json``. ``--apptest``:
the same Steps' script time under AppTest (no browser), each checkout in a process of its own
(``step_revisions_apptest.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

from bench_app import stepped_tabs
from common import ROOT, machine, save


def export(rev: str, where: Path) -> Path:
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(where, filter="fully_trusted")  # our own repository's tree, links included
    return where


def steps_of(checkout: Path, tabs: list[str], steps: int, runs_dir: Path) -> dict[str, list[dict]]:
    from tests.app_in_browser import chromium_page, streamlit_server

    env = {"GPT_SHAPE_TRACER_RUNS_DIR": str(runs_dir)}
    with streamlit_server(env=env, checkout=checkout) as url, chromium_page(1600, 1000) as page:
        return stepped_tabs(page, url, tabs, steps)


APPTEST = """
import json, os, sys, tempfile, time
sys.path.insert(0, "bench")
os.environ["GPT_SHAPE_TRACER_RUNS_DIR"] = tempfile.mkdtemp(prefix="step-revisions-runs-")
from bench_app import fresh_app, press, timed_run
at = fresh_app()
press(at, "step_button")
out = {}
for tab in TABS:
    at.session_state["view"] = tab
    timed_run(at)
    press(at, "step_button")  # the tab's first draw is not a Step's
    out[tab] = [press(at, "step_button") for _ in range(STEPS)]
print("RESULT" + json.dumps(out))
"""


def apptest_steps_of(checkout: Path, tabs: list[str], steps: int) -> dict[str, list[dict]]:
    """The same Steps under AppTest (the script's time, no browser), in a process of the checkout's own."""
    code = APPTEST.replace("TABS", repr(tabs)).replace("STEPS", str(steps))
    done = subprocess.run([sys.executable, "-c", code], cwd=checkout, check=True, capture_output=True, text=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
    return {tab: [{"total": t} for t in times] for tab, times in json.loads(line[len("RESULT"):]).items()}


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("tabs", nargs="*", default=["Shapes", "Attention"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--apptest", action="store_true", help="time the script under AppTest instead of the browser")
    args = ap.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()
    samples: dict[str, dict[str, list[dict]]] = {"old": {t: [] for t in args.tabs}, "new": {t: [] for t in args.tabs}}
    loads = []
    with tempfile.TemporaryDirectory(prefix="step-revisions-") as tmp:
        trees = {"old": export(args.old, Path(tmp) / "old"), "new": ROOT}
        for r in range(args.rounds):
            for label in (("old", "new") if r % 2 == 0 else ("new", "old")):
                before = load()
                got = (apptest_steps_of(trees[label], args.tabs, args.steps) if args.apptest else
                       steps_of(trees[label], args.tabs, args.steps, Path(tmp) / f"runs-{label}-{r}"))
                loads.append({"round": r, "tree": label, "load_before": before, "load_after": load()})
                for tab, seen in got.items():
                    samples[label][tab] += seen
                print(f"round {r} {label}: " + ", ".join(
                    f"{t} {statistics.median(p['total'] for p in s):.3f} s" for t, s in got.items())
                      + f" (load {before} → {load()})")
    medians = {label: {tab: {k: round(statistics.median(p[k] for p in seen), 3) for k in seen[0]}
                       for tab, seen in by_tab.items()} for label, by_tab in samples.items()}
    result = {"machine": machine(), "old": args.old, "new": f"working tree at {head}", "rounds": args.rounds,
              "steps_per_tab": args.steps, "loads": loads, "medians_s": medians, "samples": samples}
    for tab in args.tabs:
        o, n = medians["old"][tab], medians["new"][tab]
        if args.apptest:
            print(f"{tab}: Step script (AppTest) {o['total']:.3f} s old → {n['total']:.3f} s new")
            continue
        print(f"{tab}: Step {o['total']:.3f} s (old: script start {o['to_start']:.3f} + running {o['running']:.3f} + "
              f"to drawn {o['to_drawn']:.3f}) → {n['total']:.3f} s (new: {n['to_start']:.3f} + {n['running']:.3f} + "
              f"{n['to_drawn']:.3f})")
    print(f"wrote {save('step_revisions' + ('_apptest' if args.apptest else ''), result)}")


if __name__ == "__main__":
    main()
