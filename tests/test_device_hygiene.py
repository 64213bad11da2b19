"""Device hygiene without a GPU: every tensor a step creates follows the model's device.

Code that creates a tensor without saying where (``torch.zeros(n)``, ``torch.tensor(rows)``) puts it on the default
device — the CPU — and then mixes it with a model on a GPU: an error there, or a silent copy per record. On a CPU-only
machine such code runs, so a plain test cannot see it. Here the *default* device is the meta device for the whole
step: a tensor created without a device lands on meta, and a dispatch mode writes down every operation that produced
a meta tensor, with the line of our code that called it. A model on the CPU, whose code names its devices, produces
none. (The meta device needs no GPU; the step's real values are still computed on the CPU.)"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import load_bundled
from tracer import TracedGeneration, ablate
from tracer.experiments import (
    attention_gradients,
    cache_precision,
    direct_logit_attribution,
    gradient_trace,
    logit_lens,
    replay,
)

ROOT = Path(__file__).resolve().parent.parent
OURS = tuple(str(ROOT / part) for part in ("model", "tracer", "figures", "session.py", "tests/test_device_hygiene.py"))


class _ImplicitDevice(TorchDispatchMode):
    """Writes down each operation that produced a tensor on the meta device, and our line that called it."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.device.type == "meta":
                ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(OURS)]
                where = f"{ours[-1].filename[len(str(ROOT)) + 1:]}:{ours[-1].lineno} {ours[-1].line}" if ours else "?"
                self.found.setdefault(where, str(func))
        return out


@contextmanager
def implicit_device_is_meta() -> Iterator[_ImplicitDevice]:
    mode = _ImplicitDevice()
    torch.set_default_device("meta")
    try:
        with mode:
            yield mode
    finally:
        torch.set_default_device(None)


def created_on_meta(work: Callable[[], object]) -> dict[str, str]:
    with implicit_device_is_meta() as mode:
        work()
    return mode.found


@pytest.fixture(scope="module", params=["story-gpt", "story-llama"])
def bundled_model(request):
    return load_bundled(request.param)


@pytest.mark.parametrize(("padding_side", "use_cache", "capture"), [
    ("left", True, "values"), ("right", True, "values"), ("left", False, "values"), ("right", False, "values"),
    ("right", True, "ops"), ("left", True, "shapes")])
def test_a_step_creates_every_tensor_where_the_model_is(bundled_model, padding_side, use_cache, capture):
    model, tok = bundled_model
    gen = TracedGeneration(model, tok, ["Tom had a red kite.", "Lily ran."], use_cache=use_cache, capture=capture,
                           padding_side=padding_side, temperature=0.8, top_k=20, seed=3)
    assert created_on_meta(lambda: gen.run(3)) == {}
    assert gen.facts.n_steps == 3  # the steps really ran, on the CPU


def test_every_experiment_creates_its_tensors_where_the_model_is(bundled_model):
    model, tok = bundled_model
    gen = TracedGeneration(model, tok, ["Tom had a red kite.", "Lily ran."], padding_side="right", seed=3)
    gen.run(2)
    experiments = {
        "replay with an ablation": lambda: replay(gen, 1, [ablate("blocks.0.attn.hook_z", head=0)]),
        "logit lens": lambda: logit_lens(gen.trace, 1, 1, model=model),
        "direct logit attribution": lambda: direct_logit_attribution(gen.trace, 1, 1, model=model),
        "attention gradients": lambda: attention_gradients(gen, 1, 1, 0, 1),
        "gradient trace": lambda: gradient_trace(gen, 1),
        "a cheaper cache": lambda: cache_precision(gen, "int8", steps=2),
    }
    found = {name: created_on_meta(work) for name, work in experiments.items()}
    assert found == dict.fromkeys(experiments, {})


def test_the_check_sees_a_tensor_created_without_a_device(bundled_model):
    """The check itself: a line that forgets the device is found, with where it is."""
    model, tok = bundled_model

    def forgetful() -> None:
        torch.ones(model.config.d_model)  # no device: the default one

    found = created_on_meta(forgetful)
    assert any("torch.ones(model.config.d_model)" in where for where in found)
