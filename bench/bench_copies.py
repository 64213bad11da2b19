"""The values capture's copies to the host, waited for once per step against once per record:
``python bench/bench_copies.py [--device cuda] [--copy all]``.

A traced, sampled generation (TracedGeneration, capture="values": a prefill, then cached decode steps) in two ways,
interleaved within every repeat, beside the untraced model generating the same way (a cached decode loop that draws
each token where the logits are and reads it on the host):

* ``per step`` (now): each kept value's copy is started as its record is added (on CUDA ``non_blocking`` into pinned
  memory) and the step waits once for all of them (``tracer/storage/_host.py``);
* ``per record`` (the tracer before): ``start_host_copy`` swapped back to the blocking copy of each value as it is
  recorded (``value.to("cpu")`` off the CPU, ``clone()`` on it) — on a GPU one wait for the device per record.

On the CPU a value is the model's own tensor unless ``--copy all`` (or an inference-mode tensor) asks for a copy,
and a wait has nothing to wait for: there this measures what the bookkeeping costs the CPU path (expected: nothing
measurable). On a GPU (``--device cuda``) every kept value is copied, and this is the before/after of the change.
Timed with ``time.process_time`` on the CPU (what the step computed, less exposed than the wall clock to the other
processes of a shared machine), with ``time.perf_counter`` and ``torch.cuda.synchronize`` on CUDA; ratios of the
medians. ``--model gpt2-small``: GPT-2 small's shape with random weights built in Python (V = 50,257; on the CPU a
step takes a while); default: the bundled story-gpt.

``--sampling-only``: what a step does around its draw, now (whether each row can give a token, checked where the
logits are and read back once; the record's numbers read back together) and before (the logits copied to the host,
a check and a probability read per row: the previous revision's code, kept here), for 1 and 4 rows of GPT-2's
vocabulary, interleaved, the minimum of 300 each — the least disturbed run on a shared machine. The draw itself
(``sample``) is the same function either way, on the host before and where the logits are now: on the CPU the same
work on the same tensor, so it is left out (its milliseconds would only add the machine's noise).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
from common import machine, median, save

import gpt_shape_tracer.tracer.storage._log as tracer_log
from gpt_shape_tracer.model import GPT, GPTConfig, SamplingConfig, load_bundled, sample
from gpt_shape_tracer.tracer import TracedGeneration
from gpt_shape_tracer.tracer.generation._traced import _choosable
from gpt_shape_tracer.tracer.storage._host import on_host

MODES = ("untraced", "per step", "per record")
START = tracer_log.start_host_copy  # the copy the log starts per kept value (now: waited for once per step)
PROMPT = "Once upon a time, Lily had a red ball. She liked to play with it in the park every day. " * 2


def blocking_copy(t: torch.Tensor) -> torch.Tensor:
    """The tracer before: the kept value copied to the host as it is recorded, the copy finished on return."""
    return t.clone() if t.is_cpu else t.to("cpu")


@contextlib.contextmanager
def copies(mode: str):
    if mode == "per record":
        tracer_log.start_host_copy = blocking_copy
    try:
        yield
    finally:
        tracer_log.start_host_copy = START



def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def untraced(model, ids: torch.Tensor, steps: int, sampling: SamplingConfig) -> tuple[float, list[float]]:
    device = ids.device
    generator = sampling.generator(device)
    with torch.no_grad():
        cache = model.new_cache(ids.size(0))
        started = clock(device)
        logits = model(ids, cache)
        token = sample(logits[:, -1], sampling, generator).token
        token.tolist()
        prefill = clock(device) - started
        each = []
        for _ in range(steps):
            started = clock(device)
            logits = model(token[:, None], cache)
            token = sample(logits[:, -1], sampling, generator).token
            token.tolist()  # the chosen token read on the host, as a generation does
            each.append(clock(device) - started)
    return prefill, each


def traced(model, tok, steps: int, sampling: SamplingConfig, mode: str, copy: str,
           device: torch.device) -> tuple[float, list[float], int]:
    gen = TracedGeneration(model, tok, [PROMPT], sampling=sampling, capture="values", copy=copy, stop_at_eos=False,
                           budget_bytes=8 * 2**30)
    with copies(mode):
        started = clock(device)
        gen.step()
        prefill = clock(device) - started
        each = []
        for _ in range(steps):
            started = clock(device)
            gen.step()
            each.append(clock(device) - started)
    kept = len(gen.trace.filter(step=1))
    gen.tracer.close()
    return prefill, each, kept


def _choosable_before(logits: torch.Tensor) -> bool:
    """The previous revision's check, one row at a time on the host."""
    return not bool(torch.isnan(logits).any() or torch.isposinf(logits).any() or torch.isneginf(logits).all())


def around_before(rows: torch.Tensor, res) -> tuple:
    """The previous revision: the logits to the host, checked row by row, the record's numbers read one by one."""
    host_rows = rows.detach().float().cpu()
    bad = [r for r in range(host_rows.size(0)) if not _choosable_before(host_rows[r])]
    return (bad, res.token.tolist(), [round(float(p), 6) for p in res.token_prob], res.candidates.tolist(),
            res.stage_probs.tolist(), res.kept.tolist())


