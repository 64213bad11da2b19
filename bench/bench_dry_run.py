"""Dry runs at full size: build a shipped shape config on the meta device, an 8,192-token prefill and 4 decode
steps, shapes captured — time and peak RSS, each case in a fresh process (so the peak is its own).

Cases per model: ``untraced`` (the same forwards with no tracer: the reference), ``traced`` (``tracer.dry_run``),
``costed`` (``tracer.costed_dry_run``: every op's cost counted too, identical blocks costed once) and
``costed_every`` (``replicate=False``: every block counted op by op, the reference for ``costed``; both write their
total multiply-adds and peak memory, which must be equal). Issue 38's targets for the traced run:
≤ 15 s and ≤ 1.5 GB peak RSS. Every model runs with its KV cache (DeepSeek-V3's latent c_KV and k_R included).

transformers' own modules (``modeling_utils`` pulls in ``torch.distributed.tensor``, sympy, scipy) are imported on
first use; the child imports them first and times that apart (``import_s``: once per process, whichever model),
so ``build_s`` is the build itself: ``from_config`` on the meta device and ``HFDecoder``'s probe forward (one: on
the meta device the routing check is made by the first traced forward), or our GPT. Every forward on the meta
device runs under ``model.sources.meta_op_cache`` (each op's output computed once per distinct input), the
untraced reference's too. The machine's load (``/proc/loadavg``, 1-minute) is written beside each case, and each
phase's CPU time (``*_cpu_s``: user + system) beside its wall time: the two cores are shared, and waiting for one
is in the wall time only.

    python bench/bench_dry_run.py [--tokens 8192] [--steps 4] [--models llama-3.1-405b deepseek-v3 …]
    python bench/bench_dry_run.py --profile deepseek-v3 [--case traced]   # cProfile of one case, top functions
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import RESULTS, ROOT, machine

MODELS = ("llama-3.1-405b", "deepseek-v3", "qwen3-235b-a22b")
CASES = ("untraced", "traced", "costed", "costed_every")


def load1() -> float:
    """The 1-minute load average: how busy the shared cores were."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def cpu_seconds() -> float:
    """This process's CPU time (user + system): unlike the wall clock, it does not count the time spent waiting
    for a core that another job holds, so it moves less with the machine's load."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def one(model_name: str, case: str, tokens: int, steps: int) -> dict:
    """Runs in the child process."""
    import torch

    from gpt_shape_tracer.model import load_model
    from gpt_shape_tracer.model.sources import meta_op_cache
    from gpt_shape_tracer.tracer import costed_dry_run, dry_run

    imported = time.perf_counter()
    import transformers

    _ = transformers.AutoModelForCausalLM, transformers.PreTrainedModel  # the lazy modules a build imports
    started, started_cpu = time.perf_counter(), cpu_seconds()
    model, _ = load_model(f"shapes:{model_name}", weights=False)
    built, built_cpu = time.perf_counter(), cpu_seconds()
    use_cache = True  # every model caches, latent attention (its c_KV and k_R) included
    records = 0
    peak_activation = macs = replicated = None
    if case == "untraced":
        cache = model.new_cache(1) if use_cache else None
        ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
        with torch.no_grad(), meta_op_cache():  # as a dry run's steps are run (tracer.dry_run)
            model(ids, cache)
            for s in range(steps):
                if use_cache:
                    model(torch.zeros(1, 1, dtype=torch.long, device="meta"), cache)
                else:
                    model(torch.zeros(1, tokens + s + 1, dtype=torch.long, device="meta"))
    elif case == "traced":
        records = len(dry_run(model, n=tokens, steps=steps, use_cache=use_cache).trace.records)
    else:
        gen, costs = costed_dry_run(model, n=tokens, steps=steps, use_cache=use_cache,
                                    **({"replicate": False} if case == "costed_every" else {}))
        records = len(gen.trace.records)
        peak_activation = [round(c.peak_activation_bytes / 2**30, 2) for c in costs]  # GiB the real run would need
        macs = [c.macs for c in costs]
        replicated = [len(getattr(c, "replicated_blocks", ())) for c in costs]
    done, done_cpu = time.perf_counter(), cpu_seconds()
    return {"model": model_name, "case": case, "tokens": tokens, "steps": steps, "use_cache": use_cache,
            "import_s": round(started - imported, 2), "build_s": round(built - started, 2),
            "run_s": round(done - built, 2), "total_s": round(done - started, 2),
            "build_cpu_s": round(built_cpu - started_cpu, 2), "run_cpu_s": round(done_cpu - built_cpu, 2),
            "total_cpu_s": round(done_cpu - started_cpu, 2),
            "records": records, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
            "estimated_peak_activation_gib": peak_activation, "macs": macs, "replicated_blocks": replicated}


def profile_one(model_name: str, case: str, tokens: int, steps: int) -> None:
    """``one`` under cProfile: the functions that take the time, by cumulative and by own time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    row = profiler.runcall(one, model_name, case, tokens, steps)
    print(json.dumps(row))
    stats = pstats.Stats(profiler)
    stats.sort_stats("cumulative").print_stats(40)
    stats.sort_stats("tottime").print_stats(25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "CASE"), help=argparse.SUPPRESS)
    ap.add_argument("--profile", metavar="MODEL", help="cProfile one case of MODEL in this process")
    ap.add_argument("--case", default="traced", choices=CASES, help="the case --profile runs")
    args = ap.parse_args()
    if args.profile:
        profile_one(args.profile, args.case, args.tokens, args.steps)
        return
    if args.child:
        print(json.dumps(one(args.child[0], args.child[1], args.tokens, args.steps)))
        return
    rows = []
    for name in args.models:
        for case in CASES:
            load_before = load1()
            started = time.perf_counter()
            out = subprocess.run([sys.executable, __file__, "--child", name, case, "--tokens", str(args.tokens),
                                  "--steps", str(args.steps)], capture_output=True, text=True, cwd=ROOT, check=True)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            row["process_s"] = round(time.perf_counter() - started, 2)  # with Python's and torch's start-up
            row["load_1min"] = [load_before, load1()]  # before and after the case
            rows.append(row)
            print(json.dumps(row), flush=True)
        by_case = {r["case"]: r for r in rows if r["model"] == name}
        base = max(by_case["untraced"]["run_s"], 1e-9)
        print(f"{name}: traced/untraced run time x{by_case['traced']['run_s'] / base:.2f}, "
              f"costed/untraced x{by_case['costed']['run_s'] / base:.2f}, costed/costed_every CPU "
              f"x{by_case['costed']['run_cpu_s'] / max(by_case['costed_every']['run_cpu_s'], 1e-9):.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dry_run.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
