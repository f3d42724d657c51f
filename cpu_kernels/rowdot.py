"""The one inner routine every driver uses: four weight rows against a list of tokens.

``dot4`` walks the four rows unit by unit (32 weights), decodes each unit once into
vectors held in registers, and applies it to every token in ``toks``; so a batch reads
each weight byte once however many tokens use it. Four rows per pass load each
activation vector once for four rows (register blocking, DESIGN "Performance notes").
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .dispatch import elem, layout, quants, scales
from .simd import vfma, vload, vsplat, vstore, vsum, vzero

f32 = np.float32


@njit(fastmath=True)
def _spill(sc, r, ds, m0, m1):
    """Block scales of row r into sc[r, 0..2, k]: a plain array indexed by the unit k
    (indexing the tuples with a run-time k would compile to a switch)."""
    for k in range(len(ds)):
        sc[r, 0, k] = ds[k]
        sc[r, 1, k] = m0[k]
        sc[r, 2, k] = m1[k]


@njit(fastmath=True)
def _one(tag, w, ro0, ro1, ro2, ro3, n_units, xf, xo, xs, sc):
    """Four row dots with one token whose activations start at xf[xo] and whose 16-column
    sums are xs; the accumulators stay in registers."""
    bb, upb = layout(tag)
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    c0 = f32(0)
    c1 = f32(0)
    c2 = f32(0)
    c3 = f32(0)
    for b in range(n_units // upb):
        ob = b * bb
        d0, p0, q0 = scales(tag, w, ro0 + ob)
        _spill(sc, 0, d0, p0, q0)
        d1, p1, q1 = scales(tag, w, ro1 + ob)
        _spill(sc, 1, d1, p1, q1)
        d2, p2, q2 = scales(tag, w, ro2 + ob)
        _spill(sc, 2, d2, p2, q2)
        d3, p3, q3 = scales(tag, w, ro3 + ob)
        _spill(sc, 3, d3, p3, q3)
        for k in range(upb):
            u = b * upb + k
            x0 = vload(xf, xo + 32 * u)
            x1 = vload(xf, xo + 32 * u + 16)
            s0 = xs[2 * u]
            s1 = xs[2 * u + 1]
            v0, v1 = quants(tag, w, ro0 + ob, k)
            a0 = vfma(vfma(v1, x1, v0 * x0), vsplat(sc[0, 0, k]), a0)
            c0 += sc[0, 1, k] * s0 + sc[0, 2, k] * s1
            v0, v1 = quants(tag, w, ro1 + ob, k)
            a1 = vfma(vfma(v1, x1, v0 * x0), vsplat(sc[1, 0, k]), a1)
            c1 += sc[1, 1, k] * s0 + sc[1, 2, k] * s1
            v0, v1 = quants(tag, w, ro2 + ob, k)
            a2 = vfma(vfma(v1, x1, v0 * x0), vsplat(sc[2, 0, k]), a2)
            c2 += sc[2, 1, k] * s0 + sc[2, 2, k] * s1
            v0, v1 = quants(tag, w, ro3 + ob, k)
            a3 = vfma(vfma(v1, x1, v0 * x0), vsplat(sc[3, 0, k]), a3)
            c3 += sc[3, 1, k] * s0 + sc[3, 2, k] * s1
    return vsum(a0) + c0, vsum(a1) + c1, vsum(a2) + c2, vsum(a3) + c3


@njit(fastmath=True)
def _many(tag, w, ro0, ro1, ro2, ro3, n_units, xf, cols, xs16, toks, n_t, acc, cacc, res, sc):
    """Several tokens: decode a unit of the four rows once, then apply it to each token;
    the per-token accumulators live in small scratch arrays (L1)."""
    bb, upb = layout(tag)
    for i in range(n_t * 64):
        acc[i] = 0
    for i in range(n_t * 4):
        cacc[i] = 0
    for b in range(n_units // upb):
        ob = b * bb
        d0, p0, q0 = scales(tag, w, ro0 + ob)
        _spill(sc, 0, d0, p0, q0)
        d1, p1, q1 = scales(tag, w, ro1 + ob)
        _spill(sc, 1, d1, p1, q1)
        d2, p2, q2 = scales(tag, w, ro2 + ob)
        _spill(sc, 2, d2, p2, q2)
        d3, p3, q3 = scales(tag, w, ro3 + ob)
        _spill(sc, 3, d3, p3, q3)
        for k in range(upb):
            u = b * upb + k
            e0, f0 = quants(tag, w, ro0 + ob, k)
            e1, f1 = quants(tag, w, ro1 + ob, k)
            e2, f2 = quants(tag, w, ro2 + ob, k)
            e3, f3 = quants(tag, w, ro3 + ob, k)
            for i in range(n_t):
                t = toks[i]
                x0 = vload(xf, t * cols + 32 * u)
                x1 = vload(xf, t * cols + 32 * u + 16)
                s0 = xs16[t, 2 * u]
                s1 = xs16[t, 2 * u + 1]
                j = i * 64
                vstore(acc, j, vfma(vfma(f0, x1, e0 * x0), vsplat(sc[0, 0, k]), vload(acc, j)))
                vstore(acc, j + 16, vfma(vfma(f1, x1, e1 * x0), vsplat(sc[1, 0, k]), vload(acc, j + 16)))
                vstore(acc, j + 32, vfma(vfma(f2, x1, e2 * x0), vsplat(sc[2, 0, k]), vload(acc, j + 32)))
                vstore(acc, j + 48, vfma(vfma(f3, x1, e3 * x0), vsplat(sc[3, 0, k]), vload(acc, j + 48)))
                cacc[4 * i] += sc[0, 1, k] * s0 + sc[0, 2, k] * s1
                cacc[4 * i + 1] += sc[1, 1, k] * s0 + sc[1, 2, k] * s1
                cacc[4 * i + 2] += sc[2, 1, k] * s0 + sc[2, 2, k] * s1
                cacc[4 * i + 3] += sc[3, 1, k] * s0 + sc[3, 2, k] * s1
    for i in range(n_t):
        for r in range(4):
            res[i, r] = vsum(vload(acc, i * 64 + r * 16)) + cacc[4 * i + r]


@njit(fastmath=True)
def dot4(tag, w, ro0, ro1, ro2, ro3, cols, X, xs16, toks, n_t, acc, cacc, res, sc):
    """res[i, r] = sum_c W[row r, c] * X[toks[i], c] for i < n_t, r < 4.

    w: raw weight bytes (any shape); ro0..ro3: byte offsets of the four rows in it.
    X: float32 [N, cols]; xs16: float32 [N, cols // 16] sums of 16-column groups of X
    (the decoders' offsets m multiply them). Scratch: acc float32 >= n_t * 64,
    cacc float32 >= n_t * 4, sc float32 [4, 3, 8]; output res float32 [>= n_t, 4].
    """
    n_units = cols // 32
    xf = X.reshape(-1)
    if n_t == 1:
        t = toks[0]
        r0, r1, r2, r3 = _one(tag, w, ro0, ro1, ro2, ro3, n_units, xf, t * cols, xs16[t], sc)
        res[0, 0] = r0
        res[0, 1] = r1
        res[0, 2] = r2
        res[0, 3] = r3
    else:
        _many(tag, w, ro0, ro1, ro2, ro3, n_units, xf, cols, xs16, toks, n_t, acc, cacc, res, sc)
    # Float types only: columns past the last full unit of 32.
    for c in range(n_units * 32, cols):
        for i in range(n_t):
            xv = X[toks[i], c]
            res[i, 0] += elem(tag, w, ro0, c) * xv
            res[i, 1] += elem(tag, w, ro1, c) * xv
            res[i, 2] += elem(tag, w, ro2, c) * xv
            res[i, 3] += elem(tag, w, ro3, c) * xv
