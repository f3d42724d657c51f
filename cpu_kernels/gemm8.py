"""Prompt batches on the int8 path as a GEMM: tokens in lanes.

``rowdot8`` gives each (row, token, 64 weights) one ``vpdpbusd`` and then converts and scales
its 16 partial sums in float: three float operations per integer one, so a prompt batch
spends its time in the epilogue, not in the dot products. Here a tile of 16 tokens sits in
the 16 int32 lanes instead: the tile's quantized activations are interleaved per 4 columns
(``pack_lanes``: dword k of the tile holds columns 4k..4k+3 of token 0, then of token 1, …),
each weight dword (4 codes) is broadcast against that (``vpdpbusd`` with a 32-bit broadcast
operand), and a unit of 16 or 32 weights is summed in int32 before one conversion and one
scale per row and unit — 16 tokens at once. Four rows are decoded once per call into a small
code buffer (``decode4``: the ``pair8`` decoders, as the decode path) and applied to every
tile (``tile4``); nothing is repacked at load.

Per unit of weights with scale d and min m (``registry``: a code u stands for
d * (u - offset) + m), row r and token t:

    acc[r][t] += d * (dx[t] * isum[r][t] - offset * B[t])  [+ m * B[t]]

isum the integer dot of the unit's codes with the token's int8 codes, dx the token's scale
of the 32 the unit lies in, B = dx * (sum of the token's codes over the unit)
(``rowdot8.quantize_rows``' bsums); -offset * B is shared by the four rows. The same numbers
as ``rowdot8``: only the order of the float operations differs.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from placement.limits import GEMM_LANES

from .dispatch import (
    codes,
    decode_block,
    decode_block_pair,
    layout,
    scales,
)
from .pair8 import _V64I8, _V16I32, I8x64, dpbusd
from .registry import QTagType, kernel_by_name
from .rowdot import _prefetch_next_group, require_flat_bytes
from .simd import _VF, _byte_ptr, _is_array, _is_int, _splat, fvec, vfma, vlane, vload, vsplat, vzero

f32 = np.float32
LANES = GEMM_LANES  # tokens per tile
CODE_ROW = 64       # bytes of the code buffer per row: one decoded step (64 codes)

_I32 = ir.IntType(32)


@intrinsic
def store_codes(typingctx, cw, off, c):
    """cw[off : off + 64] = the 64 codes c (uint8 array, byte offset)."""
    if not (_is_array(cw) and _is_int(off) and isinstance(c, I8x64)):
        return None

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        builder.store(args[2], builder.bitcast(p, _V64I8.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(cw, off, c), codegen


def _tile_dot4(n_dw, small=False):
    """Make ``(cw, co, xt, xo) -> 4 fvec``: lane t of result r is the int32 sum over dwords
    k < n_dw of codes cw[co + 64 r + 4 k : +4] . activations xt[xo + 64 k + 4 t : +4], as
    float32 (exact: |sum| < 2**24). Each activation vector is loaded once for the four rows.
    ``small``: every code is below 128 (``pair8.dpbusd``)."""
    @intrinsic
    def dot(typingctx, cw, co, xt, xo):
        if not (_is_array(cw) and _is_int(co) and _is_array(xt) and _is_int(xo)):
            return None

        def codegen(context, builder, sig, args):
            pc = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            px = _byte_ptr(context, builder, sig.args[2], args[2], args[3], sig.args[3])
            accs = [ir.Constant(_V16I32, [0] * LANES)] * 4
            for k in range(n_dw):
                x = builder.load(builder.bitcast(builder.gep(px, [ir.Constant(ir.IntType(64), 64 * k)]),
                                                 _V64I8.as_pointer()), align=1)
                for r in range(4):
                    q = builder.gep(pc, [ir.Constant(ir.IntType(64), CODE_ROW * r + 4 * k)])
                    word = builder.load(builder.bitcast(q, _I32.as_pointer()), align=1)
                    c = builder.bitcast(_splat(builder, word, _V16I32), _V64I8)
                    accs[r] = dpbusd(builder, accs[r], c, x, small)
            vals = [builder.sitofp(a, _VF) for a in accs]
            return context.make_tuple(builder, sig.return_type, vals)
        return types.UniTuple(fvec, 4)(cw, co, xt, xo), codegen
    return dot


tile_dot4_16 = _tile_dot4(4)     # a unit of 16 weights
tile_dot4_32 = _tile_dot4(8)     # a unit of 32 weights
tile_dot4_16_small = _tile_dot4(4, small=True)      # the same for codes below 128
tile_dot4_32_small = _tile_dot4(8, small=True)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _scales4(sd, sk, g, d0, m0, d1, m1, d2, m2, d3, m3, lane):
    """Row r's scale and min of 16-weight unit g at sd[4 g + r], sk[4 g + r], from lane
    ``lane`` of the decoders' d, m."""
    for r, d, m in ((0, d0, m0), (1, d1, m1), (2, d2, m2), (3, d3, m3)):
        sd[4 * g + r] = vlane(d, lane)
        sk[4 * g + r] = vlane(m, lane)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _decode4_block_pairs(tag, w, ro0, ro1, ro2, ro3, cols, cw, sd, sk):
    """Four rows of a 32-weight type decoded once for all tiles: the codes of step p (blocks
    2p, 2p + 1) of row r at cw[256 p + 64 r:], each 16-weight unit's scale and min at sd, sk
    (``_scales4``)."""
    bb, n_sub, same_d = layout(tag)
    n_blocks = cols // 32
    for p in range((n_blocks + 1) // 2):
        ob = 2 * bb * p
        _prefetch_next_group(w, ro0, ro1, ob, 2 * bb)
        if 2 * p + 1 < n_blocks:
            c0, d0, m0 = decode_block_pair(tag, w, ro0 + ob)
            c1, d1, m1 = decode_block_pair(tag, w, ro1 + ob)
            c2, d2, m2 = decode_block_pair(tag, w, ro2 + ob)
            c3, d3, m3 = decode_block_pair(tag, w, ro3 + ob)
        else:                        # a row's odd last block, decoded alone
            c0, d0, m0 = decode_block(tag, w, ro0 + ob)
            c1, d1, m1 = decode_block(tag, w, ro1 + ob)
            c2, d2, m2 = decode_block(tag, w, ro2 + ob)
            c3, d3, m3 = decode_block(tag, w, ro3 + ob)
        q = 4 * CODE_ROW * p
        store_codes(cw, q, c0)
        store_codes(cw, q + CODE_ROW, c1)
        store_codes(cw, q + 2 * CODE_ROW, c2)
        store_codes(cw, q + 3 * CODE_ROW, c3)
        for h in range(4):           # block A's halves, then B's (lanes 0 and 8)
            _scales4(sd, sk, 4 * p + h, d0, m0, d1, m1, d2, m2, d3, m3, 8 * (h // 2))


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _decode4_sub_block_pairs(tag, w, ro0, ro1, ro2, ro3, cols, cw, sd, sk):
    """As _decode4_block_pairs for a 256-weight type: step 4 b + j holds sub-blocks 2j, 2j + 1
    of block b; the scales' lane h is the block's 16-weight unit h."""
    bb, n_sub, same_d = layout(tag)
    for b in range(cols // 256):
        ob = b * bb
        _prefetch_next_group(w, ro0, ro1, ob, bb)
        d0, m0 = scales(tag, w, ro0 + ob)
        d1, m1 = scales(tag, w, ro1 + ob)
        d2, m2 = scales(tag, w, ro2 + ob)
        d3, m3 = scales(tag, w, ro3 + ob)
        for h in range(16):
            _scales4(sd, sk, 16 * b + h, d0, m0, d1, m1, d2, m2, d3, m3, h)
        q = 16 * CODE_ROW * b
        for j in range(4):           # constant once unrolled (the decoders want it so)
            store_codes(cw, q + 4 * CODE_ROW * j, codes(tag, w, ro0 + ob, j))
            store_codes(cw, q + 4 * CODE_ROW * j + CODE_ROW, codes(tag, w, ro1 + ob, j))
            store_codes(cw, q + 4 * CODE_ROW * j + 2 * CODE_ROW, codes(tag, w, ro2 + ob, j))
            store_codes(cw, q + 4 * CODE_ROW * j + 3 * CODE_ROW, codes(tag, w, ro3 + ob, j))


def decode4(tag, w, ro0, ro1, ro2, ro3, cols, cw, sd, sk):
    """Decode four rows (at bytes ro_r of the flat weight bytes w) for ``tile4``: codes into
    cw (uint8, >= ``code_bytes(cols)``), per 16-weight unit scales and mins into sd, sk
    (float32, >= cols // 4). Resolved per quant type at compile time (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(decode4, jit_options={"_nrt": False})
def _decode4(tag, w, ro0, ro1, ro2, ro3, cols, cw, sd, sk):
    require_flat_bytes(w)
    if isinstance(tag, QTagType):
        kern = kernel_by_name(tag.qname)
        impl = (_decode4_block_pairs if kern.block_pair is not None
                else _decode4_sub_block_pairs if kern.codes is not None else None)
        if impl is not None:
            return lambda tag, w, ro0, ro1, ro2, ro3, cols, cw, sd, sk: impl(tag, w, ro0, ro1, ro2, ro3, cols,
                                                                              cw, sd, sk)
    return None


def unit_terms(tag):
    """(one32, offset, has_min, small) of a quant type's codes (jitted code only): one32 when
    both 16-weight halves of every 32 share scale and min (the int sums then run over 32),
    the offset between codes and values, whether mins can be nonzero, whether the codes stay
    below 128 (``registry.QuantKernel.codes_small``)."""
    raise NotImplementedError("only callable from jitted code")


@overload(unit_terms)
def _unit_terms(tag):
    if isinstance(tag, QTagType):
        kern = kernel_by_name(tag.qname)
        if kern.block_pair is not None:
            terms = (True, f32(kern.block_pair_offset), kern.block_pair_min, kern.codes_small)
        else:
            terms = (kern.same_d, f32(kern.code_offset), kern.has_min, kern.codes_small)
        return lambda tag: terms
    return None


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _unit(isums, dv, nb, bv, sd, sk, g, has_min, a0, a1, a2, a3):
    """acc_r += d_r * (dx * isum_r - offset * B) [+ m_r * B] for 16-weight unit g (nb = -offset * B,
    shared by the rows)."""
    i0, i1, i2, i3 = isums
    a0 = vfma(vsplat(sd[4 * g]), vfma(dv, i0, nb), a0)
    a1 = vfma(vsplat(sd[4 * g + 1]), vfma(dv, i1, nb), a1)
    a2 = vfma(vsplat(sd[4 * g + 2]), vfma(dv, i2, nb), a2)
    a3 = vfma(vsplat(sd[4 * g + 3]), vfma(dv, i3, nb), a3)
    if has_min:
        a0 = vfma(vsplat(sk[4 * g]), bv, a0)
        a1 = vfma(vsplat(sk[4 * g + 1]), bv, a1)
        a2 = vfma(vsplat(sk[4 * g + 2]), bv, a2)
        a3 = vfma(vsplat(sk[4 * g + 3]), bv, a3)
    return a0, a1, a2, a3


@njit(fastmath=True, error_model="numpy", _nrt=False)
def tile4(tag, cols, cw, sd, sk, xt, xo, dt, do, bt, bo):
    """(a0, a1, a2, a3): lane t of a_r = row r (``decode4``'s) . (dx * xq) of lane t of the
    tile packed at xt[xo:], dt[do:], bt[bo:] (``pack_lanes``)."""
    one32, off, has_min, small = unit_terms(tag)
    noff = -off
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    if one32:
        for u in range(cols // 32):
            bv = vload(bt, bo + 2 * LANES * u) + vload(bt, bo + 2 * LANES * u + LANES)
            co = 4 * CODE_ROW * (u // 2) + 32 * (u % 2)
            isums = tile_dot4_32_small(cw, co, xt, xo + 512 * u) if small else tile_dot4_32(cw, co, xt, xo + 512 * u)
            a0, a1, a2, a3 = _unit(isums,
                                   vload(dt, do + LANES * u), bv * noff, bv, sd, sk, 2 * u, has_min,
                                   a0, a1, a2, a3)
    else:
        for g in range(cols // 16):
            bv = vload(bt, bo + LANES * g)
            co = 4 * CODE_ROW * (g // 4) + 16 * (g % 4)
            isums = tile_dot4_16_small(cw, co, xt, xo + 256 * g) if small else tile_dot4_16(cw, co, xt, xo + 256 * g)
            a0, a1, a2, a3 = _unit(isums,
                                   vload(dt, do + LANES * (g // 2)), bv * noff, bv, sd, sk, g, has_min,
                                   a0, a1, a2, a3)
    return a0, a1, a2, a3


def thread_scratch_bytes(cols: int) -> int:
    """What each parallel piece of a GEMM call allocates for four decoded rows of ``cols``
    weights: the code buffer and a scale and min per 16 weights (an MoE's gate·up: twice)."""
    return code_bytes(cols) + 2 * 4 * (cols // 4)


@njit(nogil=True, _nrt=False)
def code_bytes(cols):
    """Bytes of ``decode4``'s code buffer for rows of ``cols`` weights."""
    return 4 * CODE_ROW * ((cols + 63) // 64)


@njit(nogil=True, _nrt=False)
def tile_sizes(cols):
    """Elements per tile of the packed (xt int8, dt float32, bt float32) arrays."""
    return LANES * cols, LANES * (cols // 32), LANES * (cols // 16)


@njit(nogil=True, fastmath=True, error_model="numpy", _nrt=False)
def pack_lanes(xq, dx, bsums, src, xt, dt, bt):
    """Tiles of 16 lanes from quantized rows (``rowdot8.quantize_rows``' xq, dx, bsums): lane
    i of tile j is row src[16 j + i] (-1: an empty lane, all zero). Per tile, xt holds
    16 * cols codes, dword k (columns 4k..4k+3) of lane i at byte 64 k + 4 i; dt the lanes'
    scales per 32 columns (dt[16 u + i]); bt their sums per 16 (bt[16 g + i])."""
    cols = bsums.shape[1] * 16
    n_dw = cols // 4
    n32, n16 = cols // 32, cols // 16
    xq32 = xq.view(np.int32)
    xt32 = xt.view(np.int32)
    for j in range(src.shape[0] // LANES):
        for i in range(LANES):
            t = src[LANES * j + i]
            xb, db, bb = LANES * n_dw * j + i, LANES * n32 * j + i, LANES * n16 * j + i
            if t >= 0:
                for k in range(n_dw):
                    xt32[xb + LANES * k] = xq32[t, k]
                for u in range(n32):
                    dt[db + LANES * u] = dx[t, u]
                for g in range(n16):
                    bt[bb + LANES * g] = bsums[t, g]
            else:
                for k in range(n_dw):
                    xt32[xb + LANES * k] = 0
                for u in range(n32):
                    dt[db + LANES * u] = 0
                for g in range(n16):
                    bt[bb + LANES * g] = 0


@njit(nogil=True, fastmath=True, error_model="numpy")
def pack_tiles(xq, dx, bsums, src):
    """(xt, dt, bt, sx, sd, sb): ``pack_lanes`` of rows ``src`` into arrays allocated here,
    and the elements per tile of each (``tile_sizes``): tile j's arrays start at j * sx, j * sd, j * sb."""
    sx, sd, sb = tile_sizes(bsums.shape[1] * 16)
    n_tiles = src.shape[0] // LANES
    xt = np.empty(n_tiles * sx, np.int8)
    dt = np.empty(n_tiles * sd, f32)
    bt = np.empty(n_tiles * sb, f32)
    pack_lanes(xq, dx, bsums, src, xt, dt, bt)
    return xt, dt, bt, sx, sd, sb


@njit(nogil=True)
def row_buffers(cols):
    """A parallel piece's buffers for ``decode4``'s four rows of ``cols`` weights: codes, scales,
    mins (``thread_scratch_bytes``)."""
    return np.empty(code_bytes(cols), np.uint8), np.empty(cols // 4, f32), np.empty(cols // 4, f32)
