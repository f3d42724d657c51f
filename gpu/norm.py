"""RMSNorm (no bias), computed in float32 whatever the weight dtype."""
from __future__ import annotations

import torch


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight  # (dim,)
        self.eps = eps
        self._w32 = weight.float()   # converted once, not per call

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., dim); normalise over the last dim. At decode x is one row, so every op
        # here is dispatch overhead: no dtype round trips when x is already float32
        f32 = x.dtype == torch.float32
        xf = x if f32 else x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self._w32
        return y if f32 else y.to(x.dtype)
