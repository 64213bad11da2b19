"""Every path on a CUDA device, then the tracing overhead there: ``python bench/bench_gpu.py [--out DIR]``.

Part 1 (checks): a model on the GPU is generated (greedy and sampled, a padded batch, cache on and off),
traced at every capture level, compared with its recompute, intervened on (ablate, patch), read through the
logit lens, differentiated (one head's gradients, ∂L/∂x at every hook point), run with a cheaper cache,
diffed, saved and loaded back, in float32 and bfloat16; a transformers-run decoder likewise. Each check
prints OK or its traceback; the greedy tokens are compared with the CPU's.

Part 2 (bench): our GPT at GPT-2 small's shape and at a 1.1B Llama shape (TinyLlama's widths), random
weights built in Python, on the GPU: the untraced forward, the same forward with a no-op forward hook on
every module ("plain hooks", what TorchLens' minimal mode costs), and shapes / values capture, at 128 and
2,048 tokens — values twice: as the tracer copies them now (each copy queued ``non_blocking`` into pinned memory as
its record is added, one wait per step) and as it did before (a blocking copy per record, swapped back in); and one
decode step with the cache. Median of 5 after 2 warm-ups, synchronised.

The per-step copies in finer detail (a sampled generation, decode steps, now against before in one process):
``python bench/bench_copies.py --device cuda --model gpt2-small``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpt_shape_tracer.model import GPT, GPTConfig, load_bundled  # noqa: E402
from gpt_shape_tracer.tracer import (  # noqa: E402
    TracedGeneration,
    Tracer,
    ablate,
    attention_gradients,
    cache_precision,
    diff_traces,
    gradient_trace,
    load_trace,
    logit_lens,
    patch,
    save_trace,
)

RESULTS: dict[str, object] = {}


def check(name: str, fn) -> None:
    start = time.perf_counter()
    try:
        detail = fn()
        print(f"OK   {name} ({time.perf_counter() - start:.2f} s){': ' + str(detail) if detail else ''}", flush=True)
        RESULTS[name] = "ok" if detail is None else str(detail)
    except Exception:
        print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        RESULTS[name] = "FAIL: " + traceback.format_exc().strip().splitlines()[-1]


def generation_checks(name: str, model, tok, device: str) -> None:
    prompts = ["Once upon a time, Lily had", "Tom"]

    def greedy():
        on_gpu = TracedGeneration(model, tok, prompts, temperature=0)
        on_gpu.run(4)
        cpu_model, _ = load_bundled(name)
        on_cpu = TracedGeneration(cpu_model, tok, prompts, temperature=0)
        on_cpu.run(4)
        same = [on_gpu.generated(r) == on_cpu.generated(r) for r in range(2)]
        assert all(same), (on_gpu.text(0), on_cpu.text(0))
        return f"greedy tokens equal the CPU's: {same}"

    def sampled():
        # the draw is made on the GPU with a CUDA generator (Philox): the same seed gives the same tokens run after
        # run there, and other tokens than the CPU's generator (Mersenne Twister) gives on the CPU
        gpu = TracedGeneration(model, tok, prompts, temperature=1.0, seed=7)
        gpu.run(6)
        again = TracedGeneration(model, tok, prompts, temperature=1.0, seed=7)
        again.run(6)
        assert gpu.generator is not None and gpu.generator.device.type == "cuda", gpu.generator
        assert [gpu.generated(r) for r in range(2)] == [again.generated(r) for r in range(2)]
        cpu = TracedGeneration(load_bundled(name)[0], tok, prompts, temperature=1.0, seed=7)
        cpu.run(6)
        return (f"seed 7 drawn on {gpu.generator.device}, the same tokens twice; equal to the CPU's (not expected): "
                f"{[gpu.generated(r) == cpu.generated(r) for r in range(2)]}")

    def values_copies():
        # every kept value copied to the host as recorded (non_blocking, pinned), one wait per step; the values equal
        # the CPU's trace's within float32's rounding across devices
        import gpt_shape_tracer.tracer.storage._log as log_module

        waits, start = [], log_module.wait_for_host_copies

        def counted(devices):
            devices = set(devices)
            waits.append(len(devices))
            start(devices)

        log_module.wait_for_host_copies = counted
        try:
            gpu = TracedGeneration(model, tok, prompts, temperature=0, capture="values")
            gpu.run(3)
        finally:
            log_module.wait_for_host_copies = start
        cpu = TracedGeneration(load_bundled(name)[0], tok, prompts, temperature=0, capture="values")
        cpu.run(3)
        assert waits == [1, 1, 1], waits  # the prefill and two decode steps: one wait each
        worst, compared = 0.0, 0
        if gpu.trace.log.n_records != cpu.trace.log.n_records:  # another attention path on the GPU: other records
            return f"waits per step {waits}; records {gpu.trace.log.n_records} on the GPU, {cpu.trace.log.n_records} " \
                   "on the CPU: values not compared"
        for index in range(gpu.trace.log.n_records):
            a, b = gpu.trace.log.value(index), cpu.trace.log.value(index)
            if a is not None and b is not None and a.is_floating_point():
                assert a.is_cpu and a.dtype == b.dtype and a.shape == b.shape, index
                finite = torch.isfinite(b)
                worst = max(worst, float((a[finite] - b[finite]).abs().max()) if finite.any() else 0.0)
                compared += 1
        return f"waits per step {waits}; {compared} values, largest |GPU − CPU| {worst:.2e}"

    def captures():
        out = []
        for capture in ("shapes", "values", "ops"):
            for use_cache in (True, False):
                for side in ("left", "right"):
                    gen = TracedGeneration(model, tok, prompts, temperature=0, capture=capture, use_cache=use_cache,
                                           padding_side=side)
                    gen.run(3)
                    out.append(len(gen.trace.records))
        return f"records per run {out}"

    check(f"{name}/{device}: greedy", greedy)
    check(f"{name}/{device}: sampled", sampled)
    check(f"{name}/{device}: every capture, cache on/off, left/right", captures)
    check(f"{name}/{device}: values copied to the host once per step", values_copies)

    gen = TracedGeneration(model, tok, prompts, temperature=0)
    gen.run(3)
    check(f"{name}/{device}: compare_with_recompute", lambda: gen.compare_with_recompute())
    check(f"{name}/{device}: logit lens", lambda: logit_lens(gen.trace, 2, model=model).shape)
    check(f"{name}/{device}: attention gradients", lambda: type(attention_gradients(gen, 2, layer=1, head=0)).__name__)
    check(f"{name}/{device}: gradient trace", lambda: len(gradient_trace(gen, 2).records))
    check(f"{name}/{device}: cheaper cache int8", lambda: cache_precision(gen, "int8", steps=4).__class__.__name__)

    def interventions():
        other = TracedGeneration(model, tok, prompts, temperature=0)
        other.set_interventions([ablate("blocks.0.attn.hook_z", head=0)])
        other.run(3)
        patched = TracedGeneration(model, tok, prompts, temperature=0)
        patched.set_interventions([patch("blocks.1.hook_resid_post", gen.trace, positions=None)])
        patched.run(1)
        return f"diff rows {len(diff_traces(gen.trace, other.trace))}"

    check(f"{name}/{device}: ablate, patch, diff", interventions)

    def save_load():
        with tempfile.TemporaryDirectory() as d:
            save_trace(gen.trace, Path(d) / "t.zip")
            back = load_trace(Path(d) / "t.zip")
            return f"{back.n_steps} steps loaded back"

    check(f"{name}/{device}: save and load", save_load)


def transformers_checks(device: str) -> None:
    from gpt_shape_tracer.model import load_hf
    from tests.hf_architectures import ARCHITECTURES, build

    for arch in [a for a in ARCHITECTURES if a in ("qwen3", "gemma2", "phi3")][:3]:
        def run(arch=arch):
            with tempfile.TemporaryDirectory() as d:
                directory = build(arch, Path(d), ROOT / "assets" / "story-gpt" / "tokenizer.json")
                model, tok = load_hf(directory, device=device)
                cpu_model, _ = load_hf(directory)
                gen = TracedGeneration(model, tok, ["Hello there"], temperature=0)
                gen.run(3)
                cpu = TracedGeneration(cpu_model, tok, ["Hello there"], temperature=0)
                cpu.run(3)
                return f"greedy tokens equal the CPU's: {gen.generated(0) == cpu.generated(0)}"

        check(f"transformers {arch}/{device}", run)


def cli_on_cuda() -> str:
    import contextlib
    import io

    from gpt_shape_tracer.trace_command import main as trace

    texts = []
    for device in ("cuda", "cpu"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = trace(["--prompt", "Lily had", "--steps", "4", "--device", device, "--json"])
        assert code == 0, device
        texts.append(json.loads(out.getvalue())["texts"])
    assert texts[0] == texts[1], texts
    return repr(texts[0])


def synced(fn, repeats: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_length(model, ids: torch.Tensor) -> dict:
    """The forward over ``ids``: untraced, with a no-op hook on every module, and traced (shapes, values)."""

    @torch.no_grad()
    def untraced():
        model(ids)

    def with_hooks():
        handles = [module.register_forward_hook(lambda m, i, o: None) for module in model.modules()]
        try:
            untraced()
        finally:
            for h in handles:
                h.remove()

    def traced(capture, per_record=False):
        def go():
            import gpt_shape_tracer.tracer.storage._log as log_module

            start = log_module.start_host_copy
            if per_record:  # the tracer before: a blocking copy of each kept value as it is recorded
                log_module.start_host_copy = lambda t: t.clone() if t.is_cpu else t.to("cpu")
            try:
                tracer = Tracer(model, capture=capture, budget_bytes=2**31)
                with torch.no_grad(), tracer.active():
                    model(ids)
            finally:
                log_module.start_host_copy = start
        return go

    base = synced(untraced)
    return {"untraced_s": base, "plain_hooks_x": synced(with_hooks) / base,
            "shapes_x": synced(traced("shapes")) / base, "values_x": synced(traced("values")) / base,
            "values_copied_per_record_x": synced(traced("values", per_record=True)) / base}


def bench_model(label: str, config: GPTConfig, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(config).to(dtype).eval()
    rows = {}
    for n in (128, 2048):
        rows[n] = bench_length(model, torch.randint(0, config.vocab_size, (1, n), device="cuda"))
        print(label, n, json.dumps(rows[n]), flush=True)
    return rows


def decode_bench(label: str, config: GPTConfig, dtype: torch.dtype, steps: int = 16) -> dict:
    """Per-token decode through TracedGeneration (shapes, values) against the untraced cached decode."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(config).to(dtype).eval()
    _, tok = load_bundled("story-gpt")  # its ids (< 1024) are valid ids of any vocabulary here
    prompt = " ".join(["Once upon a time, Lily had a red ball."] * 12)
    ids = torch.tensor([tok.encode(prompt)], device="cuda")

    @torch.no_grad()
    def untraced():
        cache = model.new_cache(1)
        model(ids, cache)
        token = ids[:, -1:]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            logits = model(token, cache)
            token = logits[:, -1].argmax(-1, keepdim=True)
            token.item()  # a real generation reads the chosen token on the host each step
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps

    out = {"untraced_decode_s": min(untraced() for _ in range(3))}
    for capture in ("shapes", "values"):
        def traced(capture=capture):
            gen = TracedGeneration(model, tok, [prompt], temperature=0, capture=capture, stop_at_eos=False)
            gen.run(1)
            torch.cuda.synchronize()
            start = time.perf_counter()
            gen.run(steps)
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / steps
        try:
            out[f"{capture}_decode_x"] = min(traced() for _ in range(3)) / out["untraced_decode_s"]
        except Exception as e:
            out[f"{capture}_decode_error"] = repr(e)[:300]
    print(label, "decode", json.dumps(out), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-checks", action="store_true")
    ap.add_argument("--checks-only", action="store_true", help="the checks and the CLI's --device cuda, no bench")
    args = ap.parse_args()
    assert torch.cuda.is_available(), "no CUDA device"
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, flush=True)
    if not args.skip_checks:
        for name in ("story-gpt", "story-llama"):
            model, tok = load_bundled(name)
            generation_checks(name, model.to("cuda"), tok, "cuda")
            bf16 = load_bundled(name)[0].to("cuda", torch.bfloat16)

            def bf16_run(bf16=bf16, tok=tok):
                gen = TracedGeneration(bf16, tok, ["Once upon a time"], temperature=0)
                gen.run(4)
                return repr(gen.text(0)[-40:])

            check(f"{name}/cuda bfloat16: values trace", bf16_run)
        transformers_checks("cuda")
        check("CLI --device cuda: the CPU's greedy text", cli_on_cuda)
    if args.checks_only:
        print(json.dumps(RESULTS, indent=1, default=str))
        return
    gpt2_small = GPTConfig(vocab_size=50257, n_ctx=2048, d_model=768, n_layer=12, n_head=12)
    tiny_llama = GPTConfig(vocab_size=32000, n_ctx=2048, d_model=2048, n_layer=22, n_head=32, n_kv_head=4,
                           d_mlp=5632, family="llama", norm="rmsnorm", positions="rope", mlp="swiglu",
                           tie_embeddings=False, qkv_bias=False, attn_out_bias=False, mlp_bias=False,
                           norm_bias=False)
    bench = {}
    for label, config in (("gpt2-small", gpt2_small), ("1.1B", tiny_llama)):
        for dtype in (torch.float32, torch.bfloat16):
            key = f"{label}/{str(dtype).removeprefix('torch.')}"
            try:
                bench[key] = {"forward": bench_model(key, config, dtype), "decode": decode_bench(key, config, dtype)}
            except Exception:
                print(f"FAIL bench {key}\n{traceback.format_exc()}", flush=True)
            torch.cuda.empty_cache()
    payload = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": RESULTS,
               "bench": bench}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_gpu.json").write_text(json.dumps(payload, indent=2, default=str))


if __name__ == "__main__":
    main()
