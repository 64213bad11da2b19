"""Long prompts, side by side in one run:
``python bench/bench_long.py [--n 32768] [--upto 8192] [--repeats 3] [--profile 0] [--only-hf]``.

A Llama-style model with random weights (2 layers, d = 256, 4 heads of d_head 64, d_ff 688, V = 1024, n_ctx
32,768), built with transformers' ``LlamaConfig`` and saved locally (no download). Three parts:

1. ``--n`` tokens (default 32,768) through our GPT: the untraced fused forward against the same forward traced
   with values (``Tracer``), each in a fresh child process so that each peak RSS is its own; then, in the
   traced child, the first overview of a head (128 × 128 blocks), a 256 × 256 zoomed region, a query-row
   strip and one layer's long-context statistics, timed.
2. Our GPT untraced against transformers' own ``LlamaForCausalLM`` (attn_implementation="sdpa") on the same
   weights, prefill, interleaved in one process, at 1,024 … ``--upto`` tokens (the median of 3, 1 beyond 8k).
3. The same architecture run by transformers (``load_hf(..., implementation="transformers")``): its prefill at
   1,024 tokens untraced (fused, and forced eager) and traced (shapes and values on the "auto" path, values
   forced fused) against transformers' untraced SDPA, the tracers installed once; ``--profile K`` then profiles
   K forwards each of the traced "auto" one and the untraced one and prints where they differ.
   ``--only-hf`` runs this part alone.

Prints ratios; writes ``bench/results/long.json`` (``long_hf.json`` for ``--only-hf``) with the machine.
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
from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.tracer import Tracer, attention_overview, attention_region, head_statistics, query_row
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

    from gpt_shape_tracer.model import load_hf

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


def hf_traced(n: int, repeats: int, profile: int = 0) -> dict:
    """Part 3: a transformers-run Llama's prefill of ``n`` tokens, interleaved: transformers' own SDPA model,
    ours untraced (the fused kernel: nothing reads an n × t hook point) and untraced forced eager, then traced
    — shapes and values on the "auto" path (eager below the threshold, as a short prompt is traced) and values
    forced fused. The tracers are installed once, as ``TracedGeneration`` does: each timed forward is one step.
    Medians and minima (the least-disturbed run on a shared machine). With ``profile`` > 0, that many more
    forwards of "values auto" and of "untraced" each under ``cProfile``, alternating; the functions whose own
    time per forward differs most between the two are printed — where the traced eager forward's time goes."""
    from transformers import AutoModelForCausalLM

    from gpt_shape_tracer.model import load_hf
    from gpt_shape_tracer.model.gpt import attention_path
    from gpt_shape_tracer.tracer import Tracer

    model, _ = load_hf(llama_dir(), implementation="transformers")
    theirs = AutoModelForCausalLM.from_pretrained(llama_dir(), attn_implementation="sdpa").eval()
    tokens = torch.randint(0, 1024, (1, n), generator=torch.Generator().manual_seed(1))
    tracers = {c: Tracer(model, capture=c) for c in ("shapes", "values")}

    def run(mode: str, capture: str | None = None):
        def go():
            with attention_path(mode):
                if capture is None:
                    model(tokens)
                else:
                    with tracers[capture].active():
                        model(tokens)
        return go

    fns = {"sdpa": lambda: theirs(tokens), "untraced": run("auto"), "untraced eager": run("eager"),
           "shapes auto": run("auto", "shapes"), "values auto": run("auto", "values"),
           "values fused": run("fused", "values")}
    with torch.no_grad():
        times = interleaved(fns, repeats)
    out: dict = {"n": n, "repeats": repeats, "median_s": {k: median(v) for k, v in times.items()},
                 "min_s": {k: min(v) for k, v in times.items()}}
    for k in fns:
        med, low = out["median_s"][k], out["min_s"][k]
        print(f"  {n:,} tokens, {k:15s} median {med:.3f} s ×{med / out['median_s']['untraced']:.2f} ours untraced, "
              f"×{med / out['median_s']['sdpa']:.2f} transformers SDPA; min {low:.3f} s "
              f"×{low / out['min_s']['untraced']:.2f} / ×{low / out['min_s']['sdpa']:.2f}", flush=True)
    if profile:
        out["profile"] = where_time_goes({"values auto": fns["values auto"], "untraced": fns["untraced"]}, profile)
    for tracer in tracers.values():
        tracer.close()
    return out


def where_time_goes(fns: dict, forwards: int, shown: int = 18) -> list[dict]:
    """Each function's own time (cProfile tottime) per forward under the first of ``fns`` minus under the
    second, ``forwards`` of each alternating; the ``shown`` largest differences, printed and returned."""
    import cProfile
    import pstats

    profiles = {k: cProfile.Profile() for k in fns}
    with torch.no_grad():
        for _ in range(forwards):
            for k, fn in fns.items():
                profiles[k].enable()
                fn()
                profiles[k].disable()
    own = {}
    for k, prof in profiles.items():
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        own[k] = {f"{Path(f).name}:{line}({name})": (tt / forwards, nc / forwards)
                  for (f, line, name), (_, nc, tt, _, _) in stats.items()}
    first, second = list(fns)
    names = set(own[first]) | set(own[second])
    rows = sorted(({"function": f, first: own[first].get(f, (0.0, 0))[0], second: own[second].get(f, (0.0, 0))[0],
                    "calls": own[first].get(f, (0.0, 0))[1]} for f in names),
                  key=lambda r: r[second] - r[first])[:shown]
    total = {k: sum(t for t, _ in own[k].values()) for k in fns}
    print(f"  profiled ({forwards} forwards each): {first} {total[first]:.3f} s, {second} {total[second]:.3f} s "
          "per forward; own time per forward, largest differences:", flush=True)
    for r in rows:
        print(f"    {r[first] - r[second]:+.3f} s  {r['function'][:90]:90s} ({r[first]:.3f} vs {r[second]:.3f}; "
              f"{r['calls']:.0f} calls)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=32768, help="tokens of the long prefill (part 1)")
    parser.add_argument("--upto", type=int, default=8192, help="longest prompt of part 2")
    parser.add_argument("--no-stats", action="store_true", help="skip the statistics of a layer in part 1")
    parser.add_argument("--only-hf", action="store_true", help="part 3 alone (writes long_hf.json)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of part 3")
    parser.add_argument("--profile", type=int, default=0, help="forwards profiled in part 3 (0: none)")
    args = parser.parse_args()
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}", flush=True)
    started = time.perf_counter()
    if args.only_hf:
        print("3. a transformers-run model traced vs untraced", flush=True)
        hf = hf_traced(1024, args.repeats, args.profile)
        save("long_hf", {"machine": info, "hf_traced_1024": hf, "seconds": time.perf_counter() - started,
                         "loadavg": Path("/proc/loadavg").read_text().split()[:3]})
        return
    print("1. long prefill, untraced fused vs traced with values (child processes)", flush=True)
    long = long_prefill(args.n, not args.no_stats)
    print("2. our GPT untraced vs transformers SDPA", flush=True)
    lengths = [n for n in (1024, 2048, 4096, 8192, 16384, 32768) if n <= args.upto]
    versus = ours_vs_sdpa(lengths)
    print("3. a transformers-run model traced vs its untraced SDPA", flush=True)
    hf = hf_traced(1024, args.repeats, args.profile)
    save("long", {"machine": info, "long_prefill": long, "ours_vs_sdpa": versus, "hf_traced_1024": hf,
                  "seconds": time.perf_counter() - started, "rss_unit": "MB (ru_maxrss / 1024)"})


if __name__ == "__main__":
    main()
