"""Headless tracing: ``python -m tracer --prompt "…" --steps N [--model-dir DIR] --out PATH``.

Writes the trace (a directory, or a .zip when PATH ends in .zip) and prints the
shape table of the chosen step.
"""

from __future__ import annotations

import argparse
import sys

import pandas as pd

from tracer.capture import CAPTURE_LEVELS
from tracer.generation import MAX_RUN_STEPS, TracedGeneration
from tracer.store import DEFAULT_BUDGET_BYTES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tracer", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    ap.add_argument("--steps", type=int, default=1, help=f"generation steps (1…{MAX_RUN_STEPS}); step 0 is the prefill")
    ap.add_argument("--model-dir", help="a local Hugging Face GPT-2 directory (default: the bundled model)")
    ap.add_argument("--out", required=True, help="where to write the trace (directory, or .zip)")
    ap.add_argument("--capture", choices=CAPTURE_LEVELS, default="values")
    ap.add_argument("--no-cache", action="store_true", help="recompute all positions at every step")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-mb", type=float, default=DEFAULT_BUDGET_BYTES / 2**20)
    ap.add_argument("--show-step", type=int, default=None, help="step whose shape table to print (default: last)")
    ap.add_argument("--all-records", action="store_true", help="print inputs/outputs too, not only hook points")
    args = ap.parse_args(argv)

    from model import ModelLoadError, SamplingError, load_bundled, load_hf_gpt2

    try:
        if args.model_dir:
            model, tokenizer = load_hf_gpt2(args.model_dir)
            if tokenizer is None:
                print(f"error: {args.model_dir} has no tokenizer (tokenizer.json or vocab.json + merges.txt)",
                      file=sys.stderr)
                return 2
        else:
            model, tokenizer = load_bundled()
        gen = TracedGeneration(
            model, tokenizer, args.prompt if len(args.prompt) > 1 else args.prompt[0],
            use_cache=not args.no_cache, capture=args.capture, temperature=args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, budget_bytes=int(args.budget_mb * 2**20),
        )
        for warning in gen.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        done = gen.run(args.steps)
    except (ModelLoadError, SamplingError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if gen.stopped:
        print(f"note: stopped after {done} step(s): {gen.stopped}", file=sys.stderr)
    gen.trace.save(args.out)
    gen.close()

    step = args.show_step if args.show_step is not None else gen.n_steps - 1
    frame = gen.trace.to_frame(step=step, kind=None if args.all_records else "hook")
    shown = frame[["name", "shape", "dtype", "numel", "summary"]].copy()
    shown["shape"] = ["[" + ", ".join(map(str, s)) + "]" for s in shown["shape"]]
    with pd.option_context("display.max_rows", None, "display.max_colwidth", 90, "display.width", 200):
        print(f"step {step}: n = {gen.trace.steps[step].n}, t = {gen.trace.steps[step].t}")
        print(shown.to_string(index=False))
    for row in range(gen.batch_size):
        print(f"text[{row}]: {gen.text(row)!r}")
    print(f"wrote {args.out}: {gen.n_steps} steps, {len(gen.trace.records)} records, "
          f"{gen.trace.bytes_kept} bytes of values")
    return 0


if __name__ == "__main__":
    sys.exit(main())
