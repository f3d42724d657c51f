"""Decoders for types whose 4-bit codes index a 16-entry value table: MXFP4 (e2m1
values, power-of-two e8m0 block scale), IQ4_NL and IQ4_XS (a fixed non-linear grid).
Contract as in ``registry``. The table lookup is one ``vpermps`` on AVX-512
(see ``simd.vlut16``).
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from numba import njit

from .pair8 import block_pair_decoder, sub_block_pair_decoder
from .registry import register
from .simd import byte_fields, ld_e8m0, ld_f16, vload, vlut16, vset2, vzero

f32 = np.float32
_jit = njit(fastmath=True, error_model="numpy")

# ggml's kvalues_mxfp4 (gguf-py's): e2m1 values doubled (0.5 -> 1); the scale is halved to match.
MXFP4_VALUES = np.array(gq.MXFP4.kvalues, np.float32)
# ggml's kvalues_iq4nl (gguf-py's)
IQ4_VALUES = np.array(gq.IQ4_NL.kvalues, np.float32)


@_jit
def _lut_nibbles(w, q, table):
    """table[low nibble] of 16 bytes at q (weights 0..15), then table[high nibble]."""
    tab = vload(table, 0)
    return vlut16(w, q, 0, tab), vlut16(w, q, 4, tab)


# block_mxfp4 { uint8_t e; uint8_t qs[16]; }  17 bytes
# w[j] = e8m0_half(e) * kv[qs[j] & 15],  w[j + 16] = e8m0_half(e) * kv[qs[j] >> 4],
# e8m0_half(e) = 2**(e - 128) (ggml_e8m0_to_fp32_half; subnormal for e < 2)
@_jit
def scales_mxfp4(w, ob):
    d = ld_e8m0(w, ob)
    return vset2(d, d), vzero()


@_jit
def quants_mxfp4(w, ob, k):
    return _lut_nibbles(w, ob + 1, MXFP4_VALUES)


# block_iq4_nl { ggml_half d; uint8_t qs[16]; }  18 bytes;  w = d * kv[nibble], Q4_0's order
@_jit
def scales_iq4_nl(w, ob):
    d = ld_f16(w, ob)
    return vset2(d, d), vzero()


@_jit
def quants_iq4_nl(w, ob, k):
    return _lut_nibbles(w, ob + 2, IQ4_VALUES)


# block_iq4_xs { ggml_half d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; }  136 bytes
# sub-block k: ls = ((scales_l[k // 2] >> 4 * (k % 2)) & 15) | ((scales_h >> 2k) & 3) << 4;
# w = d * (ls - 32) * kv[nibble of qs[16k + l]]  (low nibbles first, then high).
# Lanes 2k, 2k + 1 of the scale vector, bytes relative to scales_h (ob + 2):
_K = [L // 2 for L in range(16)]
_iq4_xs_ls = byte_fields([2 + k // 2 for k in _K], [4 * (k % 2) for k in _K], [15] * 16,
                         [k // 4 for k in _K], [2 * (k % 4) for k in _K], [3] * 16, [4] * 16)


@_jit
def scales_iq4_xs(w, ob):
    return (_iq4_xs_ls(w, ob + 2) - f32(32)) * ld_f16(w, ob), vzero()


@_jit
def quants_iq4_xs(w, ob, k):
    return _lut_nibbles(w, ob + 8 + 16 * k, IQ4_VALUES)


# int8 path: codes = table value + offset (unsigned bytes), one vpermb per 64 nibbles.
register(T.MXFP4, sub_blocks_per_block=1, scales=scales_mxfp4, quants=quants_mxfp4, same_d=True,
         block_pair=block_pair_decoder(block_bytes=17, qs=1, scale="e8m0", table=MXFP4_VALUES.astype(int) + 12),
         block_pair_offset=12, has_min=False)
register(T.IQ4_NL, sub_blocks_per_block=1, scales=scales_iq4_nl, quants=quants_iq4_nl, same_d=True,
         block_pair=block_pair_decoder(block_bytes=18, qs=2, scale="f16", table=IQ4_VALUES.astype(int) + 128),
         block_pair_offset=128, has_min=False)
register(T.IQ4_XS, sub_blocks_per_block=8, scales=scales_iq4_xs, quants=quants_iq4_xs, same_d=True,
         codes=sub_block_pair_decoder(nibbles_at=8, table=IQ4_VALUES.astype(int) + 128), code_offset=128,
         has_min=False)
