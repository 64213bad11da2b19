"""Tensor statistics, the cheap finiteness flag, and the one-line summary (in the spirit of lovely-tensors).

``tensor[1, 4, 5, 5] f32 n=100 x∈[0.000, 1.000] μ=0.200 σ=0.310`` — and NaN or
±∞ shouted (``NaN!×3``), except −∞ where a mask is meant to hold it.

Cost matters: a 1024-token GPT-2 prefill produces gigabytes of activations, and
a record's statistics are taken once, when its value is first looked at or when
the byte budget evicts it. From 4096 float32 values they take one pass of the
kernel in ``tracer/storage/_fused.py`` (min, max, Σx, Σx² of the finite values and the
NaN/±∞ counts together: 3–4 ms for a 46 MB attention stage on 2 cores,
``bench/bench_stats.py``). Without it — no C compiler, another dtype, a small
tensor — PyTorch's reductions do it: ``aminmax`` (which also tells whether any
NaN or ±∞ is there: NaN propagates, ±∞ shows as the extreme), ``sum`` and a
chunked sum of squares, and a mask's −∞ has a path of its own. Either way the
mean and σ come from Σx and Σx²; where that loses precision (a mean far larger
than the spread) or, on the PyTorch path, where the tensor holds NaN, an exact
slower path takes over.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterator, Sequence

import torch

from gpt_shape_tracer.tracer.storage import _fused as fused
from gpt_shape_tracer.tracer.storage.records import Finite, TensorStats

_SHORT_DTYPES = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "bool",
}
_DTYPE_NAMES: dict[torch.dtype, str] = {}
_CANCELLATION = 1e-2  # var/mean² below this: Σx²/n − mean² would lose too many digits in float32
_CHUNK = 4096
FUSED_NUMEL = 4096  # from here the one-pass kernel (tracer/storage/_fused.py), where it could be built, takes them
# past this many elements a tensor is read block by block (``value_blocks``): a float32 copy of a bf16 value, the
# contiguous copy of a strided one, a flag per element — each at most this many elements (64 MiB of float32),
# however large the tensor (an 8 GiB record, or a stride-0 view claiming 8 GiB over a few bytes)
WHOLE_UP_TO = 1 << 24


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"`` (cached: the tracer's hot path calls this per tensor)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def short_dtype(dtype: str) -> str:
    return _SHORT_DTYPES.get(dtype, dtype)


def _as_float(t: torch.Tensor) -> torch.Tensor:
    x = t.detach()
    if x.is_complex():
        x = x.abs()
    if not x.is_floating_point():
        x = x.to(torch.float64 if x.dtype == torch.int64 else torch.float32)
    elif x.dtype in (torch.float16, torch.bfloat16):
        x = x.float()  # reductions in float32: half precision would round the sums away
    if x.numel() > 65536 and not x.is_contiguous():
        x = x.contiguous()  # reductions over a strided view run several times slower than the copy costs
    return x


def value_blocks(t: torch.Tensor, most: int = WHOLE_UP_TO) -> Iterator[torch.Tensor]:
    """Views of ``t`` that together hold each element once, each of at most ``most`` elements (``t`` itself
    when it is that small): slices of the first dimension, or of one index of it and then of the next."""
    if t.numel() <= most or t.dim() == 0:
        yield t
        return
    if t.dim() == 1:
        for a in range(0, t.shape[0], most):
            yield t[a:a + most]
        return
    per_index = t[0].numel()
    step = max(1, most // max(1, per_index))
    for a in range(0, t.shape[0], step):
        if step == 1:
            yield from value_blocks(t[a], most)
        else:
            yield t[a:a + step]


def _combined(parts: list[TensorStats], numels: list[int]) -> TensorStats:
    """The statistics of a tensor from those of its blocks: extremes and counts added up; the mean and σ by
    Chan's pairwise update (each block's Σ(x − x̄)² = n·σ², shifted to the common mean), exact in float64."""
    nan = sum(p.nan for p in parts)
    pos, neg = sum(p.pos_inf for p in parts), sum(p.neg_inf for p in parts)
    finite = [(numel - p.nan - p.pos_inf - p.neg_inf, p) for p, numel in zip(parts, numels)]
    finite = [(k, p) for k, p in finite if k > 0]
    count = sum(k for k, _ in finite)
    if count == 0:
        return TensorStats(math.nan, math.nan, math.nan, math.nan, nan, pos, neg)
    mean = math.fsum(k * p.mean for k, p in finite) / count
    m2 = math.fsum(k * p.std * p.std + k * (p.mean - mean) ** 2 for k, p in finite)
    return TensorStats(min(p.min for _, p in finite), max(p.max for _, p in finite), mean,
                       math.sqrt(max(m2 / count, 0.0)), nan, pos, neg)


@torch.no_grad()
def tensor_stats(t: torch.Tensor) -> TensorStats:
    if t.numel() > WHOLE_UP_TO:  # block by block: the copies below stay bounded whatever the tensor's size
        parts = list(value_blocks(t.detach(), WHOLE_UP_TO))
        return _combined([_block_stats(b) for b in parts], [b.numel() for b in parts])
    return _block_stats(t)


def _block_stats(t: torch.Tensor) -> TensorStats:
    x = _as_float(t)
    n = x.numel()
    if n == 0:
        return TensorStats(math.nan, math.nan, math.nan, math.nan)
    if n >= FUSED_NUMEL:
        one_pass = fused.moments(x)
        if one_pass is not None:
            return _from_moments(x, one_pass)
    lo, hi = (float(v) for v in torch.aminmax(x))
    if math.isnan(lo) or math.isnan(hi):
        return _exact_stats(x)
    if math.isinf(lo) or math.isinf(hi):
        return _stats_around_inf(x, lo, hi)
    return _moments(x, x, n, lo, hi)


def _from_moments(x: torch.Tensor, m: fused.Moments) -> TensorStats:
    """The statistics from one pass of the fused kernel (the same numbers as the passes below take)."""
    if m.finite == 0:
        return TensorStats(math.nan, math.nan, math.nan, math.nan, m.nan, m.pos_inf, m.neg_inf)
    mean = m.sum / m.finite
    var = m.sum_sq / m.finite - mean * mean if m.finite > 1 else 0.0
    if (mean != 0 and var <= _CANCELLATION * mean * mean) or not math.isfinite(var):
        return _exact_stats(x)  # the rare ill-conditioned tensor: an exact pass in float64
    return TensorStats(m.min, m.max, mean, math.sqrt(max(var, 0.0)), m.nan, m.pos_inf, m.neg_inf)


def _moments(x: torch.Tensor, summed: torch.Tensor, count: int, lo: float, hi: float,
             nan: int = 0, pos_inf: int = 0, neg_inf: int = 0) -> TensorStats:
    """Mean and σ of ``count`` finite values from Σx and Σx² over ``summed`` (x with any ±∞ set to 0)."""
    mean = float(summed.sum()) / count
    if count == 1:
        return TensorStats(lo, hi, mean, 0.0, nan, pos_inf, neg_inf)
    var = _sum_of_squares(summed) / count - mean * mean
    if (mean != 0 and var <= _CANCELLATION * mean * mean) or not math.isfinite(var):
        return _exact_stats(x)  # the rare ill-conditioned tensor: an exact pass in float64
    return TensorStats(lo, hi, mean, math.sqrt(max(var, 0.0)), nan, pos_inf, neg_inf)


def _sum_of_squares(x: torch.Tensor) -> float:
    """Σx², accurate: norms of 4096-element chunks in float32 (each short enough to stay exact to ~1e-7),
    their squares summed in float64 — one pass at memory speed, where a single float32 norm over 12M
    elements drifts by 1e-3."""
    flat = x.reshape(-1)
    if flat.numel() <= 65536:
        return float(flat.double().square().sum())
    whole = flat.numel() // _CHUNK * _CHUNK
    total = float(torch.linalg.vector_norm(flat[:whole].view(-1, _CHUNK), dim=1).double().square().sum())
    return total + float(flat[whole:].double().square().sum())


def _stats_around_inf(x: torch.Tensor, lo: float, hi: float) -> TensorStats:
    """Finite values and ±∞ but no NaN — a mask's −∞ is the common case: count the infinities, then the
    moments with them set to 0; the finite extremes come from the same zero-filled copy when its sign
    settles them (a finite minimum below 0 is the minimum whatever the zeros), else from one more pass."""
    x = x.reshape(-1)
    flags, floats = _scratch(x.numel(), x.dtype)
    is_neg = torch.isneginf(x, out=flags) if lo == -math.inf else None
    neg = int(torch.count_nonzero(is_neg)) if is_neg is not None else 0  # count_nonzero: 10× a bool sum
    is_pos = None
    if hi == math.inf:
        is_pos = torch.isposinf(x, out=flags if is_neg is None else None)
    pos = int(torch.count_nonzero(is_pos)) if is_pos is not None else 0
    count = x.numel() - neg - pos
    if count == 0:
        return TensorStats(math.nan, math.nan, math.nan, math.nan, 0, pos, neg)
    zeroed = torch.nan_to_num(x, posinf=0.0, neginf=0.0, out=floats)
    zlo, zhi = (float(v) for v in torch.aminmax(zeroed))
    moments = _moments(x, zeroed, count, lo, hi, 0, pos, neg)
    # the zeros in place of ±∞ hide a finite extreme of the same sign as the zeros: then the infinities are
    # set to the far end instead, in the same scratch buffer (the moments are taken already)
    far = torch.finfo(x.dtype).max  # finite, and no finite value passes it
    if is_neg is not None:
        lo = zlo if zlo < 0 else float(torch.nan_to_num(x, posinf=far, neginf=far, out=floats).amin())
    if is_pos is not None:
        hi = zhi if zhi > 0 else float(torch.nan_to_num(x, posinf=-far, neginf=-far, out=floats).amax())
    return dataclasses.replace(moments, min=lo, max=hi)


_SCRATCH_MAX = 1 << 24  # elements: buffers kept for tensors up to 64 MB of float32 (a 1024² attention stage)
_scratch_of = threading.local()  # per thread: two sessions of the app may take statistics at once


def _scratch(n: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A bool and a ``dtype`` buffer of ``n`` elements reused from call to call on this thread (None when
    ``n`` is too large to keep): writing into memory already mapped is 2–3× faster than into a fresh
    allocation, which is what the mask's −∞ path would otherwise make twice per attention tensor."""
    if n > _SCRATCH_MAX:
        return None, None
    held = getattr(_scratch_of, "buffers", {})
    flags, floats = held.get(dtype, (None, None))
    if flags is None or flags.numel() < n:
        flags, floats = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=dtype)
        held[dtype] = (flags, floats)
        _scratch_of.buffers = held
    return flags[:n], floats[:n]


