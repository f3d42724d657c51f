"""Decoders for ggml's 32-weight "legacy" quants: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Contract (see ``registry``): ``scales(w, ob) -> (vd, vm)`` with (d, m) of the block's two
16-weight halves in lanes 0 and 1, ``quants(w, ob, k) -> (v0, v1)``; weights ``d * v + m``
for the block at byte offset ``ob`` of the raw bytes ``w`` (one sub-block per block: k = 0).
Offsets like Q4_0's "-8" go into ``m``, which the driver multiplies by the activations'
16-column sums. The int8 path decodes two blocks at a time (``pair8``): unsigned codes,
``block_pair_offset`` = what the codes add to the signed values.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from .pair8 import block_pair_decoder
from .registry import register
from .simd import ld_f16, ld_u32, target_has, vbit_lanes, vbits, vi8, vload, vlut16, vset2

f32 = np.float32
_jit = njit(fastmath=True, error_model="numpy")


@_jit
def _nibbles(w, q):
    """Low nibbles of 16 bytes at q (weights 0..15), then their high nibbles (16..31)."""
    return vbits(w, q, 0, 15), vbits(w, q, 4, 15)


@_jit
def _nibbles5(w, qh_at, q):
    """As _nibbles plus the 5th bit of weight j from bit j of the u32 at qh_at."""
    qh = ld_u32(w, qh_at)
    return (vbits(w, q, 0, 15) + vbit_lanes(qh, 0) * f32(16),
            vbits(w, q, 4, 15) + vbit_lanes(qh, 16) * f32(16))


@_jit
def _d_m(d, m):
    return vset2(d, d), vset2(m, m)


# block_q4_0 { ggml_half d; uint8_t qs[16]; }  18 bytes
# w[j] = d * ((qs[j] & 15) - 8),  w[j + 16] = d * ((qs[j] >> 4) - 8)
Q4_0_VALUES = np.arange(-8, 8, dtype=np.float32)       # nibble n -> n - 8
# With AVX-512 a nibble indexes Q4_0_VALUES: one vpermps per 16 weights decodes and
# removes the offset (no m term; no mask, widen and convert per nibble).
_LUT = target_has("avx512f")


@_jit
def scales_q4_0(w, ob):
    d = ld_f16(w, ob)
    return _d_m(d, f32(0) if _LUT else f32(-8) * d)


@_jit
def quants_q4_0(w, ob, k):
    if _LUT:
        tab = vload(Q4_0_VALUES, 0)
        return vlut16(w, ob + 2, 0, tab), vlut16(w, ob + 2, 4, tab)
    return _nibbles(w, ob + 2)


# block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }  20 bytes;  w = d * q + m
@_jit
def scales_q4_1(w, ob):
    return _d_m(ld_f16(w, ob), ld_f16(w, ob + 2))


@_jit
def quants_q4_1(w, ob, k):
    return _nibbles(w, ob + 4)


# block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }  22 bytes
# q[j] = nibble | (bit j of qh) << 4;  w = d * (q - 16)
@_jit
def scales_q5_0(w, ob):
    d = ld_f16(w, ob)
    return _d_m(d, f32(-16) * d)


@_jit
def quants_q5_0(w, ob, k):
    return _nibbles5(w, ob + 2, ob + 6)


# block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }  24 bytes;  w = d * q + m
@_jit
def scales_q5_1(w, ob):
    return _d_m(ld_f16(w, ob), ld_f16(w, ob + 2))


@_jit
def quants_q5_1(w, ob, k):
    return _nibbles5(w, ob + 4, ob + 8)


# block_q8_0 { ggml_half d; int8_t qs[32]; }  34 bytes;  w = d * q
@_jit
def scales_q8_0(w, ob):
    return _d_m(ld_f16(w, ob), f32(0))


@_jit
def quants_q8_0(w, ob, k):
    return vi8(w, ob + 2), vi8(w, ob + 18)


register(T.Q4_0, sub_blocks_per_block=1, scales=scales_q4_0, quants=quants_q4_0, same_d=True,
         block_pair=block_pair_decoder(block_bytes=18, qs=2, scale="f16"), block_pair_offset=8,
         has_min=not _LUT)       # the table removes the -8 where there is one
register(T.Q4_1, sub_blocks_per_block=1, scales=scales_q4_1, quants=quants_q4_1, same_d=True,
         block_pair=block_pair_decoder(block_bytes=20, qs=4, scale="f16", min_at=2), block_pair_min=True)
register(T.Q5_0, sub_blocks_per_block=1, scales=scales_q5_0, quants=quants_q5_0, same_d=True,
         block_pair=block_pair_decoder(block_bytes=22, qs=6, scale="f16", qh=2), block_pair_offset=16)
register(T.Q5_1, sub_blocks_per_block=1, scales=scales_q5_1, quants=quants_q5_1, same_d=True,
         block_pair=block_pair_decoder(block_bytes=24, qs=8, scale="f16", min_at=2, qh=4), block_pair_min=True)
# int8 codes of Q8_0 are the signed values + 128 (the instruction multiplies u8 x s8).
register(T.Q8_0, sub_blocks_per_block=1, scales=scales_q8_0, quants=quants_q8_0, same_d=True,
         block_pair=block_pair_decoder(block_bytes=34, qs=2, scale="f16", signed8=True), block_pair_offset=128,
         has_min=False)
