"""Helpers of the int8-activation path (llama.cpp's trick: quantize the activations to
int8 per 32 and take weight codes times activations as integer dot products, ``pair8``):
whether the compile target has a u8 x s8 dot instruction, and constant lane shuffles
that spread per-unit scales over the dot's lanes (4 lanes per 16 weights).
"""
from __future__ import annotations

from functools import lru_cache

from llvmlite import ir
from numba.extending import intrinsic

from .simd import LANES, fvec, target_has

_I32 = ir.IntType(32)


@lru_cache(maxsize=None)
def has_vnni() -> bool:
    """Whether the compile target has a u8 x s8 dot-product instruction (AVX512-VNNI or
    AVX-VNNI): the int8 path is only faster than the float path with one."""
    return target_has("avx512vnni", "avx512vl") or target_has("avxvnni")


def _spread1(idx):
    """Make ``f(v)``: lane i <- lane idx[i] of v (a constant shuffle)."""
    mask = [int(i) for i in idx]

    @intrinsic
    def f(typingctx, v):
        if v != fvec:
            return None

        def codegen(context, builder, sig, args):
            return builder.shuffle_vector(args[0], args[0], ir.Constant(ir.VectorType(_I32, LANES), mask))
        return fvec(v), codegen
    return f


# Scales for the lanes of pair8.pdot: 4 lanes per 16 weights, halves (A0, A1, B0, B1).
# Units 2j, 2j + 1 of a K-block: d of their halves are lanes 4j .. 4j + 3 of vd.
spread_k0, spread_k1, spread_k2, spread_k3 = (_spread1([4 * j + i // 4 for i in range(16)]) for j in range(4))
# Activation scales of units 0, 1 (lanes 0, 1 of a loaded dx vector), 8 lanes each.
spread_dx0 = _spread1([i // 8 for i in range(16)])
# The same 8 unit scales, one per half-unit (lane g: unit g // 2), as the K decoders' vd.
spread_dxh = _spread1([g // 2 for g in range(16)])
