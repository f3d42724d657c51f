"""Rotary position embedding, NeoX style (rotate-half), optionally partial.

Only the first ``n_rot`` dims of each head are rotated (GLM-4.5: ``rope.dimension_count`` =
head_dim/2), the rest pass through — the same as llama.cpp's ``LLAMA_ROPE_TYPE_NEOX`` and HF's
``apply_rotary_pos_emb`` with ``partial_rotary_factor``. cos/sin tables grow on demand and are
kept on the device, so decoding never rebuilds them.

Per-call cost matters at decode (one token, tiny tensors, every op is dispatch overhead), so a
call is three elementwise ops and one gather, ``x·C + x[perm]·S``, with per-position factor
rows C = (cos, cos, 1…) and S = (−sin, sin, 0…) over the head dim and ``perm`` swapping the
two rotated halves. That is the same arithmetic as ``(x1·cos − x2·sin, x2·cos + x1·sin, rest)``
bit for bit (``a − b·s == a + b·(−s)`` in IEEE; ``x·1 + x·0 == x``). The rows for a
``positions`` tensor are built once and reused while the same tensor object comes back — the
model passes one per forward to every layer, for q and for k.
"""
from __future__ import annotations

import torch


class Rope:
    def __init__(self, n_rot: int, base: float, device: torch.device):
        if n_rot % 2:
            raise ValueError(f"rotary dims must be even, got {n_rot}")
        self.n_rot = n_rot
        self.device = device
        # float64 for the table itself so long positions keep their precision
        self.inv_freq = 1.0 / (base ** (torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot))
        self._cos = torch.empty(0, n_rot // 2, device=device)
        self._sin = torch.empty(0, n_rot // 2, device=device)
        self._perm: dict[int, torch.Tensor] = {}          # head_dim → (D,) index on the device
        self._rows_key: tuple | None = None               # (positions object, head_dim)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def _ensure(self, n_pos: int) -> None:
        if n_pos <= self._cos.shape[0]:
            return
        n = max(n_pos, 2 * self._cos.shape[0], 256)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]  # (n, n_rot/2)
        self._cos = ang.cos().float().to(self.device)
        self._sin = ang.sin().float().to(self.device)

    def tables(self, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (>= n_pos, n_rot/2) float32 on the device: angle pos·inv_freq[j]."""
        self._ensure(n_pos)
        return self._cos, self._sin

    def _factors(self, positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(C, S), each (T, 1, dim) on the device, for ``positions`` (T,)."""
        key = (positions, dim)
        if self._rows_key is not None and self._rows_key[0] is positions and self._rows_key[1] == dim:
            return self._rows
        self._ensure(int(positions.max()) + 1)
        pos = positions.to(self.device, non_blocking=True)
        cos, sin = self._cos[pos], self._sin[pos]                     # (T, n_rot/2)
        t, rest = cos.shape[0], dim - self.n_rot
        one = torch.ones(t, rest, device=self.device)
        c = torch.cat((cos, cos, one), dim=-1)[:, None, :]            # (T, 1, D)
        s = torch.cat((-sin, sin, torch.zeros_like(one)), dim=-1)[:, None, :]
        # the key holds a reference to ``positions``, so its identity cannot be recycled
        self._rows_key, self._rows = key, (c, s)
        return c, s

    def _swap(self, dim: int) -> torch.Tensor:
        """(D,) index: the two rotated halves exchanged, the pass-through dims in place."""
        if dim not in self._perm:
            h = self.n_rot // 2
            self._perm[dim] = torch.cat((torch.arange(h, self.n_rot), torch.arange(0, h),
                                         torch.arange(self.n_rot, dim))).to(self.device)
        return self._perm[dim]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (T, H, D) float32, positions: (T,) int64 on the host (so sizing the table never
        waits for the device) → rotated copy of x."""
        dim = x.shape[-1]
        c, s = self._factors(positions, dim)
        return x * c + x[..., self._swap(dim)] * s
