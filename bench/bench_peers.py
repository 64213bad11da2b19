"""Ours beside the peers, each against its own untraced forward in one process:
``/work/peers-venv/bin/python bench/bench_peers.py [--tokens 128 1024] [--repeats 5] [--decode-steps 8]``.

GPT-2-small shape (124M, random weights), CPU, float32, batch 1, one process. For each length and each model
source — built in Python, and loaded from a directory (``common.gpt2_small_dir``) — every case below runs
``--repeats`` times after one warm-up, all cases of a (source, length) alternating in order
(``common.interleaved``); each ratio is the median of the case over the median of its own untraced forward
from the same loop:

- ours: ``Tracer`` at capture "shapes", "values", "ops" (a new tracer per call, 8 GiB budget: nothing summarised)
  on our GPT, against our GPT untraced;
- plain forward hooks on every module of transformers' ``GPT2LMHeadModel`` (each output kept by reference), against
  that model untraced;
- nnsight (``NNsight`` around the same model): every module's output saved, and the 12 blocks' outputs saved;
- TransformerLens: ``TransformerBridge`` (TransformerLens 4 has no ``HookedTransformer``) around the same weights,
  ``run_with_cache`` against the bridge's own forward;
- TorchLens: ``torchlens.trace`` (every layer saved) of the same model, against it untraced.

Decode (``--decode-steps`` cached steps after an untimed, untraced prefill of the same length) where a peer can
step a KV cache through its API: ours, plain hooks, nnsight (``past_key_values`` passed through ``trace``).
TransformerLens' ``run_with_cache`` and ``torchlens.trace`` are timed on the whole sequence only.

The peers are a bench-only extra (``bench/requirements-peers.txt``), installed in a virtual environment of their own
that sees the system's torch and transformers (docs/benchmarks.md says how); a peer that does not import is said
as such and skipped. Writes ``bench/results/peers.json`` (``--name``: another name).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import os
from collections.abc import Callable

import torch
from common import gpt2_small_dir, interleaved, machine, median, save

from gpt_shape_tracer.model import GPT, GPTConfig, load_hf_gpt2
from gpt_shape_tracer.tracer import Tracer

CAPTURES = ("shapes", "values", "ops")
BUDGET = 8 * 2**30  # nothing summarised at 1,024 tokens: every value kept, as the peers keep theirs
PEERS = ("nnsight", "transformer_lens", "torchlens")


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def importable(name: str) -> str:
    """'' when the peer imports; else why not (the bench then skips it)."""
    try:
        __import__(name)
    except Exception as e:  # noqa: BLE001 - any failure to import is reported, not raised
        return f"{type(e).__name__}: {e}"
    return ""


def hf_models(source: str):
    """transformers' GPT-2 with the same weights as ours: sdpa attention (transformers' default) for hooks, nnsight
    and TorchLens; eager for TransformerLens (its bridge hooks the attention pattern, which sdpa never forms)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    directory = gpt2_small_dir()
    if source == "directory":
        sdpa = GPT2LMHeadModel.from_pretrained(directory).eval()
        eager = GPT2LMHeadModel.from_pretrained(directory, attn_implementation="eager").eval()
    else:
        config = GPT2Config.from_pretrained(directory)
        torch.manual_seed(0)
        sdpa = GPT2LMHeadModel(config).eval()
        config = GPT2Config.from_pretrained(directory, attn_implementation="eager")
        eager = GPT2LMHeadModel(config).eval()
        eager.load_state_dict(sdpa.state_dict())
    return sdpa, eager


def our_model(source: str) -> GPT:
    loaded, _ = load_hf_gpt2(gpt2_small_dir())
    if source == "directory":
        return loaded
    torch.manual_seed(0)
    return GPT(GPTConfig(**loaded.config.to_dict())).eval()  # the same shape, built in Python


