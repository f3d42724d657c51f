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


def test_interleaved_rope_rotates_adjacent_pairs():
    """llama.cpp's NORM rope / DeepSeek's interleaved dims: pair (x_2i, x_2i+1) turns by the
    angle of frequency i; dims past n_rot pass through."""
    g = torch.Generator().manual_seed(1)
    n_rot, dim = 16, 24
    rope = Rope(n_rot, 10000.0, torch.device("cpu"), interleaved=True)
    pos = torch.arange(3, 8)
    x = torch.randn(5, 2, dim, generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot))
    ang = pos.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[:, None, :], ang.sin().float()[:, None, :]
    even, odd = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    want = torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).reshape(5, 2, n_rot)
    got = rope(x, pos)
    assert torch.allclose(got[..., :n_rot], want, atol=1e-6) and torch.equal(got[..., n_rot:], x[..., n_rot:])


def test_yarn_frequencies_match_transformers():
    """RopeSpec.inv_freq with YaRN against transformers' ``_compute_yarn_parameters`` (its
    default truncate=True is ggml's floor/ceil of the correction dims)."""
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from gpu.rope import RopeSpec, YaRN
    for factor, orig, n_rot in ((40.0, 4096, 64), (4.0, 16, 32), (8.0, 64, 16)):
        cfg = DeepseekV3Config(qk_rope_head_dim=n_rot, max_position_embeddings=int(orig * factor),
                               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor,
                                                "original_max_position_embeddings": orig,
                                                "beta_fast": 32.0, "beta_slow": 1.0})
        ref, _ = ROPE_INIT_FUNCTIONS["yarn"](cfg)
        ours = RopeSpec(n_rot, 10000.0, interleaved=True, yarn=YaRN(factor, orig)).inv_freq()
        assert torch.allclose(ours.float(), ref.float(), rtol=1e-6), (factor, orig)
