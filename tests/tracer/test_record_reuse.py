"""A tensor recorded twice in a row (a module's output, then the next module's input) is described once and, where
it must be copied, copied once — and described afresh when it changed in between."""

from __future__ import annotations

import torch
from torch import nn

from gpt_shape_tracer.tracer import Tracer


class TwoSteps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def _unsqueeze_in_place(module, args):
    args[0].unsqueeze_(0)  # the same tensor object, reshaped in place (its version counter moves)


def test_a_tensor_reshaped_in_place_between_its_two_records_is_described_afresh():
    model = TwoSteps()
    model.second.register_forward_pre_hook(_unsqueeze_in_place)  # before the tracer's: runs first
    with torch.no_grad(), Tracer(model, capture="shapes") as tr:
        model(torch.randn(3, 4))
    out, into = tr.trace.record("first:out"), tr.trace.record("second:in[0]")
    assert out.shape == (3, 4) and into.shape == (1, 3, 4)


def test_the_same_tensor_recorded_twice_is_described_alike():
    model = TwoSteps()
    with torch.no_grad(), Tracer(model, capture="shapes") as tr:
        model(torch.randn(3, 4))
    out, into = tr.trace.record("first:out"), tr.trace.record("second:in[0]")
    assert (out.shape, out.dtype, out.device) == (into.shape, into.dtype, into.device) == ((3, 4), "float32", "cpu")
    raw = tr.trace.log._raw
    assert raw[out.index][6:] == raw[into.index][6:]  # the same address too


def test_copy_all_copies_a_tensor_recorded_twice_in_a_row_once():
    """copy="all" keeps a private copy of every value; the output of one module and the input of the next are one
    tensor, so one copy serves both records (two were made before: twice the bytes, twice the time)."""
    model = TwoSteps()
    with torch.no_grad(), Tracer(model, capture="values", copy="all") as tr:
        model(torch.randn(3, 4))
    trace = tr.trace
    out, into = trace.get("first:out"), trace.get("second:in[0]")
    assert out is not None and into is not None
    assert out.data_ptr() == into.data_ptr()
    assert out.data_ptr() != trace.get("first:in[0]").data_ptr()  # a copy, not the model's tensor
    torch.testing.assert_close(out, model.first(trace.get("first:in[0]")), rtol=0, atol=0)


def test_copy_all_copies_again_after_an_in_place_write_between_the_records():
    model = TwoSteps()

    def add_one(module, args):
        args[0].add_(1.0)

    model.second.register_forward_pre_hook(add_one)
    x = torch.randn(3, 4)
    with torch.no_grad(), Tracer(model, capture="values", copy="all") as tr:
        model(x)
    trace = tr.trace
    out, into = trace.get("first:out"), trace.get("second:in[0]")
    assert out is not None and into is not None
    torch.testing.assert_close(into, out + 1.0)  # each record holds the numbers it saw
