"""NaN/∞ flags batched per step against a host read per record, on the CPU: ``python bench/bench_flags.py``.

The shapes capture flags the residual stream and the logits of every step; the tracer now holds the small ones until
a flag is read (or too many are held) and reads them together, one reduction per shape, where it read each one as
it was recorded. On a
GPU a read per record waits for the device; on the CPU there is nothing to wait for, and this measures that the
batching costs the CPU path nothing. A bundled model (story-gpt), a prefill then cached decode steps, each
configuration in turn within every repeat (untraced, batched, read per record), timed in this process's CPU time
(``time.process_time``, every torch thread counted: what the step computed, less exposed than the wall clock to
the other processes of a loaded machine); ratios of the medians. ``--flags-only``: the flags alone, 26 records
(GPT-2 small's flagged records per step) of a decode step's and a 64-token prefill's shape, each way 400 times,
interleaved; the minimum of the runs, the least disturbed on a shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from bench_tracer import flags_read_per_record
from common import machine, median, save

from gpt_shape_tracer.model import load_bundled
from gpt_shape_tracer.tracer import Tracer
from gpt_shape_tracer.tracer.storage._stats import finite_flag, flags_of_tensors

MODES = ("untraced", "batched", "read per record")


def decode_steps(model, prompt, feed, mode) -> tuple[float, list[float]]:
    """(prefill seconds, each decode step's seconds) in this process's CPU time."""
    tracer = None if mode == "untraced" else Tracer(model, capture="shapes").install()
    active = tracer.active if tracer else contextlib.nullcontext
    cache = model.new_cache(prompt.size(0))
    with flags_read_per_record(mode == "read per record"):
        started = time.process_time()
        with active():
            model(prompt, cache)
        prefill = time.process_time() - started
        steps = []
        for i in range(feed.size(1)):
            started = time.process_time()
            with active():
                model(feed[:, i : i + 1], cache)
            steps.append(time.process_time() - started)
    if tracer:
        tracer.close()
    return prefill, steps


def flags_alone(repeats: int = 400, records: int = 26) -> dict[str, dict[str, float]]:
    """µs for ``records`` flags read one by one (the tracer before) and batched (now), minimum of ``repeats``."""
    torch.manual_seed(0)
    out = {}
    for n in (1, 64):
        xs = [torch.randn(1, n, 768) for _ in range(records)]
        took: dict[str, list[float]] = {"read per record": [], "batched": []}
        for r in range(repeats):
            for mode in tuple(took) if r % 2 == 0 else tuple(reversed(took)):
                started = time.perf_counter()
                if mode == "batched":
                    flags_of_tensors(xs)
                else:
                    [finite_flag(x) for x in xs]
                took[mode].append(time.perf_counter() - started)
        out[f"[1, {n}, 768] x{records}"] = {m: round(min(t) * 1e6, 1) for m, t in took.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--flags-only", action="store_true")
    args = ap.parse_args()
    if args.flags_only:
        alone = flags_alone()
        save("flags_alone", {"machine": machine(), "us_min_of_400": alone})
        print(f"machine: {machine()['cpu']}; µs, minimum of 400: {alone}")
        return
    torch.manual_seed(0)
    model, _ = load_bundled("story-gpt")
    tokens = torch.randint(0, model.config.vocab_size, (1, args.prompt + args.steps))
    prompt, feed = tokens[:, : args.prompt], tokens[:, args.prompt :]
    prefills: dict[str, list[float]] = {m: [] for m in MODES}
    steps: dict[str, list[float]] = {m: [] for m in MODES}
    with torch.no_grad():
        decode_steps(model, prompt, feed, "batched")  # warm-up
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
                prefill, each = decode_steps(model, prompt, feed, mode)
                prefills[mode].append(prefill)
                steps[mode] += each
    base = {"prefill": median(prefills["untraced"]), "decode_step": median(steps["untraced"])}
    result = {
        "machine": machine(),
        "setup": {"model": "bundled story-gpt", "prompt_tokens": args.prompt, "decode_steps": args.steps,
                  "repeats": args.repeats, "capture": "shapes", "clock": "time.process_time"},
        "untraced_ms": {k: round(v * 1000, 3) for k, v in base.items()},
        "ratio_to_untraced": {m: {"prefill": round(median(prefills[m]) / base["prefill"], 3),
                                  "decode_step": round(median(steps[m]) / base["decode_step"], 3)}
                              for m in MODES[1:]},
        "batched_over_read_per_record": {
            "prefill": round(median(prefills["batched"]) / median(prefills["read per record"]), 3),
            "decode_step": round(median(steps["batched"]) / median(steps["read per record"]), 3)},
    }
    path = save("flags", result)
    print(f"machine: {result['machine']['cpu']} ({result['machine']['cores']} cores)")
    print(f"untraced: {result['untraced_ms']}")
    for mode, ratio in result["ratio_to_untraced"].items():
        print(f"{mode:>16}: prefill ×{ratio['prefill']:.3f}  decode step ×{ratio['decode_step']:.3f}")
    print(f"batched / read per record: {result['batched_over_read_per_record']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
