"""Causal self-attention with GQA, optional per-head q/k RMSNorm, partial NeoX RoPE,
optionally a sliding window and per-head attention sinks (gpt-oss).

q/k/v/o biases live in the projections (``Linear(weight, bias)``), so GLM's biased and
Qwen3's unbiased attention are the same class. Keys are cached after RoPE.

A sink is a learned per-head logit that joins each query's softmax as one more column with
no value: it takes probability mass away from the keys without adding anything. torch's fused
attention has no such column, so attention with sinks is computed explicitly, a chunk of
queries at a time (at most ``placement.limits.SCORE_VALUES`` float32 scores live at once).

A quantized cache (``gpu.kv_cache.QuantRows``) is read a tile of cells at a time: each tile is
dequantized, scored and folded into a running softmax (flash attention's online rescaling), so
no float copy of the whole cache exists at once. A tile holds at most ``CHUNK_VALUES``
dequantized values and ``SCORE_VALUES`` scores (``placement.limits.kv_tile_cells``): few
tiles, so few kernel launches on a GPU, and bounded temporaries. On the CPU (and CPU-backed
virtual GPUs) quantized K and V go to ``CPU_QUANTIZED_ATTEND`` instead, compiled code that
reads each row in place (``cpu_kernels.kv_attention``); on CUDA decode batches go to the
Triton kernel (``gpu.fused.use_fused_attention``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

import gpu.fused as fused
from gpu.kv_cache import KVCache, QuantRows, Segments, spans
from gpu.norm import RMSNorm
from gpu.rope import Rope
from placement.limits import SCORE_VALUES, kv_tile_cells

Projection = Callable[[torch.Tensor], torch.Tensor]

# Attention over quantized caches for layers on the CPU, compiled (a model load installs it:
# offload.cpu_ops.install_cpu_attention; gpu does not import cpu_kernels); None: the torch tiles below.
CPU_QUANTIZED_ATTEND: Callable | None = None


class Attention:
    def __init__(self, *, q: Projection, k: Projection, v: Projection, o: Projection,
                 n_head: int, n_head_kv: int, head_dim: int, rope: Rope,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
                 scale: float | None = None, sinks: torch.Tensor | None = None, window: int = 0):
        if n_head % n_head_kv:
            raise ValueError(f"n_head {n_head} is not a multiple of n_head_kv {n_head_kv}")
        self.q, self.k, self.v, self.o = q, k, v, o
        self.n_head, self.n_head_kv, self.head_dim = n_head, n_head_kv, head_dim
        self.rope = rope
        self.q_norm, self.k_norm = q_norm, k_norm
        self.scale, self.sinks, self.window = scale, sinks, window

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
        keys, values = cache.append(k.transpose(0, 1), v.transpose(0, 1))  # (Hkv, L, D)
        out = attend(q, keys, values, scale=self.scale, sinks=self.sinks, window=self.window)  # (T, H, D)
        return self.o(out.reshape(t, self.n_head * self.head_dim))


def visible(first: int, t: int, n_keys: int, window: int, device) -> torch.Tensor:
    """(t, n_keys) bool: which keys the queries at cache indices first..first+t-1 see —
    themselves and the keys before, only the last ``window`` positions when ``window`` > 0."""
    qi = torch.arange(first, first + t, device=device)[:, None]
    kj = torch.arange(n_keys, device=device)[None, :]
    return (kj <= qi) & (qi - kj < window) if window else kj <= qi


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *,
           scale: float | None = None, sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Causal attention of T new queries over the L cached keys, the last T of which are
    theirs (cache index order is sequence order). q: (T, H, Dk); keys: (Hkv, L, Dk); values:
    (Hkv, L, Dv) with H a multiple of Hkv → (T, H, Dv) float32. ``scale``: default 1/√Dk.
    ``sinks``: (H,) per-head sink logits; ``window``: a query sees only the last ``window``
    positions (0: all). keys/values may be ``QuantRows`` (a quantized cache; ``values is keys``
    for MLA's latent, one tile serving both). keys/values may be ``Segments`` (several
    sequences stepped as one batch, ``gpu.kv_cache.SequenceBatch``): each sequence's queries
    attend over its own rows."""
    if isinstance(keys, Segments):
        return torch.cat([attend(q[lo:hi], k, v, scale=scale, sinks=sinks, window=window)
                          for k, v, (lo, hi) in zip(keys, values, spans(keys.rows))])
    if isinstance(keys, QuantRows) or isinstance(values, QuantRows):
        if q.device.type == "cpu" and CPU_QUANTIZED_ATTEND is not None and \
                isinstance(keys, QuantRows) and isinstance(values, QuantRows):
            return CPU_QUANTIZED_ATTEND(q, keys, values, scale=scale, sinks=sinks, window=window)
        separate = isinstance(keys, QuantRows) and isinstance(values, QuantRows) and values is not keys
        if separate and fused.use_fused_attention(keys.qtype, values.qtype, (keys.width, values.width),
                                                  q.shape[0] * q.shape[1] // values.shape[0], q.device):
            return fused.attend(q, keys, values, scale=scale, sinks=sinks, window=window)
        return attend_tiles(q, keys, values, scale=scale, sinks=sinks, window=window)
    if sinks is not None:
        return attend_with_sinks(q, keys, values, sinks, scale=scale, window=window)
    t, n_head = q.shape[0], q.shape[1]
    n_keys = keys.shape[1]
    mask = None
    if t > 1 or window and n_keys > window:
        # query i sits at cache index n_keys - t + i and sees keys 0..that index
        mask = visible(n_keys - t, t, n_keys, window, q.device)             # (T, L)
    # CUDA computes in the cache dtype; torch's CPU kernels are slow and loose in half
    # precision, so a CPU-backed layer upcasts its (f16/bf16) cache for the product
    dtype = torch.float32 if q.device.type == "cpu" else keys.dtype
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].to(dtype), keys[None].to(dtype), values[None].to(dtype),
        attn_mask=mask, scale=scale, enable_gqa=n_head != keys.shape[0])   # (1, H, T, Dv)
    return out[0].transpose(0, 1).float()


