"""The decoding and engine paths on a CUDA device, checked against transformers on the same device, then timed:
``python bench/gpu_decoding.py [--device cuda]`` (the device run of docs/benchmarks.md; ``--device cpu`` runs
the same checks here).

1. Beam search (``BeamSearch``) on a tiny random Llama on the device: sequences, scores and every step's
   ``beam_idx`` equal ``generate(num_beams=4)`` there (eager attention), with a left-padded batch.
2. The engine (``trace_engine``) on the device: every request's tokens equal ``generate_batch``'s there.
3. Speculative decoding, where this checkout has it (``tracer.SpeculativeDecoding``): output equal to greedy.
Each check prints PASS or FAIL with the numbers; the script exits 1 if any failed. Timings are left to
``bench_beams.py --device`` and ``bench_engine.py``, run after it by the device command.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, machine

from gpt_shape_tracer.model import load_hf, load_model
from gpt_shape_tracer.tracer import BeamSearch

sys.path.insert(0, str(ROOT))
from tests.hf_architectures import build  # noqa: E402  (tiny random-weight directories, as the tests build)

TOKENIZER = ROOT / "assets" / "story-gpt" / "tokenizer.json"
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def beams(directory: Path, device: str) -> None:
    from transformers import AutoModelForCausalLM, DynamicCache

    ours, tok = load_model(str(directory), device=device)
    ref = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval().to(device)
    prompts = ["Lily had a red ball and", "Tom"]
    started = time.perf_counter()
    search = BeamSearch(ours, tok, prompts, 4, max_new_tokens=8, length_penalty=0.5, num_return_sequences=2,
                        eos_ids=())
    search.run()
    ours_s = time.perf_counter() - started
    rows = [tok.encode(p) for p in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    cache, seen = DynamicCache(config=ref.config), []
    reorder = cache.reorder_cache
    cache.reorder_cache = lambda idx: (seen.append(idx.tolist()), reorder(idx))[1]
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=mask, num_beams=4, max_new_tokens=8, do_sample=False,
                           length_penalty=0.5, num_return_sequences=2, return_dict_in_generate=True,
                           output_scores=True, pad_token_id=0, past_key_values=cache)
    result = search.result()
    mine = [list(s.beam_idx) for s in search.steps]
    differ = [i for i, (a, b) in enumerate(zip(seen, mine)) if a != b]
    last = len(mine) - 1  # every candidate ended: transformers ranks k ties at -1e9 there, in its device's order
    print(f"beam_idx differs at steps {differ} of 0 … {last}"
          + (f" (step {last}: ours {mine[last]}, theirs {seen[last]})" if differ == [last] else ""), flush=True)
    same = out.sequences.tolist() == [list(s) for s in result.sequences]
    delta = float((out.sequences_scores.cpu() - torch.tensor(result.scores)).abs().max())
    check(f"beam search on {device}", same and delta < 1e-4 and seen == mine,
          f"sequences equal: {same}, max |Δ score| {delta:.2e}, beam_idx equal at all {len(seen)} steps: "
          f"{seen == mine}; ours traced {ours_s:.2f} s")


def engine(directory: Path, device: str) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from gpt_shape_tracer.tracer.engine import trace_engine

    model, tok = load_hf(directory, implementation="transformers", device=device)  # the engine needs transformers'
    assert tok is not None
    prompts = [tok.encode("Once upon a time, there was a little girl named Lily."), tok.encode("Tom had a kite."),
               tok.encode("Once upon a time, there was a little girl named Mia.")]
    started = time.perf_counter()
    run = trace_engine(model, tok, prompts, page_size=4, pages=64, max_batch_tokens=64, max_new_tokens=6,
                       arrivals=[0, 0, 3])
    ours_s = time.perf_counter() - started
    ref = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval().to(device)
    out = ref.generate_batch(inputs=prompts, generation_config=GenerationConfig(max_new_tokens=6, do_sample=False,
                                                                               eos_token_id=-1),
                             continuous_batching_config=ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=64,
                                                                                 page_size=4), warmup=False)
    by_prompt = {tuple(o.prompt_ids): list(o.generated_tokens) for o in out.values()}
    theirs = [by_prompt[tuple(p)] for p in prompts]
    mine = [list(r.generated_ids) for r in run.requests]
    check(f"engine on {device}", mine == theirs, f"tokens equal: {mine == theirs} ({mine} vs {theirs}); "
          f"{len(run.steps)} engine steps traced in {ours_s:.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    print(machine(), torch.cuda.get_device_name() if args.device.startswith("cuda") else "", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        directory = build("llama", Path(tmp) / "llama", TOKENIZER, seed=3)
        for name, fn in (("beams", beams), ("engine", engine)):
            try:
                fn(directory, args.device)
            except Exception as e:  # noqa: BLE001 - a check that cannot run is a failure, said with its error
                check(f"{name} on {args.device}", False, f"{type(e).__name__}: {e}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
