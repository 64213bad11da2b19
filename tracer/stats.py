"""Tensor statistics and the one-line summary, in the spirit of lovely-tensors.

``tensor[1, 4, 5, 5] f32 n=100 x∈[0.000, 1.000] μ=0.200 σ=0.310`` — and NaN or
±∞ shouted (``NaN!×3``), except −∞ where a mask is meant to hold it.

Statistics are computed when asked for (a table, a summary, an eviction), not
during the forward, so they never dominate the cost of tracing.
"""

from __future__ import annotations

import math

import torch

from tracer.records import TensorStats

_SHORT_DTYPES = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "bool",
}


def short_dtype(dtype: str) -> str:
    return _SHORT_DTYPES.get(dtype, dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@torch.no_grad()
def tensor_stats(t: torch.Tensor) -> TensorStats:
    x = t.detach()
    if x.is_complex():
        x = x.abs()
    if not x.is_floating_point():
        x = x.to(torch.float64 if x.dtype == torch.int64 else torch.float32)
    if x.numel() == 0:
        return TensorStats(math.nan, math.nan, math.nan, math.nan)
    finite_mask = torch.isfinite(x)
    n_finite = int(finite_mask.sum())
    nan = pos_inf = neg_inf = 0
    if n_finite != x.numel():
        nan = int(torch.isnan(x).sum())
        pos_inf = int((x == math.inf).sum())
        neg_inf = int((x == -math.inf).sum())
        x = x[finite_mask]
    zeros = int((x == 0).sum())
    if x.numel() == 0:
        return TensorStats(math.nan, math.nan, math.nan, math.nan, nan, pos_inf, neg_inf, zeros)
    lo, hi = torch.aminmax(x)
    xd = x.double() if x.dtype != torch.float64 else x
    std, mean = torch.std_mean(xd, correction=0)
    return TensorStats(float(lo), float(hi), float(mean), float(std), nan, pos_inf, neg_inf, zeros)


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.3f}"


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}B"


def anomalies(stats: TensorStats, neg_inf_expected: bool = False) -> list[str]:
    """The loud part: NaN and ±∞ counts (−∞ only when no mask explains it)."""
    out = []
    if stats.nan:
        out.append(f"NaN!×{stats.nan}")
    if stats.pos_inf:
        out.append(f"+∞!×{stats.pos_inf}")
    if stats.neg_inf and not neg_inf_expected:
        out.append(f"−∞!×{stats.neg_inf}")
    return out


def summarize(
    shape: tuple[int, ...], dtype: str, stats: TensorStats | None, neg_inf_expected: bool = False
) -> str:
    numel = math.prod(shape)
    head = f"tensor[{', '.join(map(str, shape))}] {short_dtype(dtype)} n={numel}"
    if stats is None:
        return head + " (values not kept)"
    if numel == 0:
        return head + " empty"
    parts = [head]
    if not math.isnan(stats.min):
        parts.append(f"x∈[{_fmt(stats.min)}, {_fmt(stats.max)}] μ={_fmt(stats.mean)} σ={_fmt(stats.std)}")
    if stats.neg_inf and neg_inf_expected:
        parts.append(f"−∞×{stats.neg_inf} (masked)")
    parts.extend(anomalies(stats, neg_inf_expected))
    if stats.zeros == numel and numel > 1:
        parts.append("all zeros")
    return " ".join(parts)
