"""The int8-activation variant of ``rowdot``: four weight rows against one token whose
activations were quantized to int8 per 32 (``quantize_rows``), as llama.cpp does with
Q8_0/Q8_K. Weight codes times activations are integer dot products (``simd8.idot2``,
two units per instruction); each unit's partial sums are scaled by d * dx in float.

The result is the exact dot product of the weights with the *dequantized* activations
dx * xq (the decoders' offsets m multiply sums of dx * xq too), so the only difference
from the float path is the activation rounding: |err| <= sum_c |w_c| * dx_c / 2.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .dispatch import code_offset, codes, layout, scales
from .rowdot import _prefetch_next_group
from .simd import vfma, vlane, vload, vstore, vsum, vzero
from .simd8 import (idot2, spread_dx0, spread_dx1, spread_dx2, spread_dx3, spread_k0, spread_k1,
                    spread_k2, spread_k3, spread_pair, vhalves)

f32 = np.float32
XQ_PAD = 64       # int8 activations past a row's end that idot2 may read (times scale 0)
DX_PAD = 16       # activation scales past a row's end that a vector load may read


@njit(fastmath=True)
def quantize_rows(x, xq, dx, xs16):
    """x float32 [B, cols] (cols % 32 == 0) -> xq int8 [B, >= cols + XQ_PAD], dx float32
    [B, >= cols // 32 + DX_PAD] (scale of each 32: max |x| / 127), xs16 float32
    [B, cols // 16]: sums of 16 dequantized activations dx * xq. Padding is zeroed."""
    b_n, cols = x.shape
    for b in range(b_n):
        xq[b, cols:] = 0
        dx[b, cols // 32:] = 0
        for u in range(cols // 32):
            amax = f32(0)
            for j in range(32):
                amax = max(amax, abs(x[b, 32 * u + j]))
            d = amax / f32(127)
            inv = f32(1) / d if d > 0 else f32(0)
            dx[b, u] = d
            for h in range(2):
                s = 0
                for j in range(16):
                    q = np.int32(np.rint(x[b, 32 * u + 16 * h + j] * inv))
                    xq[b, 32 * u + 16 * h + j] = q
                    s += q
                xs16[b, 2 * u + h] = f32(s) * d


@njit(fastmath=True)
def _pair(tag, w, ro, ob_a, k_a, ob_b, k_b, xq, xo, scale, acc):
    a0, a1 = codes(tag, w, ro + ob_a, k_a)
    b0, b1 = codes(tag, w, ro + ob_b, k_b)
    return vfma(idot2(a0, a1, b0, b1, xq, xo), scale, acc)


@njit(fastmath=True)
def _m1(d, m, off, s0, s1):
    """m part of a one-unit block: (m - off * d) per half times the halves' sums."""
    return (vlane(m, 0) - off * vlane(d, 0)) * s0 + (vlane(m, 1) - off * vlane(d, 1)) * s1


@njit(fastmath=True)
def _pair1(tag, w, ro, ob_a, ob_b, keep, dxa, dxb, xq, xo, acc):
    """One-unit blocks (their halves share d): blocks A, B of one row with scalar scales."""
    da, ma = scales(tag, w, ro + ob_a)
    db, mb = scales(tag, w, ro + ob_b)
    return _pair(tag, w, ro, ob_a, 0, ob_b, 0, xq, xo,
                 vhalves(vlane(da, 0) * dxa, vlane(db, 0) * keep * dxb), acc)


@njit(fastmath=True)
def _m_pair1(tag, w, ro, ob_a, ob_b, off, s, t):
    """m parts of blocks A, B of one row (s, t: their activation sums, t = 0 for no B)."""
    da, ma = scales(tag, w, ro + ob_a)
    db, mb = scales(tag, w, ro + ob_b)
    return (vlane(ma, 0) - off * vlane(da, 0)) * s + (vlane(mb, 0) - off * vlane(db, 0)) * t


@njit(fastmath=True)
def one_i8(tag, w, ro0, ro1, ro2, ro3, n_units, xq, xo, dx, do, xs):
    """Four row dots with one quantized token: codes at xq[xo:], unit scales at dx[do:],
    16-column sums of the dequantized activations xs (1-D)."""
    bb, upb, same_d = layout(tag)
    off = code_offset(tag)
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    c0 = vzero()
    c1 = vzero()
    c2 = vzero()
    c3 = vzero()
    z0 = f32(0)
    z1 = f32(0)
    z2 = f32(0)
    z3 = f32(0)
    nb = n_units // upb
    if upb == 1:
        # Blocks in pairs (A, B) = (b, b + 1); an odd last block pairs with itself with
        # B weighted 0. Scalar scales: the int8 one-unit types all have same_d (and m0 = m1).
        for b in range(0, nb, 2):
            b2 = b + 1 if b + 1 < nb else b
            keep = f32(1) if b + 1 < nb else f32(0)
            ob_a = b * bb
            ob_b = b2 * bb
            _prefetch_next_group(w, ro0, ro1, ob_a, 2 * bb)
            dxa = dx[do + b]
            dxb = dx[do + b2]
            s = xs[2 * b] + xs[2 * b + 1]
            t = (xs[2 * b2] + xs[2 * b2 + 1]) * keep
            a0 = _pair1(tag, w, ro0, ob_a, ob_b, keep, dxa, dxb, xq, xo + 32 * b, a0)
            z0 += _m_pair1(tag, w, ro0, ob_a, ob_b, off, s, t)
            a1 = _pair1(tag, w, ro1, ob_a, ob_b, keep, dxa, dxb, xq, xo + 32 * b, a1)
            z1 += _m_pair1(tag, w, ro1, ob_a, ob_b, off, s, t)
            a2 = _pair1(tag, w, ro2, ob_a, ob_b, keep, dxa, dxb, xq, xo + 32 * b, a2)
            z2 += _m_pair1(tag, w, ro2, ob_a, ob_b, off, s, t)
            a3 = _pair1(tag, w, ro3, ob_a, ob_b, keep, dxa, dxb, xq, xo + 32 * b, a3)
            z3 += _m_pair1(tag, w, ro3, ob_a, ob_b, off, s, t)
    else:
        for b in range(nb):
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
            # Unit pairs (0, 1) .. (6, 7) unrolled: constant bit positions and shuffles.
            s = spread_dx0(vdx)
            a0 = _pair(tag, w, ro0, ob, 0, ob, 1, xq, x0, spread_k0(d0) * s, a0)
            a1 = _pair(tag, w, ro1, ob, 0, ob, 1, xq, x0, spread_k0(d1) * s, a1)
            a2 = _pair(tag, w, ro2, ob, 0, ob, 1, xq, x0, spread_k0(d2) * s, a2)
            a3 = _pair(tag, w, ro3, ob, 0, ob, 1, xq, x0, spread_k0(d3) * s, a3)
            s = spread_dx1(vdx)
            a0 = _pair(tag, w, ro0, ob, 2, ob, 3, xq, x0 + 64, spread_k1(d0) * s, a0)
            a1 = _pair(tag, w, ro1, ob, 2, ob, 3, xq, x0 + 64, spread_k1(d1) * s, a1)
            a2 = _pair(tag, w, ro2, ob, 2, ob, 3, xq, x0 + 64, spread_k1(d2) * s, a2)
            a3 = _pair(tag, w, ro3, ob, 2, ob, 3, xq, x0 + 64, spread_k1(d3) * s, a3)
            s = spread_dx2(vdx)
            a0 = _pair(tag, w, ro0, ob, 4, ob, 5, xq, x0 + 128, spread_k2(d0) * s, a0)
            a1 = _pair(tag, w, ro1, ob, 4, ob, 5, xq, x0 + 128, spread_k2(d1) * s, a1)
            a2 = _pair(tag, w, ro2, ob, 4, ob, 5, xq, x0 + 128, spread_k2(d2) * s, a2)
            a3 = _pair(tag, w, ro3, ob, 4, ob, 5, xq, x0 + 128, spread_k2(d3) * s, a3)
            s = spread_dx3(vdx)
            a0 = _pair(tag, w, ro0, ob, 6, ob, 7, xq, x0 + 192, spread_k3(d0) * s, a0)
            a1 = _pair(tag, w, ro1, ob, 6, ob, 7, xq, x0 + 192, spread_k3(d1) * s, a1)
            a2 = _pair(tag, w, ro2, ob, 6, ob, 7, xq, x0 + 192, spread_k3(d2) * s, a2)
            a3 = _pair(tag, w, ro3, ob, 6, ob, 7, xq, x0 + 192, spread_k3(d3) * s, a3)
    return (vsum(a0) + vsum(c0) + z0, vsum(a1) + vsum(c1) + z1,
            vsum(a2) + vsum(c2) + z2, vsum(a3) + vsum(c3) + z3)


@njit(fastmath=True)
def _pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob_a, k_a, ob_b, k_b, u, xqf, xqs, dxf, dxs,
                 toks, n_t, s0, s1, s2, s3, acc):
    """Units (A, B) = (u, u + 1) of the four rows, codes decoded once, against each token:
    acc[64 i + 16 r:] += idot2(row r, token i) * s_r * dx. s_r: d of the pair's halves
    spread over idot2's lanes."""
    a0, a1 = codes(tag, w, ro0 + ob_a, k_a)
    b0, b1 = codes(tag, w, ro0 + ob_b, k_b)
    c0, c1 = codes(tag, w, ro1 + ob_a, k_a)
    d0, d1 = codes(tag, w, ro1 + ob_b, k_b)
    e0, e1 = codes(tag, w, ro2 + ob_a, k_a)
    f0, f1 = codes(tag, w, ro2 + ob_b, k_b)
    g0, g1 = codes(tag, w, ro3 + ob_a, k_a)
    h0, h1 = codes(tag, w, ro3 + ob_b, k_b)
    for i in range(n_t):
        t = toks[i]
        xo = t * xqs + 32 * u
        sdx = spread_dx0(vload(dxf, t * dxs + u))
        j = 64 * i
        vstore(acc, j, vfma(idot2(a0, a1, b0, b1, xqf, xo), s0 * sdx, vload(acc, j)))
        vstore(acc, j + 16, vfma(idot2(c0, c1, d0, d1, xqf, xo), s1 * sdx, vload(acc, j + 16)))
        vstore(acc, j + 32, vfma(idot2(e0, e1, f0, f1, xqf, xo), s2 * sdx, vload(acc, j + 32)))
        vstore(acc, j + 48, vfma(idot2(g0, g1, h0, h1, xqf, xo), s3 * sdx, vload(acc, j + 48)))


@njit(fastmath=True)
def many_i8(tag, w, ro0, ro1, ro2, ro3, n_units, xqf, xqs, dxf, dxs, xs16, toks, n_t, acc, cacc, res):
    """Several quantized tokens: each pair of units of the four rows is decoded once and
    applied to every token (per-token accumulators in scratch acc [n_t * 64], cacc
    [n_t * 4]); the same arithmetic as one_i8 per token."""
    bb, upb, same_d = layout(tag)
    off = code_offset(tag)
    for i in range(n_t * 64):
        acc[i] = 0
    for i in range(n_t * 4):
        cacc[i] = 0
    nb = n_units // upb
    if upb == 1:
        for b in range(0, nb, 2):
            b2 = b + 1 if b + 1 < nb else b
            keep = f32(1) if b + 1 < nb else f32(0)
            ob_a = b * bb
            ob_b = b2 * bb
            _prefetch_next_group(w, ro0, ro1, ob_a, 2 * bb)
            da0, ma0 = scales(tag, w, ro0 + ob_a)
            db0, mb0 = scales(tag, w, ro0 + ob_b)
            da1, ma1 = scales(tag, w, ro1 + ob_a)
            db1, mb1 = scales(tag, w, ro1 + ob_b)
            da2, ma2 = scales(tag, w, ro2 + ob_a)
            db2, mb2 = scales(tag, w, ro2 + ob_b)
            da3, ma3 = scales(tag, w, ro3 + ob_a)
            db3, mb3 = scales(tag, w, ro3 + ob_b)
            for i in range(n_t):
                t = toks[i]
                s0 = xs16[t, 2 * b]
                s1 = xs16[t, 2 * b + 1]
                t0 = xs16[t, 2 * b2] * keep
                t1 = xs16[t, 2 * b2 + 1] * keep
                cacc[4 * i] += _m1(da0, ma0, off, s0, s1) + _m1(db0, mb0, off, t0, t1)
                cacc[4 * i + 1] += _m1(da1, ma1, off, s0, s1) + _m1(db1, mb1, off, t0, t1)
                cacc[4 * i + 2] += _m1(da2, ma2, off, s0, s1) + _m1(db2, mb2, off, t0, t1)
                cacc[4 * i + 3] += _m1(da3, ma3, off, s0, s1) + _m1(db3, mb3, off, t0, t1)
            _pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob_a, 0, ob_b, 0, b, xqf, xqs, dxf, dxs, toks, n_t,
                         spread_pair(da0, db0 * keep), spread_pair(da1, db1 * keep),
                         spread_pair(da2, db2 * keep), spread_pair(da3, db3 * keep), acc)
    else:
        for b in range(nb):
            ob = b * bb
            u = 8 * b
            _prefetch_next_group(w, ro0, ro1, ob, bb)
            d0, m0 = scales(tag, w, ro0 + ob)
            d1, m1 = scales(tag, w, ro1 + ob)
            d2, m2 = scales(tag, w, ro2 + ob)
            d3, m3 = scales(tag, w, ro3 + ob)
            for i in range(n_t):
                xsv = vload(xs16[toks[i]], 16 * b)
                cacc[4 * i] += vsum((m0 - d0 * off) * xsv)
                cacc[4 * i + 1] += vsum((m1 - d1 * off) * xsv)
                cacc[4 * i + 2] += vsum((m2 - d2 * off) * xsv)
                cacc[4 * i + 3] += vsum((m3 - d3 * off) * xsv)
            _pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob, 0, ob, 1, u, xqf, xqs, dxf, dxs, toks, n_t,
                         spread_k0(d0), spread_k0(d1), spread_k0(d2), spread_k0(d3), acc)
            _pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob, 2, ob, 3, u + 2, xqf, xqs, dxf, dxs, toks, n_t,
                         spread_k1(d0), spread_k1(d1), spread_k1(d2), spread_k1(d3), acc)
            _pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob, 4, ob, 5, u + 4, xqf, xqs, dxf, dxs, toks, n_t,
                         spread_k2(d0), spread_k2(d1), spread_k2(d2), spread_k2(d3), acc)
            _pair_tokens(tag, w, ro0, ro1, ro2, ro3, ob, 6, ob, 7, u + 6, xqf, xqs, dxf, dxs, toks, n_t,
                         spread_k3(d0), spread_k3(d1), spread_k3(d2), spread_k3(d3), acc)
    for i in range(n_t):
        for r in range(4):
            res[i, r] = vsum(vload(acc, 64 * i + 16 * r)) + cacc[4 * i + r]


@njit(fastmath=True)
def dot4_i8(tag, w, ro0, ro1, ro2, ro3, cols, xq, dx, xs16, toks, n_t, acc, cacc, res):
    """res[i, r] = W[row r] . (dx * xq)[toks[i]] for i < n_t, r < 4 (quantized rows from
    ``quantize_rows``). Scratch acc float32 >= n_t * 64, cacc float32 >= n_t * 4."""
    n_units = cols // 32
    xqf = xq.reshape(-1)
    dxf = dx.reshape(-1)
    if n_t == 1:
        t = toks[0]
        r0, r1, r2, r3 = one_i8(tag, w, ro0, ro1, ro2, ro3, n_units, xqf, t * xq.shape[1],
                                dxf, t * dx.shape[1], xs16[t])
        res[0, 0] = r0
        res[0, 1] = r1
        res[0, 2] = r2
        res[0, 3] = r3
    else:
        many_i8(tag, w, ro0, ro1, ro2, ro3, n_units, xqf, xq.shape[1], dxf, dx.shape[1], xs16, toks,
                n_t, acc, cacc, res)