def completion_order(model: torch.nn.Module, tokens: torch.Tensor) -> list[str]:
    """Every module's name in the order its forward returns (nnsight reads outputs in the order they are made)."""
    order: list[str] = []
    handles = [m.register_forward_hook(lambda *_, n=n: order.append(n)) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for h in handles:
            h.remove()
    return order


@contextlib.contextmanager
def every_module_hooked(model: torch.nn.Module):
    """Plain forward hooks on every module, each output kept by reference (what a hand-written cache does)."""
    kept: dict[str, object] = {}

    def hook(name: str):
        return lambda _m, _i, out: kept.__setitem__(name, out)

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()


def envoy(root, name: str):
    for part in name.split(".") if name else ():
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def nnsight_every(nn_model, order: list[str], tokens: torch.Tensor, **kwargs) -> None:
    import nnsight

    with nn_model.trace(tokens, **kwargs):
        saved = nnsight.save([envoy(nn_model, name).output for name in order])
    del saved


def nnsight_blocks(nn_model, tokens: torch.Tensor, **kwargs) -> None:
    import nnsight

    with nn_model.trace(tokens, **kwargs):
        saved = nnsight.save([nn_model.transformer.h[i].output for i in range(12)])
    del saved


def prefill_cases(source: str, tokens: torch.Tensor, missing: dict[str, str]) -> dict[str, Callable[[], None]]:
    """Every case on the whole sequence; the references are ``<family>/untraced``."""
    ours = our_model(source)
    sdpa, eager = hf_models(source)
    cases: dict[str, Callable[[], None]] = {"ours/untraced": lambda: ours(tokens)}
    for capture in CAPTURES:
        def traced(capture: str = capture) -> None:
            with Tracer(ours, capture=capture, budget_bytes=BUDGET):
                ours(tokens)
        cases[f"ours/{capture}"] = traced

    def hooked() -> None:
        with every_module_hooked(sdpa):
            sdpa(tokens)

    cases["hf/untraced"] = lambda: sdpa(tokens)
    cases["hf/hooks every module"] = hooked
    if not missing.get("nnsight"):
        from nnsight import NNsight

        nn_model = NNsight(sdpa)
        order = completion_order(sdpa, tokens[:, :8])
        cases["hf/nnsight every module"] = lambda: nnsight_every(nn_model, order, tokens)
        cases["hf/nnsight 12 blocks"] = lambda: nnsight_blocks(nn_model, tokens)
    if not missing.get("torchlens"):
        import torchlens
        from torchlens.options import CaptureOptions

        cases["hf/torchlens every layer"] = lambda: torchlens.trace(
            sdpa, tokens, capture=CaptureOptions(unwrap_when_done=True))
    if not missing.get("transformer_lens"):
        from transformer_lens.model_bridge import TransformerBridge
        from transformers import PreTrainedTokenizerFast

        directory = gpt2_small_dir()
        tok = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
        bridge = TransformerBridge.boot_transformers(str(directory), hf_model=eager, tokenizer=tok, device="cpu")
        cases["transformer_lens/untraced"] = lambda: bridge(tokens)
        cases["transformer_lens/run_with_cache"] = lambda: bridge.run_with_cache(tokens)
    return cases


def decode_cases(source: str, tokens: torch.Tensor, steps: int, missing: dict[str, str]
                 ) -> tuple[dict[str, Callable[[], None]], dict[str, list[float]]]:
    """``steps`` cached decode steps after an untimed prefill of ``tokens``; each case times its steps only (the
    prefill is redone, untraced, before every repeat: a cache grows in place), into the second dict returned."""
    from transformers import DynamicCache

    ours = our_model(source)
    sdpa, _ = hf_models(source)
    feed = torch.randint(0, 50257, (1, steps))
    timed: dict[str, list[float]] = {}  # filled by each case: the steps' own time, without the prefill

    def our_steps(capture: str | None):
        def run() -> None:
            cache = ours.new_cache(1)
            ours(tokens, cache)
            tracer = Tracer(ours, capture=capture, budget_bytes=BUDGET).install() if capture else None
            active = tracer.active if tracer else contextlib.nullcontext
            took = 0.0
            for i in range(steps):
                with _Clock() as clock, active():
                    ours(feed[:, i: i + 1], cache)
                took += clock.seconds
            if tracer:
                tracer.close()
            timed.setdefault(f"ours/{capture or 'untraced'}", []).append(took)
        return run

    def hf_steps(label: str, step: Callable[[torch.Tensor, object], None]):
        def run() -> None:
            cache = DynamicCache(config=sdpa.config)
            sdpa(tokens, past_key_values=cache, use_cache=True)
            took = 0.0
            for i in range(steps):
                with _Clock() as clock:
                    step(feed[:, i: i + 1], cache)
                took += clock.seconds
            timed.setdefault(label, []).append(took)
        return run

    def hooked(token: torch.Tensor, cache: object) -> None:
        with every_module_hooked(sdpa):
            sdpa(token, past_key_values=cache, use_cache=True)

    cases = {f"ours/{c or 'untraced'}": our_steps(c) for c in (None, *CAPTURES)}
    cases["hf/untraced"] = hf_steps("hf/untraced", lambda t, c: sdpa(t, past_key_values=c, use_cache=True))
    cases["hf/hooks every module"] = hf_steps("hf/hooks every module", hooked)
    if not missing.get("nnsight"):
        from nnsight import NNsight

        nn_model = NNsight(sdpa)
        order = completion_order(sdpa, tokens[:, :8])
        cases["hf/nnsight every module"] = hf_steps(
            "hf/nnsight every module", lambda t, c: nnsight_every(nn_model, order, t, past_key_values=c,
                                                                 use_cache=True))
        cases["hf/nnsight 12 blocks"] = hf_steps(
            "hf/nnsight 12 blocks", lambda t, c: nnsight_blocks(nn_model, t, past_key_values=c, use_cache=True))
    return cases, timed


class _Clock:
    def __enter__(self) -> _Clock:
        import time

        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        import time

        self.seconds = time.perf_counter() - self.started


def ratios(times: dict[str, list[float]]) -> dict[str, float]:
    """Each case's median over its own family's untraced median (transformers' model for hooks, nnsight,
    TorchLens; the bridge's own forward for TransformerLens)."""
    out = {}
    for name, samples in times.items():
        family = name.split("/", 1)[0]
        base = times.get(f"{family}/untraced")
        if base and not name.endswith("/untraced"):
            out[name] = round(median(samples) / median(base), 3)
    return out


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


N_CTX = 1024  # GPT-2 small's positions: a prefill and its decode steps fit in them


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--sources", nargs="+", default=["python", "directory"], choices=["python", "directory"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=8, help="0: no decode cases")
    ap.add_argument("--name", default="peers", help="bench/results/NAME.json")
    ap.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default); on a crowded machine "
                                                           "one thread is steadier than two that wait on each other")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    missing = {name: importable(name) for name in PEERS}
    for name, why in missing.items():
        if why:
            print(f"{name} is not importable, skipped: {why}")
    result: dict = {
        "machine": machine(),
        "versions": {name: version(name) for name in ("torch", "transformers", "transformer-lens", "nnsight",
                                                      "torchlens")},
        "setup": {"model": "GPT-2 small shape, 124M, random weights, float32, CPU, batch 1",
                  "repeats": args.repeats, "decode_steps": args.decode_steps, "threads": torch.get_num_threads(),
                  "method": "all cases of a (source, length) alternate in order after one warm-up each; ratio = "
                            "median of the case / median of its own untraced forward from the same loop"},
        "runs": [],
    }
    print(f"machine: {result['machine']['cpu']} ({result['machine']['cores']} cores, "
          f"{result['machine']['torch_threads']} torch threads); versions {result['versions']}")
    with torch.no_grad():
        for n in args.tokens:
            for source in args.sources:
                torch.manual_seed(0)
                tokens = torch.randint(0, 50257, (1, n))
                before = load()
                times = interleaved(prefill_cases(source, tokens, missing), args.repeats)
                gc.collect()
                run = {"tokens": n, "source": source, "phase": "prefill", "load_before": before, "load_after": load(),
                       "seconds": times, "ratio": ratios(times),
                       "untraced_ms": {k: round(median(v) * 1000, 1) for k, v in times.items()
                                       if k.endswith("/untraced")}}
                result["runs"].append(run)
                report(run)
                save(args.name, result)
                if args.decode_steps and n + args.decode_steps > N_CTX:
                    print(f"{n} tokens: no decode cases ({n} + {args.decode_steps} steps is past GPT-2's {N_CTX} "
                          "positions)")
                elif args.decode_steps:
                    before = load()
                    cases, timed = decode_cases(source, tokens, args.decode_steps, missing)
                    interleaved(cases, args.repeats)
                    steps = {k: v[1:] for k, v in timed.items()}  # the warm-up's sample dropped
                    gc.collect()
                    run = {"tokens": n, "source": source, "phase": f"decode {args.decode_steps} steps",
                           "load_before": before, "load_after": load(), "seconds": steps, "ratio": ratios(steps),
                           "untraced_ms": {k: round(median(v) * 1000 / args.decode_steps, 1)
                                           for k, v in steps.items() if k.endswith("/untraced")}}
                    result["runs"].append(run)
                    report(run)
                    save(args.name, result)
    print(f"wrote {save(args.name, result)}")


def report(run: dict) -> None:
    print(f"\n{run['tokens']} tokens, model {run['source']}, {run['phase']} (load {run['load_before']} → "
          f"{run['load_after']}); untraced {run['untraced_ms']} ms" + (" per step" if "decode" in run["phase"] else ""))
    for name, ratio in run["ratio"].items():
        print(f"  {name:<34} ×{ratio:.2f}")


if __name__ == "__main__":
    main()
