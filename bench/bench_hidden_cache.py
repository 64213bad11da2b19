"""XLNet and Reformer traced (their attention read from their own ops, their cache each layer's hidden states):
the sweep's tiny random-weight models (tests/hf_every_architecture.py), a prefill then cached steps of one token,
timed beside transformers' own eager forward with its own cache on the same weights, in the same run, interleaved.

* ``hf eager`` — transformers' model, untraced, its cache (mems / past_buckets_states) handed back each step;
* ``ours``     — load_hf's model (the ops watched, hooks on, nothing recorded);
* ``traced``   — the same under a ``Tracer`` keeping every value.

Prints medians and ratios with the machine's load (``uptime``); writes bench/results/hidden_cache.json.
``python bench/bench_hidden_cache.py [--prompt 32] [--steps 8] [--repeats 5]``"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from common import interleaved, machine, median, save

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.tracer import Tracer
from tests.hf_every_architecture import build


def run(model_type: str, prompt: int, steps: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    directory = build(model_type, Path(tempfile.mkdtemp(prefix="bench-hidden-")) / model_type)
    hf = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, attn_implementation="eager").eval()
    model, _ = load_hf(directory)
    keyword = "mems" if model_type == "xlnet" else "past_buckets_states"
    ids = torch.randint(0, 200, (1, prompt + steps), generator=torch.Generator().manual_seed(0))

    def hf_run() -> None:
        with torch.no_grad():
            past = getattr(hf(input_ids=ids[:, :prompt], use_cache=True), keyword)
            for i in range(prompt, prompt + steps):
                past = getattr(hf(input_ids=ids[:, i:i + 1], **{keyword: past}, use_cache=True), keyword)

    def ours_run(traced: bool = False) -> None:
        cache = model.new_cache()
        with torch.no_grad():
            if traced:
                with Tracer(model) as tracer:
                    model(ids[:, :prompt], cache)
                for i in range(prompt, prompt + steps):
                    with Tracer(model, trace=tracer.trace):
                        model(ids[:, i:i + 1], cache)
            else:
                model(ids[:, :prompt], cache)
                for i in range(prompt, prompt + steps):
                    model(ids[:, i:i + 1], cache)

    times = interleaved({"hf eager": hf_run, "ours": ours_run, "traced": lambda: ours_run(True)}, repeats)
    medians = {k: median(v) for k, v in times.items()}
    return {"model_type": model_type, "prompt": prompt, "steps": steps,
            "median_ms": {k: round(v * 1000, 2) for k, v in medians.items()},
            "ours / hf": round(medians["ours"] / medians["hf eager"], 2),
            "traced / hf": round(medians["traced"] / medians["hf eager"], 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(load)
    rows = [run(t, args.prompt, args.steps, args.repeats) for t in ("xlnet", "reformer")]
    for row in rows:
        print(row)
    after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(after)
    save("hidden_cache", {"machine": machine(), "load_before": load, "load_after": after,
                          "loadavg": os.getloadavg(), "rows": rows})


if __name__ == "__main__":
    main()
