"""Tensors inside the nested tuples, lists and dicts a module takes or returns."""

from __future__ import annotations

from typing import Any

import torch

MAX_TENSORS = 256  # per argument list or output: beyond this a call's tensors are not recorded one by one


def flatten_tensors(obj: Any, prefix: str = "", out: list | None = None, depth: int = 0, limit: int = MAX_TENSORS
                    ) -> list:
    """``[(slot, tensor)]`` for every tensor inside nested tuples, lists and dicts, at most ``limit``."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        if len(out) < limit:
            out.append((prefix, obj))
    elif depth < 6:
        if isinstance(obj, (tuple, list)):
            for i, item in enumerate(obj):
                if len(out) >= limit:
                    break
                flatten_tensors(item, f"{prefix}[{i}]", out, depth + 1, limit)
        elif isinstance(obj, dict):
            for key, item in obj.items():
                if len(out) >= limit:
                    break
                flatten_tensors(item, f"{prefix}.{key}", out, depth + 1, limit)
    return out
