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
from .simd import vfma, vlane, vload, vsum, vzero
from .simd8 import (idot2, spread_dx0, spread_dx1, spread_dx2, spread_dx3, spread_k0, spread_k1,
                    spread_k2, spread_k3, spread_pair)

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
        # B's scale set to 0 (after the loop, so the loop body has no branches).
        for b in range(0, nb + 1, 2):
            if b >= nb:
                break
            b2 = b + 1 if b + 1 < nb else b
            keep = f32(1) if b + 1 < nb else f32(0)
            ob_a = b * bb
            ob_b = b2 * bb
            _prefetch_next_group(w, ro0, ro1, ob_a, 2 * bb)
            sdx = spread_dx0(vload(dx, do + b))
            s0 = xs[2 * b]
            s1 = xs[2 * b + 1]
            t0 = xs[2 * b2] * keep
            t1 = xs[2 * b2 + 1] * keep
            da, ma = scales(tag, w, ro0 + ob_a)
            db, mb = scales(tag, w, ro0 + ob_b)
            z0 += _m1(da, ma, off, s0, s1) + _m1(db, mb, off, t0, t1)
            a0 = _pair(tag, w, ro0, ob_a, 0, ob_b, 0, xq, xo + 32 * b, spread_pair(da, db * keep) * sdx, a0)
            da, ma = scales(tag, w, ro1 + ob_a)
            db, mb = scales(tag, w, ro1 + ob_b)
            z1 += _m1(da, ma, off, s0, s1) + _m1(db, mb, off, t0, t1)
            a1 = _pair(tag, w, ro1, ob_a, 0, ob_b, 0, xq, xo + 32 * b, spread_pair(da, db * keep) * sdx, a1)
            da, ma = scales(tag, w, ro2 + ob_a)
            db, mb = scales(tag, w, ro2 + ob_b)
            z2 += _m1(da, ma, off, s0, s1) + _m1(db, mb, off, t0, t1)
            a2 = _pair(tag, w, ro2, ob_a, 0, ob_b, 0, xq, xo + 32 * b, spread_pair(da, db * keep) * sdx, a2)
            da, ma = scales(tag, w, ro3 + ob_a)
            db, mb = scales(tag, w, ro3 + ob_b)
            z3 += _m1(da, ma, off, s0, s1) + _m1(db, mb, off, t0, t1)
            a3 = _pair(tag, w, ro3, ob_a, 0, ob_b, 0, xq, xo + 32 * b, spread_pair(da, db * keep) * sdx, a3)
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
def dot4_i8(tag, w, ro0, ro1, ro2, ro3, cols, xq, dx, xs16, toks, n_t, res):
    """res[i, r] = W[row r] . (dx * xq)[toks[i]] for i < n_t, r < 4 (quantized rows from
    ``quantize_rows``). Tokens one at a time: the four rows' bytes stay in L1 between them."""
    n_units = cols // 32
    xqf = xq.reshape(-1)
    dxf = dx.reshape(-1)
    for i in range(n_t):
        t = toks[i]
        r0, r1, r2, r3 = one_i8(tag, w, ro0, ro1, ro2, ro3, n_units, xqf, t * xq.shape[1],
                                dxf, t * dx.shape[1], xs16[t])
        res[i, 0] = r0
        res[i, 1] = r1
        res[i, 2] = r2
        res[i, 3] = r3
