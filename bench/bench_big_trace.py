"""Tracing a 1.1B model at 2048 tokens: ``python bench/bench_big_trace.py [--tokens 2048]``.

The TinyLlama-1.1B-shaped directory of ``bench_big_load.py`` (random weights, float32; the bundled byte-level
tokenizer stands in, its ids fit in V), loaded with ``load_hf``. Side by side in one run: the untraced forward
of a ``--tokens``-token prompt, and ``TracedGeneration.step()`` of the same prompt (the prefill, values capture,
the default 512 MiB budget); then every view a Step can draw at that step, timed and sized as in
``bench_scale.py`` (targets: traced ≤ 1.3× untraced; each view ≤ 1 s and ≤ 1 MB).

Figures go to ``bench/results/big_trace.json`` and docs/benchmarks.md, with the machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from bench_big_load import tinyllama_dir
from bench_scale import figure_costs, prompt_of
from common import machine, save

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import BUNDLED_DIR
from gpt_shape_tracer.session.memory import reuse_freed_memory
from gpt_shape_tracer.tracer import TracedGeneration


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    reuse_freed_memory()  # as the app and the command line run
    directory = tinyllama_dir()
    if not (directory / "tokenizer.json").exists():
        (directory / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    started = time.perf_counter()
    model, tok = load_hf(directory)
    load_s = time.perf_counter() - started
    prompt = prompt_of(tok, args.tokens)
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        started = time.perf_counter()
        model(ids, model.new_cache(1))
        untraced = time.perf_counter() - started
    gen = TracedGeneration(model, tok, prompt, temperature=0)
    started = time.perf_counter()
    gen.step()
    traced = time.perf_counter() - started
    trace = gen.trace
    views = figure_costs(trace, 0)
    payload = {
        "machine": machine(), "model": "TinyLlama-1.1B-shaped, random weights, float32", "tokens": args.tokens,
        "load_s": load_s, "untraced_forward_s": untraced, "traced_step_s": traced,
        "traced_forward_s": trace.steps[0].seconds, "ratio": traced / untraced,
        "budget_mib": trace.log.budget_bytes / 2**20, "kept_mib": trace.bytes_kept / 2**20,
        "evicted": trace.log.evicted_count, "records": len(trace.records),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "views": {name: {"seconds": s, "bytes": b} for name, (s, b) in views.items()},
        "slowest_view_s": max(s for s, _ in views.values()), "largest_view_bytes": max(b for _, b in views.values()),
    }
    print(json.dumps(payload, indent=2))
    save("big_trace", payload)


if __name__ == "__main__":
    main()
