"""The one-pass statistics kernel (``fused_stats.c``), built on first use with the machine's C compiler.

``tracer.stats`` takes a record's statistics with PyTorch reductions: three passes over a clean tensor
(min and max together, Σx, Σx²) and up to seven over one holding a mask's −∞. A 984-token GPT-2-small prefill
evicts 44 attention tensors of 46 MB, and those passes were a third of the traced step. The kernel takes
everything in one pass — min, max, Σx, Σx² of the finite values and the NaN, +∞ and −∞ counts — split over
the threads PyTorch uses (ctypes lets go of the GIL during the call).

Built once per machine into a cache directory (``$XDG_CACHE_HOME/gpt-shape-tracer`` or
``~/.cache/gpt-shape-tracer``), named by a hash of the source, the compiler and the CPU, so a rebuilt
source or another machine never loads a stale library. No compiler, a failed build, or a platform without
one: ``available()`` is False, ``status()`` says why, and the statistics take the PyTorch path — the same
numbers, slower. Nothing is downloaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("fused_stats.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC")  # no -ffast-math: NaN and ±∞ compare as IEEE says
SPLIT_NUMEL = 1 << 20  # from 4 MB of float32, the work is split over PyTorch's threads
ALIGN = 32  # elements per split boundary: the kernel's stride (8 lanes × 4 ways)


class _Result(ctypes.Structure):
    _fields_ = [("sum", ctypes.c_double), ("sum_sq", ctypes.c_double), ("min", ctypes.c_float),
                ("max", ctypes.c_float), ("finite", ctypes.c_int64), ("nan", ctypes.c_int64),
                ("pos_inf", ctypes.c_int64), ("neg_inf", ctypes.c_int64)]


@dataclass(frozen=True)
class Moments:
    """What one pass over a float32 tensor gives: over its finite values, the count, min, max, Σx and Σx²
    (min/max ±∞ when there are none); and how many values are NaN, +∞ and −∞."""

    finite: int
    min: float
    max: float
    sum: float
    sum_sq: float
    nan: int
    pos_inf: int
    neg_inf: int


_lock = threading.Lock()
_kernel = None
_status = "not built yet"
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpt-shape-tracer"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build() -> tuple[object | None, str]:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        return None, "no C compiler (cc, gcc or clang) on PATH: statistics take the PyTorch path"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"the C compiler {compiler} did not run ({e}): statistics take the PyTorch path"
    key = hashlib.sha256("\0".join([SOURCE.read_text(), compiler, version, " ".join(FLAGS), _cpu(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"fused_stats-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
                                      capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    return None, f"building {SOURCE.name} failed: {done.stderr.strip()[-500:]}"
                os.replace(built, target)  # atomic: another process building at once loads a whole file
            for old in target.parent.glob("fused_stats-*.so"):  # builds of earlier sources or compilers
                if old != target:
                    old.unlink(missing_ok=True)
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"building {SOURCE.name} failed: {e}"
    try:
        library = ctypes.CDLL(str(target))
    except OSError as e:
        return None, f"loading {target} failed: {e}"
    try:
        kernel = library.fused_stats_f32
    except AttributeError:  # an odd $CC, or a file that is not our build: the PyTorch reductions instead
        return None, f"{target} has no fused_stats_f32 symbol: the PyTorch reductions are used instead"
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(_Result)]
    kernel.restype = None
    return kernel, f"built with {compiler} into {target}"


def _get_kernel():
    global _kernel, _status
    if _status == "not built yet":
        with _lock:
            if _status == "not built yet":
                _kernel, _status = _build()
    return _kernel


def available() -> bool:
    """Whether the kernel is built and loaded (building it on the first call)."""
    return _get_kernel() is not None


def status() -> str:
    """How the kernel was built, or why the statistics take the PyTorch path."""
    _get_kernel()
    return _status


def moments(t: torch.Tensor) -> Moments | None:
    """One pass over a contiguous float32 CPU tensor; None when the kernel is not available or ``t`` is not
    such a tensor."""
    kernel = _get_kernel()
    if kernel is None or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
        return None
    n = t.numel()
    address = t.data_ptr()
    parts = max(1, min(torch.get_num_threads(), n // SPLIT_NUMEL))
    step = -(-n // parts // ALIGN) * ALIGN
    spans = [(start, min(step, n - start)) for start in range(0, n, step)] if n else [(0, 0)]
    results = [_Result() for _ in spans]
    if len(spans) == 1:
        kernel(address, n, ctypes.byref(results[0]))
    else:
        pool = _workers(len(spans))
        waits = [pool.submit(kernel, address + 4 * start, size, ctypes.byref(r))
                 for (start, size), r in zip(spans, results)]
        for w in waits:
            w.result()
    return Moments(finite=sum(r.finite for r in results), min=min(r.min for r in results),
                   max=max(r.max for r in results), sum=sum(r.sum for r in results),
                   sum_sq=sum(r.sum_sq for r in results), nan=sum(r.nan for r in results),
                   pos_inf=sum(r.pos_inf for r in results), neg_inf=sum(r.neg_inf for r in results))


def _workers(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fused-stats"), n
        return _pool
