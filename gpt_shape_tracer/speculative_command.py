"""``gpt-shape-tracer trace --assistant-model DIR|story-gpt`` or ``--prompt-lookup N``: greedy assisted
(speculative) decoding traced one verify forward per step (``tracer.SpeculativeDecoding``), equal to transformers'
``generate(assistant_model=…)`` / ``generate(prompt_lookup_num_tokens=N)``: per step, the drafts, how many the main
model accepted, the rows cropped from its cache and from the assistant's. ``--steps`` is the most new tokens.
The options are read and checked before torch is imported."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gpt_shape_tracer.path_checks import refuse_others, refuse_sampling

MAX_DRAFT_TOKENS = 64  # tracer.generation._speculative.MAX_DRAFT_TOKENS
SCHEDULES = ("constant", "heuristic")
ASSISTANT_FLAGS = ("num_assistant_tokens", "assistant_schedule", "assistant_confidence")
BUNDLED = ("story-gpt", "story-llama")  # model.BUNDLED_MODELS


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--assistant-model", metavar="DIR|NAME",
                    help="assisted decoding: drafts from this model (a Hugging Face directory or a bundled name, "
                         "sharing the model's vocabulary), verified by the model in one forward per step")
    ap.add_argument("--prompt-lookup", type=int, metavar="N",
                    help=f"assisted decoding drafting N tokens (1…{MAX_DRAFT_TOKENS}) by n-gram lookup in the "
                         "sequence itself (transformers' prompt_lookup_num_tokens)")
    ap.add_argument("--num-assistant-tokens", type=int,
                    help="with --assistant-model: drafts at the first step (default 20, transformers')")
    ap.add_argument("--assistant-schedule", choices=SCHEDULES,
                    help="with --assistant-model: how the number of drafts moves (heuristic: +2 after all were "
                         "accepted, else −1; default constant)")
    ap.add_argument("--assistant-confidence", type=float,
                    help="with --assistant-model: drafting stops after a token the assistant gives less "
                         "probability (0 = off; default 0.4)")


def wanted(args: argparse.Namespace) -> bool:
    return args.assistant_model is not None or args.prompt_lookup is not None or \
        any(getattr(args, f) is not None for f in ASSISTANT_FLAGS)


def check(args: argparse.Namespace) -> None:
    """The speculative options checked without torch: a ``ValueError`` naming the option."""
    given = [f"--{f.replace('_', '-')}" for f in ASSISTANT_FLAGS if getattr(args, f) is not None]
    if args.assistant_model is None and args.prompt_lookup is None:
        raise ValueError(f"{', '.join(given)} go(es) with --assistant-model")
    if args.assistant_model is not None and args.prompt_lookup is not None:
        raise ValueError("give --assistant-model or --prompt-lookup, not both: one draft source")
    if args.prompt_lookup is not None and given:
        raise ValueError(f"{', '.join(given)} go(es) with --assistant-model, not --prompt-lookup")
    if args.prompt_lookup is not None and not 1 <= args.prompt_lookup <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--prompt-lookup takes 1 … {MAX_DRAFT_TOKENS}, got {args.prompt_lookup}")
    if args.num_assistant_tokens is not None and not 1 <= args.num_assistant_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--num-assistant-tokens takes 1 … {MAX_DRAFT_TOKENS}, got {args.num_assistant_tokens}")
    if args.assistant_confidence is not None and not 0 <= args.assistant_confidence <= 1:
        raise ValueError(f"--assistant-confidence takes 0 … 1, got {args.assistant_confidence}")
    if len(args.prompt) != 1:
        raise ValueError(f"assisted decoding runs one prompt (as transformers' does), got {len(args.prompt)}")
    refuse_others(args, "assisted decoding")
    refuse_sampling(args, "assisted decoding is traced greedy, as its output equals the model's greedy decoding")


def _load_assistant(name: str):
    from gpt_shape_tracer.model import load_bundled, load_model

    return load_bundled(name)[0] if name in BUNDLED else load_model(name)[0]


def main(args: argparse.Namespace, load_choice) -> int:
    """The speculative path of ``gpt-shape-tracer trace``: 0, or 2 with the reason on stderr. ``load_choice()``
    loads the model the arguments name, as the rest of the command does."""
    try:
        check(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from gpt_shape_tracer.figures.speculative import run_numbers
    from gpt_shape_tracer.model import ModelLoadError
    from gpt_shape_tracer.tracer import SpeculativeDecoding

    try:
        model, tokenizer = load_choice()
        if tokenizer is None:
            raise ValueError("the model has no tokenizer: give one with --tokenizer")
        assistant = _load_assistant(args.assistant_model) if args.assistant_model is not None else None
        run = SpeculativeDecoding(
            model, tokenizer, args.prompt[0], assistant=assistant, prompt_lookup=args.prompt_lookup,
            max_new_tokens=args.steps, num_assistant_tokens=args.num_assistant_tokens or 20,
            schedule=args.assistant_schedule or "constant",
            confidence_threshold=0.4 if args.assistant_confidence is None else args.assistant_confidence,
            capture=args.capture, budget_bytes=int(args.budget_mb * 2**20),
            eos_ids=() if args.no_stop_at_eos else None)
        run.run()
    except (ModelLoadError, ValueError, ImportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps: list[dict[str, Any]] = [
        {"step": s.step, "drafts": list(s.draft_tokens), "accepted": s.accepted, "fates": list(s.fates),
         "new_tokens": list(s.new_tokens), "cropped": s.main_cropped, "draft_cropped": s.draft_cropped,
         "main_rows": list(s.main_rows), "next_draft": s.next_draft} for s in run.steps]
    numbers = run_numbers(run.steps)
    run.close()
    if args.json:
        print(json.dumps({"source": run.source, "steps": len(steps), "main_forwards": run.main_forwards,
                          "draft_forwards": run.draft_forwards, "records": len(run.trace.records),
                          "generated": list(run.generated), "text": run.text(), "acceptance_rate": numbers["rate"],
                          "speculative_steps": steps}, ensure_ascii=False))
        return 0
    for s in steps:
        print(f"step {s['step']}: drafted {s['drafts']}, accepted {s['accepted']}, appended {s['new_tokens']}, "
              f"cropped {s['cropped']} row(s) from the main cache ({s['main_rows'][1]} → {s['main_rows'][2]})"
              + (f", {s['draft_cropped']} from the assistant's" if s["draft_cropped"] else ""))
    print(f"{run.source}: {numbers['generated']} token(s) in {numbers['forwards']} main forward(s), acceptance rate "
          f"{numbers['rate']:.0%}: {run.text()!r}")
    return 0
