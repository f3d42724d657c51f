"""Byte vectors for the int8-activation path (llama.cpp's trick: quantize the activations
to int8 per 32 and take weight codes times activations as integer dot products).

``U8x16`` is 16 unsigned weight codes (LLVM ``<16 x i8>``): a half unit. ``idot2`` takes
two units (four halves) and 64 int8 activations and returns the 16 partial sums (4 per
half, as float): one ``vpdpbusd`` on AVX512-VNNI, two on AVX-VNNI, portable integer IR
elsewhere. Codes are unsigned (u8 x s8 is what the instruction multiplies); types with
signed values add a constant ``code_offset`` that the driver takes back out exactly.
This serves the 256-weight types; 32-weight types have their own engine (``pair8``).
"""
from __future__ import annotations

from functools import lru_cache

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .simd import LANES, _VF, _byte_ptr, _is_array, _is_int, _load_vec, _splat, fvec

_I8, _I32 = ir.IntType(8), ir.IntType(32)
_V16I8 = ir.VectorType(_I8, 16)


class U8x16(types.Type):
    def __init__(self):
        super().__init__(name="u8x16")


u8x16 = U8x16()


@register_model(U8x16)
class _U8x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V16I8)


def _features():
    from numba.core import config
    import llvmlite.binding as ll
    if config.CPU_FEATURES is not None:
        return config.CPU_FEATURES
    return "" if config.CPU_NAME else ll.get_host_cpu_features().flatten()


@lru_cache(maxsize=None)
def has_vnni() -> bool:
    """Whether the compile target has a u8 x s8 dot-product instruction (AVX512-VNNI or
    AVX-VNNI): the int8 path is only faster than the float path with one."""
    f = _features()
    return "+avx512vnni" in f or "+avxvnni" in f


def _c8(builder, k):
    return _splat(builder, ir.Constant(_I8, k), _V16I8)


def _field(context, builder, sig, args, i):
    p = _byte_ptr(context, builder, sig.args[0], args[0], args[i], sig.args[i])
    b = _load_vec(builder, p, _I8, 16)
    sh = builder.trunc(context.cast(builder, args[i + 1], sig.args[i + 1], types.int32), _I8)
    mk = builder.trunc(context.cast(builder, args[i + 2], sig.args[i + 2], types.int32), _I8)
    return builder.and_(builder.lshr(b, _splat(builder, sh, _V16I8)), _splat(builder, mk, _V16I8))


@intrinsic
def cbits(typingctx, arr, off, shift, mask):
    """Codes ``(bytes[off + l] >> shift) & mask``, l < 16."""
    if not (_is_array(arr) and _is_int(off) and _is_int(shift) and _is_int(mask)):
        return None

    def codegen(context, builder, sig, args):
        return _field(context, builder, sig, args, 1)
    return u8x16(arr, off, shift, mask), codegen


@intrinsic
def cbits2(typingctx, arr, off_a, shift_a, mask_a, off_b, shift_b, mask_b, up_b):
    """Codes ``A | (B << up_b)`` with A, B bit fields as in ``cbits``."""
    ints = (off_a, shift_a, mask_a, off_b, shift_b, mask_b, up_b)
    if not (_is_array(arr) and all(_is_int(t) for t in ints)):
        return None

    def codegen(context, builder, sig, args):
        up = builder.trunc(context.cast(builder, args[7], sig.args[7], types.int32), _I8)
        b = builder.shl(_field(context, builder, sig, args, 4), _splat(builder, up, _V16I8))
        return builder.or_(_field(context, builder, sig, args, 1), b)
    return u8x16(arr, *ints), codegen


@intrinsic
def idot2(typingctx, a0, a1, b0, b1, xq, xo):
    """Integer dots of two units with 64 int8 activations ``xq[xo : xo + 64]``: lane 4h + j
    (h = half 0..3: a0, a1, b0, b1) is the sum over 4 consecutive weights of that half
    of code * activation, as float32."""
    if not (all(t == u8x16 for t in (a0, a1, b0, b1)) and _is_array(xq) and _is_int(xo)):
        return None

    def codegen(context, builder, sig, args):
        lo = builder.shuffle_vector(args[0], args[1], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        hi = builder.shuffle_vector(args[2], args[3], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        codes = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
        p = _byte_ptr(context, builder, sig.args[4], args[4], args[5], sig.args[5])
        x = _load_vec(builder, p, _I8, 64)
        v16i32 = ir.VectorType(_I32, 16)
        feats = _features()
        if "+avx512vnni" in feats and "+avx512f" in feats:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16i32, [v16i32] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
            r = builder.call(fn, [ir.Constant(v16i32, [0] * 16), builder.bitcast(codes, v16i32),
                                  builder.bitcast(x, v16i32)])
        elif "+avxvnni" in feats or ("+avx512vnni" in feats and "+avx512vl" in feats):
            v8i32 = ir.VectorType(_I32, 8)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8i32, [v8i32] * 3),
                                                "llvm.x86.avx512.vpdpbusd.256")
            z = ir.Constant(v8i32, [0] * 8)
            x_lo = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
            x_hi = builder.shuffle_vector(x, x, ir.Constant(ir.VectorType(_I32, 32), list(range(32, 64))))
            r_lo = builder.call(fn, [z, builder.bitcast(lo, v8i32), builder.bitcast(x_lo, v8i32)])
            r_hi = builder.call(fn, [z, builder.bitcast(hi, v8i32), builder.bitcast(x_hi, v8i32)])
            r = builder.shuffle_vector(r_lo, r_hi, ir.Constant(v16i32, list(range(16))))
        else:
            v64i32 = ir.VectorType(_I32, 64)
            prod = builder.mul(builder.zext(codes, v64i32), builder.sext(x, v64i32))
            parts = [builder.shuffle_vector(prod, prod, ir.Constant(v16i32, [4 * i + j for i in range(16)]))
                     for j in range(4)]
            r = builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
        return builder.sitofp(r, _VF)
    return fvec(a0, a1, b0, b1, xq, xo), codegen


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


# Scales for idot2's lanes: 4 lanes per half, halves (A0, A1, B0, B1).
# Units 2j, 2j + 1 of a K-block: d of their halves are lanes 4j .. 4j + 3 of vd.
spread_k0, spread_k1, spread_k2, spread_k3 = (_spread1([4 * j + i // 4 for i in range(16)]) for j in range(4))
# Activation scales of units 2j, 2j + 1 (lanes 2j, 2j + 1 of a loaded dx vector), 8 lanes each.
spread_dx0, spread_dx1, spread_dx2, spread_dx3 = (_spread1([2 * j + i // 8 for i in range(16)]) for j in range(4))