def query_chunk(n_head: int, t: int, n_keys: int) -> int:
    """Queries per chunk of ``attend_with_sinks`` (placement.compute counts the same)."""
    return max(1, min(t, SCORE_VALUES // max(1, n_head * n_keys)))


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor, *,
                      scale: float | None = None, window: int = 0) -> torch.Tensor:
    """``attend`` with a sink column in each softmax, in float32, a chunk of queries at a
    time: scores (H, c, L) → masked → exp(s − m) / (Σ exp(s − m) + exp(sink − m)), m the row
    maximum over keys and sink, all in place in the one score buffer."""
    t, n_head, dk = q.shape
    n_kv, n_keys, dv = values.shape
    g = n_head // n_kv                       # query head h reads KV head h // g
    scale = dk ** -0.5 if scale is None else scale
    k, v = keys.float(), values.float()
    qh = q.float().permute(1, 0, 2).reshape(n_kv, g, t, dk)
    sink = sinks.float().to(q.device)[:, None, None]                 # (H, 1, 1)
    out = torch.empty(n_head, t, dv, device=q.device)
    step = query_chunk(n_head, t, n_keys)
    for c0 in range(0, t, step):
        c = min(step, t - c0)
        s = torch.matmul(qh[:, :, c0:c0 + c].reshape(n_kv, g * c, dk), k.transpose(1, 2))
        s = s.mul_(scale).view(n_head, c, n_keys)
        s.masked_fill_(~visible(n_keys - t + c0, c, n_keys, window, q.device), float("-inf"))
        m = torch.maximum(s.amax(-1, keepdim=True), sink)
        s.sub_(m).exp_()
        s.div_(s.sum(-1, keepdim=True) + torch.exp(sink - m))
        out[:, c0:c0 + c] = torch.matmul(s.view(n_kv, g * c, n_keys), v).view(n_head, c, dv)
    return out.transpose(0, 1)


def _tile(rows, j0: int, j1: int) -> torch.Tensor:
    return rows.tile(j0, j1) if isinstance(rows, QuantRows) else rows[:, j0:j1].float()


def attend_tiles(q: torch.Tensor, keys, values, *, scale: float | None = None,
                 sinks: torch.Tensor | None = None, window: int = 0,
                 tile: int | None = None) -> torch.Tensor:
    """``attend`` over keys/values read ``tile`` cells at a time (either may be ``QuantRows``;
    default ``placement.limits.kv_tile_cells``): per tile scores (H_kv, G·T, c) → masked →
    folded in place into the running max ``m``, sum ``total`` and output ``acc`` (rescaled by
    exp(m_old − m_new)). A sink starts each row's sum at 1 with ``m`` at the sink logit: the
    same softmax column ``attend_with_sinks`` adds. ``placement.compute.tiled_attention_bytes``
    counts its peak."""
    t, n_head, dk = q.shape
    n_kv, n_keys, dv = values.shape
    g = n_head // n_kv                       # query head h reads KV head h // g
    scale = dk ** -0.5 if scale is None else scale
    qh = q.float().permute(1, 0, 2).reshape(n_kv, g * t, dk)
    if sinks is None:
        m = torch.full((n_kv, g * t, 1), float("-inf"), device=q.device)
        total = torch.zeros(n_kv, g * t, 1, device=q.device)
    else:
        m = sinks.float().to(q.device).view(n_kv, g, 1, 1).expand(n_kv, g, t, 1).reshape(n_kv, g * t, 1)
        total = torch.ones(n_kv, g * t, 1, device=q.device)
    acc = torch.zeros(n_kv, g * t, dv, device=q.device)
    seen = visible(n_keys - t, t, n_keys, window, q.device)           # (T, L)
    tile = tile or kv_tile_cells(n_head, n_kv, t, max(dk, dv))
    for j0 in range(0, n_keys, tile):
        j1 = min(n_keys, j0 + tile)
        kt = _tile(keys, j0, j1)                                        # (H_kv, c, Dk)
        vt = kt if values is keys else _tile(values, j0, j1)
        s = torch.matmul(qh, kt.transpose(1, 2)).mul_(scale).view(n_kv, g, t, j1 - j0)
        s.masked_fill_(~seen[:, j0:j1], float("-inf"))
        s = s.view(n_kv, g * t, j1 - j0)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        base = m_new.masked_fill(torch.isinf(m_new), 0.0)              # rows all masked so far
        p = s.sub_(base).exp_()
        corr = (m - base).exp_()
        total.mul_(corr).add_(p.sum(-1, keepdim=True))
        acc.mul_(corr).baddbmm_(p, vt[..., :dv])
        m = m_new
        del kt, vt, s, p                     # freed before the next tile is dequantized
    out = (acc / total).view(n_kv, g, t, dv).reshape(n_head, t, dv)
    return out.transpose(0, 1)
