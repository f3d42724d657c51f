"""Decoders for ggml's K-quants (256-weight super-blocks, 8 units of 32 each):
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Contract as in ``registry``: ``scales(w, ob)`` gives the
8 units' ``(d, m0, m1)`` at once, ``quants(w, ob, k) -> (v0, v1)``, weights ``d * v + m``
per 16-weight half of unit ``k``. Where a
type scales every 16 weights separately (Q2_K, Q3_K, Q6_K) the small integer scale is
folded into ``v`` and a constant offset times that scale goes into ``m``.

Element order inside a super-block follows ggml's ``dequantize_row_*`` (and gguf-py's
``quants.py``); each decoder notes which bytes and bit fields unit ``k`` reads.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from .registry import register
from .simd import ld_f16, ld_i8, ld_u8, vbits, vbits2

f32 = np.float32
i32 = np.int32
_jit = njit(fastmath=True)


# block_q2_K { uint8_t scales[16]; uint8_t qs[64]; ggml_half d; ggml_half dmin; }  84 bytes
# unit k = 4h + s: q = (qs[32h + l] >> 2s) & 3 (l < 32); 16-group g = 2k + (l >= 16);
# w = d * (scales[g] & 15) * q - dmin * (scales[g] >> 4)
@_jit
def _q2_k_min(w, ob, dmin, g):
    return -dmin * f32(ld_u8(w, ob + g) >> 4)


@_jit
def scales_q2_k(w, ob):
    d = ld_f16(w, ob + 80)
    n = ld_f16(w, ob + 82)
    return ((d, d, d, d, d, d, d, d),
            (_q2_k_min(w, ob, n, 0), _q2_k_min(w, ob, n, 2), _q2_k_min(w, ob, n, 4),
             _q2_k_min(w, ob, n, 6), _q2_k_min(w, ob, n, 8), _q2_k_min(w, ob, n, 10),
             _q2_k_min(w, ob, n, 12), _q2_k_min(w, ob, n, 14)),
            (_q2_k_min(w, ob, n, 1), _q2_k_min(w, ob, n, 3), _q2_k_min(w, ob, n, 5),
             _q2_k_min(w, ob, n, 7), _q2_k_min(w, ob, n, 9), _q2_k_min(w, ob, n, 11),
             _q2_k_min(w, ob, n, 13), _q2_k_min(w, ob, n, 15)))


@_jit
def quants_q2_k(w, ob, k):
    q = ob + 16 + 32 * (k >> 2)
    s = 2 * (k & 3)
    return (vbits(w, q, s, 3) * f32(ld_u8(w, ob + 2 * k) & 15),
            vbits(w, q + 16, s, 3) * f32(ld_u8(w, ob + 2 * k + 1) & 15))


@_jit
def _q3_k_scale(w, sb, g):
    """Signed 6-bit scale g (0..15) of a Q3_K block whose scales[12] start at byte sb:
    low 4 bits from scales[g % 8] (nibble g // 8), high 2 bits from scales[8 + g % 4]
    (bit pair g // 4), stored with a +32 bias."""
    lo = (i32(ld_u8(w, sb + (g & 7))) >> (4 * (g >> 3))) & 15
    hi = (i32(ld_u8(w, sb + 8 + (g & 3))) >> (2 * (g >> 2))) & 3
    return f32((lo | (hi << 4)) - 32)


# block_q3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; ggml_half d; }  110 bytes
# unit k = 4h + s: q = ((qs[32h + l] >> 2s) & 3) - 4 * (1 - ((hmask[l] >> k) & 1));
# w = d * scale[g] * q.  v holds scale * (q + 4); the -4 * d * scale goes into m.
@_jit
def scales_q3_k(w, ob):
    d = ld_f16(w, ob + 108)
    n = f32(-4) * d
    sb = ob + 96
    return ((d, d, d, d, d, d, d, d),
            (n * _q3_k_scale(w, sb, 0), n * _q3_k_scale(w, sb, 2), n * _q3_k_scale(w, sb, 4),
             n * _q3_k_scale(w, sb, 6), n * _q3_k_scale(w, sb, 8), n * _q3_k_scale(w, sb, 10),
             n * _q3_k_scale(w, sb, 12), n * _q3_k_scale(w, sb, 14)),
            (n * _q3_k_scale(w, sb, 1), n * _q3_k_scale(w, sb, 3), n * _q3_k_scale(w, sb, 5),
             n * _q3_k_scale(w, sb, 7), n * _q3_k_scale(w, sb, 9), n * _q3_k_scale(w, sb, 11),
             n * _q3_k_scale(w, sb, 13), n * _q3_k_scale(w, sb, 15)))


@_jit
def quants_q3_k(w, ob, k):
    q = ob + 32 + 32 * (k >> 2)
    s = 2 * (k & 3)
    return (vbits2(w, q, s, 3, ob, k, 1, 2) * _q3_k_scale(w, ob + 96, 2 * k),
            vbits2(w, q + 16, s, 3, ob + 16, k, 1, 2) * _q3_k_scale(w, ob + 96, 2 * k + 1))


@_jit
def _k_scale_min(w, sb, j):
    """6-bit scale and min of sub-block j (0..7) from the 12 packed bytes at sb, as ggml's
    get_scale_min_k4: j < 4 -> scales[j] & 63, scales[j + 4] & 63; else the low/high
    nibble of scales[j + 4] plus the top two bits of scales[j - 4] / scales[j]."""
    if j < 4:
        sc = i32(ld_u8(w, sb + j)) & 63
        mn = i32(ld_u8(w, sb + j + 4)) & 63
    else:
        b = i32(ld_u8(w, sb + j + 4))
        sc = (b & 15) | ((i32(ld_u8(w, sb + j - 4)) >> 6) << 4)
        mn = (b >> 4) | ((i32(ld_u8(w, sb + j)) >> 6) << 4)
    return f32(sc), f32(mn)


@_jit
def _k4_unit(w, ob, d, dmin, j):
    sc, mn = _k_scale_min(w, ob + 4, j)
    return d * sc, -dmin * mn


@_jit
def scales_k4(w, ob):
    """Q4_K / Q5_K: d * sc[k] and -dmin * min[k] from the header (d, dmin, scales[12])."""
    d = ld_f16(w, ob)
    n = ld_f16(w, ob + 2)
    a0, b0 = _k4_unit(w, ob, d, n, 0)
    a1, b1 = _k4_unit(w, ob, d, n, 1)
    a2, b2 = _k4_unit(w, ob, d, n, 2)
    a3, b3 = _k4_unit(w, ob, d, n, 3)
    a4, b4 = _k4_unit(w, ob, d, n, 4)
    a5, b5 = _k4_unit(w, ob, d, n, 5)
    a6, b6 = _k4_unit(w, ob, d, n, 6)
    a7, b7 = _k4_unit(w, ob, d, n, 7)
    m = (b0, b1, b2, b3, b4, b5, b6, b7)
    return (a0, a1, a2, a3, a4, a5, a6, a7), m, m


# block_q4_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qs[128]; }  144 bytes
# unit k: q = (qs[32 * (k // 2) + l] >> 4 * (k % 2)) & 15;  w = d * sc[k] * q - dmin * min[k]
@_jit
def quants_q4_k(w, ob, k):
    q = ob + 16 + 32 * (k >> 1)
    s = 4 * (k & 1)
    return vbits(w, q, s, 15), vbits(w, q + 16, s, 15)


# block_q5_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; }
# 176 bytes; as Q4_K plus a 5th bit: q += ((qh[l] >> k) & 1) << 4
@_jit
def quants_q5_k(w, ob, k):
    q = ob + 48 + 32 * (k >> 1)
    s = 4 * (k & 1)
    return vbits2(w, q, s, 15, ob + 16, k, 1, 4), vbits2(w, q + 16, s, 15, ob + 32, k, 1, 4)


# block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; ggml_half d; }  210 bytes
# unit k = 4h + s: low 4 bits from ql[64h + 32 * (k % 2) + l] (nibble s // 2),
# high 2 bits from qh[32h + l] >> 2s;  w = d * scales[g] * (q - 32)
@_jit
def _q6_k_min(w, ob, n, g):
    return n * f32(ld_i8(w, ob + 192 + g))


@_jit
def scales_q6_k(w, ob):
    d = ld_f16(w, ob + 208)
    n = f32(-32) * d
    return ((d, d, d, d, d, d, d, d),
            (_q6_k_min(w, ob, n, 0), _q6_k_min(w, ob, n, 2), _q6_k_min(w, ob, n, 4),
             _q6_k_min(w, ob, n, 6), _q6_k_min(w, ob, n, 8), _q6_k_min(w, ob, n, 10),
             _q6_k_min(w, ob, n, 12), _q6_k_min(w, ob, n, 14)),
            (_q6_k_min(w, ob, n, 1), _q6_k_min(w, ob, n, 3), _q6_k_min(w, ob, n, 5),
             _q6_k_min(w, ob, n, 7), _q6_k_min(w, ob, n, 9), _q6_k_min(w, ob, n, 11),
             _q6_k_min(w, ob, n, 13), _q6_k_min(w, ob, n, 15)))


@_jit
def quants_q6_k(w, ob, k):
    h = k >> 2
    s = k & 3
    lo = ob + 64 * h + 32 * (k & 1)
    hi = ob + 128 + 32 * h
    ns = 4 * (s >> 1)
    return (vbits2(w, lo, ns, 15, hi, 2 * s, 3, 4) * f32(ld_i8(w, ob + 192 + 2 * k)),
            vbits2(w, lo + 16, ns, 15, hi + 16, 2 * s, 3, 4) * f32(ld_i8(w, ob + 193 + 2 * k)))


register(T.Q2_K, units_per_block=8, scales=scales_q2_k, quants=quants_q2_k)
register(T.Q3_K, units_per_block=8, scales=scales_q3_k, quants=quants_q3_k)
register(T.Q4_K, units_per_block=8, scales=scales_k4, quants=quants_q4_k)
register(T.Q5_K, units_per_block=8, scales=scales_k4, quants=quants_q5_k)
register(T.Q6_K, units_per_block=8, scales=scales_q6_k, quants=quants_q6_k)
