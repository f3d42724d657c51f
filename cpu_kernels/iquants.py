"""Decoders for ggml's lattice ("i-") quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
IQ1_M (256-weight super-blocks, 8 sub-blocks of 32). Contract as in ``registry``.

These types do not store weights as bit fields: each group of 8 weights (4 for IQ3) is an
index into a fixed grid of byte vectors (``iq2xxs_grid`` …), plus sign bits (IQ2/IQ3) or a
±1/8 shift (IQ1). A sub-block is 4 groups of 8: per type, scalar code gathers 4 grid words (8
bytes each; IQ3's two 4-byte entries form one) and a 32-bit word of signs; ``LATTICE``
turns them into float vectors (the negation is one masked byte subtract), or into
codes + 128 for the int8 engine. IQ1's values are kept as 8 * grid ± 1 (integers,
|v| <= 9) with d / 8, so the shift needs no separate term and its int8 codes are exact.
ggml's ``ksigns_iq2xs`` (7 sign bits + their parity) is computed in vector lanes;
``KSIGNS`` holds the reference values a test holds that rule to.

The grids and ``ksigns_iq2xs`` are ggml's reference values, taken from gguf-py at import
(``gguf.quants``: the tables its numpy dequantizers use) into ``GRIDS`` / ``KSIGNS``; the
grids are compile-time constants of the kernels.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants as gq
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from .pair8 import i8x64
from .registry import register
from .simd import _VF, _byte_ptr, byte_fields, fvec, ld_f16, ld_u8, ld_u16, ld_u32, vzero

f32 = np.float32
u64 = np.uint64
_jit = njit(fastmath=True)
_I1, _I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))


def _grid_words(cls) -> np.ndarray:
    """gguf-py's grid of ``cls`` (float values, one row per entry) as ggml stores it: one
    little-endian word per entry, its bytes the values (uint64 for 8-wide grids, uint32
    for IQ3's 4-wide ones; IQ1's -1/0/1 as int8 bytes)."""
    cls.init_grid()
    g = np.asarray(cls.grid).reshape(cls.grid_shape)
    b = g.astype(np.int8 if g.min() < 0 else np.uint8).view(np.uint8)
    return np.ascontiguousarray(b).view(np.uint64 if g.shape[1] == 8 else np.uint32).reshape(-1)


GRIDS = {T.IQ2_XXS: _grid_words(gq.IQ2_XXS), T.IQ2_XS: _grid_words(gq.IQ2_XS),
         T.IQ2_S: _grid_words(gq.IQ2_S), T.IQ3_XXS: _grid_words(gq.IQ3_XXS),
         T.IQ3_S: _grid_words(gq.IQ3_S), T.IQ1_S: _grid_words(gq.IQ1_S)}
KSIGNS = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).copy()   # 7 sign bits + parity bit
IQ2XXS_GRID, IQ2XS_GRID, IQ2S_GRID = GRIDS[T.IQ2_XXS], GRIDS[T.IQ2_XS], GRIDS[T.IQ2_S]
IQ3XXS_GRID, IQ3S_GRID, IQ1S_GRID = GRIDS[T.IQ3_XXS], GRIDS[T.IQ3_S], GRIDS[T.IQ1_S]


# ---------------------------------------------------------------- lattice -> vectors

def _const(ty, vals):
    return ir.Constant(ir.VectorType(ty, len(vals)), [int(v) for v in vals])


def _negative_lanes(builder, s, kind):
    """<32 x i1>: which of the sub-block's 32 weights are negative, from the u32 s. "mask" and
    "shifted": s is that mask (lane 8l + j at bit 8l + j; one kmov). "ksigns": s holds four
    7-bit ksigns_iq2xs indices (group l at bit 7l) and the table is computed in vector
    lanes: lane j < 7 of a group is bit j of its index, lane 7 their parity (one popcount)
    — measured faster than four scalar table loads per sub-block."""
    if kind != "ksigns":
        return builder.bitcast(s, ir.VectorType(_I1, 32))
    v32 = ir.VectorType(_I32, 32)
    s32 = builder.shuffle_vector(builder.insert_element(ir.Constant(v32, None), s, ir.Constant(_I32, 0)),
                                 ir.Constant(v32, None), _const(_I32, [0] * 32))
    shift = [7 * (j // 8) + (j % 8 if j % 8 < 7 else 0) for j in range(32)]
    mask = [1 if j % 8 < 7 else 127 for j in range(32)]
    x = builder.and_(builder.lshr(s32, _const(_I32, shift)), _const(_I32, mask))
    pop = builder.call(cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32]),
                                                      "llvm.ctpop.v32i32"), [x])
    return builder.trunc(builder.and_(pop, _const(_I32, [1] * 32)), ir.VectorType(_I1, 32))


def _unit_bytes(context, builder, sig, args, i, kind):
    """<32 x i8> signed values of one sub-block from (g0, g1, g2, g3, s) at args[i:i + 5]:
    byte j of g_l is weight 8l + j; lanes ``_negative_lanes`` marks are negated, or for
    IQ1 ("shifted") 8 * value - 1 where marked and 8 * value + 1 elsewhere."""
    v = ir.Constant(ir.VectorType(_I64, 4), None)
    for l in range(4):
        g = context.cast(builder, args[i + l], sig.args[i + l], types.uint64)
        v = builder.insert_element(v, g, ir.Constant(_I32, l))
    b = builder.bitcast(v, ir.VectorType(_I8, 32))
    neg = _negative_lanes(builder, context.cast(builder, args[i + 4], sig.args[i + 4], types.uint32), kind)
    if kind == "shifted":
        return builder.add(builder.shl(b, _const(_I8, [3] * 32)),
                           builder.select(neg, _const(_I8, [-1] * 32), _const(_I8, [1] * 32)))
    return builder.select(neg, builder.sub(_const(_I8, [0] * 32), b), b)


def _lattice(kind):
    @intrinsic
    def floats(typingctx, g0, g1, g2, g3, s):
        """(v0, v1): the sub-block's weights 0..15 and 16..31 as float vectors."""
        if not all(isinstance(t, types.Integer) for t in (g0, g1, g2, g3, s)):
            return None

        def codegen(context, builder, sig, args):
            b = _unit_bytes(context, builder, sig, args, 0, kind)
            halves = [builder.sitofp(builder.shuffle_vector(b, b, _const(_I32, range(16 * h, 16 * h + 16))), _VF)
                      for h in (0, 1)]
            return context.make_tuple(builder, sig.return_type, halves)
        return types.UniTuple(fvec, 2)(g0, g1, g2, g3, s), codegen

    @intrinsic
    def codes(typingctx, g0, g1, g2, g3, s, h0, h1, h2, h3, t):
        """Two sub-blocks' values + 128 as 64 unsigned codes (the int8 engine's u8 operand)."""
        if not all(isinstance(x, types.Integer) for x in (g0, g1, g2, g3, s, h0, h1, h2, h3, t)):
            return None

        def codegen(context, builder, sig, args):
            a = _unit_bytes(context, builder, sig, args, 0, kind)
            b = _unit_bytes(context, builder, sig, args, 5, kind)
            v = builder.shuffle_vector(a, b, _const(_I32, range(64)))
            return builder.xor(v, _const(_I8, [0x80] * 64))
        return i8x64(g0, g1, g2, g3, s, h0, h1, h2, h3, t), codegen
    return floats, codes


