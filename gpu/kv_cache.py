"""Per-layer KV cache on the layer's device with ``truncate(n)`` rollback.

Storage grows by doubling, so appending one token is a slice copy, not a re-allocation;
``truncate`` only moves the length (the stale tail is overwritten by the next append).
Doubling stops at ``max_cells`` (the planner's cell count for the context), so the cache never
holds more than the plan counted.
"""
from __future__ import annotations

import numpy as np
import torch


class KVCache:
    def __init__(self, n_head_kv: int, head_dim: int, *, device: torch.device,
                 dtype: torch.dtype = torch.float32, capacity: int = 256, max_cells: int | None = None):
        if max_cells is not None:
            capacity = min(capacity, max_cells)
        self.max_cells = max_cells
        self.k = torch.empty(n_head_kv, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.length = 0
        self._raw: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (H_kv, T, D). Returns the cached keys/values (H_kv, length, D) incl. these."""
        need = self.reserve(k.shape[1])
        self.k[:, self.length:need] = k
        self.v[:, self.length:need] = v
        self.length = need
        return self.k[:, :need], self.v[:, :need]

    def reserve(self, t: int) -> int:
        """Make room for t more positions (a compiled block writes them in place, then
        advances ``length``); returns length + t."""
        need = self.length + t
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            if self.max_cells is not None:
                cap = max(need, min(cap, self.max_cells))   # past max_cells only if asked to
            k_new = self.k.new_empty(self.k.shape[0], cap, self.k.shape[2])
            v_new = self.v.new_empty(k_new.shape)
            k_new[:, :self.length] = self.k[:, :self.length]
            v_new[:, :self.length] = self.v[:, :self.length]
            self.k, self.v = k_new, v_new
            self._raw = None
        return need

    def raw(self) -> tuple[np.ndarray, np.ndarray]:
        """The CPU storage of k and v as uint8 numpy views (H_kv, cells, D · element size),
        no copy; kept until the storage grows (compiled CPU blocks write and read it)."""
        if self._raw is None:
            self._raw = (self.k.view(torch.uint8).numpy(), self.v.view(torch.uint8).numpy())
        return self._raw

    def truncate(self, n: int) -> None:
        """Keep the first n positions (rollback of rejected draft tokens)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
