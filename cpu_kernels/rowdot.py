"""The one inner routine every driver uses: four weight rows against a list of tokens.

``dot4`` walks the four rows sub-block by sub-block (32 weights), decodes each sub-block
once into vectors held in registers, and applies it to every token in ``toks``; so a batch reads
each weight byte once however many tokens use it. Four rows per pass load each
activation vector once for four rows (register blocking, DESIGN "Performance notes").

Per block, ``scales`` gives vectors vd, vm with (d, m) of every 16-weight half in lanes
2k, 2k + 1 (k = sub-block). The m part of a dot is m * (sum of the 16 activations), so with
the activations' 16-column sums xs the whole block's m part is one vector product vm . xs.
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.core.errors import TypingError
from numba.extending import overload

from .dispatch import elem, has_offsets, layout, quants, scales
from .registry import QTagType, kernel_by_name
from .simd import prefetch, vfma, vlane, vload, vsplat, vstore, vsum, vzero

f32 = np.float32


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _prefetch_next_group(w, ro0, ro1, ob, bb):
    """Prefetch the bytes the next row group (the four rows after these: contiguous in
    GGUF data) reads at this block: hardware prefetchers lose track of four interleaved
    row streams that are consumed slowly, and from DRAM the kernels ran ~40% slower."""
    nxt = ro0 + 4 * (ro1 - ro0) + 4 * ob
    for j in range(0, 4 * bb, 64):
        prefetch(w, nxt + j)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _sub_block_dot(a, v0, v1, x0, x1, sc, i, same_d):
    """a + d0 * (v0 . x0) + d1 * (v1 . x1) lane-wise, d0 = sc[i], d1 = sc[i + 1]."""
    if same_d:
        return vfma(vfma(v1, x1, v0 * x0), vsplat(sc[i]), a)
    return vfma(v1 * x1, vsplat(sc[i + 1]), vfma(v0 * x0, vsplat(sc[i]), a))


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _sub_block_dot_vd(a, v0, v1, x0, x1, vd, same_d):
    """As _sub_block_dot for 32-weight blocks (one sub-block), with d0, d1 in lanes 0, 1 of vd."""
    if same_d:
        return vfma(vfma(v1, x1, v0 * x0), vsplat(vlane(vd, 0)), a)
    return vfma(v1 * x1, vsplat(vlane(vd, 1)), vfma(v0 * x0, vsplat(vlane(vd, 0)), a))


@njit(fastmath=True, error_model="numpy", _nrt=False, inline="always")
def _sub_block_dot4(tag, w, ro0, ro1, ro2, ro3, ob, k, xf, xo, sc, a0, a1, a2, a3, same_d):
    """Sub-block k of block ob for the four rows, one token (activations at xf[xo:xo + 32],
    d of row r's halves at sc[16 r + 2k], sc[16 r + 2k + 1]). Inlined by Numba: each literal k
    would otherwise be its own compiled function, eight per 256-weight type (measured: a fifth of
    such a type's float matmul compile time, 15.3 -> 12.4 s for Q4_K, Q6_K and IQ2_XS cold)."""
    x0 = vload(xf, xo)
    x1 = vload(xf, xo + 16)
    v0, v1 = quants(tag, w, ro0 + ob, k)
    a0 = _sub_block_dot(a0, v0, v1, x0, x1, sc, 2 * k, same_d)
    v0, v1 = quants(tag, w, ro1 + ob, k)
    a1 = _sub_block_dot(a1, v0, v1, x0, x1, sc, 16 + 2 * k, same_d)
    v0, v1 = quants(tag, w, ro2 + ob, k)
    a2 = _sub_block_dot(a2, v0, v1, x0, x1, sc, 32 + 2 * k, same_d)
    v0, v1 = quants(tag, w, ro3 + ob, k)
    a3 = _sub_block_dot(a3, v0, v1, x0, x1, sc, 48 + 2 * k, same_d)
    return a0, a1, a2, a3


def _one(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, xo, xs, sc):
    """Four row dots with one token whose activations start at xf[xo] and whose 16-column
    sums are xs; the accumulators stay in registers. sc: float32 scratch [>= 64]. Resolved per
    quant type while Numba types the caller: 32-weight blocks or 256-weight ones (typing only
    the layout's own loop body keeps a 32-weight type from compiling eight unrolled sub-block
    steps it never runs; jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def require_flat_bytes(w) -> None:
    """The row routines' contract, checked while Numba types them: weights arrive as flat
    bytes (``dot4``'s docstring says why), so a caller passing a matrix or an expert stack
    fails to compile instead of silently compiling a second copy of every routine."""
    if getattr(w, "ndim", 1) != 1:
        raise TypingError(f"row routines take flat weight bytes (w.reshape(-1)), got {w}")


@overload(_one, jit_options={"_nrt": False})
def _ol_one(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, xo, xs, sc):
    require_flat_bytes(w)
    if isinstance(tag, QTagType):
        impl = _one_blocks32 if kernel_by_name(tag.qname).sub_blocks_per_block == 1 else _one_blocks256
        return (lambda tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, xo, xs, sc:
                impl(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, xo, xs, sc))
    return None


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _one_blocks32(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, xo, xs, sc):
    """``_one`` for 32-weight blocks: the m parts are scalars z (block offset times the sums
    of its two 16-column halves)."""
    bb, n_sub, same_d = layout(tag)
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    z0 = f32(0)
    z1 = f32(0)
    z2 = f32(0)
    z3 = f32(0)
    for b in range(n_sub_blocks):
        ob = b * bb
        _prefetch_next_group(w, ro0, ro1, ob, bb)
        d0, m0 = scales(tag, w, ro0 + ob)
        d1, m1 = scales(tag, w, ro1 + ob)
        d2, m2 = scales(tag, w, ro2 + ob)
        d3, m3 = scales(tag, w, ro3 + ob)
        x0 = vload(xf, xo + 32 * b)
        x1 = vload(xf, xo + 32 * b + 16)
        s0 = xs[2 * b]
        s1 = xs[2 * b + 1]
        v0, v1 = quants(tag, w, ro0 + ob, 0)
        a0 = _sub_block_dot_vd(a0, v0, v1, x0, x1, d0, same_d)
        z0 += vlane(m0, 0) * s0 + vlane(m0, 1) * s1
        v0, v1 = quants(tag, w, ro1 + ob, 0)
        a1 = _sub_block_dot_vd(a1, v0, v1, x0, x1, d1, same_d)
        z1 += vlane(m1, 0) * s0 + vlane(m1, 1) * s1
        v0, v1 = quants(tag, w, ro2 + ob, 0)
        a2 = _sub_block_dot_vd(a2, v0, v1, x0, x1, d2, same_d)
        z2 += vlane(m2, 0) * s0 + vlane(m2, 1) * s1
        v0, v1 = quants(tag, w, ro3 + ob, 0)
        a3 = _sub_block_dot_vd(a3, v0, v1, x0, x1, d3, same_d)
        z3 += vlane(m3, 0) * s0 + vlane(m3, 1) * s1
    return vsum(a0) + z0, vsum(a1) + z1, vsum(a2) + z2, vsum(a3) + z3


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _one_blocks256(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, xo, xs, sc):
    """``_one`` for 256-weight blocks: the m parts are vectors (one product of the block's 16
    offsets with its 16 group sums)."""
    bb, n_sub, same_d = layout(tag)
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    c0 = vzero()
    c1 = vzero()
    c2 = vzero()
    c3 = vzero()
    for b in range(n_sub_blocks // n_sub):
        ob = b * bb
        _prefetch_next_group(w, ro0, ro1, ob, bb)
        d0, m0 = scales(tag, w, ro0 + ob)
        d1, m1 = scales(tag, w, ro1 + ob)
        d2, m2 = scales(tag, w, ro2 + ob)
        d3, m3 = scales(tag, w, ro3 + ob)
        xsv = vload(xs, 16 * b)
        c0 = vfma(m0, xsv, c0)
        c1 = vfma(m1, xsv, c1)
        c2 = vfma(m2, xsv, c2)
        c3 = vfma(m3, xsv, c3)
        vstore(sc, 0, d0)
        vstore(sc, 16, d1)
        vstore(sc, 32, d2)
        vstore(sc, 48, d3)
        # All sub-blocks of the block unrolled: K-quant bit positions depend on k, so the
        # shifts become constants and bytes shared by neighbouring sub-blocks load once.
        xu = xo + 32 * b * n_sub
        a0, a1, a2, a3 = _sub_block_dot4(tag, w, ro0, ro1, ro2, ro3, ob, 0, xf, xu, sc, a0, a1, a2, a3, same_d)
        a0, a1, a2, a3 = _sub_block_dot4(tag, w, ro0, ro1, ro2, ro3, ob, 1, xf, xu + 32, sc, a0, a1, a2, a3, same_d)
        a0, a1, a2, a3 = _sub_block_dot4(tag, w, ro0, ro1, ro2, ro3, ob, 2, xf, xu + 64, sc, a0, a1, a2, a3, same_d)
        a0, a1, a2, a3 = _sub_block_dot4(tag, w, ro0, ro1, ro2, ro3, ob, 3, xf, xu + 96, sc, a0, a1, a2, a3, same_d)
        a0, a1, a2, a3 = _sub_block_dot4(tag, w, ro0, ro1, ro2, ro3, ob, 4, xf, xu + 128, sc, a0, a1, a2, a3, same_d)
        a0, a1, a2, a3 = _sub_block_dot4(tag, w, ro0, ro1, ro2, ro3, ob, 5, xf, xu + 160, sc, a0, a1, a2, a3, same_d)
        a0, a1, a2, a3 = _sub_block_dot4(tag, w, ro0, ro1, ro2, ro3, ob, 6, xf, xu + 192, sc, a0, a1, a2, a3, same_d)
        a0, a1, a2, a3 = _sub_block_dot4(tag, w, ro0, ro1, ro2, ro3, ob, 7, xf, xu + 224, sc, a0, a1, a2, a3, same_d)
    return vsum(a0) + vsum(c0), vsum(a1) + vsum(c1), vsum(a2) + vsum(c2), vsum(a3) + vsum(c3)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _two_blocks32(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, xa, xb, xsa, xsb):
    """``_one_blocks32`` for two tokens at once (activations at xf[xa:], xf[xb:], 16-column
    sums xsa, xsb): each block of the four rows decoded once for both, all eight accumulators
    in registers. ``_many`` keeps per-token accumulators in scratch memory, and each block's
    store and reload of them made a latency chain: on a 4096-row, 2048-column Q4_0 matrix, 2
    threads, two tokens took 493 us against one token's 212 (288 us this way)."""
    bb, n_sub, same_d = layout(tag)
    a0 = vzero()
    a1 = vzero()
    a2 = vzero()
    a3 = vzero()
    b0 = vzero()
    b1 = vzero()
    b2 = vzero()
    b3 = vzero()
    za0 = za1 = za2 = za3 = zb0 = zb1 = zb2 = zb3 = f32(0)      # the offsets' terms (zero without)
    for b in range(n_sub_blocks):
        ob = b * bb
        _prefetch_next_group(w, ro0, ro1, ob, bb)
        d0, m0 = scales(tag, w, ro0 + ob)
        d1, m1 = scales(tag, w, ro1 + ob)
        d2, m2 = scales(tag, w, ro2 + ob)
        d3, m3 = scales(tag, w, ro3 + ob)
        xa0 = vload(xf, xa + 32 * b)
        xa1 = vload(xf, xa + 32 * b + 16)
        xb0 = vload(xf, xb + 32 * b)
        xb1 = vload(xf, xb + 32 * b + 16)
        if has_offsets(tag):
            sa0, sa1, sb0, sb1 = xsa[2 * b], xsa[2 * b + 1], xsb[2 * b], xsb[2 * b + 1]
            za0 += vlane(m0, 0) * sa0 + vlane(m0, 1) * sa1
            za1 += vlane(m1, 0) * sa0 + vlane(m1, 1) * sa1
            za2 += vlane(m2, 0) * sa0 + vlane(m2, 1) * sa1
            za3 += vlane(m3, 0) * sa0 + vlane(m3, 1) * sa1
            zb0 += vlane(m0, 0) * sb0 + vlane(m0, 1) * sb1
            zb1 += vlane(m1, 0) * sb0 + vlane(m1, 1) * sb1
            zb2 += vlane(m2, 0) * sb0 + vlane(m2, 1) * sb1
            zb3 += vlane(m3, 0) * sb0 + vlane(m3, 1) * sb1
        v0, v1 = quants(tag, w, ro0 + ob, 0)
        a0 = _sub_block_dot_vd(a0, v0, v1, xa0, xa1, d0, same_d)
        b0 = _sub_block_dot_vd(b0, v0, v1, xb0, xb1, d0, same_d)
        v0, v1 = quants(tag, w, ro1 + ob, 0)
        a1 = _sub_block_dot_vd(a1, v0, v1, xa0, xa1, d1, same_d)
        b1 = _sub_block_dot_vd(b1, v0, v1, xb0, xb1, d1, same_d)
        v0, v1 = quants(tag, w, ro2 + ob, 0)
        a2 = _sub_block_dot_vd(a2, v0, v1, xa0, xa1, d2, same_d)
        b2 = _sub_block_dot_vd(b2, v0, v1, xb0, xb1, d2, same_d)
        v0, v1 = quants(tag, w, ro3 + ob, 0)
        a3 = _sub_block_dot_vd(a3, v0, v1, xa0, xa1, d3, same_d)
        b3 = _sub_block_dot_vd(b3, v0, v1, xb0, xb1, d3, same_d)
    return (vsum(a0) + za0, vsum(a1) + za1, vsum(a2) + za2, vsum(a3) + za3,
            vsum(b0) + zb0, vsum(b1) + zb1, vsum(b2) + zb2, vsum(b3) + zb3)


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _many(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, cols, bsums, toks, n_t, acc, cacc, res, sc):
    """Several tokens: decode a sub-block of the four rows once, then apply it to each token;
    the per-token accumulators live in small scratch arrays (L1)."""
    bb, n_sub, same_d = layout(tag)
    for i in range(n_t * 64):
        acc[i] = 0
    for i in range(n_t * 4):
        cacc[i] = 0
    for b in range(n_sub_blocks // n_sub):
        ob = b * bb
        _prefetch_next_group(w, ro0, ro1, ob, bb)
        d0, m0 = scales(tag, w, ro0 + ob)
        d1, m1 = scales(tag, w, ro1 + ob)
        d2, m2 = scales(tag, w, ro2 + ob)
        d3, m3 = scales(tag, w, ro3 + ob)
        vstore(sc, 0, d0)
        vstore(sc, 16, d1)
        vstore(sc, 32, d2)
        vstore(sc, 48, d3)
        for i in range(n_t):
            t = toks[i]
            if n_sub == 1:
                s0 = bsums[t, 2 * b]
                s1 = bsums[t, 2 * b + 1]
                cacc[4 * i] += vlane(m0, 0) * s0 + vlane(m0, 1) * s1
                cacc[4 * i + 1] += vlane(m1, 0) * s0 + vlane(m1, 1) * s1
                cacc[4 * i + 2] += vlane(m2, 0) * s0 + vlane(m2, 1) * s1
                cacc[4 * i + 3] += vlane(m3, 0) * s0 + vlane(m3, 1) * s1
            else:
                xsv = vload(bsums[t], 16 * b)      # the block's 16 group sums
                cacc[4 * i] += vsum(m0 * xsv)
                cacc[4 * i + 1] += vsum(m1 * xsv)
                cacc[4 * i + 2] += vsum(m2 * xsv)
                cacc[4 * i + 3] += vsum(m3 * xsv)
        for k in range(n_sub):
            u = b * n_sub + k
            e0, f0 = quants(tag, w, ro0 + ob, k)
            e1, f1 = quants(tag, w, ro1 + ob, k)
            e2, f2 = quants(tag, w, ro2 + ob, k)
            e3, f3 = quants(tag, w, ro3 + ob, k)
            for i in range(n_t):
                xo = toks[i] * cols + 32 * u
                x0 = vload(xf, xo)
                x1 = vload(xf, xo + 16)
                j = i * 64
                vstore(acc, j, _sub_block_dot(vload(acc, j), e0, f0, x0, x1, sc, 2 * k, same_d))
                vstore(acc, j + 16, _sub_block_dot(vload(acc, j + 16), e1, f1, x0, x1, sc, 16 + 2 * k, same_d))
                vstore(acc, j + 32, _sub_block_dot(vload(acc, j + 32), e2, f2, x0, x1, sc, 32 + 2 * k, same_d))
                vstore(acc, j + 48, _sub_block_dot(vload(acc, j + 48), e3, f3, x0, x1, sc, 48 + 2 * k, same_d))
    for i in range(n_t):
        for r in range(4):
            res[i, r] = vsum(vload(acc, i * 64 + r * 16)) + cacc[4 * i + r]


def _several(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, cols, bsums, toks, n_t, acc, cacc, res, sc):
    """Four row dots with several tokens (``dot4``'s arguments), resolved per quant type while
    Numba types the caller: 32-weight blocks two tokens at a time in registers
    (``_two_blocks32``, an odd last token by ``_one``), 256-weight blocks ``_many``."""
    raise NotImplementedError("only callable from jitted code")


@overload(_several, jit_options={"_nrt": False})
def _ol_several(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, cols, bsums, toks, n_t, acc, cacc, res, sc):
    require_flat_bytes(w)
    if isinstance(tag, QTagType):
        impl = _pairs_blocks32 if kernel_by_name(tag.qname).sub_blocks_per_block == 1 else _many
        return (lambda tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, cols, bsums, toks, n_t, acc, cacc, res, sc:
                impl(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, cols, bsums, toks, n_t, acc, cacc, res, sc))
    return None


@njit(fastmath=True, error_model="numpy", _nrt=False)
def _pairs_blocks32(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, cols, bsums, toks, n_t, acc, cacc, res, sc):
    """``_several`` for 32-weight blocks (``acc``, ``cacc`` unused)."""
    for i in range(0, n_t - 1, 2):
        ta, tb = toks[i], toks[i + 1]
        r = _two_blocks32(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, ta * cols, tb * cols, bsums[ta], bsums[tb])
        res[i, 0], res[i, 1], res[i, 2], res[i, 3] = r[0], r[1], r[2], r[3]
        res[i + 1, 0], res[i + 1, 1], res[i + 1, 2], res[i + 1, 3] = r[4], r[5], r[6], r[7]
    if n_t % 2:
        t = toks[n_t - 1]
        r0, r1, r2, r3 = _one(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, t * cols, bsums[t], sc)
        res[n_t - 1, 0], res[n_t - 1, 1], res[n_t - 1, 2], res[n_t - 1, 3] = r0, r1, r2, r3


@njit(fastmath=True, error_model="numpy", _nrt=False)
def dot4(tag, w, ro0, ro1, ro2, ro3, cols, X, bsums, toks, n_t, acc, cacc, res, sc):
    """res[i, r] = sum_c W[row r, c] * X[toks[i], c] for i < n_t, r < 4.

    w: raw weight bytes, flat (uint8 1-D; ro0..ro3 the byte offsets of the four rows in it).
    Every caller passes ``w.reshape(-1)`` of its matrix or expert stack, so the row routines
    below compile once per quant type, not once per weight shape (the MoE phases' 3-D stacks
    and the matmuls' 2-D matrices each compiled their own copy: 315 of the 3-D kind among a
    cold suite's 1,820 compiles).
    X: float32 [N, cols]; bsums: float32 [N, >= cols // 16] sums of 16-column groups of X
    (the decoders' offsets m multiply them). Scratch: acc float32 >= n_t * 64,
    cacc float32 >= n_t * 4, sc float32 >= 64; output res float32 [>= n_t, 4].
    """
    n_sub_blocks = cols // 32
    xf = X.reshape(-1)
    if n_t == 1:
        t = toks[0]
        r0, r1, r2, r3 = _one(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, t * cols, bsums[t], sc)
        res[0, 0] = r0
        res[0, 1] = r1
        res[0, 2] = r2
        res[0, 3] = r3
    else:
        _several(tag, w, ro0, ro1, ro2, ro3, n_sub_blocks, xf, cols, bsums, toks, n_t, acc, cacc, res, sc)
    # Float types only: columns past the last full sub-block of 32.
    for c in range(n_sub_blocks * 32, cols):
        for i in range(n_t):
            xv = X[toks[i], c]
            res[i, 0] += elem(tag, w, ro0, c) * xv
            res[i, 1] += elem(tag, w, ro1, c) * xv
            res[i, 2] += elem(tag, w, ro2, c) * xv
            res[i, 3] += elem(tag, w, ro3, c) * xv


TOKEN_TILE = 16      # tokens per pass over a row group (bounds the accumulator scratch)


@njit(error_model="numpy")
def rows4_scratch():
    """One thread's scratch for rows4: (acc, cacc, res, toks, sc)."""
    return (np.empty(TOKEN_TILE * 64, f32), np.empty(TOKEN_TILE * 4, f32), np.empty((TOKEN_TILE, 4), f32),
            np.empty(TOKEN_TILE, np.int64), np.empty(64, f32))


@njit(fastmath=True, error_model="numpy", _nrt=False)
def rows4(tag, w, r0, X, bsums, Y, acc, cacc, res, toks, sc):
    """Y[:, r0:r0 + 4] = X @ W[r0:r0 + 4]^T over all tokens of X, TOKEN_TILE at a time
    (w: uint8 [rows, row_bytes]; rows past the end repeat the last one, results dropped).
    Scratch as dot4's, for TOKEN_TILE tokens; toks int64 [TOKEN_TILE]."""
    rows = w.shape[0]
    rs = w.strides[0]
    wf = w.reshape(-1)          # flat bytes (see dot4); free here: no references taken (_nrt=False)
    last = rows - 1
    nr = min(4, rows - r0)
    n, cols = X.shape
    for t0 in range(0, n, TOKEN_TILE):
        nt = min(TOKEN_TILE, n - t0)
        for i in range(nt):
            toks[i] = t0 + i
        dot4(tag, wf, r0 * rs, min(r0 + 1, last) * rs, min(r0 + 2, last) * rs,
             min(r0 + 3, last) * rs, cols, X, bsums, toks, nt, acc, cacc, res, sc)
        for i in range(nt):
            for r in range(nr):
                Y[t0 + i, r0 + r] = res[i, r]
