"""Helpers of the int8-activation path (llama.cpp's trick: quantize the activations to
int8 per 32 and take weight codes times activations as integer dot products, ``pair8``):
whether the compile target has a u8 x s8 dot instruction, and constant lane shuffles
that spread per-sub-block scales over the dot's lanes (4 lanes per 16 weights).
"""
from __future__ import annotations

from functools import lru_cache

from llvmlite import ir
from numba.extending import intrinsic

from .simd import LANES, fvec, target_has

_I32 = ir.IntType(32)


@lru_cache(maxsize=None)
def has_int8_dot() -> bool:
    """Whether the compile target has a u8 x s8 dot product the int8 path is built on
    (``pair8.dpbusd``): AVX512-VNNI's or AVX-VNNI's ``vpdpbusd``, or AVX2's ``vpmaddubsw`` +
    ``vpmaddwd``. Without one (an x86 before AVX2, another ISA) the widened multiplies would
    be slower than the float path, so int8 requests run float there."""
    return target_has("avx512vnni", "avx512vl") or target_has("avxvnni") or target_has("avx2")


def _lane_shuffle(idx):
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
# scales_of_sub_blocks_01(vd) .. _67(vd): sub-blocks 2j, 2j + 1 of a K-quant super-block,
# whose halves' d are lanes 4j .. 4j + 3 of the ``scales`` decoder's vd, each spread over 4 lanes.
(scales_of_sub_blocks_01, scales_of_sub_blocks_23, scales_of_sub_blocks_45,
 scales_of_sub_blocks_67) = (_lane_shuffle([4 * j + i // 4 for i in range(16)]) for j in range(4))
# Activation scales (dx) of two consecutive sub-blocks (lanes 0, 1 of a loaded dx vector),
# 8 lanes each.
act_scales_of_sub_blocks_01 = _lane_shuffle([i // 8 for i in range(16)])
# The 8 activation scales of a super-block, one per half sub-block (lane g: sub-block g // 2),
# laid out as the K decoders' vd.
act_scales_per_half = _lane_shuffle([g // 2 for g in range(16)])
