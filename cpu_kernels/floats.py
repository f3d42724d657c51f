"""Decoders for unquantized weights: F32, F16, BF16. A sub-block is 32 consecutive values
(a 32-element pseudo-block) with d = 1, m = 0; rows whose length is not a multiple of
32 finish with the scalar ``elem_*`` loaders.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit

from .registry import register
from .simd import f32_from_bits, ld_f16, ld_u16, ld_u32, vbf16, vf16, vf32, vset2, vzero

f32 = np.float32
u32 = np.uint32
_jit = njit(fastmath=True, error_model="numpy")


@_jit
def identity_scales(w, ob):
    return vset2(f32(1), f32(1)), vzero()


@_jit
def quants_f32(w, ob, k):
    return vf32(w, ob), vf32(w, ob + 64)


@_jit
def quants_f16(w, ob, k):
    return vf16(w, ob), vf16(w, ob + 32)


@_jit
def quants_bf16(w, ob, k):
    return vbf16(w, ob), vbf16(w, ob + 32)


@_jit
def elem_f32(w, ro, c):
    return f32_from_bits(ld_u32(w, ro + 4 * c))


@_jit
def elem_f16(w, ro, c):
    return ld_f16(w, ro + 2 * c)


@_jit
def elem_bf16(w, ro, c):
    return f32_from_bits(u32(ld_u16(w, ro + 2 * c)) << u32(16))


register(T.F32, sub_blocks_per_block=1, scales=identity_scales, quants=quants_f32, same_d=True, elem=elem_f32,
         has_min=False)
register(T.F16, sub_blocks_per_block=1, scales=identity_scales, quants=quants_f16, same_d=True, elem=elem_f16,
         has_min=False)
register(T.BF16, sub_blocks_per_block=1, scales=identity_scales, quants=quants_bf16, same_d=True, elem=elem_bf16,
         has_min=False)
