"""Model speed, side by side in one run: ``python bench/bench_model.py``.

1. Per-token decode latency with the KV cache, our GPT vs Hugging Face's own
   class (its default SDPA attention and its eager attention) on the same random
   weights, for each family, timed interleaved in one run:
   * GPT-2 small (124M) vs ``GPT2LMHeadModel``;
   * a Llama shaped like SmolLM2-135M (d = 576, 30 layers, 9 query heads sharing
     3 key/value heads, d_ff = 1536, V = 49152, tied) vs ``LlamaForCausalLM``;
   * a Qwen2 with Qwen2-0.5B's widths (d = 896, 14 query / 2 key/value heads,
     d_ff = 4864, q/k/v biases, tied, V = 151936) but 6 of its 24 layers, vs
     ``Qwen2ForCausalLM``;
   * a small Mistral (d = 512, 8 layers, 8 / 2 heads, d_ff = 1408, V = 32000)
     with a 32-position sliding window, shorter than the 80 positions decoded, vs
     ``MistralForCausalLM``.
   Target: ours / HF ≤ 1.0.
2. What the hook-point fast path saves: the same decode with every hook point
   forced through ``nn.Module.__call__`` (what it costs without the fast path).
3. GPT-2: 64 new tokens with the cache vs without it.

Writes ``bench/results/model.json`` with the machine.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from common import gpt2_small_dir, interleaved, machine, median, save
from torch import nn

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.gpt import HookPoint

SHAPES: dict[str, dict] = {
    "llama": dict(kind="Llama", label="SmolLM2-135M shape", hidden_size=576, intermediate_size=1536,
                  num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                  max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True),
    "qwen2": dict(kind="Qwen2", label="Qwen2-0.5B widths, 6 of 24 layers", hidden_size=896,
                  intermediate_size=4864, num_hidden_layers=6, num_attention_heads=14, num_key_value_heads=2,
                  vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True),
    "mistral": dict(kind="Mistral", label="small Mistral, sliding window 32", hidden_size=512,
                    intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                    vocab_size=32000, max_position_embeddings=4096, sliding_window=32, tie_word_embeddings=False),
}


def family_dir(family: str) -> Path:
    """A random Hugging Face checkpoint of ``family``'s bench shape, saved locally once (no download)."""
    import transformers

    spec = dict(SHAPES[family])
    kind, _ = spec.pop("kind"), spec.pop("label")
    target = Path(tempfile.gettempdir()) / f"bench-{family}-random"
    if (target / "config.json").exists():
        return target
    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(bos_token_id=0, eos_token_id=0, **spec)
    model = getattr(transformers, f"{kind}ForCausalLM")(config).eval()
    with torch.no_grad():  # non-zero biases and norm weights, as a trained model has
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(target)
    return target


def hf_models(family: str, directory: Path) -> dict[str, nn.Module]:
    import transformers

    cls = transformers.GPT2LMHeadModel if family == "gpt2" else getattr(
        transformers, f"{SHAPES[family]['kind']}ForCausalLM")
    return {impl: cls.from_pretrained(directory, dtype=torch.float32, attn_implementation=impl).eval()
            for impl in ("sdpa", "eager")}


def decoders(ours: nn.Module, hf: dict[str, nn.Module], prompt: torch.Tensor, feed: torch.Tensor
             ) -> dict[str, Callable[[], None]]:
    """Prefill + decode and prefill alone, for ours and each Hugging Face attention implementation."""

    def ours_decode() -> None:
        cache = ours.new_cache(1)
        ours(prompt, cache)
        for i in range(feed.size(1)):
            ours(feed[:, i : i + 1], cache)

    def hf_decode(model: nn.Module) -> None:
        past = model(prompt, use_cache=True).past_key_values
        for i in range(feed.size(1)):
            past = model(feed[:, i : i + 1], past_key_values=past, use_cache=True).past_key_values

    fns: dict[str, Callable[[], None]] = {"ours": ours_decode, "ours_prefill": lambda: ours(prompt, ours.new_cache(1))}
    for impl, model in hf.items():
        fns[f"hf_{impl}"] = lambda model=model: hf_decode(model)
        fns[f"hf_{impl}_prefill"] = lambda model=model: model(prompt, use_cache=True)
    return fns


def per_token(times: dict[str, list[float]], name: str, new: int) -> float:
    """Decode-only time = (prefill + decodes) − prefill, per token, from the medians."""
    return (median(times[name]) - median(times[f"{name}_prefill"])) / new


