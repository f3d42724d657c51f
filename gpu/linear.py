"""A projection ``y = x @ W^T (+ b)`` held as a torch tensor on one device.

Every projection in the model is a callable ``(x: (T, in)) -> (T, out)`` returning on the
input's device; this one moves the input to its weight's device and back only if they
differ (a plan may put one matrix of a layer elsewhere). Other implementations (raw GGUF
blocks through Numba) follow the same call convention.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, name: str = ""):
        self.weight = weight   # (out, in)
        self.bias = bias       # (out,) or None
        self.device = weight.device
        self.name = name

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        home = x.device
        xw = x.to(self.device, self.weight.dtype)
        y = F.linear(xw, self.weight, self.bias)
        return y.to(home, torch.float32)
