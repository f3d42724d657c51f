"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi-K2), as llama.cpp's deepseek2 runs it.

Per token the block keeps one compressed row: ``c = kv_a_norm(kv_a(x)[:kv_lora])`` and the
roped shared key ``k_pe = rope(kv_a(x)[kv_lora:])``. Heads split q into a no-rope part
(``nope`` dims) and a rope part (``rope`` dims, interleaved rotary).

* **Absorbed** (``k_b``, ``v_b``: the GGUF's ``attn_k_b`` / ``attn_v_b``): the cache holds the
  latent row ``[c, k_pe]`` only (``kv_lora + rope`` values, no V). Since k_nope = W_UK·c per
  head, q_nope·k_nope = (W_UKᵀ·q_nope)·c: the query is absorbed into the latent space and the
  attention is MQA over the latent with V = c; W_UV then maps each head's output back to its
  ``v`` dims. This is what the planner counts (``ModelSpec.is_mla``).
* **Expanded** (``kv_b``, the older ``attn_kv_b`` layout): k_nope and v are decompressed for
  every head and cached in full (H × (nope + rope) keys, H × v values), as llama.cpp does for
  such files.

Both score with ``scale`` (1/√(nope + rope), times YaRN's mscale² where the model says so).
"""
from __future__ import annotations

from typing import Callable

import torch

from gpu.attention import attend
from gpu.kv_cache import KVCache
from gpu.norm import RMSNorm
from gpu.rope import Rope

Projection = Callable[[torch.Tensor], torch.Tensor]
HeadProjection = Callable[[torch.Tensor], torch.Tensor]   # (T, H, in) → (T, H, out)


class LatentAttention:
    def __init__(self, *, q: Projection, kv_a: Projection, kv_a_norm: RMSNorm, o: Projection,
                 n_head: int, nope: int, rope_dims: int, kv_lora: int, v_dim: int, rope: Rope,
                 scale: float, k_b: HeadProjection | None = None, v_b: HeadProjection | None = None,
                 kv_b: Projection | None = None):
        if (k_b is None or v_b is None) == (kv_b is None):
            raise ValueError("MLA needs attn_k_b and attn_v_b (absorbed), or attn_kv_b (expanded)")
        self.q, self.kv_a, self.kv_a_norm, self.o = q, kv_a, kv_a_norm, o
        self.k_b, self.v_b, self.kv_b = k_b, v_b, kv_b
        self.n_head, self.nope, self.rope_dims, self.kv_lora, self.v_dim = n_head, nope, rope_dims, kv_lora, v_dim
        self.rope, self.scale = rope, scale

    @property
    def absorbed(self) -> bool:
        return self.kv_b is None

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x: (T, n_embd) on the layer's device; positions: (T,) RoPE positions."""
        t, h = x.shape[0], self.n_head
        q = self.q(x).view(t, h, self.nope + self.rope_dims)
        q_nope, q_pe = q[..., :self.nope], self.rope(q[..., self.nope:], positions)   # (T, H, ·)
        ckv = self.kv_a(x)                                                # (T, kv_lora + rope)
        c = self.kv_a_norm(ckv[:, :self.kv_lora])                         # (T, kv_lora)
        k_pe = self.rope(ckv[:, None, self.kv_lora:], positions)          # (T, 1, rope)
        if self.absorbed:
            latent, _ = cache.append(torch.cat((c, k_pe[:, 0]), -1)[None])  # (1, L, kv_lora+rope)
            q_lat = self.k_b(q_nope)                                      # (T, H, kv_lora)
            # V = c; the whole row serves as V so keys and values are one tensor of one width
            # (torch's fused kernel, no per-head expansion) and the rope columns are dropped
            out = attend(torch.cat((q_lat, q_pe), -1), latent, latent, scale=self.scale)
            out = self.v_b(out[..., :self.kv_lora])                       # (T, H, v)
        else:
            kv = self.kv_b(c).view(t, h, self.nope + self.v_dim)
            k = torch.cat((kv[..., :self.nope], k_pe.expand(t, h, self.rope_dims)), -1)
            keys, values = cache.append(k.transpose(0, 1), kv[..., self.nope:].transpose(0, 1))
            out = attend(torch.cat((q_nope, q_pe), -1), keys, values, scale=self.scale)  # (T, H, v)
        return self.o(out.reshape(t, h * self.v_dim))
