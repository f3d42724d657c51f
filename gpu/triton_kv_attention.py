"""Attention over a quantized KV cache in Triton (flash-decoding): each program owns one KV
head, its G = (query heads per KV head) · T query rows and one span of the cache; it walks
the span in tiles of ``BLOCK_C`` cells, dequantizes each K and V tile from the raw GGUF
blocks in registers (``triton_matmul._dequant``, the fused matmul's decoder: one block
decoder for both) and folds it into a running softmax; a second kernel combines the spans'
partial softmaxes. Nothing dequantized is written to memory. Splitting the cache is what
fills the device: one program per KV head used 8 of an H200's 132 multiprocessors and ran
at 0.2-0.4x the f16 cache's torch attention at 8k cells (bench/gpu_check.py (e)).

Same contract as ``gpu.attention.attend_tiles`` (causal over cache index order, optional
sliding window and sinks); row widths must be powers of two (``tl.arange``), else the caller
takes the torch path (``gpu.fused.use_fused_attention`` decides). Checked under
``TRITON_INTERPRET=1`` against ``attend_tiles``, and on CUDA by bench/gpu_check.py.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES

from gpu.qtypes import FUSED_KERNEL_IDS, VALUE_TABLES
from gpu.triton_matmul import _dequant

BLOCK_C = 32      # cells per tile


@triton.jit
def _tile(ptr, head_off, c0, n_keys, row_stride, TYPE_SIZE: tl.constexpr, D: tl.constexpr,
          table, QTYPE: tl.constexpr, BC: tl.constexpr):
    """Cells c0..c0+BC of one head's raw rows → (BC, D) float32 (rows past the end clamped)."""
    S: tl.constexpr = D // 32
    cells = tl.minimum(c0 + tl.arange(0, BC), n_keys - 1)
    base = head_off + cells[:, None, None] * row_stride + (tl.arange(0, S) * TYPE_SIZE)[None, :, None]
    w = _dequant(ptr, base, tl.zeros((1, S, 1), tl.int32), tl.arange(0, 32)[None, None, :], table, QTYPE)
    return tl.reshape(w, (BC, D))


