"""Per-layer KV cache on the layer's device with ``truncate(n)`` rollback.

Storage grows by doubling, so appending one token is a slice copy, not a re-allocation;
``truncate`` only moves the length (the stale tail is overwritten by the next append).
Doubling stops at ``max_cells`` (the planner's cell count for the context), so the cache never
holds more than the plan counted.

``head_dim_v=0`` makes a K-only cache: MLA's compressed latent (one row of
``kv_lora_rank + rope dims`` per token, whose first ``kv_lora_rank`` values serve as V), as
llama.cpp's V-less MLA cache and the planner count it.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_head_kv: int, head_dim: int, *, head_dim_v: int | None = None,
                 device: torch.device, dtype: torch.dtype = torch.float32, capacity: int = 256,
                 max_cells: int | None = None):
        if max_cells is not None:
            capacity = min(capacity, max_cells)
        self.max_cells = max_cells
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.k = torch.empty(n_head_kv, capacity, head_dim, device=device, dtype=dtype)
        self.v = (torch.empty(n_head_kv, capacity, head_dim_v, device=device, dtype=dtype)
                  if head_dim_v else None)
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def _grow(self, t: torch.Tensor, cap: int) -> torch.Tensor:
        new = t.new_empty(t.shape[0], cap, t.shape[2])
        new[:, :self.length] = t[:, :self.length]
        return new

    def append(self, k: torch.Tensor, v: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k, v: (H_kv, T, D) (v None for a K-only cache). Returns the cached keys/values
        (H_kv, length, D) incl. these (values None for a K-only cache)."""
        t = k.shape[1]
        need = self.length + t
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            if self.max_cells is not None:
                cap = max(need, min(cap, self.max_cells))   # past max_cells only if asked to
            self.k = self._grow(self.k, cap)
            if self.v is not None:
                self.v = self._grow(self.v, cap)
        self.k[:, self.length:need] = k
        if self.v is not None:
            self.v[:, self.length:need] = v
        self.length = need
        return self.k[:, :need], (None if self.v is None else self.v[:, :need])

    def truncate(self, n: int) -> None:
        """Keep the first n positions (rollback of rejected draft tokens)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)
