"""The settings every sentence-producing function is run over (issue 41): the prefill and decode steps of a
cached generation, the cache off, left and right padding of a batch, a sliding window and a soft-cap (Gemma 2,
run by transformers), a trace saved and loaded back, and both bundled models. Each generation runs three greedy
steps, so step 0 is a prefill and steps 1, 2 are decode steps (recomputes with the cache off)."""

from __future__ import annotations

import tempfile
from pathlib import Path

PROMPTS = ["Once upon a time, there was a little girl named Lily.", "Tom ran"]
STEPS = 3


def build_matrix() -> dict:
    """name → (generation or None, trace). A loaded trace has no live generation."""
    from gpt_shape_tracer.model import load_bundled, load_hf
    from gpt_shape_tracer.model.sources import ASSETS
    from gpt_shape_tracer.tracer import TracedGeneration, load_trace, save_trace
    from tests.hf_architectures import build

    gpt, tok = load_bundled("story-gpt")
    llama, llama_tok = load_bundled("story-llama")
    directory = build("gemma2", Path(tempfile.mkdtemp(prefix="gemma2-")) / "gemma2", ASSETS / "story-gpt" /
                      "tokenizer.json")
    gemma, gemma_tok = load_hf(directory)
    runs = {
        "story-gpt": (gpt, tok, PROMPTS[0], {}),
        "cache off": (gpt, tok, PROMPTS[0], {"use_cache": False}),
        "left padding": (gpt, tok, PROMPTS, {}),
        "right padding": (gpt, tok, PROMPTS, {"padding_side": "right"}),
        "story-llama": (llama, llama_tok, PROMPTS, {}),
        "gemma2 (window, soft-cap)": (gemma, gemma_tok, PROMPTS, {}),
    }
    matrix = {}
    for name, (model, tokenizer, prompt, options) in runs.items():
        gen = TracedGeneration(model, tokenizer, prompt, temperature=0, **options)
        gen.run(STEPS)
        matrix[name] = (gen, gen.trace)
    path = Path(tempfile.mkdtemp(prefix="loaded-")) / "left.zip"
    save_trace(matrix["left padding"][1], path)
    matrix["loaded trace"] = (None, load_trace(path))
    return matrix
