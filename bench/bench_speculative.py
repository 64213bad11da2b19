"""Traced speculative (assisted) decoding beside transformers' untraced ``generate(assistant_model=…)`` and
``generate(prompt_lookup_num_tokens=…)``, in one run: ``python bench/bench_speculative.py [--repeats 3]
[--new 32] [--device cpu] [--threads 1]``.

Two main models, each built once in Python, saved, and loaded by ours (our GPT) and by transformers (SDPA): *deep*,
the bundled story-gpt (4 layers, d = 128) deepened to 8 layers — its own 4 layers, then 4 random ones whose output
projections are scaled by 0.6, so the assistant, story-gpt itself, agrees with it often but not always, as a real
draft model does; and *wide*, GPT-2 small's shape (d = 768, 12 layers) with story-gpt's vocabulary, random
weights — a main forward that costs what a real one does, which the assistant agrees with only by chance. Ours
records values for the main model's verify forwards (the assistant's: shapes). A short (16-token) and a long
(192-token) prompt. Prints the medians, ours / transformers, the acceptance, whether the tokens are equal, with the
machine and its load average.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from common import interleaved, machine, median, save

from gpt_shape_tracer.model import load_model
from gpt_shape_tracer.model.sources import BUNDLED_DIR
from gpt_shape_tracer.tracer import SpeculativeDecoding


def main_directory() -> Path:
    """The wider main model, built once (random weights, story-gpt's vocabulary and tokenizer)."""
    target = Path(tempfile.gettempdir()) / "speculative-main-gpt2"
    if (target / "model.safetensors").exists():
        return target
    from transformers import GPT2Config, GPT2LMHeadModel

    small = GPT2LMHeadModel.from_pretrained(BUNDLED_DIR)
    torch.manual_seed(0)
    config = GPT2Config(**{**small.config.to_dict(), "n_layer": 2 * small.config.n_layer})
    model = GPT2LMHeadModel(config).eval()
    state = model.state_dict()
    state.update({k: v for k, v in small.state_dict().items() if k in state})  # story-gpt's layers first
    with torch.no_grad():
        for name, value in state.items():
            layer = name.split(".")[2] if name.startswith("transformer.h.") else None
            if layer is not None and int(layer) >= small.config.n_layer and "c_proj" in name:
                value.mul_(0.6)  # the added layers nudge the residual stream, not replace it
    model.load_state_dict(state)
    model.save_pretrained(target)
    (target / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return target


def wide_directory() -> Path:
    """A wider main model: GPT-2 small's shape (d = 768, 12 layers, 12 heads) with story-gpt's vocabulary and
    tokenizer, random weights, built once — the scale where a main forward costs what a real one does; the
    assistant agrees with it only by chance."""
    target = Path(tempfile.gettempdir()) / "speculative-main-gpt2-wide"
    if (target / "model.safetensors").exists():
        return target
    from transformers import GPT2Config, GPT2LMHeadModel

    small = GPT2LMHeadModel.from_pretrained(BUNDLED_DIR)
    torch.manual_seed(0)
    config = GPT2Config(**{**small.config.to_dict(), "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None})
    GPT2LMHeadModel(config).eval().save_pretrained(target)
    (target / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    drafter, tok = load_model(str(BUNDLED_DIR), device=args.device)
    their_drafter = AutoModelForCausalLM.from_pretrained(BUNDLED_DIR, attn_implementation="sdpa").eval().to(
        args.device)
    # the drafting settings where transformers reads them, the assistant's generation config (as
    # tests/tracer/test_speculative.py sets them); ours gets the same, so both sides run the same forwards
    drafting = {"num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
                "assistant_confidence_threshold": 0.4}
    for key, value in drafting.items():
        setattr(their_drafter.generation_config, key, value)
    base = "Once upon a time, there was a little girl named Lily. She had a red ball and a small blue boat. "
    results = {}
    mains = {"deep": main_directory, "wide": wide_directory}
    for (main_label, build), (label, n) in [(m, p) for m in mains.items() for p in (("short", 16), ("long", 192))]:
        directory = build()
        ours, _ = load_model(str(directory), device=args.device)
        theirs = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="sdpa").eval().to(args.device)
        main_calls = [0]
        theirs.register_forward_pre_hook(lambda *_, calls=main_calls: calls.__setitem__(0, calls[0] + 1))
        label = f"{label}, {main_label} main"
        prompt = tok.decode(tok.encode(base * 20)[:n])
        ids = tok.encode(prompt)
        for source in ("assistant", "prompt lookup"):
            holder: dict = {}

            def ours_run(prompt=prompt, source=source, holder=holder, ours=ours):
                run = SpeculativeDecoding(ours, tok, prompt, max_new_tokens=args.new, eos_ids=(),
                                          assistant=drafter if source == "assistant" else None,
                                          prompt_lookup=None if source == "assistant" else 4,
                                          num_assistant_tokens=4, schedule="constant", confidence_threshold=0.4,
                                          budget_bytes=2 * 2**30)
                run.run()
                holder["our forwards"] = run.main_forwards
                holder["ours"] = tuple(run.generated)
                holder["accepted"] = sum(s.accepted for s in run.steps)
                holder["drafted"] = sum(len(s.draft_tokens) for s in run.steps)
                run.close()

            def theirs_run(ids=ids, source=source, holder=holder, theirs=theirs, main_calls=main_calls):
                extra = {"assistant_model": their_drafter} if source == "assistant" else {"prompt_lookup_num_tokens": 4}
                main_calls[0] = 0
                with torch.no_grad():
                    out = theirs.generate(torch.tensor([ids], device=args.device), max_new_tokens=args.new,
                                          do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
                holder["theirs"] = tuple(out[0, len(ids):].tolist())
                holder["their forwards"] = main_calls[0]

            load_before = os.getloadavg()
            times = interleaved({"ours, values": ours_run, "transformers": theirs_run}, args.repeats)
            seconds = {k: median(v) for k, v in times.items()}
            ratio = seconds["ours, values"] / seconds["transformers"]
            same = holder["ours"] == holder["theirs"]
            results[f"{label}, {source}"] = {"prompt_tokens": len(ids), "seconds": seconds, "ratio": ratio,
                                             "same_tokens": same, "accepted": holder["accepted"],
                                             "drafted": holder["drafted"], "load": [load_before, os.getloadavg()],
                                             "main_forwards": {"ours": holder["our forwards"],
                                                               "transformers": holder["their forwards"]}}
            print(f"{label} ({len(ids)} tokens), {source}, {args.new} new: transformers {seconds['transformers']:.2f}"
                  f" s; ours traced with values x{ratio:.2f}; {holder['accepted']}/{holder['drafted']} drafts "
                  f"accepted; same tokens: {same}; main forwards {holder['our forwards']} / "
                  f"{holder['their forwards']}; load {load_before[0]:.1f} → {os.getloadavg()[0]:.1f}", flush=True)
    save(f"speculative-{args.device.split(':')[0]}", {"machine": machine(), "device": args.device,
                                                       "new_tokens": args.new, "results": results})


if __name__ == "__main__":
    main()
