"""gpu.rope against the textbook NeoX rotate-half formula, bit for bit, including the
per-positions factor rows it reuses across calls."""
from __future__ import annotations

import torch

from gpu.rope import Rope


def rotate_half(x: torch.Tensor, positions: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """(x1·cos − x2·sin, x2·cos + x1·sin, rest) with the table built the same way (float64 angles)."""
    inv = 1.0 / (base ** (torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot))
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    h = n_rot // 2
    x1, x2, rest = x[..., :h], x[..., h:n_rot], x[..., n_rot:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def test_rope_is_rotate_half_exactly():
    g = torch.Generator().manual_seed(0)
    for n_rot, dim in ((32, 64), (64, 64), (16, 48)):
        rope = Rope(n_rot, 10000.0, torch.device("cpu"))
        for t, p0 in ((1, 5), (7, 0), (3, 700)):     # 700 grows the table past its first 256
            pos = torch.arange(p0, p0 + t)
            q = torch.randn(t, 4, dim, generator=g)
            k = torch.randn(t, 2, dim, generator=g)
            # same positions object twice (cached rows), then a different head count
            assert torch.equal(rope(q, pos), rotate_half(q, pos, n_rot, 10000.0))
            assert torch.equal(rope(k, pos), rotate_half(k, pos, n_rot, 10000.0))
            # equal values in a new tensor: rows rebuilt, same result
            assert torch.equal(rope(q, pos.clone()), rotate_half(q, pos, n_rot, 10000.0))