LATTICE = {kind: _lattice(kind) for kind in ("mask", "ksigns", "shifted")}


def _decoders(sub_block, kind):
    """(quants, codes) of a type from ``sub_block(w, ob, k) -> (g0, g1, g2, g3, s)``: four grid
    words and the sub-block's signs as ``_negative_lanes`` reads them for ``kind``."""
    to_f32, to_codes = LATTICE[kind]

    @_jit
    def quants(w, ob, k):
        g0, g1, g2, g3, s = sub_block(w, ob, k)
        return to_f32(g0, g1, g2, g3, s)

    @_jit
    def codes(w, ob, j):
        g0, g1, g2, g3, s = sub_block(w, ob, 2 * j)
        h0, h1, h2, h3, t = sub_block(w, ob, 2 * j + 1)
        return to_codes(g0, g1, g2, g3, s, h0, h1, h2, h3, t)
    return quants, codes


@intrinsic
def unit_fields(typingctx, arr, off, stride, shift, mask):
    """Lanes 2k, 2k + 1 = float((byte[off + stride * k] >> shift) & mask), k < 8: one scale
    field per sub-block when the sub-blocks' scale bytes are further apart than ``byte_fields``' 16."""
    if not all(isinstance(t, types.Integer) for t in (off, stride, shift, mask)) or not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, sig, args):
        off_ = context.cast(builder, args[1], sig.args[1], types.intp)
        st = context.cast(builder, args[2], sig.args[2], types.intp)
        v = ir.Constant(ir.VectorType(_I32, 16), None)
        for k in range(8):
            o = builder.add(off_, builder.mul(st, ir.Constant(_I64, k)))
            p = _byte_ptr(context, builder, sig.args[0], args[0], o, types.intp)
            x = builder.zext(builder.load(p), _I32)
            v = builder.insert_element(v, x, ir.Constant(_I32, 2 * k))
            v = builder.insert_element(v, x, ir.Constant(_I32, 2 * k + 1))
        sh = context.cast(builder, args[3], sig.args[3], types.int32)
        mk = context.cast(builder, args[4], sig.args[4], types.int32)
        splat = lambda x: builder.shuffle_vector(builder.insert_element(ir.Constant(ir.VectorType(_I32, 16), None), x,
                                                                        ir.Constant(_I32, 0)),
                                                 ir.Constant(ir.VectorType(_I32, 16), None), _const(_I32, [0] * 16))
        return builder.uitofp(builder.and_(builder.lshr(v, splat(sh)), splat(mk)), _VF)
    return fvec(arr, off, stride, shift, mask), codegen


