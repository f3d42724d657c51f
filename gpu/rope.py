"""Rotary position embedding, NeoX style (rotate-half), optionally partial.

Only the first ``n_rot`` dims of each head are rotated (GLM-4.5: ``rope.dimension_count`` =
head_dim/2), the rest pass through — the same as llama.cpp's ``LLAMA_ROPE_TYPE_NEOX`` and HF's
``apply_rotary_pos_emb`` with ``partial_rotary_factor``. cos/sin tables grow on demand and are
kept on the device, so decoding never rebuilds them.
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

    def _ensure(self, n_pos: int) -> None:
        if n_pos <= self._cos.shape[0]:
            return
        n = max(n_pos, 2 * self._cos.shape[0], 256)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]  # (n, n_rot/2)
        self._cos = ang.cos().float().to(self.device)
        self._sin = ang.sin().float().to(self.device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: (T, H, D) float32, positions: (T,) int64 on the host (so sizing the table never
        waits for the device) → rotated copy of x."""
        self._ensure(int(positions.max()) + 1)
        pos = positions.to(self.device, non_blocking=True)
        cos = self._cos[pos][:, None, :]  # (T, 1, n_rot/2)
        sin = self._sin[pos][:, None, :]
        h = self.n_rot // 2
        x1, x2, rest = x[..., :h], x[..., h:self.n_rot], x[..., self.n_rot:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
