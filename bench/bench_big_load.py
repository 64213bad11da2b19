"""Loading a 1.1B model: ``python bench/bench_big_load.py [--repeats 2]``.

A TinyLlama-1.1B-shaped directory (22 layers, d = 2048, 32 query heads sharing 4 key/value heads,
d_ff = 5632, V = 32000; random weights written by transformers, float32, 4.1 GiB; built once in the temp
directory, nothing downloaded). Each load runs in a fresh process, ours and transformers' alternated:
``model.load_hf`` (checks every header, maps the file and copies each weight once into our layout while a
second thread hashes every byte for the model's identity) against
``AutoModelForCausalLM.from_pretrained`` — which maps the file and reads a weight only when it is first used,
so it is also timed with every weight read once. Reported: seconds and the process's peak resident memory
(ru_maxrss) over the weights' bytes (targets: time ≤ 1.2× from_pretrained's, peak ≤ 1.15× the weights).

Figures go to ``bench/results/big_load.json`` and docs/benchmarks.md, with the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, machine, median, save

LOADERS = {
    "load_hf": "from gpt_shape_tracer.model import load_hf; m, _ = load_hf(D)",
    # our GPT until its identity is known (the files' hash goes on on a second thread after the load returns)
    "load_hf, identity": "from gpt_shape_tracer.model import load_hf; m, _ = load_hf(D); m.identity",
    # transformers runs the model, our hook points in place: its load, plus the identity's hash of the files
    # (on a second thread) and the one-token check that every layer's attention is routed through ours
    "load_hf, transformers": "from gpt_shape_tracer.model import load_hf; "
                             "m, _ = load_hf(D, implementation='transformers')",
    # the same until its identity is known: what the first traced step waits for (the files' hash goes on
    # on a second thread after the load returns)
    "load_hf, transformers, identity": "from gpt_shape_tracer.model import load_hf; "
                                       "m, _ = load_hf(D, implementation='transformers');"
                                       " m.identity",
    "from_pretrained": "from transformers import AutoModelForCausalLM; m = AutoModelForCausalLM.from_pretrained(D)",
    # transformers maps the file and reads a weight when it is first used: the same load with every weight
    # read once (as a first forward would), to compare with a loader that reads and hashes every byte
    "from_pretrained, every weight read": "from transformers import AutoModelForCausalLM; "
                                          "m = AutoModelForCausalLM.from_pretrained(D); "
                                          "[float(p.detach().sum()) for p in m.parameters()]",
}
PROBE = """
import resource, sys, time
sys.path.insert(0, {root!r})
D = {directory!r}
import torch  # imported before the clock starts, for both
started = time.perf_counter()
{load}
seconds = time.perf_counter() - started
print(seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def tinyllama_dir() -> Path:
    target = Path(tempfile.gettempdir()) / "tinyllama-1.1b-random"
    if (target / "model.safetensors.index.json").exists() or (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(target)
    return target


def load_once(name: str, directory: Path) -> tuple[float, int]:
    code = PROBE.format(root=str(ROOT), directory=str(directory), load=LOADERS[name])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=1200)
    seconds, peak = out.stdout.split()[-2:]
    return float(seconds), int(peak)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    directory = tinyllama_dir()
    weights = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in LOADERS}
    for _ in range(args.repeats):
        for name in LOADERS:  # alternated, each in a fresh process
            runs[name].append(load_once(name, directory))
    result = {name: {"seconds": median([s for s, _ in r]), "peak_rss_gib": max(p for _, p in r) / 2**30,
                     "peak_over_weights": max(p for _, p in r) / weights, "runs": r} for name, r in runs.items()}
    result["weights_gib"] = weights / 2**30
    result["time_ratio"] = result["load_hf"]["seconds"] / result["from_pretrained"]["seconds"]
    result["time_ratio_every_weight_read"] = (result["load_hf"]["seconds"]
                                              / result["from_pretrained, every weight read"]["seconds"])
    result["time_ratio_transformers"] = (result["load_hf, transformers"]["seconds"]
                                         / result["from_pretrained, every weight read"]["seconds"])
    payload = {"machine": machine(), "directory": "TinyLlama-1.1B-shaped, random weights, float32", **result}
    print(json.dumps(payload, indent=2))
    save("big_load", payload)


if __name__ == "__main__":
    main()
