"""Where a step would run: an accelerator's roofline from its public spec sheet.

An op can finish no sooner than its arithmetic at the chip's peak rate, nor sooner than its bytes at the memory's
bandwidth: ``floor = max(FLOPs / peak, bytes / bandwidth)``. Whichever term is larger says whether the op is
compute-bound or memory-bound. A step's floor is the sum of its ops' floors (they run one after another): a lower
bound on its time, reached by no real kernel. The point shows in the numbers: a decode step multiplies one
row per sequence by every weight matrix, ~1 FLOP per byte of weight read, far below any GPU's
peak/bandwidth ratio (hundreds of FLOPs per byte), so it is memory-bound; a long prefill is compute-bound.

Peak rates are the dense (no structured sparsity) tensor-core rates the vendors state for bfloat16/float16, and
the plain FP32 rate for float32 (PyTorch does not use TF32 for float32 matrix products unless asked). Bytes are
the bytes an op reads (weights and activations) and writes, as if nothing stayed in cache: a floor, again. A
mixture-of-experts step reads the experts its router picks, which a dry run cannot know: its floor is a range, from
every token on the same k experts to as many experts hit as the tokens' choices can reach (``OpCost.spread_bytes``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from gpt_shape_tracer.tracer.costs._counter import OpCost

Bound = Literal["compute", "memory"]
TERA = 1e12


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: dict[str, float]  # dtype name → dense FLOP/s
    bandwidth: float  # bytes/s
    memory_bytes: int
    source: str  # where the numbers were read

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["float32"])


GB = 10**9
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    # NVIDIA H100 datasheet, SXM column: BF16/FP16 tensor 1,979 TFLOPS with sparsity (989.5 dense), FP32 67 TFLOPS,
    # HBM3 3.35 TB/s, 80 GB
    Accelerator("H100 SXM", {"bfloat16": 989.5 * TERA, "float16": 989.5 * TERA, "float32": 67 * TERA},
                3.35e12, 80 * GB, "https://www.nvidia.com/en-us/data-center/h100/"),
    # NVIDIA H200 datasheet, SXM column: BF16/FP16 tensor 1,979 TFLOPS with sparsity, FP32 67 TFLOPS, 4.8 TB/s, 141 GB
    Accelerator("H200 SXM", {"bfloat16": 989.5 * TERA, "float16": 989.5 * TERA, "float32": 67 * TERA},
                4.8e12, 141 * GB, "https://www.nvidia.com/en-us/data-center/h200/"),
    # NVIDIA A100 datasheet, 80GB SXM column: BF16/FP16 tensor 312 TFLOPS dense, FP32 19.5 TFLOPS, 2,039 GB/s, 80 GB
    Accelerator("A100 80GB SXM", {"bfloat16": 312 * TERA, "float16": 312 * TERA, "float32": 19.5 * TERA},
                2.039e12, 80 * GB, "https://www.nvidia.com/en-us/data-center/a100/"),
    # NVIDIA L4 datasheet: BF16/FP16 tensor 242 TFLOPS with sparsity (121 dense), FP32 30.3 TFLOPS, 300 GB/s, 24 GB
    Accelerator("L4", {"bfloat16": 121 * TERA, "float16": 121 * TERA, "float32": 30.3 * TERA},
                300e9, 24 * GB, "https://www.nvidia.com/en-us/data-center/l4/"),
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090 column: FP16/BF16 tensor with FP32 accumulate
    # 165.2 TFLOPS dense, FP32 82.6 TFLOPS, 1,008 GB/s GDDR6X, 24 GB
    Accelerator("RTX 4090", {"bfloat16": 165.2 * TERA, "float16": 165.2 * TERA, "float32": 82.6 * TERA},
                1008e9, 24 * GB,
                "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"),
    # Apple's M1 Max announcement: 32-core GPU, 10.4 TFLOPS (FP32; Apple states no separate half-precision rate),
    # 400 GB/s, up to 64 GB unified memory
    Accelerator("Apple M1 Max", {"float32": 10.4 * TERA}, 400e9, 64 * GB,
                "https://www.apple.com/newsroom/2021/10/introducing-m1-pro-and-m1-max-the-most-powerful-chips-apple-"
                "has-ever-built/"),
)}


def measure_this_cpu(size: int = 1024, copy_bytes: int = 256 << 20) -> Accelerator:
    """This machine's CPU, measured now (not a spec sheet): the best of 3 float32 ``size``² matrix products and the
    best of 3 copies of ``copy_bytes`` (read + write). A shared machine measures lower than it would alone."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = min(_timed(lambda: a @ b) for _ in range(3))
    src = torch.empty(copy_bytes // 4)
    dst = torch.empty_like(src)
    copy = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    flops = 2 * size**3 / best
    import os

    return Accelerator("this CPU (measured)", {"float32": flops}, 2 * copy_bytes / copy, _memory_bytes(),
                       f"measured here: {size}² float32 matmul, {copy_bytes >> 20} MiB copy, "
                       f"{os.cpu_count()} cores visible")


def _memory_bytes() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


@dataclass(frozen=True)
class OpFloor:
    op: OpCost
    compute_s: float
    memory_s: float

    @property
    def seconds(self) -> float:
        return max(self.compute_s, self.memory_s)

    @property
    def bound(self) -> Bound:
        return "compute" if self.compute_s >= self.memory_s else "memory"

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved."""
        moved = self.op.read_bytes + self.op.written_bytes
        return self.op.flops / moved if moved else float("inf")


def op_floors(ops: tuple[OpCost, ...] | list[OpCost], accelerator: Accelerator, dtype: str,
              spread: bool = False) -> list[OpFloor]:
    """Each op's floor; ``spread``: with the most experts a mixture-of-experts op can read (``spread_bytes``)."""
    peak = accelerator.peak(dtype)
    return [OpFloor(op, op.flops / peak, (op.read_bytes + op.written_bytes + (op.spread_bytes if spread else 0))
                    / accelerator.bandwidth) for op in ops]


@dataclass(frozen=True)
class StepFloor:
    """A step's time floor on one accelerator, and how much of it is memory-bound."""

    accelerator: str
    seconds: float
    compute_seconds: float  # the floors of the compute-bound ops
    memory_seconds: float  # the floors of the memory-bound ops
    flops: int
    bytes_moved: int
    spread_seconds: float = 0.0  # the floor when the tokens' expert choices hit as many experts as they can (0: the
    # step reads no experts a router picks, or its choices can reach no more than k)

    @property
    def bound(self) -> Bound:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    def describe(self) -> str:
        share = self.memory_seconds / self.seconds if self.seconds else 0.0
        floor = (f"at least {_time(self.seconds)} with every token on the same k experts, "
                 f"{_time(self.spread_seconds)} with as many experts hit as the tokens' choices reach"
                 if self.spread_seconds > self.seconds else f"at least {_time(self.seconds)}")
        return (f"{self.accelerator}: {floor} — {share:.0%} of it in memory-bound ops "
                f"({self.flops / max(self.bytes_moved, 1):.1f} FLOPs per byte moved): {self.bound}-bound")


def step_floor(ops: tuple[OpCost, ...] | list[OpCost], accelerator: Accelerator, dtype: str) -> StepFloor:
    floors = op_floors(ops, accelerator, dtype)
    compute = sum(f.seconds for f in floors if f.bound == "compute")
    memory = sum(f.seconds for f in floors if f.bound == "memory")
    spread = sum(f.seconds for f in op_floors(ops, accelerator, dtype, spread=True)) \
        if any(op.spread_bytes for op in ops) else 0.0
    return StepFloor(accelerator.name, compute + memory, compute, memory, sum(op.flops for op in ops),
                     sum(op.read_bytes + op.written_bytes for op in ops), spread)


def _time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"
