"""The int8-activation variant of ``rowdot``: four weight rows against one token whose
activations were quantized to int8 per 32 (``quantize_rows``), as llama.cpp does with
Q8_0/Q8_K. Weight codes times activations are integer dot products; each 32's partial
sums are scaled by d * dx in float. Each step is 64 weights (one 512-bit ``vpdpbusd``,
``pair8.pdot``): two sub-blocks of a 256-weight block, or two 32-weight blocks.

The result is the exact dot product of the weights with the *dequantized* activations
dx * xq (the decoders' offsets m multiply sums of dx * xq too), so the only difference
from the float path is the activation rounding: |err| <= sum_c |w_c| * dx_c / 2.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from .dispatch import (
    block_pair_offset_min,
    code_offset,
    codes,
    decode_block,
    decode_block_pair,
    layout,
    scales,
)
from .pair8 import pdot, quantize32
from .registry import QTagType, kernel_by_name
from .rowdot import _prefetch_next_group, require_flat_bytes
from .simd import vfma, vload, vstore, vsum, vzero
from .simd8 import (
    act_scales_of_sub_blocks_01,
    act_scales_per_half,
    scales_of_sub_blocks_01,
    scales_of_sub_blocks_23,
    scales_of_sub_blocks_45,
    scales_of_sub_blocks_67,
)

f32 = np.float32


@njit(fastmath=True, error_model="numpy", cache=True)   # also called from Python: cached like an entry
def quantize_rows(x, xq, dx, bsums, xs4, dx8):
    """x float32 [B, cols] (cols % 32 == 0) -> xq int8 [B, >= cols + XQ_PAD], dx float32
    [B, >= cols // 32 + DX_PAD] (scale of each 32: max |x| / 127), bsums float32
    [B, cols // 16]: sums of 16 dequantized activations dx * xq (ggml's block_q8_K.bsums,
    there int16 sums of the codes, here times dx); for the block-pair engine,
    xs4 float32 [B, >= cols // 4 + S4_PAD]: sums of 4 of them, dx8 float32 (same shape):
    the scale of each 4's 32. Padding is zeroed (its sizes: ``placement.limits``)."""
    b_n, cols = x.shape
    xs, qs, ds, bs, ss, es = (x.strides[0] // 4, xq.strides[0], dx.strides[0] // 4, bsums.strides[0] // 4,
                              xs4.strides[0] // 4, dx8.strides[0] // 4)
    for b in range(b_n):
        xq[b, cols:] = 0
        dx[b, cols // 32:] = 0
        xs4[b, cols // 4:] = 0
        dx8[b, cols // 4:] = 0
        for u in range(cols // 32):      # one 32 in vector registers (pair8.quantize32)
            quantize32(x, b * xs + 32 * u, xq, b * qs + 32 * u, dx, b * ds + u, bsums, b * bs + 2 * u,
                       xs4, b * ss + 8 * u, dx8, b * es + 8 * u)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _sub_block_pair_dot(tag, w, ro, ob, j, xq, xo, scale, acc):
    """acc + scale * (codes of sub-blocks 2j, 2j + 1 of one row's block . activations)."""
    return vfma(pdot(codes(tag, w, ro + ob, j), xq, xo), scale, acc)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _block_pair_step(c, d, m, xq, xp, dxv, xs, cv, has_min, acc):
    """One row's step: acc + d * (dx * pdot + cv) [+ m * xs], cv = -offset * xs."""
    if has_min:
        acc = vfma(m, xs, acc)
    return vfma(d, vfma(dxv, pdot(c, xq, xp), cv), acc)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def dot4_block_pairs_one_token(tag, w, ro0, ro1, ro2, ro3, n_blocks, xq, xo, xs4, so, dx8):
    """Four row dots of a 32-weight type with one quantized token (codes at xq[xo:], its
    sums of 4 and their scales at xs4[so:], dx8[so:]): blocks two at a time (pair8)."""
    bb, n_sub, same_d = layout(tag)
    off, has_min = block_pair_offset_min(tag)
    noff = f32(-off)
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    for p in range(n_blocks // 2):
        ob = 2 * bb * p
        _prefetch_next_group(w, ro0, ro1, ob, 2 * bb)
        sp = so + 16 * p
        xp = xo + 64 * p
        xs = vload(xs4, sp)
        cv = xs * noff
        dxv = vload(dx8, sp)
        c, d, m = decode_block_pair(tag, w, ro0 + ob)
        a0 = _block_pair_step(c, d, m, xq, xp, dxv, xs, cv, has_min, a0)
        c, d, m = decode_block_pair(tag, w, ro1 + ob)
        a1 = _block_pair_step(c, d, m, xq, xp, dxv, xs, cv, has_min, a1)
        c, d, m = decode_block_pair(tag, w, ro2 + ob)
        a2 = _block_pair_step(c, d, m, xq, xp, dxv, xs, cv, has_min, a2)
        c, d, m = decode_block_pair(tag, w, ro3 + ob)
        a3 = _block_pair_step(c, d, m, xq, xp, dxv, xs, cv, has_min, a3)
    if n_blocks % 2:                 # the last block alone (B's lanes decode as zero)
        p = n_blocks // 2
        ob = 2 * bb * p
        sp = so + 16 * p
        xp = xo + 64 * p
        xs = vload(xs4, sp)
        cv = xs * noff
        dxv = vload(dx8, sp)
        c, d, m = decode_block(tag, w, ro0 + ob)
        a0 = _block_pair_step(c, d, m, xq, xp, dxv, xs, cv, has_min, a0)
        c, d, m = decode_block(tag, w, ro1 + ob)
        a1 = _block_pair_step(c, d, m, xq, xp, dxv, xs, cv, has_min, a1)
        c, d, m = decode_block(tag, w, ro2 + ob)
        a2 = _block_pair_step(c, d, m, xq, xp, dxv, xs, cv, has_min, a2)
        c, d, m = decode_block(tag, w, ro3 + ob)
        a3 = _block_pair_step(c, d, m, xq, xp, dxv, xs, cv, has_min, a3)
    return vsum(a0), vsum(a1), vsum(a2), vsum(a3)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _block_pair_tokens(c0, d0, m0, c1, d1, m1, c2, d2, m2, c3, d3, m3, p, xqf, xqs, xs4f, s4s, dx8f,
                 toks, n_t, has_min, noff, acc):
    """One step (blocks 2p, 2p + 1) of the four rows, decoded once, against each token."""
    for i in range(n_t):
        t = toks[i]
        sp = t * s4s + 16 * p
        xp = t * xqs + 64 * p
        xs = vload(xs4f, sp)
        cv = xs * noff
        dxv = vload(dx8f, sp)
        j = 64 * i
        vstore(acc, j, _block_pair_step(c0, d0, m0, xqf, xp, dxv, xs, cv, has_min, vload(acc, j)))
        vstore(acc, j + 16, _block_pair_step(c1, d1, m1, xqf, xp, dxv, xs, cv, has_min, vload(acc, j + 16)))
        vstore(acc, j + 32, _block_pair_step(c2, d2, m2, xqf, xp, dxv, xs, cv, has_min, vload(acc, j + 32)))
        vstore(acc, j + 48, _block_pair_step(c3, d3, m3, xqf, xp, dxv, xs, cv, has_min, vload(acc, j + 48)))


@njit(fastmath=True, error_model="numpy", _nrt=False)
def dot4_block_pairs_tokens(tag, w, ro0, ro1, ro2, ro3, n_blocks, xqf, xqs, xs4f, s4s, dx8f, toks, n_t,
                            acc, res):
    """Several quantized tokens, 32-weight type: each step's codes of the four rows are
    decoded once and applied to every token (accumulators in scratch acc [n_t * 64])."""
    bb, n_sub, same_d = layout(tag)
    off, has_min = block_pair_offset_min(tag)
    noff = f32(-off)
    for i in range(n_t * 64):
        acc[i] = 0
    for p in range(n_blocks // 2):
        ob = 2 * bb * p
        _prefetch_next_group(w, ro0, ro1, ob, 2 * bb)
        c0, d0, m0 = decode_block_pair(tag, w, ro0 + ob)
        c1, d1, m1 = decode_block_pair(tag, w, ro1 + ob)
        c2, d2, m2 = decode_block_pair(tag, w, ro2 + ob)
        c3, d3, m3 = decode_block_pair(tag, w, ro3 + ob)
        _block_pair_tokens(c0, d0, m0, c1, d1, m1, c2, d2, m2, c3, d3, m3, p, xqf, xqs, xs4f, s4s, dx8f,
                     toks, n_t, has_min, noff, acc)
    if n_blocks % 2:
        p = n_blocks // 2
        ob = 2 * bb * p
        c0, d0, m0 = decode_block(tag, w, ro0 + ob)
        c1, d1, m1 = decode_block(tag, w, ro1 + ob)
        c2, d2, m2 = decode_block(tag, w, ro2 + ob)
        c3, d3, m3 = decode_block(tag, w, ro3 + ob)
        _block_pair_tokens(c0, d0, m0, c1, d1, m1, c2, d2, m2, c3, d3, m3, p, xqf, xqs, xs4f, s4s, dx8f,
                     toks, n_t, has_min, noff, acc)
    for i in range(n_t):
        for r in range(4):
            res[i, r] = vsum(vload(acc, 64 * i + 16 * r))


@njit(fastmath=True, error_model="numpy", _nrt=False)
def dot4_sub_block_pairs_one_token(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xq, xo, dx, do, xs):
    """Four row dots of a 256-weight type with one quantized token: codes at xq[xo:],
    sub-block scales at dx[do:], the token's bsums xs (1-D: sums of 16 dequantized activations)."""
    bb, n_sub, same_d = layout(tag)
    off = code_offset(tag)
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    c0 = vzero()
    c1 = vzero()
    c2 = vzero()
    c3 = vzero()
    for b in range(n_sub_blocks // 8):
        ob = b * bb
        _prefetch_next_group(w, ro0, ro1, ob, bb)
        xsv = vload(xs, 16 * b)
        vdx = vload(dx, do + 8 * b)
        x0 = xo + 256 * b
        d0, m0 = scales(tag, w, ro0 + ob)
        d1, m1 = scales(tag, w, ro1 + ob)
        d2, m2 = scales(tag, w, ro2 + ob)
        d3, m3 = scales(tag, w, ro3 + ob)
        c0 = vfma(m0 - d0 * off, xsv, c0)
        c1 = vfma(m1 - d1 * off, xsv, c1)
        c2 = vfma(m2 - d2 * off, xsv, c2)
        c3 = vfma(m3 - d3 * off, xsv, c3)
        # Scales times the activations' sub-block scales, per half sub-block (lane g: g // 2).
        dxh = act_scales_per_half(vdx)
        e0 = d0 * dxh
        e1 = d1 * dxh
        e2 = d2 * dxh
        e3 = d3 * dxh
        # Sub-block pairs (0, 1) .. (6, 7) unrolled: constant bit positions and shuffles.
        a0 = _sub_block_pair_dot(tag, w, ro0, ob, 0, xq, x0, scales_of_sub_blocks_01(e0), a0)
        a1 = _sub_block_pair_dot(tag, w, ro1, ob, 0, xq, x0, scales_of_sub_blocks_01(e1), a1)
        a2 = _sub_block_pair_dot(tag, w, ro2, ob, 0, xq, x0, scales_of_sub_blocks_01(e2), a2)
        a3 = _sub_block_pair_dot(tag, w, ro3, ob, 0, xq, x0, scales_of_sub_blocks_01(e3), a3)
        a0 = _sub_block_pair_dot(tag, w, ro0, ob, 1, xq, x0 + 64, scales_of_sub_blocks_23(e0), a0)
        a1 = _sub_block_pair_dot(tag, w, ro1, ob, 1, xq, x0 + 64, scales_of_sub_blocks_23(e1), a1)
        a2 = _sub_block_pair_dot(tag, w, ro2, ob, 1, xq, x0 + 64, scales_of_sub_blocks_23(e2), a2)
        a3 = _sub_block_pair_dot(tag, w, ro3, ob, 1, xq, x0 + 64, scales_of_sub_blocks_23(e3), a3)
        a0 = _sub_block_pair_dot(tag, w, ro0, ob, 2, xq, x0 + 128, scales_of_sub_blocks_45(e0), a0)
        a1 = _sub_block_pair_dot(tag, w, ro1, ob, 2, xq, x0 + 128, scales_of_sub_blocks_45(e1), a1)
        a2 = _sub_block_pair_dot(tag, w, ro2, ob, 2, xq, x0 + 128, scales_of_sub_blocks_45(e2), a2)
        a3 = _sub_block_pair_dot(tag, w, ro3, ob, 2, xq, x0 + 128, scales_of_sub_blocks_45(e3), a3)
        a0 = _sub_block_pair_dot(tag, w, ro0, ob, 3, xq, x0 + 192, scales_of_sub_blocks_67(e0), a0)
        a1 = _sub_block_pair_dot(tag, w, ro1, ob, 3, xq, x0 + 192, scales_of_sub_blocks_67(e1), a1)
        a2 = _sub_block_pair_dot(tag, w, ro2, ob, 3, xq, x0 + 192, scales_of_sub_blocks_67(e2), a2)
        a3 = _sub_block_pair_dot(tag, w, ro3, ob, 3, xq, x0 + 192, scales_of_sub_blocks_67(e3), a3)
    return vsum(a0) + vsum(c0), vsum(a1) + vsum(c1), vsum(a2) + vsum(c2), vsum(a3) + vsum(c3)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _sub_block_pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob, jp, u, xqf, xqs, dxf, dxs, toks, n_t,
                           s0, s1, s2, s3, acc):
    """Sub-blocks (u, u + 1) = pair jp of the block at ob of the four rows, codes decoded once,
    against each token: acc[64 i + 16 r:] += (codes . x) * s_r * dx. s_r: d of the pair's
    halves spread over the dot's lanes (4 per 16 weights)."""
    c0 = codes(tag, w, ro0 + ob, jp)
    c1 = codes(tag, w, ro1 + ob, jp)
    c2 = codes(tag, w, ro2 + ob, jp)
    c3 = codes(tag, w, ro3 + ob, jp)
    for i in range(n_t):
        t = toks[i]
        xo = t * xqs + 32 * u
        sdx = act_scales_of_sub_blocks_01(vload(dxf, t * dxs + u))
        j = 64 * i
        vstore(acc, j, vfma(pdot(c0, xqf, xo), s0 * sdx, vload(acc, j)))
        vstore(acc, j + 16, vfma(pdot(c1, xqf, xo), s1 * sdx, vload(acc, j + 16)))
        vstore(acc, j + 32, vfma(pdot(c2, xqf, xo), s2 * sdx, vload(acc, j + 32)))
        vstore(acc, j + 48, vfma(pdot(c3, xqf, xo), s3 * sdx, vload(acc, j + 48)))


@njit(fastmath=True, error_model="numpy", _nrt=False)
def dot4_sub_block_pairs_tokens(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xqf, xqs, dxf, dxs, bsums,
                                toks, n_t, acc, cacc, res):
    """Several quantized tokens, 256-weight type: each pair of sub-blocks of the four rows is
    decoded once and applied to every token (per-token accumulators in scratch acc
    [n_t * 64], cacc [n_t * 4]); per token the arithmetic of dot4_sub_block_pairs_one_token."""
    bb, n_sub, same_d = layout(tag)
    off = code_offset(tag)
    for i in range(n_t * 64):
        acc[i] = 0
    for i in range(n_t * 4):
        cacc[i] = 0
    for b in range(n_sub_blocks // 8):
        ob = b * bb
        u = 8 * b
        _prefetch_next_group(w, ro0, ro1, ob, bb)
        d0, m0 = scales(tag, w, ro0 + ob)
        d1, m1 = scales(tag, w, ro1 + ob)
        d2, m2 = scales(tag, w, ro2 + ob)
        d3, m3 = scales(tag, w, ro3 + ob)
        for i in range(n_t):
            xsv = vload(bsums[toks[i]], 16 * b)
            cacc[4 * i] += vsum((m0 - d0 * off) * xsv)
            cacc[4 * i + 1] += vsum((m1 - d1 * off) * xsv)
            cacc[4 * i + 2] += vsum((m2 - d2 * off) * xsv)
            cacc[4 * i + 3] += vsum((m3 - d3 * off) * xsv)
        _sub_block_pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob, 0, u, xqf, xqs, dxf, dxs, toks, n_t,
                               scales_of_sub_blocks_01(d0), scales_of_sub_blocks_01(d1),
                               scales_of_sub_blocks_01(d2), scales_of_sub_blocks_01(d3), acc)
        _sub_block_pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob, 1, u + 2, xqf, xqs, dxf, dxs, toks, n_t,
                               scales_of_sub_blocks_23(d0), scales_of_sub_blocks_23(d1),
                               scales_of_sub_blocks_23(d2), scales_of_sub_blocks_23(d3), acc)
        _sub_block_pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob, 2, u + 4, xqf, xqs, dxf, dxs, toks, n_t,
                               scales_of_sub_blocks_45(d0), scales_of_sub_blocks_45(d1),
                               scales_of_sub_blocks_45(d2), scales_of_sub_blocks_45(d3), acc)
        _sub_block_pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob, 3, u + 6, xqf, xqs, dxf, dxs, toks, n_t,
                               scales_of_sub_blocks_67(d0), scales_of_sub_blocks_67(d1),
                               scales_of_sub_blocks_67(d2), scales_of_sub_blocks_67(d3), acc)
    for i in range(n_t):
        for r in range(4):
            res[i, r] = vsum(vload(acc, 64 * i + 16 * r)) + cacc[4 * i + r]


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _dot4_block_pairs(tag, w, ro0, ro1, ro2, ro3, cols, xq, dx, bsums, xs4, dx8, toks, n_t, acc, cacc, res):
    n_blocks = cols // 32
    xqf = xq.reshape(-1)
    xs4f = xs4.reshape(-1)
    dx8f = dx8.reshape(-1)
    if n_t == 1:
        t = toks[0]
        r0, r1, r2, r3 = dot4_block_pairs_one_token(tag, w, ro0, ro1, ro2, ro3, n_blocks, xqf,
                                                    t * xq.shape[1], xs4f, t * xs4.shape[1], dx8f)
        res[0, 0] = r0
        res[0, 1] = r1
        res[0, 2] = r2
        res[0, 3] = r3
    else:
        dot4_block_pairs_tokens(tag, w, ro0, ro1, ro2, ro3, n_blocks, xqf, xq.shape[1], xs4f,
                                xs4.shape[1], dx8f, toks, n_t, acc, res)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _dot4_sub_block_pairs(tag, w, ro0, ro1, ro2, ro3, cols, xq, dx, bsums, xs4, dx8, toks, n_t, acc, cacc, res):
    n_sub_blocks = cols // 32
    xqf = xq.reshape(-1)
    dxf = dx.reshape(-1)
    if n_t == 1:
        t = toks[0]
        r0, r1, r2, r3 = dot4_sub_block_pairs_one_token(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xqf,
                                                        t * xq.shape[1], dxf, t * dx.shape[1], bsums[t])
        res[0, 0] = r0
        res[0, 1] = r1
        res[0, 2] = r2
        res[0, 3] = r3
    else:
        dot4_sub_block_pairs_tokens(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xqf, xq.shape[1], dxf,
                                    dx.shape[1], bsums, toks, n_t, acc, cacc, res)


def dot4_i8(tag, w, ro0, ro1, ro2, ro3, cols, xq, dx, bsums, xs4, dx8, toks, n_t, acc, cacc, res):
    """res[i, r] = W[row r] . (dx * xq)[toks[i]] for i < n_t, r < 4 (quantized rows from
    ``quantize_rows``). Scratch acc float32 >= n_t * 64, cacc float32 >= n_t * 4.
    Resolved per quant type at compile time: block pairs or sub-block pairs (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(dot4_i8, jit_options={"_nrt": False})
def _dot4_i8(tag, w, ro0, ro1, ro2, ro3, cols, xq, dx, bsums, xs4, dx8, toks, n_t, acc, cacc, res):
    require_flat_bytes(w)
    if isinstance(tag, QTagType):
        kern = kernel_by_name(tag.qname)
        impl = (_dot4_block_pairs if kern.block_pair is not None
                else _dot4_sub_block_pairs if kern.codes is not None else None)
        if impl is not None:
            return (lambda tag, w, ro0, ro1, ro2, ro3, cols, xq, dx, bsums, xs4, dx8, toks, n_t, acc, cacc, res:
                    impl(tag, w, ro0, ro1, ro2, ro3, cols, xq, dx, bsums, xs4, dx8, toks, n_t, acc, cacc, res))
    return None
