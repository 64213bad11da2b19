"""GPT shape tracer: every tensor of a GPT's forward, step by step. ``import gpt_shape_tracer as gst``.

The user-facing API in one place::

    import gpt_shape_tracer as gst

    model, tokenizer = gst.load_bundled("story-gpt")       # or gst.load_model("path/or/org-name")
    gen = gst.TracedGeneration(model, tokenizer, ["Once upon a time"])
    gen.run(4)                                              # the prefill and three decode steps
    print(gen.trace.to_frame(step=3)[["name", "shape"]])    # every tensor of step 3
    gst.save_trace(gen.trace, "trace.zip")

The names are imported on first use, so ``gpt-shape-tracer --help`` and this import itself cost nothing: torch
is loaded when a name that needs it is first read.

One installed name. The rooms are subpackages of this one: ``gpt_shape_tracer.model`` (our GPT, where models come
from), ``gpt_shape_tracer.tracer`` (recording, reading, saving), ``gpt_shape_tracer.figures`` (pure figure
functions), and the app's side, ``gpt_shape_tracer.session`` and ``gpt_shape_tracer.gui``. The repository keeps
them as top-level folders (``model/``, ``tracer/``, …); in a checkout this package reaches them through links
(``gpt_shape_tracer/model -> ../model``), and the wheel copies them in (pyproject.toml), so a checkout, an editable
install and an installed wheel import the same names, and a ``model.py`` of yours never meets ours.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.3.0"

# name -> the room it comes from (one table: __all__ and the lazy lookup both read it)
API: dict[str, str] = {
    **dict.fromkeys(("load_model", "load_hf", "load_bundled", "load_nanogpt", "load_tokenizer", "BUNDLED_MODELS",
                     "GPT", "GPTConfig", "KVCache", "ModelLoadError", "SamplingConfig", "TextTokenizer", "generate",
                     "save_hf"), "model"),
    **dict.fromkeys(("Tracer", "TracedGeneration", "BeamSearch", "SpeculativeDecoding", "Trace", "save_trace",
                     "load_trace", "TraceFileError",
                     "ablate",
                     "patch", "logit_lens", "direct_logit_attribution", "diff_traces", "attention_gradients",
                     "gradient_trace", "head_scores", "activation_patching", "dry_run", "costed_dry_run", "costs_frame",
                     "step_floor", "place", "kv_cache_bytes", "ACCELERATORS", "collectives", "collectives_sentence"),
                    "tracer"),
}
API.update(dict.fromkeys(("trace_engine", "EngineRun", "engine_sizing", "save_engine_run", "load_engine_run"),
                         "tracer"))  # the KV cache as serving engines hold it (tracer/engine/)
ROOMS = ("model", "tracer", "figures")  # the subpackages ``gst.<room>`` reaches lazily
__all__ = [*API, *ROOMS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in ROOMS:
        return importlib.import_module(f"{__name__}.{name}")
    if name in API:
        return getattr(importlib.import_module(f"{__name__}.{API[name]}"), name)
    raise AttributeError(f"module 'gpt_shape_tracer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *API, *ROOMS])
