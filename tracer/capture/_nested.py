"""Tensors inside the nested tuples, lists and dicts a module takes or returns."""

from __future__ import annotations

from typing import Any

import torch

MAX_TENSORS = 256  # per argument list or output: beyond this a call's tensors are not recorded one by one
_CONTAINERS = (tuple, list, dict)


def flatten_tensors(obj: Any, prefix: str = "", out: list | None = None, depth: int = 0, limit: int = MAX_TENSORS
                    ) -> list:
    """``[(slot, tensor)]`` for every tensor inside nested tuples, lists and dicts, at most ``limit``.

    An item that is a tensor is taken, and one that is neither a tensor nor a container skipped, without a call of
    its own: a decode step flattens every block's and attention's arguments (the residual stream, the mask, the
    cache, RoPE's cos and sin), and a Python call each was most of the time."""
    if out is None:
        out = []
    if isinstance(obj, torch.Tensor):
        if len(out) < limit:
            out.append((prefix, obj))
        return out
    if depth >= 6:
        return out
    if isinstance(obj, (tuple, list)):
        items: Any = enumerate(obj)
        brackets = True
    elif isinstance(obj, dict):
        items = obj.items()
        brackets = False
    else:
        return out
    for key, item in items:
        if len(out) >= limit:
            break
        if isinstance(item, torch.Tensor):
            out.append((f"{prefix}[{key}]" if brackets else f"{prefix}.{key}", item))
        elif isinstance(item, _CONTAINERS):
            flatten_tensors(item, f"{prefix}[{key}]" if brackets else f"{prefix}.{key}", out, depth + 1, limit)
    return out