@intrinsic
def f16_bits(typingctx, bits):
    """The IEEE half with bits ``bits`` as float32 (IQ1_M's scale, assembled from nibbles)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        b = builder.trunc(context.cast(builder, args[0], sig.args[0], types.uint32), _I16)
        return builder.fpext(builder.bitcast(b, ir.HalfType()), ir.FloatType())
    return types.float32(bits), codegen


_K = [L // 2 for L in range(16)]       # sub-block of each scale lane


# block_iq2_xxs { ggml_half d; uint16_t qs[32]; }  66 bytes
# sub-block k: 8 bytes at 2 + 8k: grid indices q[0..3], then u32 aux with the ksigns indices
# (7 bits each, group l at bit 7l) and the scale s = aux >> 28;
# w[8l + j] = d * (0.5 + s) / 4 * iq2xxs_grid[q[l]][j] * (-1 if bit j of ksigns[...] else 1)
@_jit
def scales_iq2_xxs(w, ob):
    return (unit_fields(w, ob + 9, 8, 4, 15) + f32(0.5)) * (f32(0.25) * ld_f16(w, ob)), vzero()


@_jit
def sub_block_iq2_xxs(w, ob, k):
    q = ob + 2 + 8 * k
    return (IQ2XXS_GRID[ld_u8(w, q)], IQ2XXS_GRID[ld_u8(w, q + 1)], IQ2XXS_GRID[ld_u8(w, q + 2)],
            IQ2XXS_GRID[ld_u8(w, q + 3)], ld_u32(w, q + 4) & 0x0FFFFFFF)


# block_iq2_xs { ggml_half d; uint16_t qs[32]; uint8_t scales[8]; }  74 bytes
# sub-block k: u16 q_l at 2 + 8k + 2l: grid index q & 511, ksigns index q >> 9; half h of the
# sub-block (groups 2h, 2h + 1) scaled by d * (0.5 + nibble h of scales[k]) / 4.
# Scale lanes from the 16 bytes at 58 (scales[k] is byte 8 + k there).
_iq2_xs_sc = byte_fields([8 + k for k in _K], [4 * (L % 2) for L in range(16)], [15] * 16)


@_jit
def scales_iq2_s_xs(w, ob, at):
    return (_iq2_xs_sc(w, ob + at) + f32(0.5)) * (f32(0.25) * ld_f16(w, ob)), vzero()


@_jit
def scales_iq2_xs(w, ob):
    return scales_iq2_s_xs(w, ob, 58)


@_jit
def sub_block_iq2_xs(w, ob, k):
    q = ob + 2 + 8 * k
    q0, q1, q2, q3 = ld_u16(w, q), ld_u16(w, q + 2), ld_u16(w, q + 4), ld_u16(w, q + 6)
    s = np.int64(q0 >> 9) | np.int64(q1 >> 9) << 7 | np.int64(q2 >> 9) << 14 | np.int64(q3 >> 9) << 21
    return IQ2XS_GRID[q0 & 511], IQ2XS_GRID[q1 & 511], IQ2XS_GRID[q2 & 511], IQ2XS_GRID[q3 & 511], s


# block_iq2_s { ggml_half d; uint8_t qs[32]; uint8_t signs[32]; uint8_t qh[8]; uint8_t scales[8]; }
# 82 bytes. sub-block k, group l: index qs[4k + l] | ((qh[k] >> 2l) & 3) << 8, sign byte
# signs[4k + l]; halves scaled as IQ2_XS (scales[k] is byte 8 + k of the 16 at 66).
@_jit
def scales_iq2_s(w, ob):
    return scales_iq2_s_xs(w, ob, 66)


@_jit
def sub_block_iq2_s(w, ob, k):
    q = ob + 2 + 4 * k
    h = np.int64(ld_u8(w, ob + 66 + k))
    return (IQ2S_GRID[np.int64(ld_u8(w, q)) | (h & 3) << 8],
            IQ2S_GRID[np.int64(ld_u8(w, q + 1)) | (h & 12) << 6],
            IQ2S_GRID[np.int64(ld_u8(w, q + 2)) | (h & 48) << 4],
            IQ2S_GRID[np.int64(ld_u8(w, q + 3)) | (h & 192) << 2], ld_u32(w, ob + 34 + 4 * k))


# block_iq3_xxs { ggml_half d; uint8_t qs[64]; uint32_t aux[8]; }  98 bytes
# sub-block k: 8 indices qs[8k + i] into iq3xxs_grid (4 values each); aux[k] as IQ2_XXS's
# (ksigns indices, scale aux >> 28); w = d * (0.5 + s) / 2 * grid * ±1.
@_jit
def scales_iq3_xxs(w, ob):
    return (unit_fields(w, ob + 69, 4, 4, 15) + f32(0.5)) * (f32(0.5) * ld_f16(w, ob)), vzero()


@_jit
def _iq3(grid, a, b):
    """One group of 8 weights from two 4-value grid entries."""
    return u64(grid[a]) | u64(grid[b]) << u64(32)


@_jit
def sub_block_iq3_xxs(w, ob, k):
    q = ob + 2 + 8 * k
    g = IQ3XXS_GRID
    return (_iq3(g, ld_u8(w, q), ld_u8(w, q + 1)), _iq3(g, ld_u8(w, q + 2), ld_u8(w, q + 3)),
            _iq3(g, ld_u8(w, q + 4), ld_u8(w, q + 5)), _iq3(g, ld_u8(w, q + 6), ld_u8(w, q + 7)),
            ld_u32(w, ob + 66 + 4 * k) & 0x0FFFFFFF)


# block_iq3_s { ggml_half d; uint8_t qs[64]; uint8_t qh[8]; uint8_t signs[32]; uint8_t scales[4]; }
# 110 bytes. sub-block k: indices qs[8k + i] | ((qh[k] >> i) & 1) << 8 into iq3s_grid, sign
# bytes signs[4k + l]; w = d * (1 + 2 * nibble k % 2 of scales[k // 2]) * grid * ±1.
# Scale lanes from the 16 bytes at 94 (scales[k // 2] is byte 12 + k // 2 there).
_iq3_s_sc = byte_fields([12 + k // 2 for k in _K], [4 * (k % 2) for k in _K], [15] * 16)


@_jit
def scales_iq3_s(w, ob):
    return (_iq3_s_sc(w, ob + 94) * f32(2) + f32(1)) * ld_f16(w, ob), vzero()


@_jit
def sub_block_iq3_s(w, ob, k):
    q = ob + 2 + 8 * k
    h = np.int64(ld_u8(w, ob + 66 + k))
    g = IQ3S_GRID
    return (_iq3(g, np.int64(ld_u8(w, q)) | (h & 1) << 8, np.int64(ld_u8(w, q + 1)) | (h & 2) << 7),
            _iq3(g, np.int64(ld_u8(w, q + 2)) | (h & 4) << 6, np.int64(ld_u8(w, q + 3)) | (h & 8) << 5),
            _iq3(g, np.int64(ld_u8(w, q + 4)) | (h & 16) << 4, np.int64(ld_u8(w, q + 5)) | (h & 32) << 3),
            _iq3(g, np.int64(ld_u8(w, q + 6)) | (h & 64) << 2, np.int64(ld_u8(w, q + 7)) | (h & 128) << 1),
            ld_u32(w, ob + 74 + 4 * k))


# block_iq1_s { ggml_half d; uint8_t qs[32]; uint16_t qh[8]; }  50 bytes
# sub-block k: index qs[4k + l] | ((qh[k] >> 3l) & 7) << 8 into iq1s_grid (-1/0/1 bytes);
# w = d * (2 * ((qh[k] >> 12) & 7) + 1) * (grid + delta), delta = -1/8 if qh[k] >> 15 else 1/8.
# Scale lanes from the 16 bytes at 34 (the high byte of qh[k] is byte 2k + 1 there).
_iq1_s_sc = byte_fields([2 * k + 1 for k in _K], [4] * 16, [7] * 16)


@_jit
def scales_iq1_s(w, ob):
    return (_iq1_s_sc(w, ob + 34) * f32(2) + f32(1)) * (f32(0.125) * ld_f16(w, ob)), vzero()


@_jit
def sub_block_iq1_s(w, ob, k):
    q = ob + 2 + 4 * k
    h = np.int64(ld_u16(w, ob + 34 + 2 * k))
    g = IQ1S_GRID
    return (g[np.int64(ld_u8(w, q)) | (h & 7) << 8], g[np.int64(ld_u8(w, q + 1)) | (h & 56) << 5],
            g[np.int64(ld_u8(w, q + 2)) | (h & 448) << 2], g[np.int64(ld_u8(w, q + 3)) | (h & 3584) >> 1],
            (h >> 15) * 0xFFFFFFFF)


# block_iq1_m { uint8_t qs[32]; uint8_t qh[16]; uint8_t scales[8]; }  56 bytes (no d field)
# d: the f16 whose nibbles are the top nibbles of the four u16 sc[i] (sc[0]'s lowest).
# sub-block k, group l: index qs[4k + l] | ((qh[2k + l // 2] >> 4 * (l % 2)) & 7) << 8, delta
# sign bit 3 of that nibble; half h: d * (2 * ((sc[k // 2] >> 6 * (k % 2) + 3h) & 7) + 1).
# Scale lanes from the 16 bytes at 40 (sc[i] is bytes 8 + 2i, 9 + 2i there); the field at
# bit 6 spans both bytes.
def _iq1_m_field(k, h):
    sh = 6 * (k % 2) + 3 * h
    lo, hi = 8 + 2 * (k // 2), 9 + 2 * (k // 2)
    if sh == 6:
        return lo, 6, 3, hi, 0, 1, 2
    return (lo, sh, 7, lo, 0, 0, 0) if sh < 8 else (hi, sh - 8, 7, lo, 0, 0, 0)


_iq1_m_sc = byte_fields(*[list(t) for t in zip(*[_iq1_m_field(L // 2, L % 2) for L in range(16)])])


@_jit
def scales_iq1_m(w, ob):
    s0, s1, s2, s3 = ld_u16(w, ob + 48), ld_u16(w, ob + 50), ld_u16(w, ob + 52), ld_u16(w, ob + 54)
    d = f16_bits((s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000))
    return (_iq1_m_sc(w, ob + 40) * f32(2) + f32(1)) * (f32(0.125) * d), vzero()


@_jit
def sub_block_iq1_m(w, ob, k):
    q = ob + 4 * k
    h = np.int64(ld_u16(w, ob + 32 + 2 * k))      # qh[2k], qh[2k + 1]: one nibble per group
    g = IQ1S_GRID
    # delta sign of group l (bit 4l + 3 of h) moved to bit 8l, then spread over its byte
    x = h & 0x8888
    s = ((x & 0x8) | (x & 0x80) << 4 | (x & 0x800) << 8 | (x & 0x8000) << 12) >> 3
    return (g[np.int64(ld_u8(w, q)) | (h & 7) << 8], g[np.int64(ld_u8(w, q + 1)) | (h & 0x70) << 4],
            g[np.int64(ld_u8(w, q + 2)) | (h & 0x700)], g[np.int64(ld_u8(w, q + 3)) | (h & 0x7000) >> 4], s * 0xFF)


_TYPES = (  # type, scales, sub-block decoder, same d for both halves, how the sub-block's signs come
    (T.IQ2_XXS, scales_iq2_xxs, sub_block_iq2_xxs, True, "ksigns"),
    (T.IQ2_XS, scales_iq2_xs, sub_block_iq2_xs, False, "ksigns"),
    (T.IQ2_S, scales_iq2_s, sub_block_iq2_s, False, "mask"),
    (T.IQ3_XXS, scales_iq3_xxs, sub_block_iq3_xxs, True, "ksigns"),
    (T.IQ3_S, scales_iq3_s, sub_block_iq3_s, True, "mask"),
    (T.IQ1_S, scales_iq1_s, sub_block_iq1_s, True, "shifted"),
    (T.IQ1_M, scales_iq1_m, sub_block_iq1_m, False, "shifted"),
)
for _qt, _scales, _sub_block, _same_d, _kind in _TYPES:
    _quants, _codes = _decoders(_sub_block, _kind)
    register(_qt, sub_blocks_per_block=8, scales=_scales, quants=_quants, same_d=_same_d,
             codes=_codes, code_offset=128)
