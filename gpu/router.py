"""MoE routers: logits → (expert ids (T, k) int64, weights (T, k) float32).

Both compute in float32 on the router's device. Ties in top-k follow ``torch.topk``.
"""
from __future__ import annotations

from typing import Callable

import torch

Projection = Callable[[torch.Tensor], torch.Tensor]


class SigmoidRouter:
    """GLM-4.5 / DeepSeek-V3 (``noaux_tc`` without groups): select by sigmoid score + bias,
    weight by the score without the bias, optionally normalised, then scaled."""

    def __init__(self, proj: Projection, bias: torch.Tensor | None, *, k: int,
                 norm: bool, scale: float):
        self.proj, self.bias, self.k, self.norm, self.scale = proj, bias, k, norm, scale

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.proj(x).float())                     # (T, E)
        choice = scores if self.bias is None else scores + self.bias.float()
        ids = torch.topk(choice, self.k, dim=-1).indices                  # (T, k)
        w = scores.gather(1, ids)
        if self.norm:
            w = w / w.sum(-1, keepdim=True)
        return ids, w * self.scale


class SoftmaxRouter:
    """Qwen3-MoE / Mixtral: softmax over all experts, top-k, optionally renormalised."""

    def __init__(self, proj: Projection, *, k: int, norm: bool, scale: float = 1.0):
        self.proj, self.k, self.norm, self.scale = proj, k, norm, scale

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(self.proj(x).float(), dim=-1)              # (T, E)
        w, ids = torch.topk(probs, self.k, dim=-1)
        if self.norm:
            w = w / w.sum(-1, keepdim=True)
        return ids, w * self.scale
