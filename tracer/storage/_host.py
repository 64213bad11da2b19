"""Kept values on their way to the host: each copy started as its record is added, waited for once per step.

A blocking ``value.to("cpu")`` per kept record made a GPU stop for every tensor of every layer: Python waited for
the device to finish everything queued, then for the copy, and only then queued the forward's next kernel. Now a
CUDA tensor's copy is queued with ``non_blocking=True`` into pinned (page-locked) host memory, which is what lets
the device copy it while Python goes on: on the tensor's stream, behind the kernel that made the tensor and ahead
of any later one, so it copies the numbers as they were recorded, exactly as the blocking copy did (the same values,
dtype, shape and strides, and the same bytes charged to the budget). Python queues the rest of the forward
meanwhile; the step waits once, per device, before anything reads the copies (``TraceLog`` keeps the devices with
copies in flight and waits at the step's end, or earlier if a reader or an eviction needs a copy during the step).

The CPU goes through the same two functions: a CPU value that must be copied (``copy="all"``, an inference-mode
tensor) is cloned here, and its "wait" has nothing to wait for. Devices other than CUDA copy with a blocking
``to("cpu")`` (correct everywhere; their asynchronous copies differ from backend to backend).

A cost of pinned memory: PyTorch's pinned-host allocator rounds each block up to a power of two and keeps freed
blocks for reuse, so the host memory behind the kept values can be up to twice what the budget counts."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def start_host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory, which may still be landing: read it only after ``wait_for_host_copies``
    of ``t``'s device has returned."""
    if t.is_cuda:
        return t.to("cpu", non_blocking=True)  # pinned host memory, queued on t's stream
    if t.is_cpu:
        return t.clone()
    return t.to("cpu")


def wait_for_host_copies(devices: Iterable[torch.device]) -> None:
    """Return once every copy ``start_host_copy`` started from ``devices`` has landed: one wait per device."""
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def on_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the host: those there as they are, the others copied together (one wait per device, not
    one per tensor)."""
    away = {t.device for t in tensors if not t.is_cpu}
    out = [t if t.is_cpu else start_host_copy(t) for t in tensors]
    wait_for_host_copies(away)
    return out
