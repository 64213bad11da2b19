"""Dry runs at full size: build a shipped shape config on the meta device, an 8,192-token prefill and 4 decode
steps, shapes captured — time and peak RSS, each case in a fresh process (so the peak is its own).

Cases per model: ``untraced`` (the same forwards with no tracer: the reference), ``traced`` (``tracer.dry_run``)
and ``costed`` (``tracer.costed_dry_run``: every op's cost counted too). Issue 38's targets for the traced run:
≤ 15 s and ≤ 1.5 GB peak RSS. DeepSeek-V3 runs without a KV cache (its latent cache is not held here), so each of
its decode steps recomputes all 8,193+ positions.

    python bench/bench_dry_run.py [--tokens 8192] [--steps 4] [--models llama-3.1-405b deepseek-v3 …]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from common import RESULTS, ROOT, machine

MODELS = ("llama-3.1-405b", "deepseek-v3", "qwen3-235b-a22b")
CASES = ("untraced", "traced", "costed")


def one(model_name: str, case: str, tokens: int, steps: int) -> dict:
    """Runs in the child process."""
    import torch

    from model import load_model
    from tracer import costed_dry_run, dry_run

    started = time.perf_counter()
    model, _ = load_model(f"shapes:{model_name}", weights=False)
    built = time.perf_counter()
    use_cache = True  # every model caches, latent attention (its c_KV and k_R) included
    records = 0
    if case == "untraced":
        cache = model.new_cache(1) if use_cache else None
        ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        with torch.no_grad():
            model(ids, cache)
            for s in range(steps):
                if use_cache:
                    model(torch.zeros(1, 1, dtype=torch.long, device="meta"), cache)
                else:
                    model(torch.zeros(1, tokens + s + 1, dtype=torch.long, device="meta"))
    elif case == "traced":
        records = len(dry_run(model, n=tokens, steps=steps, use_cache=use_cache).trace.records)
    else:
        gen, costs = costed_dry_run(model, n=tokens, steps=steps, use_cache=use_cache)
        records = len(gen.trace.records)
    done = time.perf_counter()
    return {"model": model_name, "case": case, "tokens": tokens, "steps": steps, "use_cache": use_cache,
            "build_s": round(built - started, 2), "run_s": round(done - built, 2), "total_s": round(done - started, 2),
            "records": records, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "CASE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.child[0], args.child[1], args.tokens, args.steps)))
        return
    rows = []
    for name in args.models:
        for case in CASES:
            started = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--child", name, case, "--tokens", str(args.tokens),
                                  "--steps", str(args.steps)], capture_output=True, text=True, cwd=ROOT, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["process_s"] = round(time.perf_counter() - started, 2)  # with Python's and torch's start-up
            rows.append(row)
            print(json.dumps(row), flush=True)
        by_case = {r["case"]: r for r in rows if r["model"] == name}
        base = max(by_case["untraced"]["run_s"], 1e-9)
        print(f"{name}: traced/untraced run time x{by_case['traced']['run_s'] / base:.2f}, "
              f"costed/untraced x{by_case['costed']['run_s'] / base:.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dry_run.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
