"""Freed memory kept for reuse: the page faults behind a slow traced prefill, and how to avoid them.

A GPT-2-small prefill of 1024 tokens allocates and frees gigabytes: each attention stage is a 48 MB tensor
per layer. glibc's malloc serves blocks that large with a fresh ``mmap`` and returns them to the system when
they are freed, so the next one faults its pages in again, and the kernel zeroes each page first. Keeping
values makes it worse: the kept tensors stop the allocator reusing its heap in between. On the machine of
docs/benchmarks.md (``python bench/bench_scale.py``, with and without ``--malloc default``: results in
bench/results/scale.json and scale-default-malloc.json), a values trace of that prefill had the kernel map
1876 MiB of fresh pages with glibc's defaults and 6 MiB with freed memory kept; the traced/untraced ratio
went ×1.91 → ×1.40 (×2.83 → ×1.13 at 128 tokens), and a ``TracedGeneration`` prefill of 984 tokens
1.69 → 1.47 s.

``reuse_freed_memory()`` asks glibc to serve every block from its heap (no ``mmap``) and to give memory back
to the system only past 2 GiB free at the top of the heap. The price is that the process keeps the memory of
its largest forward: what a long-running app tracing long prompts wants, and what the PyTorch CUDA caching
allocator does on a GPU. The app and the command line call it; a library user decides for themselves.

``freeze_imports()`` does for Python's cyclic garbage collector what the first does for malloc. A full collection
walks every object the collector tracks — in the app's process about 410,000 after the imports of torch,
transformers, Streamlit, plotly and pandas, 0.2 s a walk on this machine — and the figures a Step builds promote
enough objects to start one every few Steps (an Attention Step: one in three, measured with ``gc.callbacks`` under
AppTest). Frozen (``gc.freeze``), the imports' objects are left out of every later collection; they are modules,
classes and functions that live as long as the process, and reference counting still frees any that goes. The app's
server calls it once, after its imports; a library user decides for themselves.
"""

from __future__ import annotations

import ctypes
import gc
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h: bytes free at the top of the heap before it is returned
M_MMAP_MAX = -4  # how many blocks may be served by mmap at once (0: none)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: about 2 GiB


def reuse_freed_memory() -> bool:
    """Keep freed memory in the process for reuse (glibc only); True if the allocator took the setting.
    Affects the whole process from now on, and cannot fail: elsewhere it does nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: glibc's malloc
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def return_freed_memory() -> bool:
    """Hand the memory the process has freed back to the system now (glibc's ``malloc_trim``): what
    ``reuse_freed_memory`` keeps for the next forward, given back when a session's trace is gone for good.
    True if glibc did; elsewhere it does nothing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return bool(trim(0))


def freeze_imports() -> int:
    """Collect the garbage there is now, then move every object the cyclic collector still tracks out of its
    reach for good (``gc.freeze``): call it once, after the imports and before the work. Returns how many objects
    are frozen. Objects made afterwards are collected as ever; a cycle among frozen ones would not be."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
