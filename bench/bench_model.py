"""Model speed, side by side in one run: ``python bench/bench_model.py``.

1. Per-token decode latency with the KV cache, our GPT vs Hugging Face's
   GPT2LMHeadModel on the same GPT-2-small-shaped random weights (124M).
   Target: ours / HF ≤ 1.05.
2. Our GPT generating 64 new tokens with the cache vs without it.
"""

from __future__ import annotations

import argparse

import torch
from common import gpt2_small_dir, interleaved, machine, median, save

from model import load_hf_gpt2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)

    from transformers import GPT2LMHeadModel

    directory = gpt2_small_dir()
    ours, _ = load_hf_gpt2(directory)
    hf_sdpa = GPT2LMHeadModel.from_pretrained(directory).eval()
    hf_eager = GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager").eval()
    tokens = torch.randint(0, 50257, (1, args.prompt + args.new))
    prompt, feed = tokens[:, : args.prompt], tokens[:, args.prompt :]

    def ours_decode() -> None:
        cache = ours.new_cache(1)
        ours(prompt, cache)
        for i in range(args.new):
            ours(feed[:, i : i + 1], cache)

    def hf_decode(model) -> None:
        out = model(prompt, use_cache=True)
        past = out.past_key_values
        for i in range(args.new):
            past = model(feed[:, i : i + 1], past_key_values=past, use_cache=True).past_key_values

    def ours_prefill() -> None:
        ours(prompt, ours.new_cache(1))

    def hf_prefill(model) -> None:
        model(prompt, use_cache=True)

    def ours_no_cache() -> None:
        for i in range(args.new + 1):
            ours(tokens[:, : args.prompt + i])

    with torch.no_grad():
        # decode-only time = (prefill + decodes) − prefill, per token
        t = interleaved({
            "ours": ours_decode, "hf_sdpa": lambda: hf_decode(hf_sdpa), "hf_eager": lambda: hf_decode(hf_eager),
            "ours_prefill": ours_prefill, "hf_sdpa_prefill": lambda: hf_prefill(hf_sdpa),
            "hf_eager_prefill": lambda: hf_prefill(hf_eager),
        }, repeats=args.repeats)
        per_token = {k: (median(t[k]) - median(t[f"{k}_prefill"])) / args.new for k in ("ours", "hf_sdpa", "hf_eager")}
        c = interleaved({"with_cache": ours_decode, "without_cache": ours_no_cache}, repeats=max(2, args.repeats // 2))

    result = {
        "machine": machine(),
        "setup": {"weights": "GPT-2 small shape, random, 124M", "prompt_tokens": args.prompt,
                  "new_tokens": args.new, "repeats": args.repeats},
        "decode_ms_per_token": {k: round(v * 1000, 3) for k, v in per_token.items()},
        "ratio_ours_over_hf_sdpa": round(per_token["ours"] / per_token["hf_sdpa"], 3),
        "ratio_ours_over_hf_eager": round(per_token["ours"] / per_token["hf_eager"], 3),
        "generate_64_seconds": {"with_cache": round(median(c["with_cache"]), 3),
                                "without_cache": round(median(c["without_cache"]), 3)},
        "speedup_cache": round(median(c["without_cache"]) / median(c["with_cache"]), 2),
    }
    path = save("model", result)
    print(f"machine: {result['machine']['cpu']} ({result['machine']['cores']} cores, "
          f"torch {result['machine']['torch']}, {result['machine']['torch_threads']} threads)")
    ms = result["decode_ms_per_token"]
    print(f"decode ms/token  ours {ms['ours']:.2f}   HF sdpa {ms['hf_sdpa']:.2f}   HF eager {ms['hf_eager']:.2f}")
    print(f"ratio ours/HF: sdpa {result['ratio_ours_over_hf_sdpa']}  eager {result['ratio_ours_over_hf_eager']}"
          "  (target ≤ 1.05)")
    print(f"{args.new} new tokens: with cache {result['generate_64_seconds']['with_cache']} s, without "
          f"{result['generate_64_seconds']['without_cache']} s → {result['speedup_cache']}× faster with the cache")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
