"""What the runs folder's write after a Step costs as the run grows: ``python bench/bench_run_writes.py [--steps 40]
[--model story|gpt2-small] [--prompt-tokens N]``.

The app writes a generation's run after every Step (gui/runs.py ``RunWrite``, session/runs.py ``RunStore``); a Step
clicked while that write runs waits for it. Here, in one process, a bundled story-gpt generation (values captured,
greedy) is stepped to ``--steps`` steps, and after each step both ways are timed on the same trace: the whole trace
written again (``save_trace``, what every write did before) and the part holding only that step
(``save_trace_part`` after the files so far, what ``RunStore.save_steps`` writes) — each 5 times at the run lengths
printed, the median (the same write again reads the trace and changes nothing). Then the run is read back both
ways (``load_trace`` of the whole file against ``load_trace_parts`` of the first file and its parts) — a restore
reads it once. Prints the times at 1, 5, 10, 20 and 40 steps with the load average; writes
``bench/results/run_writes.json`` (``run_writes-<model>-<N>.json`` with the options).

``--model gpt2-small``: a GPT-2-small-shaped model (124M, random weights built in Python by transformers and loaded
from its directory, ``common.gpt2_small_dir``) instead of the bundled story model; ``--prompt-tokens N``: a prompt of
N tokens (the story sentence repeated) instead of the short one — the first write then holds the prefill's values.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import gpt2_small_dir, machine, save

SHOWN = (1, 5, 10, 20, 40)  # the run lengths printed, each write timed REPEATS times there (the median)
REPEATS = 5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--model", choices=("story", "gpt2-small"), default="story")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="0: the short prompt")
    args = ap.parse_args()
    from gpt_shape_tracer.model import load_bundled, load_model
    from gpt_shape_tracer.tracer import TracedGeneration, load_trace, save_trace
    from gpt_shape_tracer.tracer.files import load_trace_parts, save_trace_part

    model, tok = load_bundled() if args.model == "story" else load_model(str(gpt2_small_dir()))
    prompt = "Once upon a time, there was a little girl"
    if args.prompt_tokens:
        text = prompt
        while len(tok.encode(text)) < args.prompt_tokens:
            text += " " + prompt
        prompt = tok.decode(tok.encode(text)[:args.prompt_tokens])
    gen = TracedGeneration(model, tok, prompt, temperature=0.0, stop_at_eos=False)
    folder = Path(tempfile.mkdtemp(prefix="bench-run-writes-"))
    load_before = os.getloadavg()
    after, paths, rows = None, [], []
    for k in range(1, args.steps + 1):
        gen.step()
        path = folder / ("trace.zip" if after is None else f"trace-from-{after.steps:06d}.zip")
        part_s, whole_s = [], []
        for _ in range(REPEATS if k in SHOWN else 1):  # the same write again: it reads the trace, changes nothing
            started = time.perf_counter()
            written = save_trace_part(gen.trace, path, after)
            part_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            save_trace(gen.trace, folder / "whole.zip")
            whole_s.append(time.perf_counter() - started)
        after = written
        paths.append(path)
        rows.append({"steps": k, "part_s": statistics.median(part_s), "whole_s": statistics.median(whole_s),
                     "part_samples": part_s, "whole_samples": whole_s, "part_bytes": path.stat().st_size,
                     "whole_bytes": (folder / "whole.zip").stat().st_size})
    reads = {"parts": [], "whole": []}
    for _ in range(3):
        started = time.perf_counter()
        load_trace_parts(paths)
        reads["parts"].append(time.perf_counter() - started)
        started = time.perf_counter()
        load_trace(folder / "whole.zip")
        reads["whole"].append(time.perf_counter() - started)
    result = {"machine": machine(), "model": args.model, "prompt_tokens": len(gen.facts.columns(0, 0)),
              "load_before": load_before, "load_after": os.getloadavg(), "rows": rows, "read_s": reads}
    for row in rows:
        if row["steps"] in SHOWN:
            print(f"{row['steps']:3d} steps: the whole trace {row['whole_s'] * 1000:6.1f} ms "
                  f"({row['whole_bytes']:,} B); the step's part {row['part_s'] * 1000:5.1f} ms "
                  f"({row['part_bytes']:,} B)")
    print(f"read back: {len(paths)} files {statistics.median(reads['parts']):.3f} s, the whole file "
          f"{statistics.median(reads['whole']):.3f} s (median of 3)")
    print(f"load {load_before} → {result['load_after']}")
    name = "run_writes" if args.model == "story" and not args.prompt_tokens else \
        f"run_writes-{args.model}-{args.prompt_tokens or 'short'}"
    print(f"{args.model}, a prompt of {result['prompt_tokens']} tokens")
    print(f"wrote {save(name, result)}")


if __name__ == "__main__":
    main()
