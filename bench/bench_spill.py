"""Keeping every value of a long run: ``python bench/bench_spill.py [--steps 200]``.

GPT-2 small (124M, random weights, from a local directory), a 60-token prompt, the KV cache on, a budget of
``--budget-mb`` (64 MiB: the default 512 MiB holds all of a 200-step run of this prompt), ``--steps`` steps,
once with ``spill_bytes`` (every evicted value to disk) and once without, each in a fresh process. Reported:
seconds, peak resident memory (VmHWM) over what the process held with the model loaded, bytes spilled, and
records without a value (target: RSS ≤ budget + model + 500 MB, none lost).

Figures go to ``bench/results/spill.json`` and docs/benchmarks.md, with the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import ROOT, gpt2_small_dir, machine, save

PROBE = """
import sys, time
sys.path.insert(0, {root!r})
from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.tracer import TracedGeneration
from tests.app_in_browser import status_kib
model, tok = load_hf({directory!r})
loaded = status_kib("self", "VmRSS") * 1024
gen = TracedGeneration(model, tok, " ".join(["Once upon a time there was a girl."] * 6), temperature=0,
                       spill_bytes={spill}, budget_bytes={budget})
started = time.perf_counter()
gen.run({steps})
seconds = time.perf_counter() - started
trace = gen.trace
lost = sum(not trace.has_value(r) for r in trace.records if r.kind == "hook")
print(seconds, loaded, status_kib("self", "VmHWM") * 1024, trace.log.spilled_bytes, lost, len(trace.records),
      trace.log.budget_bytes)
"""


def once(directory, steps: int, spill: int, budget: int) -> dict:
    code = PROBE.format(root=str(ROOT), directory=str(directory), steps=steps, spill=spill, budget=budget)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=3600)
    seconds, loaded, peak, spilled, lost, records, budget = out.stdout.split()[-7:]
    return {"seconds": float(seconds), "rss_with_model_mib": int(loaded) / 2**20, "peak_mib": int(peak) / 2**20,
            "peak_over_model_mib": (int(peak) - int(loaded)) / 2**20, "spilled_mib": int(spilled) / 2**20,
            "hook_records_without_value": int(lost), "records": int(records), "budget_mib": int(budget) / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--budget-mb", type=int, default=64)
    args = ap.parse_args()
    directory = gpt2_small_dir()
    budget = args.budget_mb * 2**20
    result = {"steps": args.steps, "without_spill": once(directory, args.steps, 0, budget),
              "with_spill": once(directory, args.steps, 64 * 2**30, budget)}
    spill = result["with_spill"]
    result["target_mib"] = spill["budget_mib"] + 500
    result["within_target"] = spill["peak_over_model_mib"] <= result["target_mib"]
    payload = {"machine": machine(), **result}
    print(json.dumps(payload, indent=2))
    save("spill", payload)


if __name__ == "__main__":
    main()
