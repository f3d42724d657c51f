"""Decoders for ggml's K-quants (256-weight super-blocks, 8 sub-blocks of 32 each):
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Contract as in ``registry``: ``scales(w, ob) -> (vd, vm)``
gives (d, m) of all 16 half sub-blocks of a super-block at once (lanes 2k, 2k + 1 for sub-block k),
``quants(w, ob, k) -> (v0, v1)`` the integer codes of sub-block k; weights ``d * v + m``.
Constant offsets (Q3_K's -4, Q6_K's -32) times the scale go into ``m``.

Element order inside a super-block follows ggml's ``dequantize_row_*`` (and gguf-py's
``quants.py``); each decoder notes which bytes and bit fields sub-block ``k`` reads.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from .pair8 import sub_block_pair_decoder
from .registry import register
from .simd import byte_fields, ld_f16, vbits, vbits2, vi8

f32 = np.float32
_jit = njit(fastmath=True, error_model="numpy")
_G = range(16)                       # 16-weight groups g = 2k + half
_K = [g // 2 for g in _G]            # sub-block of each lane


# block_q2_K { uint8_t scales[16]; uint8_t qs[64]; ggml_half d; ggml_half dmin; }  84 bytes
# sub-block k = 4h + s: q = (qs[32h + l] >> 2s) & 3 (l < 32); group g = 2k + (l >= 16);
# w = d * (scales[g] & 15) * q - dmin * (scales[g] >> 4)
@_jit
def scales_q2_k(w, ob):
    return vbits(w, ob, 0, 15) * ld_f16(w, ob + 80), vbits(w, ob, 4, 15) * -ld_f16(w, ob + 82)


@_jit
def quants_q2_k(w, ob, k):
    q = ob + 16 + 32 * (k >> 2)
    s = 2 * (k & 3)
    return vbits(w, q, s, 3), vbits(w, q + 16, s, 3)


# block_q3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; ggml_half d; }  110 bytes
# sub-block k = 4h + s: q = ((qs[32h + l] >> 2s) & 3) - 4 * (1 - ((hmask[l] >> k) & 1));
# w = d * (sc[g] - 32) * q with 6-bit sc[g]: low 4 bits from scales[g % 8] (nibble g // 8),
# high 2 bits from scales[8 + g % 4] (bits 2 * (g // 4)). v = q + 4; m = -4 * d * (sc - 32).
# The scale vector reads 16 bytes from ob + 94 (scales start at byte 2 of that window).
_q3_k_sc = byte_fields([2 + g % 8 for g in _G], [4 * (g // 8) for g in _G], [15] * 16,
                       [10 + g % 4 for g in _G], [2 * (g // 4) for g in _G], [3] * 16, [4] * 16)


@_jit
def scales_q3_k(w, ob):
    dl = (_q3_k_sc(w, ob + 94) - f32(32)) * ld_f16(w, ob + 108)
    return dl, dl * f32(-4)


@_jit
def quants_q3_k(w, ob, k):
    q = ob + 32 + 32 * (k >> 2)
    s = 2 * (k & 3)
    return vbits2(w, q, s, 3, ob, k, 1, 2), vbits2(w, q + 16, s, 3, ob + 16, k, 1, 2)


# Q4_K / Q5_K 6-bit scales and mins of sub-block k (ggml's get_scale_min_k4), from the packed
# scales[12] at ob + 4: k < 4 -> scales[k] & 63, scales[k + 4] & 63; k >= 4 -> the low /
# high nibble of scales[k + 4] plus the top two bits of scales[k - 4] / scales[k].
_k4_sc = byte_fields([k if k < 4 else k + 4 for k in _K], [0] * 16, [63 if k < 4 else 15 for k in _K],
                     [0 if k < 4 else k - 4 for k in _K], [6] * 16, [0 if k < 4 else 3 for k in _K],
                     [4] * 16)
_k4_mn = byte_fields([k + 4 for k in _K], [0 if k < 4 else 4 for k in _K], [63 if k < 4 else 15 for k in _K],
                     [0 if k < 4 else k for k in _K], [6] * 16, [0 if k < 4 else 3 for k in _K],
                     [4] * 16)


@_jit
def scales_k4(w, ob):
    """Q4_K / Q5_K header { ggml_half d; ggml_half dmin; uint8_t scales[12]; }:
    d * sc[k] and -dmin * min[k]."""
    return _k4_sc(w, ob + 4) * ld_f16(w, ob), _k4_mn(w, ob + 4) * -ld_f16(w, ob + 2)


# block_q4_K { ggml_half d; ggml_half dmin; uint8_t scales[12]; uint8_t qs[128]; }  144 bytes
# sub-block k: q = (qs[32 * (k // 2) + l] >> 4 * (k % 2)) & 15;  w = d * sc[k] * q - dmin * min[k]
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
# sub-block k = 4h + s: low 4 bits from ql[64h + 32 * (k % 2) + l] (nibble s // 2),
# high 2 bits from qh[32h + l] >> 2s;  w = d * scales[g] * (q - 32)
@_jit
def scales_q6_k(w, ob):
    dl = vi8(w, ob + 192) * ld_f16(w, ob + 208)
    return dl, dl * f32(-32)


@_jit
def quants_q6_k(w, ob, k):
    h = k >> 2
    s = k & 3
    lo = ob + 64 * h + 32 * (k & 1)
    hi = ob + 128 + 32 * h
    ns = 4 * (s >> 1)
    return vbits2(w, lo, ns, 15, hi, 2 * s, 3, 4), vbits2(w, lo + 16, ns, 15, hi + 16, 2 * s, 3, 4)


# int8 path: the codes of sub-block pairs (2j, 2j + 1) as bit fields (pair8.sub_block_pair_decoder),
# parts (byte offset, shift, width, up) per sub-block k as in the quants decoders above.
codes_q2_k = sub_block_pair_decoder((lambda k: 16 + 32 * (k >> 2), lambda k: 2 * (k & 3), 2, lambda k: 0))
codes_q3_k = sub_block_pair_decoder((lambda k: 32 + 32 * (k >> 2), lambda k: 2 * (k & 3), 2, lambda k: 0),
                               (lambda k: 0, lambda k: k, 1, lambda k: 2))
codes_q4_k = sub_block_pair_decoder((lambda k: 16 + 32 * (k >> 1), lambda k: 4 * (k & 1), 4, lambda k: 0))
codes_q5_k = sub_block_pair_decoder((lambda k: 48 + 32 * (k >> 1), lambda k: 4 * (k & 1), 4, lambda k: 0),
                               (lambda k: 16, lambda k: k, 1, lambda k: 4))
codes_q6_k = sub_block_pair_decoder((lambda k: 64 * (k >> 2) + 32 * (k & 1), lambda k: 4 * ((k & 3) >> 1), 4, lambda k: 0),
                               (lambda k: 128 + 32 * (k >> 2), lambda k: 2 * (k & 3), 2, lambda k: 4))

register(T.Q2_K, sub_blocks_per_block=8, scales=scales_q2_k, quants=quants_q2_k, same_d=False,
         codes=codes_q2_k)
register(T.Q3_K, sub_blocks_per_block=8, scales=scales_q3_k, quants=quants_q3_k, same_d=False,
         codes=codes_q3_k)
register(T.Q4_K, sub_blocks_per_block=8, scales=scales_k4, quants=quants_q4_k, same_d=True,
         codes=codes_q4_k)
register(T.Q5_K, sub_blocks_per_block=8, scales=scales_k4, quants=quants_q5_k, same_d=True,
         codes=codes_q5_k)
register(T.Q6_K, sub_blocks_per_block=8, scales=scales_q6_k, quants=quants_q6_k, same_d=False,
         codes=codes_q6_k)
