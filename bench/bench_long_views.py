"""The views of a long derived pattern, two revisions side by side:
``python bench/bench_long_views.py [--n 8192] [--old REV] [--rounds 2] [--threads 2]``.

A Llama-style GPT with random weights (2 layers, d = 256, 4 heads of d_head 64, d_ff 688, V = 1024), built in
Python from ``GPTConfig`` (no files). In one child process per run: the untraced forward of ``--n`` tokens (our
GPT runs it fused), the same forward traced with values (fused: every n × t record derived), then on layer 1's
pattern: a floor (every visible QKᵀ cell of head 0 computed once and exponentiated, in 128-row chunks: the least
an exact overview must do), then the views timed one after the other as a user meets them: the first overview
of head 0 (128 × 128 blocks, mean and max), the same overview again (a Streamlit rerun), a 256 × 256 exact
region of head 0, the query-row strip of the last row, an overview of head 0 zoomed to 1/8 of the rows, a
region of head 1 (no overview of it yet), and one layer's long-context statistics (4 heads). Each is also
printed as a multiple of the untraced forward measured in the same process, which is what a loaded shared
machine can compare.

``--old REV`` runs the same child on that revision (a temporary ``git worktree``) alternately with the working
tree, ``--rounds`` times each (the floor needs ``attention_source``, which both have). Writes
``bench/results/long_views.json`` with the machine and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, machine, save

CHILD = r"""
import json, sys, time, torch
root, n, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, root)
torch.set_num_threads(threads)
from gpt_shape_tracer.model import GPT, GPTConfig
from gpt_shape_tracer.model.gpt import attention_path
from gpt_shape_tracer.tracer import (
    Tracer,
    attention_overview,
    attention_region,
    attention_source,
    head_statistics,
    query_row,
)
torch.manual_seed(0)
config = GPTConfig.for_family("llama", vocab_size=1024, n_ctx=n, d_model=256, n_layer=2, n_head=4, n_kv_head=4,
                              d_mlp=688)
model = GPT(config).eval()
tokens = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(0))
out = {}
with torch.no_grad(), attention_path("fused"):
    model(tokens[:, :256])  # warm up
    t0 = time.perf_counter(); model(tokens); out["forward_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    with Tracer(model) as tr:
        model(tokens)
    out["traced_forward_s"] = time.perf_counter() - t0
name, trace = "blocks.1.attn.hook_pattern", tr.trace
views = (
    ("overview_s", lambda: attention_overview(trace, name, 0, head=0, bins=128)),
    ("overview_again_s", lambda: attention_overview(trace, name, 0, head=0, bins=128)),
    ("region_s", lambda: attention_region(trace, name, 0, rows=(n // 2, n // 2 + 256),
                                          cols=(n // 2 - 128, n // 2 + 128), heads=[0])),
    ("row_s", lambda: query_row(trace, name, 0, row=n - 1, head=0)),
    ("overview_zoomed_s", lambda: attention_overview(trace, name, 0, head=0, bins=128,
                                                     rows=(n // 2, n // 2 + n // 8), cols=(0, n // 2 + n // 8))),
    ("region_cold_head_s", lambda: attention_region(trace, name, 0, rows=(n // 2, n // 2 + 256),
                                                    cols=(n // 2 - 128, n // 2 + 128), heads=[1])),
    ("statistics_s", lambda: head_statistics(trace, name, 0)),
)
def floor():  # the least an exact overview of head 0 must do: every visible QKᵀ cell once, and its exponential
    src = attention_source(trace, name, 0)
    q, k = src.q[0, 0], src.k[0, 0]
    for r0 in range(0, n, 128):
        x = q[r0:r0 + 128] @ k[:r0 + 128].T
        x.exp_()
views = (("floor_s", floor),) + views
for what, call in views:
    t0 = time.perf_counter()
    call()
    out[what] = time.perf_counter() - t0
print(json.dumps(out))
"""


def run(root: Path, n: int, threads: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(root), str(n), str(threads)], capture_output=True,
                          text=True, timeout=7200, cwd=root)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_average"] = os.getloadavg()[0]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--old", help="a git revision to run alternately with the working tree")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in each child")
    args = parser.parse_args()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    trees = {"new": ROOT}
    scratch = None
    if args.old:
        scratch = Path(tempfile.mkdtemp()) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(scratch), args.old], cwd=ROOT, check=True)
        trees = {"old": scratch, "new": ROOT}
    runs: dict[str, list[dict]] = {k: [] for k in trees}
    try:
        for _ in range(args.rounds):
            for label, root in trees.items():
                result = run(root, args.n, args.threads)
                runs[label].append(result)
                fwd = result["forward_s"]
                print(f"  {label}: " + ", ".join(f"{k[:-2]} {v:.3f} s (×{v / fwd:.2f})" for k, v in result.items()
                                                 if k.endswith("_s")) + f"; load {result['load_average']:.1f}",
                      flush=True)
    finally:
        if scratch is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(scratch)], cwd=ROOT, check=False)
    summary = {label: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("_s")}
               for label, rs in runs.items()}
    for label, s in summary.items():
        print(f"{label} (medians): " + ", ".join(f"{k[:-2]} {v:.3f} s = ×{v / s['forward_s']:.2f} forward"
                                                for k, v in s.items()), flush=True)
    save("long_views", {"machine": info, "n": args.n, "threads": args.threads, "old": args.old, "runs": runs,
                        "medians": summary})


if __name__ == "__main__":
    main()
