"""float → GGUF quant blocks, in torch, on whatever device holds the values: the KV cache's
row quantizer for the torch path (a quantized ``--cache-type``).

Each function takes ``(N, 32)`` float32 and returns ``(N, type_size)`` uint8 with ggml's
reference rounding (``quantize_row_*_ref`` in ggml-quants.c, = gguf-py's
``quantize_blocks``), in float32 with IEEE division, so the bytes equal
``cpu_kernels.kv_rows``'s (what the compiled CPU block writes) bit for bit. IQ4_NL's scale is
a least-squares fit over 32 products: torch sums them in its own order, ggml in sequence, so
a block's scale may differ in its last f16 bit (tests compare the two on fixed data).
"""
from __future__ import annotations

from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from gpu.qtypes import IQ4_NL_VALUES

QUANTIZERS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {}


def _register(qtype: Q):
    def deco(fn):
        QUANTIZERS[qtype] = fn
        return fn
    return deco


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), exactly (gguf-py's np_roundf)."""
    a = v.abs()
    fl = a.floor()
    return torch.copysign(fl + (2 * (a - fl)).floor(), v)


def _inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, torch.ones_like(d), d))


def _f16(d: torch.Tensor) -> torch.Tensor:
    """(N, 1) float32 → (N, 2) uint8, IEEE round to nearest even."""
    return d.to(torch.float16).view(torch.uint8)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, 32) codes → (N, 16): q[j] | q[j + 16] << 4."""
    return ((q[:, :16] & 15) | ((q[:, 16:] & 15) << 4)).to(torch.uint8)


def _high_bits(q: torch.Tensor) -> torch.Tensor:
    """(N, 32) 5-bit codes → qh (N, 4): bit j of a little-endian u32 = bit 4 of q[j]."""
    bits = ((q >> 4) & 1).view(-1, 4, 8)
    return (bits << torch.arange(8, device=q.device)).sum(-1).to(torch.uint8)


def _signed_max(x: torch.Tensor) -> torch.Tensor:
    """The value of largest magnitude per block (the first of ties), (N, 1)."""
    return x.gather(1, x.abs().argmax(1, keepdim=True))


@_register(Q.Q8_0)
def _q8_0(x):   # d = amax / 127, q = roundf(x / d)
    d = x.abs().amax(1, keepdim=True) / 127
    q = _roundf(x * _inv(d)).to(torch.int8).view(torch.uint8)
    return torch.cat((_f16(d), q), 1)


@_register(Q.Q4_0)
def _q4_0(x):   # d = max / -8, q = min(15, (int)(x / d + 8.5))
    d = _signed_max(x) / -8
    q = (x * _inv(d) + 8.5).trunc().clamp(0, 15).to(torch.int32)
    return torch.cat((_f16(d), _nibbles(q)), 1)


@_register(Q.Q5_0)
def _q5_0(x):   # d = max / -16, q = min(31, (int)(x / d + 16.5))
    d = _signed_max(x) / -16
    q = (x * _inv(d) + 16.5).trunc().clamp(0, 31).to(torch.int32)
    return torch.cat((_f16(d), _high_bits(q), _nibbles(q)), 1)


def _min_max(x: torch.Tensor, levels: int):
    lo, hi = x.amin(1, keepdim=True), x.amax(1, keepdim=True)
    d = (hi - lo) / levels
    q = ((x - lo) * _inv(d) + 0.5).trunc().clamp(0, levels).to(torch.int32)
    return d, lo, q


@_register(Q.Q4_1)
def _q4_1(x):   # m = min, d = (max - min) / 15, q = min(15, (int)((x - m) / d + 0.5))
    d, m, q = _min_max(x, 15)
    return torch.cat((_f16(d), _f16(m), _nibbles(q)), 1)


@_register(Q.Q5_1)
def _q5_1(x):
    d, m, q = _min_max(x, 31)
    return torch.cat((_f16(d), _f16(m), _high_bits(q), _nibbles(q)), 1)


def _best_index(values: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """ggml's best_index_int8: the nearest table entry, the lower one on a tie."""
    hi = torch.searchsorted(values, a, right=True).clamp(1, 15)   # values[hi - 1] <= a < values[hi]
    lo = hi - 1
    return torch.where(a - values[lo] < values[hi] - a, lo, hi)


@_register(Q.IQ4_NL)
def _iq4_nl(x):  # ggml's quantize_row_iq4_nl_ref: codes for d = max / kvalues[0], d refit (weights x²)
    v = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=x.device)
    mx = _signed_max(x)
    live = mx.abs() >= 1e-15
    q = _best_index(v, x * (1 / torch.where(live, mx / v[0], torch.ones_like(mx))))
    c = v[q]
    w = x * x
    d = (w * c * x).sum(1, keepdim=True) / (w * c * c).sum(1, keepdim=True)
    d = torch.where(live, d, torch.zeros_like(d))
    q = torch.where(live, q, torch.zeros_like(q))
    return torch.cat((_f16(d), _nibbles(q)), 1)


def quantize(x: torch.Tensor, qtype: Q) -> torch.Tensor:
    """x float (..., cols), cols a multiple of 32 → uint8 (..., cols / 32 · type_size)."""
    if qtype not in QUANTIZERS:
        raise NotImplementedError(f"no torch quantizer for {qtype.name}")
    block, size = GGML_QUANT_SIZES[qtype]
    lead, cols = x.shape[:-1], x.shape[-1]
    out = QUANTIZERS[qtype](x.float().reshape(-1, block).contiguous())
    return out.reshape(*lead, cols // block * size)
