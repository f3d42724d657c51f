"""Causal self-attention with GQA, optional per-head q/k RMSNorm, partial NeoX RoPE.

q/k/v biases live in the projections (``Linear(weight, bias)``), so GLM's biased and
Qwen3's unbiased attention are the same class. Keys are cached after RoPE.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from gpu.kv_cache import KVCache
from gpu.norm import RMSNorm
from gpu.rope import Rope

Projection = Callable[[torch.Tensor], torch.Tensor]


class Attention:
    def __init__(self, *, q: Projection, k: Projection, v: Projection, o: Projection,
                 n_head: int, n_head_kv: int, head_dim: int, rope: Rope,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None):
        if n_head % n_head_kv:
            raise ValueError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
        self.q, self.k, self.v, self.o = q, k, v, o
        self.n_head, self.n_head_kv, self.head_dim = n_head, n_head_kv, head_dim
        self.rope = rope
        self.q_norm, self.k_norm = q_norm, k_norm

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x: (T, n_embd) on the layer's device; positions: (T,) RoPE positions.

        The T new tokens attend to everything already in ``cache`` plus themselves,
        causally (cache index order, which is the sequence order).
        """
        t = x.shape[0]
        q = self.q(x).view(t, self.n_head, self.head_dim)       # (T, H, D)
        k = self.k(x).view(t, self.n_head_kv, self.head_dim)    # (T, Hkv, D)
        v = self.v(x).view(t, self.n_head_kv, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        q = self.rope(q, positions)
        k = self.rope(k, positions)
        keys, values = cache.append(k.transpose(0, 1).to(cache.k.dtype),
                                    v.transpose(0, 1).to(cache.v.dtype))  # (Hkv, L, D)
        out = attend(q, keys, values)                             # (T, H, D)
        return self.o(out.reshape(t, self.n_head * self.head_dim))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
           scale: float | None = None) -> torch.Tensor:
    """Causal attention of T new queries over the L cached keys, the last T of which are
    theirs (cache index order is sequence order). q: (T, H, Dk); keys: (Hkv, L, Dk); values:
    (Hkv, L, Dv) with H a multiple of Hkv → (T, H, Dv) float32. ``scale``: default 1/√Dk."""
    t, n_head = q.shape[0], q.shape[1]
    n_keys = keys.shape[1]
    mask = None
    if t > 1:
        # query i sits at cache index n_keys - t + i and sees keys 0..that index
        qi = torch.arange(n_keys - t, n_keys, device=q.device)[:, None]
        mask = torch.arange(n_keys, device=q.device)[None, :] <= qi  # (T, L)
    # CUDA computes in the cache dtype; torch's CPU kernels are slow and loose in half
    # precision, so a CPU-backed layer upcasts its (f16/bf16) cache for the product
    dtype = torch.float32 if q.device.type == "cpu" else keys.dtype
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].to(dtype), keys[None].to(dtype), values[None].to(dtype),
        attn_mask=mask, scale=scale, enable_gqa=n_head != keys.shape[0])   # (1, H, T, Dv)
    return out[0].transpose(0, 1).float()