def _exact_stats(x: torch.Tensor) -> TensorStats:
    finite = torch.isfinite(x)
    nan = int(torch.count_nonzero(torch.isnan(x)))
    pos_inf = int(torch.count_nonzero(torch.isposinf(x)))
    neg_inf = int(torch.count_nonzero(torch.isneginf(x)))
    values = x[finite]
    if values.numel() == 0:
        return TensorStats(math.nan, math.nan, math.nan, math.nan, nan, pos_inf, neg_inf)
    lo, hi = torch.aminmax(values)
    std, mean = torch.std_mean(values.double(), correction=0)
    return TensorStats(float(lo), float(hi), float(mean), float(std), nan, pos_inf, neg_inf)


# a flagged tensor of at most this many elements is held until its flag is read, and checked then with the others
# held, one reduction per shape (``flags_of_tensors``): a decode step's residual stream and logits. A larger one is
# reduced as it is recorded (``flag_range``), so that a long prefill does not hold its residual stream
FLAG_LATER_ELEMENTS = 1 << 16
# held until read, at most this many elements (16 MiB of complex128, 4 MiB of float32: a dozen GPT-2 decode steps)
# or this many records: then read together when a step ends
FLAGS_HELD_ELEMENTS = 1 << 20
FLAGS_HELD_RECORDS = 4096


