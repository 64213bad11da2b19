"""What a values trace leaves Python's cyclic collector: ``python bench/bench_collector.py [--steps 160] [--runs 3]``.

GPT-2-small-shaped random weights (124M, ``common.gpt2_small_dir``), a values trace (budget 8 GiB: nothing evicted)
of a 128-token prefill and ``--steps`` decode steps, ``--runs`` times in one process, each a new trace (the last one
dropped first). Python's collector is timed by ``gc.callbacks`` per generation: how many collections and their
seconds during the decode steps, and the young (generation 0 and 1) and full (generation 2) ones apart — a full
collection walks every tracked object of the process, so it costs about the same however few objects a step
added, and comes more often the more a step leaves it. Then, for one decode step, the tracked objects it left
after a collection (what full collections walk for as long as the trace lives), by type. Prints them with the
load average; writes ``bench/results/collector.json``. Run it in another checkout with that checkout first on
``PYTHONPATH`` to compare revisions.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import time

import torch
from common import gpt2_small_dir, machine, save

from gpt_shape_tracer.model import load_hf_gpt2
from gpt_shape_tracer.session.memory import reuse_freed_memory
from gpt_shape_tracer.tracer import Tracer

PROMPT = 128


class Clock:
    """Collections and their seconds per generation, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            generation = info["generation"]
            self.count[generation] += 1
            self.seconds[generation] += time.perf_counter() - self._started


def one_run(model, tokens: torch.Tensor, steps: int, clock: Clock) -> dict:
    tracer = Tracer(model, capture="values", budget_bytes=8 * 2**30)
    cache = model.new_cache(1)
    with torch.no_grad(), tracer:
        model(tokens[:, :PROMPT], cache)
        clock.count, clock.seconds = [0, 0, 0], [0.0, 0.0, 0.0]
        started = time.perf_counter()
        for i in range(steps):
            model(tokens[:, PROMPT + i : PROMPT + i + 1], cache)
        seconds = time.perf_counter() - started
    return {"decode_seconds": seconds, "collections": list(clock.count),
            "collector_seconds": [round(s, 4) for s in clock.seconds]}


def left_by_one_step(model, tokens: torch.Tensor) -> dict[str, int]:
    """Tracked objects one decode step of a values trace leaves after collections, by type."""
    tracer = Tracer(model, capture="values", budget_bytes=8 * 2**30)
    cache = model.new_cache(1)
    with torch.no_grad(), tracer:
        model(tokens[:, :PROMPT], cache)
        model(tokens[:, PROMPT : PROMPT + 1], cache)
        gc.collect()
        before = {id(o) for o in gc.get_objects()}
        model(tokens[:, PROMPT + 1 : PROMPT + 2], cache)
        gc.collect()
        gc.collect()  # a tuple is untracked once what it holds is: a collection later
        left = collections.Counter(type(o).__name__ for o in gc.get_objects() if id(o) not in before
                                   and o is not before)
    return dict(left.most_common())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    reuse_freed_memory()
    torch.manual_seed(0)
    model, _ = load_hf_gpt2(gpt2_small_dir())
    tokens = torch.randint(0, model.config.vocab_size, (1, PROMPT + args.steps))
    load_before = os.getloadavg()
    clock = Clock()
    gc.callbacks.append(clock)
    try:
        runs = []
        for _ in range(args.runs):
            runs.append(one_run(model, tokens, args.steps, clock))
            gc.collect()  # the last trace gone before the next begins
    finally:
        gc.callbacks.remove(clock)
    left = left_by_one_step(model, tokens)
    load_after = os.getloadavg()
    print(f"machine: {machine()['cpu']}; load {load_before[0]:.1f} → {load_after[0]:.1f}; a values trace of a "
          f"{PROMPT}-token prefill and {args.steps} decode steps, {args.runs} runs:")
    for i, run in enumerate(runs):
        young = sum(run["collector_seconds"][:2])
        print(f"  run {i}: decode {run['decode_seconds']:.2f} s; collections (gen 0, 1, 2) {run['collections']}, "
              f"young {young * 1e3:.1f} ms, full {run['collector_seconds'][2] * 1e3:.1f} ms")
    print(f"tracked objects one decode step leaves: {sum(left.values())} {left}")
    path = save("collector", {"machine": machine(), "steps": args.steps, "load": [load_before, load_after],
                              "runs": runs, "left_by_one_step": left})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
