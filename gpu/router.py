"""MoE routers: logits → (expert ids (T, k) int64, weights (T, k) float32).

All compute in float32 on the router's device. Ties in top-k follow ``torch.topk``.
"""
from __future__ import annotations

from typing import Callable

import torch

Projection = Callable[[torch.Tensor], torch.Tensor]


def limit_to_groups(choice: torch.Tensor, n_group: int, n_group_used: int) -> torch.Tensor:
    """Group-limited selection (DeepSeek-V3's ``noaux_tc``, llama.cpp's expert groups): the
    experts split into ``n_group`` equal groups, a group scores the sum of its two best
    choice values, and only the best ``n_group_used`` groups stay selectable (the others'
    choice values become -inf). choice: (T, E)."""
    if n_group <= 1:
        return choice
    t, e = choice.shape
    grouped = choice.view(t, n_group, e // n_group)
    group_score = grouped.topk(2, dim=-1).values.sum(-1)                  # (T, G)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(n_group_used, dim=-1).indices, True)
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)


class SigmoidRouter:
    """GLM-4.5 / DeepSeek-V3 (``noaux_tc``): select by sigmoid score + bias (within the best
    groups when ``n_group`` > 1), weight by the score without the bias, optionally
    normalised, then scaled."""

    def __init__(self, proj: Projection, bias: torch.Tensor | None, *, k: int,
                 norm: bool, scale: float, n_group: int = 1, n_group_used: int = 1):
        self.proj, self.bias, self.k, self.norm, self.scale = proj, bias, k, norm, scale
        self.n_group, self.n_group_used = n_group, n_group_used

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = torch.sigmoid(self.proj(x).float())                     # (T, E)
        choice = scores if self.bias is None else scores + self.bias.float()
        choice = limit_to_groups(choice, self.n_group, self.n_group_used)
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


class TopKSoftmaxRouter:
    """gpt-oss: top-k of the (biased) router logits, then a softmax over those k only."""

    def __init__(self, proj: Projection, *, k: int):
        self.proj, self.k = proj, k

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = torch.topk(self.proj(x).float(), self.k, dim=-1)    # proj carries the bias
        return ids, torch.softmax(top, dim=-1)


def sqrt_softplus_scores(proj: Projection, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's expert scores √softplus(proj(x)), float32 (T, E)."""
    return torch.sqrt(torch.nn.functional.softplus(proj(x).float()))


def normalised_weights(scores: torch.Tensor, ids: torch.Tensor, scale: float) -> torch.Tensor:
    """The chosen experts' scores normalised over the k, times ``scale`` (T, k)."""
    w = scores.gather(1, ids)
    return w / w.sum(-1, keepdim=True) * scale


class SqrtSoftplusRouter:
    """DeepSeek-V4: scores √softplus(logits); select the top k of score + ``exp_probs_b``
    (the bias steers selection only), weight by the scores normalised over the k, then
    ``scale`` (``expert_weights_scale``)."""

    def __init__(self, proj: Projection, bias: torch.Tensor, *, k: int, scale: float):
        self.proj, self.bias, self.k, self.scale = proj, bias.float(), k, scale

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = sqrt_softplus_scores(self.proj, x)                                   # (T, E)
        ids = torch.topk(scores + self.bias, self.k, dim=-1).indices
        return ids, normalised_weights(scores, ids, self.scale)


class HashRouter:
    """DeepSeek-V4's first ``hash_layer_count`` blocks: the experts come from a fixed table by
    token id (``ffn_gate_tid2eid``, (n_vocab, k) int), the weights from the √softplus scores of
    those experts, normalised over the k, then ``scale``."""

    def __init__(self, proj: Projection, table: torch.Tensor, *, scale: float):
        self.proj, self.table, self.scale = proj, table.long(), scale

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = sqrt_softplus_scores(self.proj, x)
        ids = self.table[tokens.to(self.table.device)].to(scores.device)
        return ids, normalised_weights(scores, ids, self.scale)
