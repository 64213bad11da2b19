"""GPT shape tracer: every tensor of a GPT's forward, step by step. ``import gpt_shape_tracer as gst``.

The user-facing API in one place (the rooms of the code are ``model``, ``tracer`` and ``figures``)::

    import gpt_shape_tracer as gst

    model, tokenizer = gst.load_bundled("story-gpt")       # or gst.load_model("path/or/org-name")
    gen = gst.TracedGeneration(model, tokenizer, ["Once upon a time"])
    gen.run(4)                                              # the prefill and three decode steps
    print(gen.trace.to_frame(step=3)[["name", "shape"]])    # every tensor of step 3
    gst.save_trace(gen.trace, "trace.zip")

The names are imported on first use, so ``gpt-shape-tracer --help`` and this import itself cost nothing: torch
is loaded when a name that needs it is first read.

The rooms are installed as top-level modules beside this package (``model``, ``tracer``, ``figures``, …). A
file of the same name in the working directory (your own ``model.py``) comes first on ``sys.path`` for
``python -c`` and ``python -m``: the rooms are therefore always imported from here, wherever Python looks first.
The package also holds the installed front doors: the ``gpt-shape-tracer`` command (``cli``) and the
process-wide choices a front end makes for itself (``memory``).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HOME = str(Path(__file__).resolve().parent.parent)  # the folder holding model/, tracer/, figures/, session.py
ROOMS = ("model", "tracer", "figures", "session")

# name -> the room it comes from (one table: __all__ and the lazy lookup both read it)
API: dict[str, str] = {
    **dict.fromkeys(("load_model", "load_hf", "load_bundled", "load_nanogpt", "load_tokenizer", "BUNDLED_MODELS",
                     "GPT", "GPTConfig", "KVCache", "ModelLoadError", "SamplingConfig", "TextTokenizer", "generate",
                     "save_hf"), "model"),
    **dict.fromkeys(("Tracer", "TracedGeneration", "Trace", "save_trace", "load_trace", "TraceFileError", "ablate",
                     "patch", "logit_lens", "direct_logit_attribution", "diff_traces", "attention_gradients",
                     "gradient_trace", "head_scores", "activation_patching", "dry_run", "costed_dry_run", "costs_frame",
                     "step_floor", "place", "kv_cache_bytes", "ACCELERATORS", "collectives", "collectives_sentence"),
                    "tracer"),
}
__all__ = [*API, "figures", "room"]


def room(name: str) -> ModuleType:
    """The room ``name`` ("model", "tracer", "figures", "session") as installed beside this package, never a
    same-named module of the working directory. Refused with the file's path if another ``name`` was imported
    first (Python keeps one module per name)."""
    if name not in ROOMS:
        raise ValueError(f"{name!r} is not one of gpt-shape-tracer's rooms: {', '.join(ROOMS)}")
    module = sys.modules.get(name)
    if module is None:
        sys.path.insert(0, HOME)  # for this import (and the rooms it imports in turn) only
        try:
            module = importlib.import_module(name)
        finally:
            sys.path.remove(HOME)  # the first occurrence: the one inserted above
    where = getattr(module, "__file__", None) or ""
    if not Path(where).resolve().is_relative_to(HOME):
        raise ImportError(f"the module {name!r} was already imported from {where or 'a built-in'}, not from "
                          f"gpt-shape-tracer ({HOME}): rename your own {name}.py, or import gpt_shape_tracer first")
    return module


def __getattr__(name: str) -> Any:
    if name == "figures":
        return room("figures")
    if name in API:
        for needed in ("model", "tracer"):  # tracer imports model: both from here, in that order
            room(needed)
        return getattr(room(API[name]), name)
    raise AttributeError(f"module 'gpt_shape_tracer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *API, "figures"])
