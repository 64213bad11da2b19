"""Traced beam search beside transformers' untraced ``generate(num_beams=k)``, in one run:
``python bench/bench_beams.py [--repeats 3] [--new 32] [--beams 4]``.

The same GPT-2-small-shaped random weights (124M), built in Python by transformers and saved once
(``common.gpt2_small_dir``); ours loads them as our GPT. A short (16-token) and a long (256-token) prompt; ours
records values (``capture="values"``) and the reorder's key snapshots, transformers runs its SDPA attention. Both
decode greedily over the same k beams, so the tokens are compared too (equal, or the run says so). Prints the
medians and ours / transformers, with the machine and its load average.
"""

from __future__ import annotations

import argparse
import os

import torch
from common import gpt2_small_dir, interleaved, machine, median, save

from gpt_shape_tracer.model import load_model
from gpt_shape_tracer.tracer import BeamSearch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1 by default: on a shared 2-core machine two threads spin against the load)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    directory = gpt2_small_dir()
    ours, tok = load_model(str(directory), device=args.device)
    theirs = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval().to(args.device)
    base = "Once upon a time, there was a little girl named Lily. She had a red ball and a small blue boat. "
    results = {}
    for label, n in (("short", 16), ("long", 256)):
        ids = (tok.encode(base * 40))[:n]
        prompt = tok.decode(ids)
        ids = tok.encode(prompt)  # what BeamSearch will encode
        holder = {}

        def ours_run(prompt=prompt, holder=holder, capture="values"):
            search = BeamSearch(ours, tok, prompt, args.beams, max_new_tokens=args.new, eos_ids=(),
                                budget_bytes=2 * 2**30, capture=capture)
            search.run()
            holder[f"ours {capture}"] = search.result().sequences[0]
            search.close()

        def theirs_run(ids=ids, holder=holder):
            with torch.no_grad():
                out = theirs.generate(torch.tensor([ids], device=args.device), num_beams=args.beams,
                                      max_new_tokens=args.new, do_sample=False, eos_token_id=None, pad_token_id=0)
            holder["theirs"] = tuple(out[0].tolist())
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()

        load_before = os.getloadavg()
        times = interleaved({"ours, values": ours_run, "ours, shapes": lambda: ours_run(capture="shapes"),
                             "transformers": theirs_run}, args.repeats)
        seconds = {k: median(v) for k, v in times.items()}
        ratios = {k: seconds[k] / seconds["transformers"] for k in ("ours, values", "ours, shapes")}
        same = holder["ours values"] == holder["ours shapes"] == holder["theirs"]
        results[label] = {"prompt_tokens": len(ids), "seconds": seconds, "ratio": ratios, "same_tokens": same,
                          "load": [load_before, os.getloadavg()]}
        print(f"{label} ({len(ids)} tokens, k = {args.beams}, {args.new} new): transformers "
              f"{seconds['transformers']:.2f} s; ours traced with values x{ratios['ours, values']:.2f}, shapes "
              f"x{ratios['ours, shapes']:.2f}; same tokens: {same}; load {load_before[0]:.1f} → "
              f"{os.getloadavg()[0]:.1f}")
    save(f"beams-{args.device.split(':')[0]}", {"machine": machine(), "device": args.device, "beams": args.beams,
                                                "new_tokens": args.new, "results": results})


if __name__ == "__main__":
    main()
