"""Where a traced decode step's time goes, part by part: ``python bench/bench_decode_parts.py [--steps 150]``.

GPT-2-small-shaped random weights (124M, ``common.gpt2_small_dir``), a 128-token prefill, then one decode step
repeated at the same length (``KVCache.crop`` back to 128 after each), so every step does the same work. Each
setting runs one step in turn, step after step, ``--steps`` times, and the median of each is compared with the step
without a tracer:

* ``none``: no tracer installed (the model as it is);
* ``inactive``: a tracer installed and none active on this thread — what the taps and hooks cost on their own;
* ``null``: a tracer active whose three entry points do nothing — the routing to a listener;
* ``norecord``: the tracer's own bookkeeping (steps, the module stack, a module's call counts) but no record
  added (a hook point's tensor or fused stage goes straight to the log, which counts its calls: left out too);
* ``noflags``: records added, the NaN/∞ checks left out;
* ``shapes``: ``Tracer(capture="shapes")`` as it is.

Values are left out here: a step written again at the same position rewrites the KV cache's rows that the previous
step's kept values view, which a values trace must then copy — work a growing decode never does
(``bench/bench_tracer.py`` measures values on a growing cache). Then, with Python's cyclic collector off for one
decode step of a growing cache, how many objects each capture leaves it to walk (``gc.get_count``): what makes
young collections come, every 700. Prints the medians and the counts with the load average; writes
``bench/results/decode_parts.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import time

import torch
from common import gpt2_small_dir, machine, save

from gpt_shape_tracer.model import load_hf_gpt2
from gpt_shape_tracer.session.memory import reuse_freed_memory
from gpt_shape_tracer.tracer import Tracer

SETTINGS = ("none", "inactive", "null", "norecord", "noflags", "shapes")
PROMPT = 128


def _nothing(*_args) -> None:
    return None


def tracers(model) -> dict[str, Tracer]:
    """The tracers of the settings that have one, installed (each its own trace), and changed as the setting says."""
    made = {}
    for setting in SETTINGS[2:]:
        tr = Tracer(model, capture="shapes", budget_bytes=8 * 2**30).install()
        if setting == "null":
            tr.on_enter = tr.on_exit = tr.on_hook_point = _nothing  # type: ignore[method-assign]
            tr.record_hook = tr.record_derived = tr.record_derived_each = _nothing
        elif setting == "norecord":
            tr._record = _nothing  # noqa: SLF001 - the bench takes the record out to time the rest
            # a hook point's value and a fused layer's stages go straight to the log
            tr.record_hook = tr.record_derived = tr.record_derived_each = _nothing
        made[setting] = tr
    _no_flags(made["noflags"])
    return made


def _no_flags(tr: Tracer) -> None:
    """The tracer's log told that no module's tensors are NaN/∞-checked (installing tells it again)."""
    tr.trace.log.set_modules(tr.trace.log.modules, flagged=())


def step_times(model, steps: int) -> dict[str, list[float]]:
    tokens = torch.randint(0, model.config.vocab_size, (1, PROMPT + 1))
    made = tracers(model)
    took: dict[str, list[float]] = {s: [] for s in SETTINGS}
    cache = model.new_cache(1)
    model(tokens[:, :PROMPT], cache)
    for i in range(steps + 10):
        for setting in SETTINGS:
            if setting == "none":  # every tracer's claim taken off the model, put back after
                for tr in made.values():
                    tr.close()
            tr = made.get(setting)
            active = tr.active() if tr is not None else contextlib.nullcontext()
            started = time.perf_counter()
            with active:
                model(tokens[:, PROMPT:], cache)
            if i >= 10:  # the first steps warm every path
                took[setting].append(time.perf_counter() - started)
            cache.crop(PROMPT)
            if setting == "none":
                for tr in made.values():
                    tr.install()
                _no_flags(made["noflags"])
    for tr in made.values():
        tr.close()
    return took


def objects_left(model) -> dict[str, int]:
    """Objects a decode step leaves Python's cyclic collector (net new tracked objects), per capture."""
    tokens = torch.randint(0, model.config.vocab_size, (1, PROMPT + 2))
    out = {}
    for capture in (None, "shapes", "values"):
        tr = Tracer(model, capture=capture, budget_bytes=8 * 2**30).install() if capture else None
        active = tr.active if tr is not None else contextlib.nullcontext
        cache = model.new_cache(1)
        with active():
            model(tokens[:, :PROMPT], cache)
        with active():
            model(tokens[:, PROMPT : PROMPT + 1], cache)
        gc.collect()
        gc.disable()
        try:
            before = gc.get_count()[0]
            with active():
                model(tokens[:, PROMPT + 1 :], cache)
            out[capture or "untraced"] = gc.get_count()[0] - before
        finally:
            gc.enable()
        if tr is not None:
            tr.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    reuse_freed_memory()
    torch.manual_seed(0)
    model, _ = load_hf_gpt2(gpt2_small_dir())
    load_before = os.getloadavg()
    with torch.no_grad():
        took = step_times(model, args.steps)
        left = objects_left(model)
    load_after = os.getloadavg()
    base = statistics.median(took["none"])
    medians = {s: round(statistics.median(xs) * 1e3, 3) for s, xs in took.items()}
    print(f"machine: {machine()['cpu']}; load {load_before[0]:.1f} → {load_after[0]:.1f}; one decode step at "
          f"t = {PROMPT + 1}, {args.steps} times each, medians:")
    for s in SETTINGS:
        print(f"  {s:<9} {medians[s]:7.3f} ms  +{medians[s] - base * 1e3:6.3f} ms  ×{medians[s] / (base * 1e3):.3f}")
    print(f"objects left to the cyclic collector by one decode step: {left}")
    path = save("decode_parts", {"machine": machine(), "steps": args.steps, "load": [load_before, load_after],
                                 "median_ms": medians, "objects_left_per_step": left})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
