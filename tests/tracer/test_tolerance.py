"""The cross-CPU tolerance (tests/tolerance.py) admits another CPU's rounding and nothing more."""

from __future__ import annotations

import pytest
import torch

from tests.tolerance import assert_close_across_cpus, close_across_cpus, cross_cpu_atol


def test_a_reordered_sum_passes_and_a_real_error_fails():
    torch.manual_seed(0)
    a, b = torch.randn(64, 512), torch.randn(512, 64) * 6
    blocked = sum(a[:, i:i + 64] @ b[i:i + 64] for i in range(0, 512, 64))  # another summation order
    assert not torch.equal(a @ b, blocked) and close_across_cpus(blocked, a @ b)
    wrong = (a @ b).clone()
    wrong[3, 5] += 1e-3 * (a @ b).abs().max()  # a thousandth of the magnitude: a bug, not rounding
    assert not close_across_cpus(wrong, a @ b)
    with pytest.raises(AssertionError, match="exceeds"):
        assert_close_across_cpus(wrong, a @ b, "product")


def test_the_bound_scales_with_the_magnitude_and_the_dtype():
    assert cross_cpu_atol(torch.tensor([48.0])) == pytest.approx(48 * cross_cpu_atol(torch.tensor([1.0])))
    assert cross_cpu_atol(torch.tensor([0.001])) == cross_cpu_atol(torch.tensor([1.0]))  # never below one unit
    assert cross_cpu_atol(torch.tensor([1.0], dtype=torch.bfloat16)) > 1000 * cross_cpu_atol(torch.tensor([1.0]))


def test_infinities_must_match_exactly():
    x = torch.tensor([0.0, float("-inf"), 1.0])
    assert close_across_cpus(x.clone(), x)
    assert not close_across_cpus(torch.tensor([0.0, 0.0, 1.0]), x)
    assert not close_across_cpus(torch.tensor([0.0, float("-inf")]), x[:2].neg())
