"""SiLU-gated FFN: ``down(silu(gate(x)) * up(x))`` — dense layers and shared experts — and
the gated activations routed experts use (``GLU``)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Projection = Callable[[torch.Tensor], torch.Tensor]


class SwiGLU:
    """``down(glu(gate(x), up(x)))``; ``glu`` SiLU-gated unless given (``glu(act, limit)``:
    DeepSeek-V4's shared expert clamps)."""

    def __init__(self, gate: Projection, up: Projection, down: Projection, *, glu: Callable | None = None):
        self.gate, self.up, self.down, self.glu = gate, up, down, glu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, n_embd) → (T, n_embd) via (T, n_ff)
        if self.glu is not None:
            return self.down(self.glu(self.gate(x), self.up(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0     # gpt-oss (llama.cpp's constants)


def silu_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


def swiglu_oai(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped GLU: g ≤ limit, |u| ≤ limit, (u + 1) · g · σ(α·g)."""
    g = g.clamp(max=SWIGLU_OAI_LIMIT)
    u = u.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    return (u + 1) * g * torch.sigmoid(SWIGLU_OAI_ALPHA * g)


def swiglu_clamp(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """DeepSeek-V4's clamped SwiGLU (``swiglu_clamp_exp`` / ``_shexp``): silu(min(g, limit)) ·
    clamp(u, ±limit) — the gate clamped from above only, before the SiLU."""
    return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)


GLU = {"silu": silu_glu, "swiglu_oai": swiglu_oai, "swiglu_clamp": swiglu_clamp}   # cpu_kernels' names
LIMITED = {"swiglu_clamp"}        # the activations that take a ``limit``


def glu(act: str, limit: float | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The gated activation ``act`` as ``(g, u) → h``, bound to its ``limit`` where it has one."""
    if act not in GLU:
        raise ValueError(f"unknown expert activation {act!r}; supported: {sorted(GLU)}")
    if act in LIMITED:
        if limit is None:
            raise ValueError(f"{act} needs a clamp limit")
        return lambda g, u: GLU[act](g, u, limit)
    return GLU[act]
