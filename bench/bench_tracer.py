"""Tracer overhead, side by side with the untraced model in one run: ``python bench/bench_tracer.py``.

GPT-2-small-shaped random weights (124M), CPU: a prefill of 128 tokens and 32
cached decode steps, timed untraced and traced at each capture level
(shapes / values / ops), interleaved. Reports traced / untraced per phase and
the bytes of values kept per decode step. Targets (issue 53's): decode shapes ≤ 1.05×,
values ≤ 1.08×; ops ≤ 2.0×. If TransformerLens or TorchLens can be imported, their
capture is timed against their own plain forward at n = 128 in the same run.

``paired``: the decode step again, each traced step beside an untraced one of the same position — two caches
filled by the same prompt, one set of weights, the two steps taken one after the other in alternating order — so that
drift in the machine's speed (other work on shared cores) falls on both of a pair alike. It reports the
median step of each side, the median of the per-pair ratios and the mean step of each side; whole runs alternated
(above) move by several per cent between runs on a shared machine, pairs by less. The untraced step of a pair is
taken on a twin of the model (the same weight tensors, its own modules) that no tracer ever taps: the model as it
is, with nothing installed on it.

``shapes/read`` is the shapes capture with each flagged record's NaN/∞ flag read to the host as it is recorded
(what the tracer did before it batched them): held until read and read together against it, in the same run, says
what that costs or saves on the CPU, where a read waits for nothing.

``--lengths 128,1024``: prefills only, at each length, untraced / shapes / values, each traced run twice — as the
tracer runs now (attention fused, its n × t stages derived and recomputed when read) and with
``attention_path("eager")`` (the stages materialised during the forward, what the tracer did below 64 Mi elements
before issue 53) — alternated in one process; the load average (``uptime``) is printed before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
from common import gpt2_small_dir, machine, median, save

import gpt_shape_tracer.tracer.storage._log as tracer_log
from gpt_shape_tracer.model import load_hf_gpt2
from gpt_shape_tracer.model.gpt import attention_path
from gpt_shape_tracer.session.memory import reuse_freed_memory
from gpt_shape_tracer.tracer import Tracer, hooks_installed
from gpt_shape_tracer.tracer.storage._stats import FLAG_LATER_ELEMENTS, finite_flag, flag_range

MODES = (None, "shapes", "shapes/read", "values", "ops")
READ_PER_RECORD = "shapes/read"  # the shapes capture, each flag read to the host as its record is added


@contextlib.contextmanager
def flags_read_per_record(on: bool):
    """Each flagged record's check read as it is recorded (one reduction and one host read each), instead of held
    until read and read together."""
    if on:
        tracer_log.FLAG_LATER_ELEMENTS = -1  # none held: every check taken as its record is added
        tracer_log.flag_range = finite_flag  # an int: the log stores it as it comes
    try:
        yield
    finally:
        tracer_log.FLAG_LATER_ELEMENTS, tracer_log.flag_range = FLAG_LATER_ELEMENTS, flag_range


def run_once(model, prompt, feed, mode):
    with flags_read_per_record(mode == READ_PER_RECORD):
        return _run_once(model, prompt, feed, "shapes" if mode == READ_PER_RECORD else mode)


def _run_once(model, prompt, feed, capture):
    tracer = Tracer(model, capture=capture, budget_bytes=8 * 2**30).install() if capture else None
    active = tracer.active if tracer else contextlib.nullcontext
    cache = model.new_cache(1)
    started = time.perf_counter()
    with active():
        model(prompt, cache)
    prefill = time.perf_counter() - started
    steps, kept = [], []
    for i in range(feed.size(1)):
        started = time.perf_counter()
        with active():
            model(feed[:, i : i + 1], cache)
        steps.append(time.perf_counter() - started)
        if tracer:
            kept.append(tracer.trace.bytes_kept)
    stats_seconds = 0.0
    if tracer and capture != "shapes":
        started = time.perf_counter()
        tracer.trace.to_frame(stats=True)  # statistics are computed lazily, here, not during the forward
        stats_seconds = time.perf_counter() - started
    if tracer:
        tracer.close()
    return prefill, steps, kept, stats_seconds


def plain_twin(model):
    """A second module tree over the same parameter and buffer tensors (one copy of the weights in memory): the
    untraced side of a pair, on which no tracer ever puts its taps. Made while none is on ``model`` either: a copy
    would carry its taps along, routing the twin's forwards to the model's tracer."""
    if hooks_installed(model):
        raise RuntimeError("a tracer is installed on the model: close it before making its twin")
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, shared)


def paired_decode(model, twin, prompt, feed, capture: str, rounds: int) -> dict:
    """Traced and untraced decode steps taken in pairs (``paired`` in the module's text): median step each side,
    the median per-pair ratio and the mean step each side (the periodic work — held NaN/∞ checks read together,
    Python's collections — that medians leave out), over ``rounds`` fresh tracers of ``feed.size(1)`` steps each.
    The untraced step is ``twin``'s (``plain_twin``): the same weights with no taps on its modules. The sixteenth
    stop's pairs took it on the traced model, whose taps — installed, none listening — cost a step too."""
    if any(a is not b for a, b in zip(model.parameters(), twin.parameters(), strict=True)):
        raise ValueError("the twin must hold the model's own parameter tensors")
    untraced, traced, pairs = [], [], []
    for r in range(rounds):
        tracer = Tracer(model, capture=capture, budget_bytes=8 * 2**30).install()
        plain_cache, traced_cache = twin.new_cache(1), model.new_cache(1)
        twin(prompt, plain_cache)
        with tracer.active():
            model(prompt, traced_cache)
        for i in range(feed.size(1)):
            token = feed[:, i : i + 1]
            took = {}
            for side in ((False, True) if (i + r) % 2 == 0 else (True, False)):
                started = time.perf_counter()
                if side:
                    with tracer.active():
                        model(token, traced_cache)
                else:
                    twin(token, plain_cache)
                took[side] = time.perf_counter() - started
            untraced.append(took[False])
            traced.append(took[True])
            pairs.append(took[True] / took[False])
        tracer.close()
    return {"median_step_ratio": round(median(traced) / median(untraced), 3),
            "median_pair_ratio": round(median(pairs), 3), "mean_step_ratio": round(sum(traced) / sum(untraced), 3),
            "pairs": len(pairs)}


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def prefill_ratios(model, lengths: list[int], repeats: int) -> dict:
    """Traced / untraced prefill at each length: shapes and values, derived (now) and eager (materialised)."""
    runs = {"untraced": (None, None), "shapes": ("shapes", None), "values": ("values", None),
            "shapes eager": ("shapes", "eager"), "values eager": ("values", "eager")}

    def once(tokens, capture, path) -> float:
        with attention_path(path) if path else contextlib.nullcontext():
            tracer = Tracer(model, capture=capture, budget_bytes=8 * 2**30).install() if capture else None
            started = time.perf_counter()
            with tracer.active() if tracer else contextlib.nullcontext():
                model(tokens)
            took = time.perf_counter() - started
            if tracer:
                tracer.close()
            return took

    out: dict = {"load_before": load_average()}
    for n in lengths:
        tokens = torch.randint(0, 50257, (1, n))
        once(tokens, None, None)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(repeats):
            order = list(runs.items()) if r % 2 == 0 else list(reversed(runs.items()))
            for name, (capture, path) in order:
                times[name].append(once(tokens, capture, path))
        base = median(times["untraced"])
        out[str(n)] = {"untraced_ms": round(base * 1000, 1),
                       **{name: round(median(v) / base, 3) for name, v in times.items() if name != "untraced"}}
    out["load_after"] = load_average()
    return out


def third_party(tokens: torch.Tensor, repeats: int) -> dict:
    out = {}
    try:
        import transformer_lens
    except ImportError as e:
        out["transformer_lens"] = f"not importable ({e.__class__.__name__})"
    else:
        try:
            from transformer_lens import HookedTransformer, HookedTransformerConfig  # TransformerLens < 4

            cfg = HookedTransformerConfig(n_layers=12, d_model=768, n_ctx=1024, d_head=64, n_heads=12,
                                          d_vocab=50257, act_fn="gelu_new", normalization_type="LN", device="cpu")
            tl = HookedTransformer(cfg).eval()
            label = "HookedTransformer"
        except ImportError:  # TransformerLens 4 wraps the Hugging Face model in a TransformerBridge
            from transformer_lens.model_bridge import TransformerBridge
            from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

            directory = gpt2_small_dir()
            hf = GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager").eval()
            tok = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
            tl = TransformerBridge.boot_transformers(str(directory), hf_model=hf, tokenizer=tok, device="cpu")
            label = "TransformerBridge"
        plain, cached = [], []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            tl(tokens)
            plain.append(time.perf_counter() - started)
            started = time.perf_counter()
            tl.run_with_cache(tokens)
            cached.append(time.perf_counter() - started)
        out["transformer_lens"] = f"{getattr(transformer_lens, '__version__', '')} {label}".strip()
        out["transformer_lens_run_with_cache_ratio"] = round(median(cached[1:]) / median(plain[1:]), 3)
    try:
        import torchlens
        from torchlens.options import CaptureOptions
    except ImportError as e:
        out["torchlens"] = f"not importable ({e.__class__.__name__})"
    else:
        model, _ = load_hf_gpt2(gpt2_small_dir())
        plain, logged = [], []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            model(tokens)
            plain.append(time.perf_counter() - started)
            started = time.perf_counter()
            torchlens.trace(model, tokens, capture=CaptureOptions(unwrap_when_done=True))  # saves every layer
            logged.append(time.perf_counter() - started)
        out["torchlens_full_capture_ratio"] = round(median(logged[1:]) / median(plain[1:]), 3)
        out["torchlens"] = getattr(torchlens, "__version__", "")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-third-party", action="store_true")
    ap.add_argument("--lengths", default="", help="comma-separated prefill lengths: only the prefill ratios there")
    ap.add_argument("--malloc", choices=("reuse", "default"), default="reuse",
                    help="reuse: freed memory kept for reuse, as the app runs (tracer.memory); default: glibc's own")
    args = ap.parse_args()
    took = reuse_freed_memory() if args.malloc == "reuse" else False
    torch.manual_seed(0)
    model, _ = load_hf_gpt2(gpt2_small_dir())
    if args.lengths:
        with torch.no_grad():
            found = prefill_ratios(model, [int(x) for x in args.lengths.split(",")], args.repeats)
        found["machine"] = machine()
        path = save("tracer_lengths", found)
        print(f"load average before {found['load_before']}, after {found['load_after']}")
        for n in args.lengths.split(","):
            print(f"n = {n}: {found[n]}")
        print(f"wrote {path}")
        return
    load_before = load_average()
    tokens = torch.randint(0, 50257, (1, args.prompt + args.steps))
    prompt, feed = tokens[:, : args.prompt], tokens[:, args.prompt :]
    times = {m: {"prefill": [], "decode": [], "decode_median_step": []} for m in MODES}
    kept_per_step: dict[str, list[int]] = {}
    stats_seconds: dict[str, float] = {}
    with torch.no_grad():
        run_once(model, prompt, feed, None)  # warm-up
        for r in range(args.repeats):
            order = MODES if r % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                prefill, steps, kept, stats = run_once(model, prompt, feed, mode)
                times[mode]["prefill"].append(prefill)
                times[mode]["decode"].append(sum(steps) / len(steps))
                times[mode]["decode_median_step"].append(median(steps))
                if mode:
                    kept_per_step[mode] = [b - a for a, b in zip(kept, kept[1:])]
                    stats_seconds[mode] = stats
        twin = plain_twin(model)
        paired = {c: paired_decode(model, twin, prompt, feed, c, args.repeats) for c in ("shapes", "values")}
        others = {} if args.skip_third_party else third_party(prompt, args.repeats)

    phases = ("prefill", "decode", "decode_median_step")
    base = {phase: median(times[None][phase]) for phase in phases}
    result = {
        "machine": machine(),
        "load_average": {"before": load_before, "after": load_average()},
        "setup": {"weights": "GPT-2 small shape, random, 124M (ours)", "prompt_tokens": args.prompt,
                  "decode_steps": args.steps, "repeats": args.repeats,
                  "malloc": "freed memory reused" if took else "glibc default",
                  "method": "each repeat runs prefill + decode steps untraced and at every capture level, in "
                            "alternating order, a fresh tracer per run; ratios of the medians over repeats. "
                            "decode = mean step of a run; decode_median_step = median step of a run"},
        "untraced_ms": {"prefill": round(base["prefill"] * 1000, 2),
                        "decode_per_step": round(base["decode"] * 1000, 2)},
        "ratio": {
            mode: {phase: round(median(times[mode][phase]) / base[phase], 3) for phase in phases}
            for mode in MODES[1:]
        },
        "bytes_kept_per_decode_step": {m: int(median(v)) if v else 0 for m, v in kept_per_step.items()},
        "lazy_stats_seconds_for_whole_trace": {m: round(s, 3) for m, s in stats_seconds.items()},
        "shapes_batched_over_read_per_record": {
            phase: round(median(times["shapes"][phase]) / median(times[READ_PER_RECORD][phase]), 3)
            for phase in phases},
        "decode_paired": paired,
        "third_party": others,
    }
    path = save("tracer", result)
    m = result["machine"]
    print(f"machine: {m['cpu']} ({m['cores']} cores, torch {m['torch']}, {m['torch_threads']} threads)")
    load = result["load_average"]
    print(f"load average (1, 5, 15 min) before {load['before']}, after {load['after']}")
    print(f"untraced: prefill {result['untraced_ms']['prefill']} ms, decode {result['untraced_ms']['decode_per_step']} "
          "ms/step")
    targets = {"shapes": 1.05, READ_PER_RECORD: 1.05, "values": 1.08, "ops": 2.0}
    for mode, ratios in result["ratio"].items():
        print(f"{mode:>7}: prefill ×{ratios['prefill']:.3f}  decode ×{ratios['decode']:.3f} (median step "
              f"×{ratios['decode_median_step']:.3f})  target ≤ {targets[mode]}  "
              f"bytes/decode step {result['bytes_kept_per_decode_step'].get(mode, 0):,}")
    for capture, found in paired.items():
        print(f"{capture:>7}: decode in pairs: median step ×{found['median_step_ratio']:.3f}, median pair "
              f"×{found['median_pair_ratio']:.3f}, mean step ×{found['mean_step_ratio']:.3f} ({found['pairs']} pairs)  "
              f"target ≤ {targets[capture]}")
    print(f"shapes, flags batched per step / read per record: {result['shapes_batched_over_read_per_record']}")
    print(f"lazy statistics for the whole trace: {result['lazy_stats_seconds_for_whole_trace']}")
    print(f"third party: {others}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
