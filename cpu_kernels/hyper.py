"""DeepSeek-V4's hyper-connection mixing (mHC) before a sublayer, for CPU-resident blocks: one
compiled call per sublayer and token batch where torch takes ~90 tiny ops (the Sinkhorn
iterations alone are 4 per iteration), each a few µs of dispatch. The math is
``gpu.hyper.HyperConnection``'s (llama.cpp ``build_hc_pre`` + ``build_hc_sinkhorn``)::

    mix  = rms(x) @ fn.T                    (T, 2n + n²)
    pre  = σ(mix[:n]·s0 + b[:n]) + ε        post = 2σ(mix[n:2n]·s1 + b[n:2n])
    comb = softmax over dst(mix[2n:]·s2 + b[2n:]) + ε; columns normalised, then
           (iters − 1) × (rows, columns)
    y    = Σ_i pre_i x_i
"""
from __future__ import annotations

import numpy as np
from numba import njit

f32 = np.float32


@njit(nogil=True, cache=True, error_model="numpy")
def hc_pre(x, fn, base, scale, iters, hc_eps, norm_eps, y, post, comb):
    """x float32 (T, n, d) streams; fn (2n + n², n·d), base (2n + n²,), scale (3,) → fills
    y (T, d), post (T, n), comb (T, n_src, n_dst)."""
    t_n, n, d = x.shape
    mix = np.empty(fn.shape[0], f32)
    eps = f32(hc_eps)
    for t in range(t_n):
        _rms_mix(x[t].reshape(n * d), fn, f32(norm_eps), mix)
        pre = np.empty(n, f32)
        for i in range(n):
            pre[i] = f32(1.0) / (f32(1.0) + np.exp(-(mix[i] * scale[0] + base[i]))) + eps
            post[t, i] = f32(2.0) / (f32(1.0) + np.exp(-(mix[n + i] * scale[1] + base[n + i])))
        c = comb[t]
        for i in range(n):                      # softmax over the destinations j
            hi = -np.inf
            for j in range(n):
                c[i, j] = mix[2 * n + i * n + j] * scale[2] + base[2 * n + i * n + j]
                hi = max(hi, c[i, j])
            s = f32(0.0)
            for j in range(n):
                c[i, j] = np.exp(c[i, j] - hi)
                s += c[i, j]
            for j in range(n):
                c[i, j] = c[i, j] / s + eps
        _norm_cols(c, eps)
        for _ in range(iters - 1):
            _norm_cols(c.T, eps)                # the rows: the columns of the transpose, same order
            _norm_cols(c, eps)
        for k in range(d):
            acc = f32(0.0)
            for i in range(n):
                acc += pre[i] * x[t, i, k]
            y[t, k] = acc


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _rms_mix(flat, fn, norm_eps, mix):
    """mix = (flat · rsqrt(mean(flat²) + ε)) @ fn.T, normalised first as the references round
    it (the dot products vectorised: fastmath only here, no infinities in play)."""
    k_n = flat.shape[0]
    ss = f32(0.0)
    for k in range(k_n):
        ss += flat[k] * flat[k]
    r = f32(1.0) / np.sqrt(ss / f32(k_n) + norm_eps)
    normed = flat * r
    for j in range(fn.shape[0]):
        acc = f32(0.0)
        for k in range(k_n):
            acc += normed[k] * fn[j, k]
        mix[j] = acc


@njit(nogil=True, cache=True, error_model="numpy")
def _norm_cols(c, eps):
    n = c.shape[0]
    for j in range(n):
        s = f32(0.0)
        for i in range(n):
            s += c[i, j]
        s += eps
        for i in range(n):
            c[i, j] /= s


@njit(nogil=True, cache=True, error_model="numpy")
def hc_combine(f, x, post, comb, out):
    """The streams after a sublayer (``gpu.hyper.HyperConnection.combine``): f (T, d) its
    output, x (T, n, d) its input streams → out (T, n, d), stream j = post_j · f + Σ_i comb[i, j] · x_i
    (summed over i in order, as the reference's matmul over n = 4 terms)."""
    t_n, n, d = x.shape
    for t in range(t_n):
        for j in range(n):
            pj = post[t, j]
            for k in range(d):
                acc = f32(0.0)
                for i in range(n):
                    acc += comb[t, i, j] * x[t, i, k]
                out[t, j, k] = pj * f[t, k] + acc
