"""A traced engine run against transformers' own continuous batching, side by side in one run:
``python bench/bench_engine.py [--repeats 5] [--threads 1]``.

8 requests of 16 … 48 prompt tokens (two of them sharing a 32-token prefix), arriving over engine steps 0 … 5,
64 new tokens each, through a 2-layer Llama built in Python (d = 256, 4 query / 2 key/value heads of 64,
V = 1024, random weights), pages of 16 positions, a pool of 128 pages, 512 tokens per engine step. Timed
alternately in one process:

* ``generate_batch`` — transformers' ``generate_batch`` of the same 8 requests (its background thread; all
  requests at once, since it takes no arrival times), untraced;
* ``engine, no values`` — ``trace_engine(..., values=False)``: the step-by-step driver and the pool records;
* ``engine, values`` — ``trace_engine``: the same with every request's Q, K, V and pattern at every layer and step.

Prints the medians, the ratios to ``generate_batch``, the machine and its load (``os.getloadavg()`` before and
after); writes ``bench/results/engine.json``.
"""

from __future__ import annotations

import argparse
import os

import torch
from common import interleaved, machine, median, save

from gpt_shape_tracer.tracer.engine import trace_engine

NEW_TOKENS = 64
PAGE_SIZE = 16
PAGES = 128
BATCH_TOKENS = 512


def requests() -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, 1024, (32,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 1024, (8,), generator=g).tolist(),
               prefix + torch.randint(3, 1024, (12,), generator=g).tolist()]
    prompts += [torch.randint(3, 1024, (int(n),), generator=g).tolist()
                for n in torch.randint(16, 49, (6,), generator=g)]
    arrivals = [0, 1, 0, 2, 3, 4, 5, 5]
    return prompts, arrivals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                                         max_position_embeddings=256, attn_implementation="eager")).eval()
    prompts, arrivals = requests()
    options = dict(page_size=PAGE_SIZE, pages=PAGES, max_batch_tokens=BATCH_TOKENS, max_new_tokens=NEW_TOKENS,
                   arrivals=arrivals)
    runs = {}

    def batch() -> None:
        runs["generate_batch"] = model.generate_batch(
            inputs=prompts, generation_config=GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False,
                                                               eos_token_id=-1),
            continuous_batching_config=ContinuousBatchingConfig(num_blocks=PAGES, max_batch_tokens=BATCH_TOKENS,
                                                                page_size=PAGE_SIZE), warmup=False)

    def bare() -> None:
        runs["bare"] = trace_engine(model, None, prompts, values=False, **options)

    def traced() -> None:
        runs["values"] = trace_engine(model, None, prompts, **options)

    load_before = os.getloadavg()
    times = interleaved({"generate_batch": batch, "engine, no values": bare, "engine, values": traced},
                        repeats=args.repeats)
    load_after = os.getloadavg()
    by_prompt = {tuple(o.prompt_ids): o.generated_tokens for o in runs["generate_batch"].values()}
    same = all(list(r.generated_ids) == by_prompt[r.prompt_ids] for r in runs["values"].requests)
    run = runs["values"]
    base = median(times["generate_batch"])
    print(f"machine: {machine()}")
    print(f"load average before {load_before}, after {load_after}; torch threads {torch.get_num_threads()}")
    print(f"{len(prompts)} requests, {len(run.steps)} engine steps, {run.bytes_kept:,} B of values kept; tokens "
          f"equal to generate_batch's: {same}")
    for name, ts in times.items():
        print(f"{name:>20}: median {median(ts):.3f} s (min {min(ts):.3f}, max {max(ts):.3f}) "
              f"x{median(ts) / base:.2f}")
    save("engine", {"machine": machine(), "load_before": load_before, "load_after": load_after,
                    "threads": torch.get_num_threads(), "repeats": args.repeats, "engine_steps": len(run.steps),
                    "bytes_kept": run.bytes_kept, "tokens_equal": same,
                    "median_s": {k: median(v) for k, v in times.items()},
                    "ratio_to_generate_batch": {k: median(v) / base for k, v in times.items()}})


if __name__ == "__main__":
    main()
