"""What the trace command's other paths (``--num-beams``, ``--assistant-model`` / ``--prompt-lookup``,
``--cache``, ``--continuous-batching``) share: the options none of them takes, the greedy-only rule (both checked
without torch), and loading the named model through transformers for the paths that need its own classes."""

from __future__ import annotations

import argparse
from pathlib import Path

# options of the plain path that a decoding path does not take
OTHER_PATHS = ("dry_run", "no_cache", "chat", "html", "html_run", "out", "num_beams", "continuous_batching")


def refuse_others(args: argparse.Namespace, path: str, allowed: tuple[str, ...] = ()) -> None:
    """A ``ValueError`` naming the first option of ``OTHER_PATHS`` (less ``allowed``) given with ``path``."""
    for name in OTHER_PATHS:
        if name not in allowed and getattr(args, name, None):
            raise ValueError(f"--{name.replace('_', '-')} does not go with {path}")


def refuse_sampling(args: argparse.Namespace, why: str) -> None:
    """A ``ValueError`` when sampling is asked for on a greedy path (``why`` says which and why)."""
    if args.temperature != 0 or args.top_k or args.top_p is not None:
        raise ValueError(f"{why}: no --temperature, --top-k or --top-p")


def load_through_transformers(args: argparse.Namespace):
    """(model, tokenizer) of ``--model-dir`` (or the bundled ``--model``) as transformers runs it, with
    ``--tokenizer`` in place of its own; a ``ValueError`` when there is none."""
    from gpt_shape_tracer.model import load_hf, load_tokenizer
    from gpt_shape_tracer.model.sources import ASSETS

    directory = Path(args.model_dir).expanduser() if args.model_dir else ASSETS / args.model
    model, tokenizer = load_hf(directory, implementation="transformers", dtype=args.dtype, device=args.device)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer, model.config.vocab_size)
    if tokenizer is None:
        raise ValueError(f"{directory} has no tokenizer (tokenizer.json or vocab.json + merges.txt): give one with "
                         "--tokenizer")
    return model, tokenizer
