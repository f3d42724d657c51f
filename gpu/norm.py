"""RMSNorm (no bias), computed in float32 whatever the weight dtype."""
from __future__ import annotations

import torch


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight = weight  # (dim,)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: (..., dim); normalise over the last dim
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)
