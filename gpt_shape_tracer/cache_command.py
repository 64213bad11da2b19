"""``gpt-shape-tracer trace --cache dynamic|static|sliding|quantized-fp8|offloaded``: the prompt decoded greedily
``--steps`` tokens with transformers' own cache class (``tracer.cache_class_run``), the model run by transformers
(``load_hf(…, implementation="transformers")``), beside a full-precision dynamic cache fed the same tokens: per
step, what each layer holds and the cache events (grow, drop, overwrite, quantize, move); at the end, the class's
takeaway. The options are read and checked before torch is imported."""

from __future__ import annotations

import argparse
import json
import sys

from gpt_shape_tracer.path_checks import load_through_transformers, refuse_others, refuse_sampling

CACHE_CLASSES = ("dynamic", "static", "sliding", "quantized-fp8", "offloaded")  # tracer.CACHE_CLASSES


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cache", choices=CACHE_CLASSES,
                    help="decode greedily with transformers' own cache class (the model run by transformers) and "
                         "show what it holds at each step, beside a full-precision dynamic cache")


def wanted(args: argparse.Namespace) -> bool:
    return getattr(args, "cache", None) is not None


def check(args: argparse.Namespace) -> None:
    """The --cache options checked without torch: a ``ValueError`` naming the option."""
    if len(args.prompt) != 1:
        raise ValueError(f"--cache runs one prompt, got {len(args.prompt)}")
    refuse_others(args, "--cache")
    refuse_sampling(args, "--cache decodes greedily, as transformers' generate(do_sample=False)")


def main(args: argparse.Namespace) -> int:
    """The cache-class path of ``gpt-shape-tracer trace``: 0, or 2 with the reason on stderr."""
    try:
        check(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from gpt_shape_tracer.figures.cache_classes import cache_class_takeaway
    from gpt_shape_tracer.model import ModelLoadError
    from gpt_shape_tracer.tracer import cache_class_run

    try:
        model, tokenizer = load_through_transformers(args)
        run = cache_class_run(model, tokenizer, args.prompt[0], args.cache, args.steps)
    except (ModelLoadError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sentence, _ = cache_class_takeaway(run)
    if args.json:
        print(json.dumps({
            "cache": run.cache, "class": run.class_name, "layers": list(run.kinds()), "tokens": list(run.tokens),
            "text": tokenizer.decode(list(run.tokens)), "generate_settings": run.generate_settings, "note": run.note,
            "takeaway": sentence,
            "steps": [{"step": s.step, "token": s.token, "max_abs_delta": s.max_abs_delta, "bytes": s.nbytes,
                       "reference_bytes": s.reference_bytes,
                       "layers": [{"layer": h.layer, "kind": h.kind, "keys_shape": list(h.keys_shape),
                                   "dtype": h.dtype, "bytes": h.nbytes, "seen": h.seen, "held": h.held,
                                   "reserved": h.reserved, "first_held": h.first_held, "device": h.device,
                                   "max_row_error": max(h.row_error, default=None)} for h in s.layers],
                       "events": [{"kind": ev.kind, "layer": ev.layer, "indices": list(ev.indices),
                                   "detail": ev.detail} for ev in s.events]} for s in run.steps]},
            ensure_ascii=False))
        return 0
    if run.note:
        print(f"note: {run.note}")
    for s in run.steps:
        h = s.layers[0]
        print(f"step {s.step}: token {s.token}, layer 0 holds {h.held} of {h.seen} positions "
              f"({h.reserved} reserved, {h.dtype}, {h.device}), {s.nbytes:,} B in all, |Δ logits| "
              f"{s.max_abs_delta:.3g}")
        for event in s.events:
            print(f"  {event.sentence()}")
    print(sentence)
    return 0
