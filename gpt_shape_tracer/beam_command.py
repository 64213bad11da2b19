"""``gpt-shape-tracer trace --num-beams K``: beam search traced one forward per step (``tracer.BeamSearch``),
equal to transformers' ``generate(num_beams=K)``: per step, every beam's token, its parent beam and running score,
and the rows the KV cache was reordered from; at the end, the best hypotheses and their scores. ``--steps`` is
the most tokens generated. The options are read and checked before torch is imported."""

from __future__ import annotations

import argparse
import json
import sys

from gpt_shape_tracer.path_checks import refuse_others, refuse_sampling

MAX_BEAMS = 16  # tracer.generation._beams.MAX_BEAMS
BEAM_FLAGS = ("length_penalty", "early_stopping", "num_return_sequences")
EARLY_STOPPING: dict[str, bool | str] = {"false": False, "true": True, "never": "never"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--num-beams", type=int, help=f"beam search with K beams per prompt (2…{MAX_BEAMS}), as "
                                                  "transformers' generate(num_beams=K); --steps is the most new tokens")
    ap.add_argument("--length-penalty", type=float,
                    help="with --num-beams: a finished hypothesis scores its log-probability sum / length ** this "
                         "(default 1.0)")
    ap.add_argument("--early-stopping", choices=tuple(EARLY_STOPPING),
                    help="with --num-beams: transformers' early_stopping (default false)")
    ap.add_argument("--num-return-sequences", type=int, help="with --num-beams: hypotheses returned per prompt "
                                                             "(default 1)")


def wanted(args: argparse.Namespace) -> bool:
    return args.num_beams is not None or any(getattr(args, f) is not None for f in BEAM_FLAGS)


def check(args: argparse.Namespace) -> None:
    """The beam options checked without torch: a ``ValueError`` naming the option."""
    if args.num_beams is None:
        given = [f"--{f.replace('_', '-')}" for f in BEAM_FLAGS if getattr(args, f) is not None]
        raise ValueError(f"{', '.join(given)} go(es) with --num-beams")
    if not 2 <= args.num_beams <= MAX_BEAMS:
        raise ValueError(f"--num-beams takes 2 … {MAX_BEAMS}, got {args.num_beams}")
    returned = args.num_return_sequences or 1
    if not 1 <= returned <= args.num_beams:
        raise ValueError(f"--num-return-sequences takes 1 … --num-beams ({args.num_beams}), got {returned}")
    refuse_others(args, "--num-beams", allowed=("num_beams",))
    refuse_sampling(args, "--num-beams is traced as transformers' beam search without sampling")


def main(args: argparse.Namespace, load_choice) -> int:
    """The beam path of ``gpt-shape-tracer trace``: 0, or 2 with the reason on stderr. ``load_choice()`` loads the
    model the arguments name, as the rest of the command does."""
    try:
        check(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from gpt_shape_tracer.model import ModelLoadError
    from gpt_shape_tracer.tracer import BeamSearch

    try:
        model, tokenizer = load_choice()
        if tokenizer is None:
            raise ValueError("the model has no tokenizer: give one with --tokenizer")
        search = BeamSearch(model, tokenizer, list(args.prompt), args.num_beams, max_new_tokens=args.steps,
                            length_penalty=1.0 if args.length_penalty is None else args.length_penalty,
                            early_stopping=EARLY_STOPPING[args.early_stopping or "false"],
                            num_return_sequences=args.num_return_sequences or 1, capture=args.capture,
                            budget_bytes=int(args.budget_mb * 2**20),
                            eos_ids=() if args.no_stop_at_eos else None)
        search.run()
    except (ModelLoadError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result, texts = search.result(), search.texts()
    steps = [{"step": s.step, "tokens": [list(r) for r in s.tokens], "parents": [list(r) for r in s.parents],
              "scores": [[round(x, 6) for x in r] for r in s.scores], "beam_idx": list(s.beam_idx),
              "moved_rows": s.moved_rows} for s in search.steps]
    search.close()
    if args.json:
        print(json.dumps({"num_beams": args.num_beams, "steps": len(steps), "records": len(search.trace.records),
                          "sequences": [list(s) for s in result.sequences], "scores": list(result.scores),
                          "texts": texts, "beam_steps": steps}, ensure_ascii=False))
        return 0
    for s in steps:
        print(f"step {s['step']}: parents {s['parents']}, cache rows from {s['beam_idx']} "
              f"({s['moved_rows']} moved)")
    per = len(result.sequences) // len(args.prompt)
    for i, (text, score) in enumerate(zip(texts, result.scores)):
        print(f"prompt {i // per}, hypothesis {i % per}: score {score:.4f}: {text!r}")
    return 0
