"""A new ``Tracer`` per call, on a model built in Python and on the same model loaded from a directory:
``python bench/bench_built_in_python.py [--repeats 7]``.

A notebook user writes ``with Tracer(model) as tr: model(tokens)`` in every cell. A model loaded from a
directory carries its identity (the files' hash, taken beside the load); a model built in Python has none,
so its weights digest is computed from its tensors — once per set of weights (model/gpt/_identity.py), not on every
``Tracer``. GPT-2-small shape (124M, random weights), a 128-token prefill, untraced and under a fresh Tracer at
shapes and values, interleaved; ratios against the untraced forward of the same model in the same run.
"""

from __future__ import annotations

import argparse

import torch
from common import gpt2_small_dir, interleaved, machine, median, save

from gpt_shape_tracer.model import GPT, GPTConfig, load_hf_gpt2
from gpt_shape_tracer.tracer import Tracer


def cases(model, tokens: torch.Tensor) -> dict:
    def untraced() -> None:
        with torch.no_grad():
            model(tokens)

    def traced(capture: str):
        def run() -> None:
            with torch.no_grad(), Tracer(model, capture=capture):
                model(tokens)
        return run

    return {"untraced": untraced, "shapes": traced("shapes"), "values": traced("values")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    loaded, _ = load_hf_gpt2(gpt2_small_dir())
    torch.manual_seed(0)
    built = GPT(GPTConfig(**loaded.config.to_dict())).eval()  # the same shape, built in Python
    tokens = torch.randint(0, loaded.config.vocab_size, (1, 128))
    out: dict = {"machine": machine(), "tokens": 128}
    print("GPT-2 small, 128-token prefill, a new Tracer per call (median of", args.repeats, "interleaved runs)")
    for label, model in (("built in Python", built), ("loaded from a directory", loaded)):
        times = interleaved(cases(model, tokens), args.repeats)
        base = median(times["untraced"])
        out[label] = {k: v for k, v in times.items()}
        print(f"  {label}: untraced {base * 1000:.0f} ms; shapes ×{median(times['shapes']) / base:.2f}, "
              f"values ×{median(times['values']) / base:.2f}")
    print("saved", save("built_in_python", out))


if __name__ == "__main__":
    main()
