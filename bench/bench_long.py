"""Long prompts, side by side in one run: ``python bench/bench_long.py [--n 32768] [--upto 8192] [--quick]``.

A Llama-style model with random weights (2 layers, d = 256, 4 heads of d_head 64, d_ff 688, V = 1024, n_ctx
32,768), built with transformers' ``LlamaConfig`` and saved locally (no download). Three parts:

1. ``--n`` tokens (default 32,768) through our GPT: the untraced fused forward against the same forward traced
   with values (``Tracer``), each in a fresh child process so that each peak RSS is its own; then, in the
   traced child, the first overview of a head (128 × 128 blocks), a 256 × 256 zoomed region, a query-row
   strip and one layer's long-context statistics, timed.
2. Our GPT untraced against transformers' own ``LlamaForCausalLM`` (attn_implementation="sdpa") on the same
   weights, prefill, interleaved in one process, at 1,024 … ``--upto`` tokens (the median of 3, 1 beyond 8k).
3. The same architecture run by transformers (``load_hf(..., implementation="transformers")``): its traced
   prefill at 1,024 tokens (attention path "auto", and forced "fused") against transformers' untraced SDPA.

Prints ratios; writes ``bench/results/long.json`` with the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, interleaved, machine, median, save

SHAPE = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=32768, tie_word_embeddings=False)


def llama_dir() -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    target = Path(tempfile.gettempdir()) / "bench-llama-long"
    if not (target / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**SHAPE)).eval().save_pretrained(target)
    return target


CHILD = """
import json, resource, sys, time, torch
sys.path.insert(0, {root!r})
from model import load_hf
from tracer import Tracer, attention_overview, attention_region, head_statistics, query_row
n, traced = int(sys.argv[1]), sys.argv[2] == "values"
model, _ = load_hf({directory!r})
tokens = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    model(tokens[:, :128])  # warm up
def rss():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
before = rss()
out = {{"rss_before_mb": before}}
started = time.perf_counter()
with torch.no_grad():
    if traced:
        with Tracer(model) as tr:
            model(tokens)
    else:
        model(tokens)
out["forward_s"] = time.perf_counter() - started
out["peak_rss_mb"] = rss()
if traced:
    out["kept_mb"] = tr.trace.bytes_kept / 2**20
    name = "blocks.1.attn.hook_pattern"
    for what, call in (
            ("overview_s", lambda: attention_overview(tr.trace, name, 0, head=0, bins=128)),
            ("region_s", lambda: attention_region(tr.trace, name, 0, rows=(n // 2, n // 2 + 256),
                                                  cols=(n // 2 - 128, n // 2 + 128), heads=[0])),
            ("row_s", lambda: query_row(tr.trace, name, 0, row=n - 1, head=0)),
            ("statistics_s", lambda: head_statistics(tr.trace, name, 0)) if {stats} else (None, None)):
        if what is None:
            continue
        t0 = time.perf_counter()
        call()
        out[what] = time.perf_counter() - t0
    out["peak_rss_after_views_mb"] = rss()
print(json.dumps(out))
"""


def long_prefill(n: int, stats: bool) -> dict:
    code = CHILD.format(root=str(ROOT), directory=str(llama_dir()), stats=stats)
    results = {}
    for mode in ("untraced", "values"):
        done = subprocess.run([sys.executable, "-c", code, str(n), mode], capture_output=True, text=True,
                              timeout=3600)
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  {n:,} tokens {mode}: {json.dumps(results[mode])}", flush=True)
    u, v = results["untraced"], results["values"]
    results["time_ratio"] = v["forward_s"] / u["forward_s"]
    results["rss_over_untraced_mb"] = v["peak_rss_mb"] - u["peak_rss_mb"]
    print(f"  traced/untraced time ×{results['time_ratio']:.2f}; peak RSS {v['peak_rss_mb']:.0f} MB against "
          f"{u['peak_rss_mb']:.0f} MB (+{results['rss_over_untraced_mb']:.0f} MB; the trace keeps "
          f"{v['kept_mb']:.0f} MB)", flush=True)
    return results


def ours_vs_sdpa(lengths: list[int]) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from model import load_hf

    ours, _ = load_hf(llama_dir())
    theirs = AutoModelForCausalLM.from_pretrained(llama_dir(), attn_implementation="sdpa").eval()
    rows = []
    for n in lengths:
        tokens = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(n))
        repeats = 3 if n <= 8192 else 1
        with torch.no_grad():
            assert (ours(tokens) - theirs(tokens).logits).abs().max() < 1e-3  # the same model
            times = interleaved({"ours": lambda x=tokens: ours(x), "sdpa": lambda x=tokens: theirs(x)}, repeats,
                                warmup=0)
        row = {"n": n, "ours_s": median(times["ours"]), "sdpa_s": median(times["sdpa"]), "repeats": repeats}
        row["ratio"] = row["ours_s"] / row["sdpa_s"]
        rows.append(row)
        print(f"  {n:>6,} tokens: ours {row['ours_s']:.3f} s, transformers SDPA {row['sdpa_s']:.3f} s, "
              f"×{row['ratio']:.2f}", flush=True)
    return rows


def hf_traced(n: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from model import load_hf
    from model.gpt import attention_path
    from tracer import Tracer

    model, _ = load_hf(llama_dir(), implementation="transformers")
    theirs = AutoModelForCausalLM.from_pretrained(llama_dir(), attn_implementation="sdpa").eval()
    tokens = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(1))

    def traced(mode: str):
        def run():
            with attention_path(mode), Tracer(model):
                model(tokens)
        return run

    with torch.no_grad():
        times = interleaved({"sdpa": lambda: theirs(tokens), "traced auto": traced("auto"),
                             "traced fused": traced("fused"), "traced eager": traced("eager")}, repeats)
    out = {k: median(v) for k, v in times.items()}
    for k in ("traced auto", "traced fused", "traced eager"):
        print(f"  {n:,} tokens, transformers-run, {k}: {out[k]:.3f} s, ×{out[k] / out['sdpa']:.2f} "
              f"transformers' untraced SDPA ({out['sdpa']:.3f} s)", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=32768, help="tokens of the long prefill (part 1)")
    parser.add_argument("--upto", type=int, default=8192, help="longest prompt of part 2")
    parser.add_argument("--no-stats", action="store_true", help="skip the statistics of a layer in part 1")
    args = parser.parse_args()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}", flush=True)
    started = time.perf_counter()
    print("1. long prefill, untraced fused vs traced with values (child processes)", flush=True)
    long = long_prefill(args.n, not args.no_stats)
    print("2. our GPT untraced vs transformers SDPA", flush=True)
    lengths = [n for n in (1024, 2048, 4096, 8192, 16384, 32768) if n <= args.upto]
    versus = ours_vs_sdpa(lengths)
    print("3. a transformers-run model traced vs its untraced SDPA", flush=True)
    hf = hf_traced(1024, 3)
    save("long", {"machine": info, "long_prefill": long, "ours_vs_sdpa": versus, "hf_traced_1024": hf,
                  "seconds": time.perf_counter() - started, "rss_unit": "MB (ru_maxrss / 1024)"})


if __name__ == "__main__":
    main()
