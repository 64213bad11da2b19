"""A model larger than the memory it is given: ``python bench/bench_offload.py [--tokens 128] [--max-memory 1GiB]``.

The TinyLlama-1.1B-shaped directory of ``bench_big_load.py`` (4.1 GiB float32, random weights, nothing
downloaded), each case in a fresh process:

* **in memory**: ``load_hf(dir, implementation="transformers")`` — transformers runs it, every weight in RAM;
* **offloaded**: ``load_hf(dir, max_memory=…)`` — accelerate keeps what does not fit in ``max_memory`` on disk
  and reads it in, memory-mapped from the directory's safetensors files, for each layer's forward.

For each: the load's seconds, an untraced prefill of ``--tokens`` tokens and a values-traced one
(``Tracer(model, capture="values")``, default budget), alternated; the process's peak resident memory
(ru_maxrss: it counts the file pages a memory-mapped read touches, which the kernel may drop) and its peak
anonymous memory (RssAnon, sampled every 5 ms: what the process itself holds — the traced forward's kept
values, up to the 512 MiB budget, included). The offloaded logits are
compared with the in-memory ones. Figures go to ``bench/results/offload.json`` and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from bench_big_load import tinyllama_dir
from common import ROOT, machine, median, save

PROBE = """
import resource, sys, threading, time
sys.path.insert(0, {root!r})
import torch
from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.tracer import Tracer

peak_anon = 0
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0
def sample():
    global peak_anon
    while True:
        peak_anon = max(peak_anon, anon())
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
started = time.perf_counter()
model, _ = load_hf({directory!r}, implementation="transformers", max_memory={max_memory!r})
load_s = time.perf_counter() - started
tokens = torch.randint(0, model.config.vocab_size, (1, {tokens}), generator=torch.Generator().manual_seed(0))
untraced, traced = [], []
with torch.no_grad():
    model(tokens)  # warm-up
    for r in range({repeats}):
        for name in (("untraced", "traced") if r % 2 == 0 else ("traced", "untraced")):
            started = time.perf_counter()
            if name == "traced":
                with Tracer(model, capture="values"):
                    logits = model(tokens)
                traced.append(time.perf_counter() - started)
            else:
                logits = model(tokens)
                untraced.append(time.perf_counter() - started)
torch.save(logits[0, -4:].clone(), {logits_out!r})
import json
print("PLACEMENT", json.dumps(model.offloaded))
print("RESULT", load_s, *untraced, "|", *traced, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
      peak_anon, "disk" in model.offloaded.values())
"""


def measure(directory, max_memory, tokens: int, repeats: int, logits_out: str) -> dict:
    code = PROBE.format(root=str(ROOT), directory=str(directory), max_memory=max_memory, tokens=tokens,
                        repeats=repeats, logits_out=logits_out)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=3000)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT")).split()[1:]
    load_s = float(line[0])
    bar = line.index("|")
    untraced = [float(x) for x in line[1:bar]]
    traced = [float(x) for x in line[bar + 1:bar + 1 + repeats]]
    peak, anon, on_disk = int(line[-3]), int(line[-2]), line[-1] == "True"
    placement = json.loads(next(x for x in out.stdout.splitlines() if x.startswith("PLACEMENT"))[len("PLACEMENT "):])
    return {"load_seconds": load_s, "untraced_seconds": median(untraced), "traced_seconds": median(traced),
            "traced_over_untraced": median(traced) / median(untraced), "peak_rss_gib": peak / 2**30,
            "peak_anon_gib": anon / 2**30, "some_weights_on_disk": on_disk, "placement": placement,
            "layers_on_disk": sum(1 for k, v in placement.items() if ".layers." in k and v == "disk"),
            "untraced_runs": untraced, "traced_runs": traced}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-memory", default="1GiB")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    directory = tinyllama_dir()
    weights = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    out_mem, out_off = "/tmp/bench_offload_mem.pt", "/tmp/bench_offload_off.pt"
    in_memory = measure(directory, None, args.tokens, args.repeats, out_mem)
    offloaded = measure(directory, args.max_memory, args.tokens, args.repeats, out_off)
    difference = float((torch.load(out_mem) - torch.load(out_off)).abs().max())
    payload = {"machine": machine(), "directory": "TinyLlama-1.1B-shaped, random weights, float32",
               "weights_gib": weights / 2**30, "tokens": args.tokens, "max_memory": args.max_memory,
               "in_memory": in_memory, "offloaded": offloaded,
               "offloaded_over_in_memory_untraced": offloaded["untraced_seconds"] / in_memory["untraced_seconds"],
               "max_abs_logit_difference": difference}
    print(json.dumps(payload, indent=2))
    save("offload", payload)


if __name__ == "__main__":
    main()