def around_now(rows: torch.Tensor, res) -> tuple:
    bad = [r for r, ok in enumerate(_choosable(rows).tolist()) if not ok]
    tokens, probs, candidates, stage_probs, kept = (t.tolist() for t in on_host(
        (res.token, res.token_prob, res.candidates, res.stage_probs, res.kept)))
    return bad, tokens, [round(float(p), 6) for p in probs], candidates, stage_probs, kept


def sampling_alone(device: torch.device, repeats: int = 300) -> dict[str, dict[str, float]]:
    """µs around one draw from ``rows`` [B, 50257], before and now, minimum of ``repeats`` (interleaved)."""
    sampling = SamplingConfig(temperature=0.9, top_k=40, seed=7)
    out = {}
    for batch in (1, 4):
        rows = torch.randn(batch, 50257, generator=torch.Generator().manual_seed(0)).to(device)
        res = sample(rows, sampling, sampling.generator(device))
        if device.type == "cpu":  # the same draw on the host before (the CPU's generator): the same record
            before = sample(rows.cpu(), sampling, torch.Generator().manual_seed(7))
            assert around_before(rows, before) == around_now(rows, res)
        took: dict[str, list[float]] = {"before": [], "now": []}
        for r in range(repeats):
            for mode in ("before", "now") if r % 2 == 0 else ("now", "before"):
                started = clock(device)
                (around_before if mode == "before" else around_now)(rows, res)
                took[mode].append(clock(device) - started)
        out[f"[{batch}, 50257]"] = {m: round(min(t) * 1e6, 1) for m, t in took.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", choices=("story-gpt", "gpt2-small"), default="story-gpt")
    ap.add_argument("--copy", choices=("auto", "all"), default="auto")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--sampling-only", action="store_true")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.sampling_only:
        load_before = os.getloadavg()
        alone = sampling_alone(device)
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()["cpu"]
        path = save(f"sampling-{device.type}", {"machine": machine(), "device": where, "us_min_of_300": alone,
                                                 "load_average": {"before": load_before, "after": os.getloadavg()}})
        print(f"device: {where}; load average before {load_before}, after {os.getloadavg()}")
        print(f"µs around one draw, minimum of 300: {alone}\nwrote {path}")
        return
    model, tok = load_bundled("story-gpt")
    if args.model == "gpt2-small":
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=50257, n_ctx=1024, d_model=768, n_layer=12, n_head=12)).eval()
    model = model.to(device)
    sampling = SamplingConfig(temperature=0.9, top_k=40, seed=7)
    ids = torch.tensor([tok.encode(PROMPT)], device=device)
    prefills: dict[str, list[float]] = {m: [] for m in MODES}
    steps: dict[str, list[float]] = {m: [] for m in MODES}
    kept = 0
    load_before = os.getloadavg()
    traced(model, tok, 2, sampling, "per step", args.copy, device)  # warm-up
    untraced(model, ids, 2, sampling)
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else tuple(reversed(MODES)):
            if mode == "untraced":
                prefill, each = untraced(model, ids, args.steps, sampling)
            else:
                prefill, each, kept = traced(model, tok, args.steps, sampling, mode, args.copy, device)
            prefills[mode].append(prefill)
            steps[mode] += each
    base = {"prefill": median(prefills["untraced"]), "decode_step": median(steps["untraced"])}
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()["cpu"]
    result = {
        "machine": machine(), "device": where, "load_average": {"before": load_before, "after": os.getloadavg()},
        "setup": {"model": args.model, "prompt_tokens": ids.size(1), "decode_steps": args.steps,
                  "repeats": args.repeats, "copy": args.copy, "records_kept_per_decode_step": kept,
                  "clock": "perf_counter, synchronised" if device.type == "cuda" else "time.process_time"},
        "untraced_ms": {k: round(v * 1000, 3) for k, v in base.items()},
        "ratio_to_untraced": {m: {"prefill": round(median(prefills[m]) / base["prefill"], 3),
                                  "decode_step": round(median(steps[m]) / base["decode_step"], 3)}
                              for m in MODES[1:]},
        "per_step_over_per_record": {
            "prefill": round(median(prefills["per step"]) / median(prefills["per record"]), 3),
            "decode_step": round(median(steps["per step"]) / median(steps["per record"]), 3)},
    }
    path = save(f"copies-{device.type}-{args.model}-{args.copy}", result)
    print(f"device: {where}; load average before {load_before}, after {result['load_average']['after']}")
    print(f"setup: {result['setup']}")
    print(f"untraced: {result['untraced_ms']} ms")
    for mode, ratio in result["ratio_to_untraced"].items():
        print(f"{mode:>11}: prefill ×{ratio['prefill']:.3f}  decode step ×{ratio['decode_step']:.3f}")
    print(f"per step / per record: {result['per_step_over_per_record']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
