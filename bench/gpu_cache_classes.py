"""transformers' cache classes on a CUDA device (``tracer.cache_class_run``), checked against ``generate()`` with the
same class there (``disable_compile``: on CUDA generate would compile a static cache's forward, which changes no
cache): ``python bench/gpu_cache_classes.py [--device cuda]`` (``--device cpu`` runs the same checks here, where
"offloaded" runs as the dynamic cache and says so).

For each class (llama: dynamic, static, quantized-fp8, offloaded; mistral with a window of 4: sliding, static) the
tokens equal generate's and every step's logits are within 1e-4 of its; on CUDA, the offloaded cache's layers live
on the CPU between uses (a "move" event each) but the one prefetched for the next use. PASS or FAIL with the
numbers; exit 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from common import ROOT

from gpt_shape_tracer.model import load_hf
from gpt_shape_tracer.tracer import cache_class_run

sys.path.insert(0, str(ROOT))
from tests.hf_architectures import build  # noqa: E402  (tiny random-weight directories, as the tests build)

TOKENIZER = ROOT / "assets" / "story-gpt" / "tokenizer.json"
PROMPT = "Once upon a time there was"
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="cache-classes-"))
    for arch, classes in (("llama", ("dynamic", "static", "quantized-fp8", "offloaded")),
                          ("mistral", ("sliding", "static"))):
        model, tok = load_hf(build(arch, root / arch, TOKENIZER, seed=1), implementation="transformers",
                             device=args.device)
        for cache in classes:
            name = f"{arch} {cache}"
            try:
                run = cache_class_run(model, tok, PROMPT, cache, args.steps)
            except Exception as e:  # noqa: BLE001  (a check reports, whatever went wrong)
                check(name, False, f"{type(e).__name__}: {e}")
                continue
            ids = torch.tensor([list(run.prompt_ids)], device=run.device)
            out = model.hf.generate(ids, max_new_tokens=args.steps, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, disable_compile=True,
                                    **run.generate_settings)
            tokens = out.sequences[0, ids.shape[1]:].tolist()
            theirs = torch.stack([row[0] for row in out.logits]).float().cpu()
            ours = torch.stack([s.logits for s in run.steps])
            same = torch.allclose(ours, theirs, rtol=0, atol=1e-4, equal_nan=True)  # NaN where generate has NaN
            delta = float((ours - theirs).abs().nan_to_num(0).max())
            nan_steps = int(ours.isnan().any(dim=-1).sum())
            overflowed = sum(len(h.overflowed) for h in run.steps[-1].layers)
            check(name, tokens == list(run.tokens) and same,
                  f"{run.class_name} {sorted(set(run.kinds()))}, generate{run.generate_settings}: tokens equal "
                  f"{tokens == list(run.tokens)}, logits equal (NaN where generate's are) {same}, max finite "
                  f"|Δ logits| {delta:.3g}; steps with NaN logits {nan_steps}; fp8 rows past the frozen scale "
                  f"{overflowed}; vs full-precision dynamic {[round(s.max_abs_delta, 6) for s in run.steps]}; "
                  f"note: {run.note or 'none'}")
            if cache == "offloaded" and run.device.startswith("cuda"):
                last = run.steps[-1]
                devices = [h.device for h in last.layers]
                moves = [e for e in run.events if e.kind == "move"]
                check(f"{name} devices", devices.count("cpu") == len(devices) - 1 and bool(moves),
                      f"between uses after the last step: {devices}; {len(moves)} move event(s); "
                      f"{moves[-1].sentence() if moves else ''}")
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
