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

import numpy as np
import torch


class KVCache:
    start = 0      # the position of the oldest row kept (a window cache drops old rows)

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
        self._raw: tuple[np.ndarray, np.ndarray] | None = None

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
        need = self.reserve(k.shape[1])
        self.k[:, self.length:need] = k
        if self.v is not None:
            self.v[:, self.length:need] = v
        self.length = need
        return self.k[:, :need], (None if self.v is None else self.v[:, :need])

    def reserve(self, t: int) -> int:
        """Make room for t more positions (a compiled block writes them in place, then
        advances ``length``); returns length + t."""
        need = self.length + t
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            if self.max_cells is not None:
                cap = max(need, min(cap, self.max_cells))   # past max_cells only if asked to
            self.k = self._grow(self.k, cap)
            if self.v is not None:
                self.v = self._grow(self.v, cap)
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
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)


class WindowKVCache(KVCache):
    """The cache of a sliding-window block: only the keys a query can still see are kept.

    Query p sees keys p - window + 1 .. p. ``length`` stays the number of positions seen (the
    sequence length); ``start`` is the position of the oldest row kept. The storage never
    exceeds ``max_cells`` (the planner's ``min(pad256(ctx), pad256(window + ubatch))``): when an
    append of T rows would overflow it, the rows older than the last ``window - 1`` are dropped
    first (one shift, amortised over many appends). Rolling back (``truncate``) works as far as
    the rows kept allow — always within the batch just appended, which is what speculative
    verify needs; further back raises."""

    def __init__(self, n_head_kv: int, head_dim: int, *, window: int, max_cells: int | None,
                 device: torch.device, dtype: torch.dtype = torch.float32, head_dim_v: int | None = None):
        super().__init__(n_head_kv, head_dim, device=device, dtype=dtype, max_cells=max_cells,
                         head_dim_v=head_dim_v)
        self.window, self.start = window, 0

    def append(self, k: torch.Tensor, v: torch.Tensor | None = None):
        stored = self.length - self.start
        t = k.shape[1]
        if self.max_cells is not None and stored + t > self.max_cells and stored > self.window - 1:
            keep = self.window - 1
            drop = stored - keep
            for buf in (self.k, self.v):
                if buf is not None:          # K-only (head_dim_v=0): no V rows
                    buf[:, :keep] = buf[:, drop:stored].clone()
            self.start += drop
        # the parent appends at ``length``: shift the view so it indexes the stored rows
        self.length -= self.start
        try:
            return super().append(k, v)
        finally:
            self.length += self.start

    def truncate(self, n: int) -> None:
        if 0 <= n <= self.length and self.start > max(0, n - self.window + 1):
            raise ValueError(f"sliding-window cache keeps positions {self.start}..{self.length - 1}: "
                             f"cannot roll back to {n}")
        super().truncate(n)
