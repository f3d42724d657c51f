"""Per-layer KV cache on the layer's device with ``truncate(n)`` rollback.

Storage grows by doubling, so appending one token is a slice copy, not a re-allocation;
``truncate`` only moves the length (the stale tail is overwritten by the next append).
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_head_kv: int, head_dim: int, *, device: torch.device,
                 dtype: torch.dtype = torch.float32, capacity: int = 256):
        self.k = torch.empty(n_head_kv, capacity, head_dim, device=device, dtype=dtype)
        self.v = torch.empty_like(self.k)
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v: (H_kv, T, D). Returns the cached keys/values (H_kv, length, D) incl. these."""
        t = k.shape[1]
        need = self.length + t
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            k_new = self.k.new_empty(self.k.shape[0], cap, self.k.shape[2])
            v_new = self.v.new_empty(k_new.shape)
            k_new[:, :self.length] = self.k[:, :self.length]
            v_new[:, :self.length] = self.v[:, :self.length]
            self.k, self.v = k_new, v_new
        self.k[:, self.length:need] = k
        self.v[:, self.length:need] = v
        self.length = need
        return self.k[:, :need], self.v[:, :need]

    def truncate(self, n: int) -> None:
        """Keep the first n positions (rollback of rejected draft tokens)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
