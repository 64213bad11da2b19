"""Long contexts with tracing left on: ``python bench/bench_scale.py [--repeats 3] [--malloc default]``.

GPT-2-small-shaped random weights (124M), CPU, the default memory budget (512 MiB), side by side in one run:

1. a prefill of n = 128, 512 and 1024 tokens, untraced and with ``Tracer(capture="values")`` and
   ``capture="shapes"``, alternated; ratio traced / untraced (target: values ≤ 1.3×);
2. ``TracedGeneration.step()`` on a 984-token prompt (the prefill) and the first decode step, against the
   untraced forward on the same tokens (target ≤ 1.3×), with the bytes the budget kept and evicted;
3. at that 984-token prefill, each view a Step draws: seconds to build the figure and the bytes of its JSON
   (target ≤ 0.3 s, ≤ 1 MB), including the stacked attention history over two steps and the all-heads grid.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

import torch
from common import gpt2_small_dir, machine, median, save

import gpt_shape_tracer.tracer.storage._log as tracer_log
from gpt_shape_tracer.figures import attention, cache, flow, inspector, mask, pitfalls, tokens
from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.session.memory import reuse_freed_memory
from gpt_shape_tracer.tracer import TracedGeneration, Tracer

LENGTHS = (128, 512, 1024)
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with "
         "her red ball. One day, she saw a big dog in the park and said hello.")


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def prefill_ratios(model, repeats: int) -> dict:
    out = {}
    for n in LENGTHS:
        ids = torch.randint(0, model.config.vocab_size, (1, n))
        runs = {"untraced": [], "shapes": [], "values": []}
        new_pages = {mode: [] for mode in runs}

        def once(mode: str, ids: torch.Tensor = ids, new_pages: dict = new_pages) -> float:
            gc.collect()  # the previous run's trace and cache are gone before the clock starts, for both sides
            cache_ = model.new_cache(1)
            tracer = Tracer(model, capture=mode) if mode != "untraced" else None
            faults = minor_faults()
            started = time.perf_counter()
            if tracer is None:
                model(ids, cache_)
            else:
                with tracer:
                    model(ids, cache_)
            elapsed = time.perf_counter() - started
            new_pages[mode].append(minor_faults() - faults)
            if tracer is not None:
                tracer.close()
            return elapsed

        with torch.no_grad():
            once("untraced")
            for r in range(repeats):
                for mode in (list(runs) if r % 2 == 0 else list(reversed(runs))):
                    runs[mode].append(once(mode))
        base = median(runs["untraced"])
        out[n] = {"untraced_s": round(base, 3),
                  **{f"{mode}_ratio": round(median(runs[mode]) / base, 3) for mode in ("shapes", "values")},
                  # memory the run mapped for the first time (4 KiB pages the kernel had to fault in): what
                  # keeping values costs beyond the statistics, on a VM where a fault costs microseconds
                  **{f"{mode}_new_mib": round(median(new_pages[mode]) * 4096 / 2**20) for mode in runs}}
    return out


def figure_costs(trace, step: int) -> dict[str, tuple[float, int]]:
    """Seconds to build and bytes of JSON of each figure a Step can draw at ``step``."""
    layer, head = 0, 0
    makers = {
        "attention stages (4 panels)": lambda: attention.attention_stages_figure(trace, step, layer, head),
        "attention history (1 head, 2 steps)": lambda: attention.attention_history_figure(trace, layer, head, step),
        "all-heads grid": lambda: attention.all_heads_figure(trace, step).figure,
        "pitfalls": lambda: pitfalls.pitfall_figure(trace, step, layer, head),
        "causal mask": lambda: mask.mask_figure(trace, step, layer),
        "scores before/after mask": lambda: mask.scores_before_after_figure(trace, step, layer, head),
        "shape flow": lambda: flow.shape_flow_figure(trace, step, layer),
        "KV cache over the steps": lambda: cache.cache_steps_figure(trace, step),
        "cached keys heatmap": lambda: cache.key_heatmap_figure(trace, step, layer, head),
        "next token": lambda: tokens.next_token_figure(trace, step),
    }
    logits = trace.get("hook_logits", step)
    if logits is not None:
        makers["inspector: hook_logits heatmap"] = lambda: inspector.tensor_heatmap_figure(
            inspector.slice_2d(logits, 1, 2, {0: 0}), "hook_logits")
        makers["inspector: hook_logits histogram"] = lambda: inspector.histogram_figure(logits, "hook_logits")
    out = {}
    for name, make in makers.items():
        started = time.perf_counter()
        fig = make()
        text = fig.to_json() if fig is not None else ""
        out[name] = (round(time.perf_counter() - started, 3), len(text.encode()))
    return out


def prompt_of(tok, n: int) -> str:
    """A story text of exactly ``n`` tokens (the app takes text, not ids)."""
    words = STORY.split()
    text, i = "", 0
    while len(tok.encode(text)) < n:
        text += (" " if text else "") + words[i % len(words)]
        i += 1
    while len(tok.encode(text)) > n:
        text = text[:-1]
    assert len(tok.encode(text)) == n, "no prefix of exactly n tokens"
    return text


class Stopwatch:
    """Wraps a function of ``tracer.log`` to add up the seconds spent in it (the profile of a step)."""

    def __init__(self, name: str) -> None:
        self.name, self.seconds, self.calls = name, 0.0, 0
        self.inner = getattr(tracer_log, name)

    def __call__(self, *args, **kwargs):
        started = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1

    def __enter__(self) -> Stopwatch:
        setattr(tracer_log, self.name, self)
        return self

    def __exit__(self, *exc) -> None:
        setattr(tracer_log, self.name, self.inner)


def generation_costs(model, tok, repeats: int) -> dict:
    text = prompt_of(tok, 984)
    ids = torch.tensor([tok.encode(text)])
    untraced, traced, decode_untraced, decode_traced, in_stats, in_pooling = [], [], [], [], [], []
    gen = None
    with torch.no_grad():
        for _ in range(repeats):
            if gen is not None:
                gen.close()
                gen = None
            gc.collect()
            cache_ = model.new_cache(1)
            started = time.perf_counter()
            logits = model(ids, cache_)
            untraced.append(time.perf_counter() - started)
            nxt = logits[:, -1:].argmax(-1)
            started = time.perf_counter()
            model(nxt, cache_)
            decode_untraced.append(time.perf_counter() - started)
            del cache_, logits
            gc.collect()
            gen = TracedGeneration(model, tok, text, temperature=0)
            with Stopwatch("tensor_stats") as stats, Stopwatch("pooled") as pooling:
                started = time.perf_counter()
                gen.step()
                traced.append(time.perf_counter() - started)
            in_stats.append(stats.seconds)
            in_pooling.append(pooling.seconds)
            started = time.perf_counter()
            gen.step()
            decode_traced.append(time.perf_counter() - started)
    trace = gen.trace
    return {
        "prefill_untraced_s": round(median(untraced), 3), "prefill_step_s": round(median(traced), 3),
        "prefill_ratio": round(median(traced) / median(untraced), 3),
        # where the prefill step's time over the forward goes: statistics of the values the budget evicts
        # (taken as they leave) and the pooled summaries of evicted attention weights
        "prefill_stats_s": round(median(in_stats), 3), "prefill_pooling_s": round(median(in_pooling), 3),
        "prefill_ratio_without_stats_and_pooling": round(
            median([t - s - p for t, s, p in zip(traced, in_stats, in_pooling)]) / median(untraced), 3),
        "decode_untraced_s": round(median(decode_untraced), 3), "decode_step_s": round(median(decode_traced), 3),
        "decode_ratio": round(median(decode_traced) / median(decode_untraced), 3),
        "bytes_kept": trace.bytes_kept, "budget_bytes": trace.budget_bytes,
        "evicted_records": trace.log.evicted_count,
        "figures": figure_costs(trace, 1), "figures_prefill": figure_costs(trace, 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="scale", help="results file: bench/results/NAME.json")
    ap.add_argument("--malloc", choices=("reuse", "default"), default="reuse",
                    help="reuse: freed memory kept for reuse, as the app runs (tracer.memory); default: glibc's own")
    args = ap.parse_args()
    took = reuse_freed_memory() if args.malloc == "reuse" else False
    torch.manual_seed(0)
    model, tok = load_hf(gpt2_small_dir())
    result = {"machine": machine(), "setup": {"weights": "GPT-2 small shape, random (124M)", "budget": "default",
                        "malloc": "freed memory reused" if took else "glibc default"},
              "prefill": prefill_ratios(model, args.repeats), "generation": generation_costs(model, tok, args.repeats)}
    path = save(args.name, result)
    m = result["machine"]
    print(f"machine: {m['cpu']} ({m['cores']} cores, torch {m['torch']}, {m['torch_threads']} threads), {m['date']}; "
          f"malloc: {result['setup']['malloc']}")
    for n, row in result["prefill"].items():
        print(f"prefill n={n:>4}: untraced {row['untraced_s']:.3f} s, shapes ×{row['shapes_ratio']:.3f}, "
              f"values ×{row['values_ratio']:.3f} (target ≤ 1.3); memory newly mapped: untraced "
              f"{row['untraced_new_mib']} MiB, values {row['values_new_mib']} MiB")
    g = result["generation"]
    print(f"TracedGeneration.step() prefill of 984 tokens: {g['prefill_step_s']:.2f} s vs untraced "
          f"{g['prefill_untraced_s']:.2f} s → ×{g['prefill_ratio']:.2f} (target ≤ 1.3); "
          f"decode ×{g['decode_ratio']:.2f}; "
          f"of the prefill step, {g['prefill_stats_s']:.2f} s statistics of evicted values and "
          f"{g['prefill_pooling_s']:.2f} s pooling evicted weights (without them ×"
          f"{g['prefill_ratio_without_stats_and_pooling']:.2f}); "
          f"kept {g['bytes_kept'] / 2**20:.0f} MiB of {g['budget_bytes'] / 2**20:.0f}, "
          f"{g['evicted_records']} records evicted")
    for label, key in (("prefill (step 0)", "figures_prefill"), ("first decode (step 1)", "figures")):
        print(f"figures at the {label}:")
        for name, (seconds, size) in g[key].items():
            flag = "" if seconds <= 0.3 and size <= 2**20 else "   ← over target"
            print(f"  {name:<36} {seconds:6.3f} s {size / 1024:8.0f} KiB{flag}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
