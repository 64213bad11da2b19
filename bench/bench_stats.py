"""A record's statistics, one pass against PyTorch's: ``python bench/bench_stats.py [--repeats 12]``.

The tensors a long prefill evicts: an attention stage of GPT-2 small at 984 tokens, [1, 12, 984, 984] float32
(46 MB), clean and with a causal mask's −∞ above the diagonal. Six of each are rotated through, so each
timing reads memory another tensor's pass has not just warmed. Side by side, alternating: the one-pass kernel
(``tracer/storage/_fused.py``), the PyTorch reductions ``tracer/storage/_stats.py`` uses without it, and a bare
``torch.aminmax`` (one pass that computes next to nothing: the floor). Milliseconds, median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import machine, save

from gpt_shape_tracer.tracer.storage import _fused as fused
from gpt_shape_tracer.tracer.storage import _stats as stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    torch.manual_seed(0)
    n = 984
    clean = [torch.randn(1, 12, n, n) * 4 + 0.5 for _ in range(6)]
    mask = torch.full((n, n), float("-inf")).triu(1)
    masked = [t + mask for t in clean]
    fused_numel = stats.FUSED_NUMEL

    def one_pass(t: torch.Tensor) -> None:
        stats.FUSED_NUMEL = fused_numel
        stats.tensor_stats(t)

    def pytorch(t: torch.Tensor) -> None:
        stats.FUSED_NUMEL = 2**62  # the fused kernel is never asked
        stats.tensor_stats(t)

    ways = {"one pass (fused kernel)": one_pass, "PyTorch reductions": pytorch,
            "bare aminmax (the floor)": torch.aminmax}
    out: dict = {"machine": machine(), "kernel": fused.status(), "ms": {}}
    for label, tensors in (("clean", clean), ("masked", masked)):
        times: dict[str, list[float]] = {w: [] for w in ways}
        for r in range(args.repeats + 1):
            for w in (list(ways) if r % 2 == 0 else list(reversed(ways))):
                t = tensors[(r * len(ways) + list(ways).index(w)) % len(tensors)]
                started = time.perf_counter()
                ways[w](t)
                if r:  # the first round warms up
                    times[w].append(time.perf_counter() - started)
        stats.FUSED_NUMEL = fused_numel
        out["ms"][label] = {w: round(statistics.median(v) * 1000, 2) for w, v in times.items()}
        print(f"{label:>6} [1, 12, {n}, {n}] f32: " + "   ".join(f"{w} {ms:.2f} ms"
                                                               for w, ms in out["ms"][label].items()))
    print(f"kernel: {out['kernel']}")
    print(f"wrote {save('stats', out)}")


if __name__ == "__main__":
    main()
