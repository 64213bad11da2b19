"""The tracer benchmark of two revisions, side by side: ``python bench/compare_revisions.py OLD [NEW]``.

Checks each revision out into a temporary git worktree (NEW defaults to the
working tree itself) and runs its own ``bench/bench_tracer.py`` alternately,
``--rounds`` times each, so machine drift hits both alike. Every run reports
traced/untraced ratios measured inside one process; the table prints the median
ratio per revision, capture level and phase (the decode step's mean and median), and writes
``bench/results/compare_revisions.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, save

ROOT = Path(__file__).resolve().parent.parent
# decode: the mean step, a full garbage collection that falls on a step included; decode_median_step: without it
PHASES = ("prefill", "decode", "decode_median_step")


def checkout(rev: str, where: Path) -> Path:
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(where), rev], cwd=ROOT, check=True)
    return where


def run_bench(tree: Path, repeats: int) -> dict:
    subprocess.run([sys.executable, "bench/bench_tracer.py", "--skip-third-party", "--repeats", str(repeats)],
                   cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return json.loads((tree / "bench" / "results" / "tracer.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", default=None, help="a revision (default: the working tree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="compare-"))
    trees = {args.old: checkout(args.old, tmp / "old")}
    trees[args.new or "working tree"] = checkout(args.new, tmp / "new") if args.new else ROOT
    backup = (ROOT / "bench" / "results" / "tracer.json").read_bytes()
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                runs[name].append(run_bench(trees[name], args.repeats))
                print(f"round {r + 1}: {name} done", flush=True)
    finally:
        (ROOT / "bench" / "results" / "tracer.json").write_bytes(backup)  # the working tree's own result stays
        for tree in trees.values():
            if tree != ROOT:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
        shutil.rmtree(tmp, ignore_errors=True)
    table = {}
    for name, results in runs.items():
        table[name] = {
            mode: {phase: round(statistics.median(res["ratio"][mode][phase] for res in results), 3)
                   for phase in PHASES}
            for mode in ("shapes", "values", "ops")
        }
        table[name]["untraced_ms"] = {k: round(statistics.median(res["untraced_ms"][k] for res in results), 2)
                                      for k in ("prefill", "decode_per_step")}
    path = save("compare_revisions", {"machine": machine(), "rounds": args.rounds, "repeats": args.repeats,
                                      "revisions": list(trees), "median_ratios": table})
    print(f"{'':>28}" + "".join(f"{name[:22]:>24}" for name in trees))
    for mode in ("shapes", "values", "ops"):
        for phase in PHASES:
            print(f"{mode + ' ' + phase:>28}" + "".join(f"{'×' + format(table[n][mode][phase], '.3f'):>24}"
                                                          for n in trees))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
