"""SiLU-gated FFN: ``down(silu(gate(x)) * up(x))`` — dense layers and shared experts — and
the gated activations routed experts use (``GLU``)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Projection = Callable[[torch.Tensor], torch.Tensor]


class SwiGLU:
    def __init__(self, gate: Projection, up: Projection, down: Projection):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, n_embd) → (T, n_embd) via (T, n_ff)
        return self.down(F.silu(self.gate(x)) * self.up(x))


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0     # gpt-oss (llama.cpp's constants)


def silu_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def swiglu_oai(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped GLU: g ≤ limit, |u| ≤ limit, (u + 1) · g · σ(α·g)."""
    g = g.clamp(max=SWIGLU_OAI_LIMIT)
    u = u.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (u + 1) * g * torch.sigmoid(SWIGLU_OAI_ALPHA * g)


GLU = {"silu": silu_glu, "swiglu_oai": swiglu_oai}   # by cpu_kernels' activation names