class ModuleCallHookPoints:
    """Inside this block every hook point goes through ``nn.Module.__call__``, as it would without the fast path."""

    def __enter__(self) -> None:
        self._saved = HookPoint.__call__
        HookPoint.__call__ = nn.Module.__call__

    def __exit__(self, *exc) -> None:
        HookPoint.__call__ = self._saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--families", nargs="+", default=["gpt2", *SHAPES])
    args = ap.parse_args()
    torch.manual_seed(0)
    result: dict = {
        "machine": machine(),
        "setup": {"prompt_tokens": args.prompt, "new_tokens": args.new, "repeats": args.repeats,
                  "timing": "interleaved; decode ms/token = (median prefill+decode − median prefill) / new tokens"},
        "families": {},
    }
    print(f"machine: {result['machine']['cpu']} ({result['machine']['cores']} cores, "
          f"torch {result['machine']['torch']}, {result['machine']['torch_threads']} threads)")
    with torch.no_grad():
        for family in args.families:
            directory = gpt2_small_dir() if family == "gpt2" else family_dir(family)
            ours, _ = load_hf(directory)
            hf = hf_models(family, directory)
            V = ours.config.vocab_size
            tokens = torch.randint(0, V, (1, args.prompt + args.new))
            prompt, feed = tokens[:, : args.prompt], tokens[:, args.prompt :]
            with torch.no_grad():  # the same weights: the same logits, before anything is timed
                diff = (ours(tokens) - hf["eager"](tokens).logits).abs().max().item()
            t = interleaved(decoders(ours, hf, prompt, feed), repeats=args.repeats)
            ms = {k: round(per_token(t, k, args.new) * 1000, 3) for k in ("ours", "hf_sdpa", "hf_eager")}
            row = {
                "shape": "GPT-2 small, 124M" if family == "gpt2" else SHAPES[family]["label"],
                "parameters": ours.num_parameters,
                "max_abs_logit_diff_vs_hf": diff,
                "decode_ms_per_token": ms,
                "ratio_ours_over_hf_sdpa": round(ms["ours"] / ms["hf_sdpa"], 3),
                "ratio_ours_over_hf_eager": round(ms["ours"] / ms["hf_eager"], 3),
            }
            result["families"][family] = row
            print(f"{family:8s} {row['shape']:36s} ours {ms['ours']:7.2f}  HF sdpa {ms['hf_sdpa']:7.2f}  "
                  f"HF eager {ms['hf_eager']:7.2f} ms/token   ours/HF: sdpa ×{row['ratio_ours_over_hf_sdpa']}  "
                  f"eager ×{row['ratio_ours_over_hf_eager']}  (|Δ logits| {diff:.1e})", flush=True)
            if family in ("gpt2", "llama"):
                fns = decoders(ours, {}, prompt, feed)

                def slow_decode(fns=fns) -> None:
                    with ModuleCallHookPoints():
                        fns["ours"]()

                def slow_prefill(fns=fns) -> None:
                    with ModuleCallHookPoints():
                        fns["ours_prefill"]()

                h = interleaved({"fast": fns["ours"], "fast_prefill": fns["ours_prefill"], "module_call": slow_decode,
                                 "module_call_prefill": slow_prefill}, repeats=args.repeats)
                fast, slow = per_token(h, "fast", args.new) * 1000, per_token(h, "module_call", args.new) * 1000
                hook_points = sum(isinstance(m, HookPoint) for m in ours.modules())
                row["hook_fast_path"] = {"hook_points": hook_points, "decode_ms_fast": round(fast, 3),
                                         "decode_ms_module_call": round(slow, 3),
                                         "saved_ms_per_token": round(slow - fast, 3)}
                print(f"         hook points ({hook_points}) through nn.Module.__call__: {slow:.2f} ms/token vs "
                      f"{fast:.2f} with the fast path (saves {slow - fast:.2f} ms/token)", flush=True)
            if family == "gpt2":
                def ours_no_cache(model: nn.Module = ours, tokens: torch.Tensor = tokens) -> None:
                    for i in range(args.new + 1):
                        model(tokens[:, : args.prompt + i])

                c = interleaved({"with_cache": decoders(ours, {}, prompt, feed)["ours"],
                                 "without_cache": ours_no_cache}, repeats=max(2, args.repeats // 2))
                # kept at the top level too: the earlier GPT-2-only result had these keys
                result.update({
                    "decode_ms_per_token": ms,
                    "ratio_ours_over_hf_sdpa": row["ratio_ours_over_hf_sdpa"],
                    "ratio_ours_over_hf_eager": row["ratio_ours_over_hf_eager"],
                    "generate_64_seconds": {"with_cache": round(median(c["with_cache"]), 3),
                                            "without_cache": round(median(c["without_cache"]), 3)},
                    "speedup_cache": round(median(c["without_cache"]) / median(c["with_cache"]), 2),
                })
                print(f"         {args.new} new tokens: with cache {result['generate_64_seconds']['with_cache']} s, "
                      f"without {result['generate_64_seconds']['without_cache']} s → {result['speedup_cache']}×",
                      flush=True)
            ours = hf = None  # free this family's weights before the next
    path = save("model", result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
