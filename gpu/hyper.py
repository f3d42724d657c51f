"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is ``n`` parallel
streams (T, n, d). Around each sublayer a tiny perceptron over the RMS-normalised streams
gives three mixings: ``pre`` collapses the streams into the sublayer's input, ``post`` spreads
its output back over them, and ``comb`` (n × n, pushed towards doubly stochastic by Sinkhorn
iterations) mixes the streams themselves, so deep stacks stay non-expansive.

Per token, all in float32 (llama.cpp's ``build_hc_pre`` / ``build_hc_sinkhorn`` /
``build_hc_post``, transformers' ``DeepseekV4HyperConnection``)::

    mix  = rms(flat(X)) @ fn.T                                   (T, 2n + n²)
    pre  = σ(mix[:n]·s0 + b[:n]) + ε          post = 2σ(mix[n:2n]·s1 + b[n:2n])
    comb = softmax_dst(mix[2n:]·s2 + b[2n:]) + ε, then column/row normalisations
    y    = Σ_i pre_i X_i                       X'_j = post_j · f(y) + Σ_i comb[i, j] X_i
"""
from __future__ import annotations

import torch


def _normed_mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """(T, n, d) streams → (T, rows of fn): fn over the unweighted-RMS-normalised flat streams."""
    flat = x.reshape(x.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return flat @ fn.T


class HyperConnection:
    """One sublayer's mHC (``hc_{attn,ffn}_{fn,base,scale}``): ``__call__(X) → (y, post, comb)``,
    and ``combine`` puts the sublayer's output back into the streams."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                 n_streams: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        n = n_streams
        if fn.shape[0] != (2 + n) * n or base.shape != (fn.shape[0],) or scale.numel() != 3:
            raise ValueError(f"hyper-connection of {n} streams needs fn ({(2 + n) * n}, ·), base "
                             f"({(2 + n) * n},) and scale (3,); got {tuple(fn.shape)}, {tuple(base.shape)}, "
                             f"{tuple(scale.shape)}")
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float().reshape(3)
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (T, n, d) float32 → y (T, d), post (T, n), comb (T, n_src, n_dst)."""
        n, eps = self.n, self.hc_eps
        mix = _normed_mix(x, self.fn, self.norm_eps)
        b, s = self.base, self.scale
        pre = torch.sigmoid(mix[:, :n] * s[0] + b[:n]) + eps
        post = 2 * torch.sigmoid(mix[:, n:2 * n] * s[1] + b[n:2 * n])
        comb = torch.softmax((mix[:, 2 * n:] * s[2] + b[2 * n:]).view(-1, n, n), dim=-1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)          # columns: sum over the sources
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        y = (pre.unsqueeze(-1) * x).sum(1)
        return y, post, comb

    @staticmethod
    def combine(out: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The streams after the sublayer: out (T, d), x (T, n, d) its input streams →
        (T, n, d), stream j = post_j · out + Σ_i comb[i, j] · x_i."""
        return post.unsqueeze(-1) * out.float().unsqueeze(1) + comb.transpose(1, 2) @ x


class HyperHead:
    """The final collapse (``output_hc_{fn,base,scale}``): only a ``pre`` mixing, no post or
    comb. (T, n, d) → (T, d)."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, hc_eps: float,
                 norm_eps: float):
        self.fn, self.base, self.scale = fn.float(), base.float(), scale.float().reshape(-1)[:1]
        self.hc_eps, self.norm_eps = hc_eps, norm_eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mix = _normed_mix(x, self.fn, self.norm_eps)
        pre = torch.sigmoid(mix * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * x).sum(1)