@torch.no_grad()
def finite_flag(t: torch.Tensor) -> int:
    """``Finite.CLEAN`` / ``NEG_INF`` / ``BAD`` of one tensor, read at once: its smallest and largest elements
    say it (NaN carries through both; +∞ is the largest, −∞ the smallest). A step batches its flags instead
    (``flag_range`` or ``flags_of_tensors``, read together by ``flags_of_ranges``)."""
    r = flag_range(t)
    return r if isinstance(r, int) else flags_of_ranges([r])[0]


def flag_range(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | int:
    """``(min, max)`` of ``t``, two 0-d tensors left where ``t`` is (no host read), or the flag itself when no
    reduction is needed: ``UNKNOWN`` for a meta tensor (a dry run: a shape and a dtype, no values), ``CLEAN``
    for integers and empty tensors. Taken from ``t.detach()``: no autograd graph without ``torch.no_grad``,
    whose context costs more than the reduction of a decode step's ``[1, 1, d]``."""
    x = _flaggable(t)
    return x if isinstance(x, int) else torch.aminmax(x)


def _flaggable(t: torch.Tensor) -> torch.Tensor | int:
    if t.is_meta:
        return Finite.UNKNOWN
    x = t.detach()
    if not (x.is_floating_point() or x.is_complex()) or x.numel() == 0:
        return Finite.CLEAN
    return torch.view_as_real(x) if x.is_complex() else x


@torch.no_grad()
def flags_of_tensors(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The flags of many tensors, in order. Those of one device, dtype and shape (a decode step's residual
    stream: [1, 1, d] each) are stacked and reduced together, min and max along each one's elements; all are
    read to the host together — where a reduction per record cost a dispatch per record. Each tensor is asked
    for its device, dtype and shape only: what else decides its flag (a meta tensor, an integer or empty one) is
    the same for its whole group, asked of the group's first (the held checks of 14 GPT-2 decode steps, 518
    tensors, took 2.4 ms asked one by one)."""
    flags: list[int] = [Finite.UNKNOWN] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype, torch.Size], list[int]] = {}
    for i, t in enumerate(tensors):
        key = (t.device, t.dtype, t.shape)
        members = groups.get(key)
        if members is None:
            groups[key] = [i]
        else:
            members.append(i)
    order: list[int] = []
    ranges: list[tuple[torch.Tensor, torch.Tensor]] = []
    for members in groups.values():
        first = _flaggable(tensors[members[0]])
        if isinstance(first, int):  # the same answer for every member: same device, dtype and shape
            for i in members:
                flags[i] = first
            continue
        order += members
        if len(members) == 1:
            ranges.append(torch.aminmax(first))
        else:  # [k, …] -> [k, numel]: each row one tensor (a stack, so no autograd graph: no_grad here)
            stacked = _flaggable(torch.stack([tensors[i] for i in members]))
            assert not isinstance(stacked, int)  # the first member's device, dtype and shape: flaggable as it is
            ranges.append(_row_ranges(stacked.view(len(members), -1)))
    for i, flag in zip(order, flags_of_ranges(ranges)):
        flags[i] = flag
    return flags


def _row_ranges(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(min, max)`` of each row of ``rows`` (NaN carries through both). On the CPU as two reductions: there
    ``aminmax`` along a dimension runs a scalar loop, ten times slower than ``amin`` and ``amax`` together (a decode
    step's 36 residual-stream rows of 768 float32: 62.6 against 6.5 µs, AMD EPYC, one thread)."""
    if rows.is_cpu:
        return rows.amin(dim=1), rows.amax(dim=1)
    return torch.aminmax(rows, dim=1)


@torch.no_grad()
def flags_of_ranges(ranges: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """The flags of ``(min, max)`` pairs (0-d, or ``[k]`` for k tensors), in order, read to the host together:
    one concatenation and one transfer per device among them — per step, not per record (on a GPU each read
    waits for the device)."""
    groups: dict[torch.device, list[int]] = {}
    for i, (lo, _) in enumerate(ranges):
        groups.setdefault(lo.device, []).append(i)
    flags: list[list[int]] = [[] for _ in ranges]
    for members in groups.values():
        # the lows of every member one vector, the highs another (cat promotes mixed dtypes; a wider one holds any
        # narrower), and each one's flag worked out there: NaN makes both ends NaN, +∞ is the largest, −∞ the
        # smallest (a Python call per flag cost a held step's 500-odd checks 0.2 ms)
        sizes = [ranges[i][0].numel() for i in members]
        lows = torch.cat([ranges[i][0].reshape(-1) for i in members])
        highs = torch.cat([ranges[i][1].reshape(-1) for i in members])
        read = torch.where(highs.isnan() | (highs == math.inf), Finite.BAD,
                           torch.where(lows == -math.inf, Finite.NEG_INF, Finite.CLEAN)).tolist()
        at = 0
        for i, k in zip(members, sizes):
            flags[i] = read[at : at + k]
            at += k
    return [f for fl in flags for f in fl]


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if v != 0 and (abs(v) >= 1e4 or abs(v) < 1e-3):
        return f"{v:.2e}"
    return f"{v:.3f}"


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


DRY_RUN = "no values (dry run)"  # what a record of a meta-device run says where a value or statistic would be


def summarize(shape: tuple[int, ...], dtype: str, stats: TensorStats | None, neg_inf_expected: bool = False,
              flag: int = Finite.UNKNOWN, dry_run: bool = False) -> str:
    """The one-line summary. Without statistics (values not kept) it still shouts a non-finite flag; a record of
    a dry run (a model on the meta device) says it has no values."""
    numel = math.prod(shape)
    head = f"tensor[{', '.join(map(str, shape))}] {short_dtype(dtype)} n={numel}"
    if dry_run:
        return f"{head}, {DRY_RUN}"
    if stats is None:
        loud = " NaN/+∞ present!" if flag == Finite.BAD else (
            " −∞ present!" if flag == Finite.NEG_INF and not neg_inf_expected else "")
        return head + " (values not kept)" + loud
    if numel == 0:
        return head + " empty"
    parts = [head]
    if not math.isnan(stats.min):
        parts.append(f"x∈[{_fmt(stats.min)}, {_fmt(stats.max)}] μ={_fmt(stats.mean)} σ={_fmt(stats.std)}")
    if stats.neg_inf and neg_inf_expected:
        parts.append(f"−∞×{stats.neg_inf} (masked)")
    parts.extend(anomalies(stats, neg_inf_expected))
    if stats.all_zero and numel > 1:
        parts.append("all zeros")
    return " ".join(parts)
