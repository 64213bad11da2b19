"""How close two float tensors must be when they were computed on different CPUs.

One rule for every test that compares values computed here with values stored from another run or machine
(the trace files in tests/data/, the numbers the docs print, figures in training.json).

Why not a fixed ``atol``: PyTorch picks its CPU kernels by instruction set (AVX-512, AVX2 or plain code;
``ATEN_CPU_CAPABILITY`` forces one) and each sums a dot product's products in a different order. In float32
each reordered sum of k terms moves by at most about log2(k) rounding steps of its largest partial sum
(pairwise and blocked summation), and a forward pass chains a few dozen such sums (two matmuls per
projection, the softmax's sum, the norms). So the difference scales with the *magnitude* of the values,
not with a constant: a stored trace's step-1 records, up to ~48 in size, differed by up to 1.14e-5 on an
Intel Xeon against the AMD EPYC that wrote them — 2.0 rounding steps of float32 at that magnitude.

``CROSS_CPU_ULPS`` rounding steps of the tensor's largest magnitude, in the tensor's own dtype, is the bound:
32 leaves room for sixteen times what was observed, and is still 10⁴ times smaller than any bug the tests
look for (a wrong mask, a wrong head, a missing scale move values by 1e-2 of their size or more).
"""

from __future__ import annotations

import torch

CROSS_CPU_ULPS = 32


def cross_cpu_atol(expected: torch.Tensor, ulps: int = CROSS_CPU_ULPS) -> float:
    """The absolute tolerance for values like ``expected`` computed by another CPU's kernels: ``ulps`` rounding
    steps of its dtype at its largest magnitude (at least 1, so that tensors of tiny values are not held to
    a tolerance smaller than the rounding of the larger values they were computed from)."""
    dtype = expected.dtype if expected.is_floating_point() else torch.float32
    scale = max(1.0, float(expected.detach().abs().max())) if expected.numel() else 1.0
    return ulps * torch.finfo(dtype).eps * scale


def close_across_cpus(actual: torch.Tensor, expected: torch.Tensor, ulps: int = CROSS_CPU_ULPS) -> bool:
    """``actual`` equals ``expected`` up to another CPU's float rounding (see the module's docstring)."""
    if actual.shape != expected.shape:
        return False
    if not expected.is_floating_point():
        return bool(torch.equal(actual, expected))
    diff = (actual.double() - expected.double()).abs()
    finite = torch.isfinite(expected)
    if not torch.equal(finite, torch.isfinite(actual)) or not torch.equal(actual[~finite], expected[~finite]):
        return False  # an inf or NaN must be the same inf or NaN
    return bool(diff[finite].max() <= cross_cpu_atol(expected[finite], ulps)) if finite.any() else True


def assert_close_across_cpus(actual: torch.Tensor, expected: torch.Tensor, what: str = "",
                             ulps: int = CROSS_CPU_ULPS) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if close_across_cpus(actual, expected, ulps):
        return
    diff = (actual.double() - expected.double()).abs().nan_to_num(float("inf")).max().item()
    raise AssertionError(f"{what}: max |Δ| {diff:.3g} exceeds {cross_cpu_atol(expected, ulps):.3g} "
                         f"({ulps} rounding steps of {expected.dtype} at the values' largest magnitude)")
