"""Building the figures with and without plotly's per-property checks: ``python bench/bench_figures.py``.

The app builds figures unchecked (``figures/plot.py``); this times each builder of a Step's tabs both ways,
alternating, on a 3-step trace of the bundled model, and prints the milliseconds and the ratio.
"""

from __future__ import annotations

import os
import statistics
import time

from common import machine, save

from figures import attention, cache, flow, mask, tokens
from figures.plot import VALIDATE_ENV
from model import load_bundled
from tracer.generation import TracedGeneration


def main(repeats: int = 7) -> None:
    model, tok = load_bundled()
    gen = TracedGeneration(model, tok, "Tom had a big red kite. One day, Tom went to the park.")
    gen.run(3)
    trace, step = gen.trace, 2
    builders = {
        "shape flow (Shapes)": lambda: flow.shape_flow_figure(trace, step, 0),
        "reshape strip (Shapes)": lambda: flow.reshape_figure(trace, step, 0),
        "attention stages (Attention)": lambda: attention.attention_stages_figure(trace, step, 0, 0),
        "all heads (Attention)": lambda: attention.all_heads_figure(trace, step).figure,
        "cache growth (KV cache)": lambda: cache.cache_growth_figure(trace, step),
        "keys (KV cache)": lambda: cache.key_heatmap_figure(trace, step, 0, 0),
        "mask (Causal mask)": lambda: mask.mask_figure(trace, 0, 0),
        "next token (Next token)": lambda: tokens.next_token_figure(trace, step),
    }
    out = {}
    for name, build in builders.items():
        times: dict[str, list[float]] = {"checked": [], "unchecked": []}
        for _ in range(repeats):
            for mode, flag in (("checked", "1"), ("unchecked", "0")):
                os.environ[VALIDATE_ENV] = flag
                started = time.perf_counter()
                build()
                times[mode].append(time.perf_counter() - started)
        checked, unchecked = (statistics.median(times[m]) for m in ("checked", "unchecked"))
        out[name] = {"checked_s": checked, "unchecked_s": unchecked}
        print(f"{name:<32} checked {checked * 1000:6.1f} ms   unchecked {unchecked * 1000:6.1f} ms   "
              f"×{unchecked / checked:.2f}")
    print(f"wrote {save('figures', {'machine': machine(), 'figures': out})}")


if __name__ == "__main__":
    main()