@triton.jit
def _kernel(q_ptr, k_ptr, v_ptr, m_ptr, l_ptr, a_ptr, sink_ptr, table_k, table_v,
            n_keys, t, g, n_split, cells_per_split, k_head_stride, k_row_stride, v_head_stride, v_row_stride,
            scale, window,
            HAS_SINK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, GT: tl.constexpr,
            KTYPE: tl.constexpr, KSIZE: tl.constexpr, VTYPE: tl.constexpr, VSIZE: tl.constexpr,
            BC: tl.constexpr):
    """Program (h, s): KV head h over cells s·cells_per_split.. of the cache → its partial
    running max m, sum l and unnormalised output a (split s's rows of the scratch)."""
    h = tl.program_id(0)
    sp = tl.program_id(1)
    rows = tl.arange(0, GT)                       # row r = (head in group) · t + query i
    live = rows < g * t
    qi = rows % t
    q = tl.load(q_ptr + (h * g * t + rows)[:, None] * DK + tl.arange(0, DK)[None, :], mask=live[:, None], other=0.0)
    if HAS_SINK:   # the sink column joins split 0's softmax only
        sink = tl.load(sink_ptr + h * g + rows // t, mask=live, other=0.0)
        m = tl.where(sp == 0, sink, float("-inf"))
        total = tl.where(sp == 0, 1.0, 0.0) + tl.zeros((GT,), tl.float32)
    else:
        m = tl.full((GT,), float("-inf"), tl.float32)
        total = tl.zeros((GT,), tl.float32)
    acc = tl.zeros((GT, DV), tl.float32)
    last = n_keys - t + qi                        # the cache index of each row's query
    c_lo = sp * cells_per_split
    c_hi = tl.minimum(c_lo + cells_per_split, n_keys)
    for c0 in range(c_lo, c_hi, BC):
        k = _tile(k_ptr, h * k_head_stride, c0, n_keys, k_row_stride, KSIZE, DK, table_k, KTYPE, BC)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale        # (GT, BC)
        cells = c0 + tl.arange(0, BC)
        seen = (cells[None, :] <= last[:, None]) & (cells[None, :] < c_hi)
        seen = seen & ((last[:, None] - cells[None, :] < window) | (window <= 0))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - base[:, None])
        corr = tl.exp(m - base)
        total = total * corr + tl.sum(p, 1)
        v = _tile(v_ptr, h * v_head_stride, c0, n_keys, v_row_stride, VSIZE, DV, table_v, VTYPE, BC)
        acc = acc * corr[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    part = (h * n_split + sp) * GT + rows
    tl.store(m_ptr + part, m)
    tl.store(l_ptr + part, total)
    tl.store(a_ptr + part[:, None] * DV + tl.arange(0, DV)[None, :], acc)


@triton.jit
def _combine(m_ptr, l_ptr, a_ptr, o_ptr, t, g, n_split, GT: tl.constexpr, DV: tl.constexpr):
    """Program h: the splits' partial softmaxes of KV head h rescaled to their common max and
    summed (flash-decoding's reduction) → o rows h·g·t.."""
    h = tl.program_id(0)
    rows = tl.arange(0, GT)
    big = tl.full((GT,), float("-inf"), tl.float32)
    for sp in range(0, n_split):
        big = tl.maximum(big, tl.load(m_ptr + (h * n_split + sp) * GT + rows))
    base = tl.where(big == float("-inf"), 0.0, big)
    total = tl.zeros((GT,), tl.float32)
    acc = tl.zeros((GT, DV), tl.float32)
    for sp in range(0, n_split):
        part = (h * n_split + sp) * GT + rows
        w = tl.exp(tl.load(m_ptr + part) - base)
        total += w * tl.load(l_ptr + part)
        acc += w[:, None] * tl.load(a_ptr + part[:, None] * DV + tl.arange(0, DV)[None, :])
    out = acc / total[:, None]
    tl.store(o_ptr + (h * g * t + rows)[:, None] * DV + tl.arange(0, DV)[None, :], out,
             mask=(rows < g * t)[:, None])


@lru_cache(maxsize=None)
def _programs_wanted(device: torch.device) -> int:
    """Programs that fill the device: two per streaming multiprocessor (one under the interpreter)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def _table(qtype, device):
    values = VALUE_TABLES.get(qtype, (0.0,))
    return torch.tensor(values, dtype=torch.float32, device=device)


def attend_quantized(q: torch.Tensor, keys, values, *, scale: float | None = None,
                     sinks: torch.Tensor | None = None, window: int = 0,
                     splits: int | None = None) -> torch.Tensor:
    """``attend_tiles`` for ``QuantRows`` keys and values (raw (H_kv, L, bytes) contiguous in
    the last dim) → (T, H, Dv) float32. The cache is cut into ``splits`` spans per KV head
    (default: enough programs to fill the device), each a program; a second kernel combines."""
    t, n_head, dk = q.shape
    n_kv, n_keys, dv = values.shape
    g = n_head // n_kv
    for w in (dk, dv):
        if w & (w - 1) or w < 32:
            raise ValueError(f"attend_quantized needs power-of-two rows of 32 or more, not {w}")
    gt = max(16, triton.next_power_of_2(g * t))                 # tl.dot needs >= 16 rows
    tiles = triton.cdiv(n_keys, BLOCK_C)
    if splits is None:
        splits = triton.cdiv(_programs_wanted(q.device), n_kv)
    per_split = triton.cdiv(tiles, max(1, min(splits, tiles))) * BLOCK_C
    n_split = triton.cdiv(n_keys, per_split)                    # no empty splits
    qh = q.float().permute(1, 0, 2).contiguous()                 # (H, T, Dk): row h·t + i
    m = torch.empty(n_kv, n_split, gt, device=q.device)
    total = torch.empty_like(m)
    acc = torch.empty(n_kv, n_split, gt, dv, device=q.device)
    kr, vr = keys.raw, values.raw
    sink = sinks.float().to(q.device).contiguous() if sinks is not None else qh
    _kernel[(n_kv, n_split)](qh, kr, vr, m, total, acc, sink, _table(keys.qtype, q.device),
                             _table(values.qtype, q.device), n_keys, t, g, n_split, per_split,
                             kr.stride(0), kr.stride(1), vr.stride(0), vr.stride(1),
                             dk ** -0.5 if scale is None else scale, window,
                             HAS_SINK=sinks is not None, DK=dk, DV=dv, GT=gt,
                             KTYPE=FUSED_KERNEL_IDS[keys.qtype], KSIZE=GGML_QUANT_SIZES[keys.qtype][1],
                             VTYPE=FUSED_KERNEL_IDS[values.qtype], VSIZE=GGML_QUANT_SIZES[values.qtype][1],
                             BC=BLOCK_C)
    out = torch.empty(n_head, t, dv, device=q.device)
    _combine[(n_kv,)](m, total, acc, out, t, g, n_split, GT=gt, DV=dv)
    return out.transpose(0, 1)
