"""SiLU-gated FFN: ``down(silu(gate(x)) * up(x))`` — dense layers and shared experts."""
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
