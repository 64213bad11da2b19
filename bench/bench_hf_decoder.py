"""The transformers path, side by side in one run: ``python bench/bench_hf_decoder.py [--long 1024]``.

A Qwen3 with Qwen3-0.6B's widths but 4 of its 28 layers (d = 1024, 16 query / 8 key/value heads of 128,
QK-norm, d_ff = 3072, V = 151936, tied), random weights, saved to a local directory (no download). For a
short (16-token) and a long (``--long`` tokens) prompt, the prefill and one cached decode step, timed
interleaved in one process:

* ``hf sdpa``   — transformers' own model as a user runs it (its default attention), untraced;
* ``ours``      — the same weights loaded with ``load_hf`` (transformers runs it, our attention function and
                  hook points in place), untraced;
* ``shapes`` / ``values`` — the same under ``Tracer``.

Both ways a user gets such a model are timed: loaded from the directory, and wrapped in Python
(``HFDecoder(AutoModelForCausalLM.from_config(...))``) — the wrapping itself (its one-token routing check)
and ``load_hf`` against ``from_pretrained`` are timed too. Ratios are to ``hf sdpa``. Writes
``bench/results/hf_decoder.json`` with the machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import interleaved, machine, median, save

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.model.sources import HFDecoder
from gpt_shape_tracer.tracer import Tracer

SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
             tie_word_embeddings=True, rope_theta=1000000.0)


def qwen3_dir() -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    target = Path(tempfile.gettempdir()) / "bench-qwen3-0.6b-widths"
    if not (target / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE)).eval().save_pretrained(target)
    return target


def run(prompt_len: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM, Qwen3Config

    directory = qwen3_dir()
    out: dict = {"prompt": prompt_len}
    started = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    out["from_pretrained_s"] = time.perf_counter() - started
    started = time.perf_counter()
    ours, _ = load_hf(directory)
    out["load_hf_s"] = time.perf_counter() - started
    torch.manual_seed(0)
    built = AutoModelForCausalLM.from_config(Qwen3Config(**SHAPE)).eval()
    started = time.perf_counter()
    in_python = HFDecoder(built)
    out["wrap_in_python_s"] = time.perf_counter() - started
    ids = torch.randint(0, SHAPE["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(1))
    nxt = ids[:, -1:]

    def hf_prefill():
        with torch.no_grad():
            ref(ids)

    tracers = {c: Tracer(ours, capture=c) for c in ("shapes", "values")}  # the default budget; installed once,
    # as TracedGeneration does: each timed forward is one traced step

    def prefill(model, capture=None):
        def go():
            with torch.no_grad():
                if capture is None:
                    model(ids)
                else:
                    with tracers[capture].active():
                        model(ids)
        return go

    def hf_decode():
        from transformers import DynamicCache

        cache = DynamicCache(config=ref.config)
        with torch.no_grad():
            ref(ids, past_key_values=cache, use_cache=True)
            started = time.perf_counter()
            ref(nxt, past_key_values=cache, use_cache=True)
        return time.perf_counter() - started

    def decode(model, capture=None):
        cache = model.new_cache(1)
        with torch.no_grad():
            model(ids, cache)
            started = time.perf_counter()
            if capture is None:
                model(nxt, cache)
            else:
                with tracers[capture].active():
                    model(nxt, cache)
        return time.perf_counter() - started

    fns = {"hf sdpa": hf_prefill, "ours (directory)": prefill(ours), "ours (built in Python)": prefill(in_python),
           "shapes": prefill(ours, "shapes"), "values": prefill(ours, "values")}
    times = interleaved(fns, repeats)
    out["prefill_s"] = {k: median(v) for k, v in times.items()}
    dec = {"hf sdpa": [], "ours (directory)": [], "ours (built in Python)": [], "shapes": [], "values": []}
    for _ in range(repeats):
        dec["hf sdpa"].append(hf_decode())
        dec["ours (directory)"].append(decode(ours))
        dec["ours (built in Python)"].append(decode(in_python))
        dec["shapes"].append(decode(ours, "shapes"))
        dec["values"].append(decode(ours, "values"))
    out["decode_s"] = {k: median(v) for k, v in dec.items()}
    for tracer in tracers.values():
        tracer.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--long", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    results = {"machine": machine(), "shape": "Qwen3-0.6B widths, 4 of 28 layers", "runs": []}
    for n in (16, args.long):
        r = run(n, args.repeats)
        results["runs"].append(r)
        base_p, base_d = r["prefill_s"]["hf sdpa"], r["decode_s"]["hf sdpa"]
        print(f"prompt {n}: load_hf {r['load_hf_s']:.2f} s vs from_pretrained {r['from_pretrained_s']:.2f} s; "
              f"wrapping a model built in Python {r['wrap_in_python_s'] * 1e3:.0f} ms")
        for k in r["prefill_s"]:
            print(f"  {k:24s} prefill {r['prefill_s'][k] * 1e3:8.1f} ms ×{r['prefill_s'][k] / base_p:5.2f}   "
                  f"decode {r['decode_s'][k] * 1e3:7.1f} ms ×{r['decode_s'][k] / base_d:5.2f}")
    save("hf_decoder", results)


if __name__ == "__main__":
    main()
