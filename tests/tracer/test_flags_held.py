"""A shapes trace's NaN/∞ flags of small tensors are held until read (tracer/storage/_stats.py
``FLAG_LATER_ELEMENTS``): read together, they are each tensor's own as it was recorded — or, where the model wrote
the tensor in place before the flag was read, not made up; and what is held is bounded."""

from __future__ import annotations

import gc
import math
import weakref

import torch
from torch import nn

from gpt_shape_tracer.model import GPT, GPTConfig
from gpt_shape_tracer.tracer import Finite, Tracer
from gpt_shape_tracer.tracer.storage._stats import FLAGS_HELD_ELEMENTS


class Poisons(nn.Module):
    """Writes NaN into its input in place, in its own code (no ``inplace`` attribute says so)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(math.nan)


def _flags(trace, step: int) -> dict[str, int]:
    return {r.name: trace.finite_flag(r) for r in trace.filter(step=step)}


def test_a_tensor_written_in_place_before_its_flag_is_read_is_not_called_clean():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Poisons())
    with torch.no_grad(), Tracer(model, capture="shapes") as tr:
        model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    trace = tr.trace
    first, second = _flags(trace, 0), _flags(trace, 1)
    # the Linear's output was finite when recorded and NaN when its step ended: not checked, and said so; from
    # the next step on, that module's tensors are checked as they are recorded
    assert first["0:out"] == first["1:in[0]"] == Finite.UNKNOWN
    assert "written in place after it was recorded" in trace.value_note(trace.record("0:out", 0))
    assert second["0:out"] == second["1:in[0]"] == Finite.CLEAN
    assert first["1:out"] == second["1:out"] == first["model:out"] == Finite.BAD


def test_a_module_that_says_it_writes_in_place_has_its_input_checked_before():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    with torch.no_grad():
        model[0].bias.fill_(-math.inf)  # every output −∞, which the ReLU then writes to 0
        with Tracer(model, capture="shapes") as tr:
            model(torch.randn(2, 4))
    flags = _flags(tr.trace, 0)
    assert flags["0:out"] == flags["1:in[0]"] == Finite.NEG_INF
    assert flags["1:out"] == flags["model:out"] == Finite.CLEAN


def test_held_checks_are_bounded_and_read_by_a_reader_mid_run():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16384, n_ctx=256, d_model=32, n_head=2, n_layer=2)
    model = GPT(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1, 200))
    held = []
    with torch.no_grad(), Tracer(model, capture="shapes") as tr:
        cache = model.new_cache(1)
        model(tokens[:, :8], cache)
        for i in range(8, 158):  # 150 steps: more than the bound holds, and not a multiple of it
            logits = model(tokens[:, i : i + 1], cache)
            held.append(weakref.ref(logits))
            del logits
    gc.collect()
    alive = sum(ref() is not None for ref in held)
    # each step holds a [1, 1, 16384] logits and the small residual stream until the flags are read or the
    # bound is reached: fewer than bound / logits size steps' logits may still be alive
    assert alive < FLAGS_HELD_ELEMENTS // cfg.vocab_size + 1, alive
    assert alive > 0  # the last steps' are held, unread
    trace = tr.trace
    last = trace.filter(step=len(trace.steps) - 1)
    assert all(trace.finite_flag(r) == Finite.CLEAN for r in last if r.name in ("hook_logits",))
    gc.collect()
    assert sum(ref() is not None for ref in held) == 0  # read: nothing held any more


def test_a_tensor_the_caller_writes_before_reading_its_flag_is_not_called_clean():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    with torch.no_grad(), Tracer(model, capture="shapes") as tr:
        out = model(torch.randn(2, 4))
    out.fill_(math.nan)
    rec = tr.trace.record("model:out", 0)
    assert tr.trace.finite_flag(rec) == Finite.UNKNOWN
    assert "written in place after it was recorded" in tr.trace.value_note(rec)
    assert tr.trace.finite_flag(tr.trace.record("model:in[0]", 0)) == Finite.CLEAN


class PoisonsFromItsSecondCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.mul_(math.nan) if self.calls > 1 else x


def test_a_write_after_checks_were_read_mid_step_is_still_found_when_the_step_ends():
    """A reader asks for an earlier step's flag in the middle of a step (all held checks are read then); a tensor
    recorded after that and written in place before the step ends is found when the step ends, so the next step
    checks that module's tensors as they are recorded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), PoisonsFromItsSecondCall())
    steps = []

    def reader(module, args, output):
        if len(steps) == 1:  # in the second step, before the Linear's output is recorded
            tr.trace.finite_flag(tr.trace.record("model:in[0]", 0))

    model[0].register_forward_hook(reader)
    with torch.no_grad(), Tracer(model, capture="shapes") as tr:
        for _ in range(3):
            model(torch.randn(2, 4))
            steps.append(None)
    flags = [_flags(tr.trace, step) for step in range(3)]
    assert flags[0]["0:out"] == Finite.CLEAN and flags[1]["0:out"] == Finite.UNKNOWN
    assert flags[1]["1:out"] == flags[2]["1:out"] == Finite.BAD
    assert flags[2]["0:out"] == Finite.CLEAN  # checked as recorded, before the write
