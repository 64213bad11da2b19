"""The KV cache: per layer, the keys and values of every position seen so far.

The seed's argument (001, "KV caching"): each row of K and V depends only on
its own token, so earlier rows never change. A decode step computes K, V (and
Q) for the one new position, appends the new rows here, and attends with the
full K, V: ``[B,H,1,d_head] @ [B,H,d_head,t] -> [B,H,1,t]``.

Updates are transactional: layers stage their new rows during a forward, and
the model commits them only when the whole forward succeeded, so a forward
that raises leaves the cache exactly as it was.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values ``[B, H, t, d_head]`` per layer, plus what padding they hold."""

    def __init__(self, n_layer: int, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.n_layer = n_layer
        self.batch_size = batch_size
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.key_is_token: torch.Tensor | None = None  # [B, t] bool, None while nothing is padding
        self.last_positions: torch.Tensor | None = None  # positions of the newest forward, [B|1, n]
        self._length = 0
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        """t of the next forward before its new positions: how many positions are cached."""
        return self._length

    def check_batch(self, batch: int) -> None:
        if batch != self.batch_size:
            raise ValueError(f"this cache holds {self.batch_size} sequence(s) but the tokens have batch size {batch}")

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage the new rows ``[B,H,n,d_head]`` of ``layer``; return the full ``[B,H,t,d_head]``."""
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is None or old_v is None:
            full_k, full_v = k, v
        else:
            full_k = torch.cat([old_k, k], dim=2)  # [B,H,t−n,d_head] ++ [B,H,n,d_head] -> [B,H,t,d_head]
            full_v = torch.cat([old_v, v], dim=2)
        self._staged[layer] = (full_k, full_v)
        return full_k, full_v

    def commit(self, n: int, key_is_token: torch.Tensor | None, positions: torch.Tensor) -> None:
        """Make the staged rows of a successful forward of ``n`` new positions permanent."""
        if len(self._staged) != self.n_layer:
            missing = sorted(set(range(self.n_layer)) - set(self._staged))
            self._staged.clear()
            raise RuntimeError(f"KV cache commit with layers {missing} not updated in this forward")
        for layer, (k, v) in self._staged.items():
            self.keys[layer], self.values[layer] = k, v
        self._staged.clear()
        self._length += n
        self.key_is_token = key_is_token
        self.last_positions = positions

    def rollback(self) -> None:
        """Forget whatever a failed forward staged."""
        self._staged.clear()

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values over all layers."""
        return sum(int(t.numel() * t.element_size()) for t in (*self.keys, *self.values) if t is not None)

    def __repr__(self) -> str:
        shape = list(self.keys[0].shape) if self.keys[0] is not None else None
        return f"KVCache(n_layer={self.n_layer}, length={self.length}, keys per layer {shape})"
