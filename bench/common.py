"""Shared benchmark helpers: machine description, interleaved timing, GPT-2-small-shaped weights."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d"),
    }


def interleaved(fns: dict[str, Callable[[], None]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
    """Time each function ``repeats`` times, alternating between them so drift hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats):
        order = list(fns.items()) if r % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return times


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def gpt2_small_dir() -> Path:
    """A Hugging Face GPT-2 small (124M) with random weights, saved locally (built once, no download)."""
    target = Path(tempfile.gettempdir()) / "gpt2-small-random"
    if (target / "model.safetensors").exists() and (target / "tokenizer.json").exists():
        return target
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt_shape_tracer.model.sources import BUNDLED_DIR

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0)).eval()
    hf.save_pretrained(target)
    # no GPT-2 tokenizer may be downloaded: the bundled byte-level tokenizer stands in (its ids fit in V)
    (target / "tokenizer.json").write_bytes((BUNDLED_DIR / "tokenizer.json").read_bytes())
    return target


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
