"""BLT traced, side by side in one run: ``python bench/bench_blt.py [--bytes 64] [--repeats 9]``.

The sweep's tiny BLT (tests/hf_every_architecture.py: every list of layers 64 wide, 4 heads), random weights, saved
locally (no download). BLT runs without a cache (model/sources/_hf_stacks.py), so every step is a forward of the
whole text: one forward of ``--bytes`` bytes, timed interleaved in one process:

* ``hf eager`` — transformers' own eager forward without a cache, untraced: the reference;
* ``ours``     — the same weights loaded with ``load_hf`` (its ten attention calls through our function and hook
                 points, each eager with the mask it is given), untraced;
* ``shapes`` / ``values`` — the same under ``Tracer``.

Ratios are to ``hf eager``; the 1-minute load average before and after is printed and saved (other processes sharing
the cores slow every column alike, which the interleaving spreads). Writes ``bench/results/blt.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from common import ROOT, interleaved, machine, median, save

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.tracer import Tracer


def main() -> None:
    import sys
    import warnings

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from tests.hf_every_architecture import build

    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    directory = Path(tempfile.gettempdir()) / "bench-blt-tiny"
    if not (directory / "config.json").exists():
        build("blt", directory)
    ref = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32,
                                               attn_implementation="eager").eval()
    ours, _ = load_hf(directory)
    ids = torch.randint(0, 200, (1, args.bytes), generator=torch.Generator().manual_seed(1))
    tracers = {c: Tracer(ours, capture=c) for c in ("shapes", "values")}

    def forward(model, capture: str | None = None):
        def go() -> None:
            with torch.no_grad():
                if capture is None:
                    model(ids) if model is ours else model(input_ids=ids, use_cache=False)
                else:
                    with tracers[capture].active():
                        model(ids)
        return go

    load_before = os.getloadavg()
    times = interleaved({"hf eager": forward(ref), "ours": forward(ours), "shapes": forward(ours, "shapes"),
                         "values": forward(ours, "values")}, args.repeats)
    load_after = os.getloadavg()
    base = median(times["hf eager"])
    rows = {name: {"median_s": median(ts), "ratio": median(ts) / base} for name, ts in times.items()}
    for name, row in rows.items():
        print(f"{name:9s} {row['median_s'] * 1e3:8.1f} ms  ×{row['ratio']:.2f}")
    print(f"1-minute load average: {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    print(save("blt", {"machine": machine(), "bytes": args.bytes, "repeats": args.repeats, "rows": rows,
                       "load_average": {"before": load_before, "after": load_after}}))


if __name__ == "__main__":
    main()
