"""DeepSeek-V4's FFN half for a CPU-resident block and a decode/verify batch, as one compiled
call (``v4_ffn_half``) where the reference path takes two compiled calls and a few dozen
torch ops (``offload.models.deepseek4.Deepseek4Block``'s last two lines)::

    y, post, comb = mHC pre-mix of the streams x          (hyper.hc_pre)
    h  = ffn_norm(y)
    [router | shared gate | shared up] of h                (one parallel region)
    s  = √softplus(logits); experts = top k of s + exp_probs_b, or the hash table's row of
         the token (ffn_gate_tid2eid); weights = s of those, normalised over the k, × scale
    f  = routed experts (moe.routed_ffn) + shared expert, both with the clamped SwiGLU
         silu(min(g, limit)) · clamp(u, ±limit), each its own limit
    out = post · f + combᵀ · x                              (hyper.hc_combine)

The math is ``gpu.hyper``, ``gpu.router.SqrtSoftplusRouter`` / ``HashRouter`` and
``gpu.ffn.swiglu_clamp``'s; only the float rounding order differs. Every function uses
``error_model="numpy"``: non-finite data give NaN/inf values, never an exception.
"""
from __future__ import annotations

import numpy as np
from numba import njit

# _glue_kw: the phase-chaining entries compile without fastmath (block.py says why)
from .block import _glue_kw, _norm_and_bsums, _swiglu_down, matmuls_sharing_x, top_k_ids
from .hyper import hc_combine, hc_pre
from .moe import routed_ffn, routed_scratch
from .registry import source_digest

f32 = np.float32
SOFTPLUS_THRESHOLD = f32(20)      # torch.nn.functional.softplus's default: the identity above it


def _build_entries(salt):
    # As block._build_entries: these link other files' kernels (the decoders, hc_pre, the
    # routed phases, top_k_ids) into their own code, so they carry the package's source digest,
    # and they call each other as module globals (a closure over a dispatcher misses the cache).
    global sqrt_softplus_route, _clamped_moe, v4_ffn_half

    @njit(nogil=True, cache=True, error_model="numpy")     # no fastmath: NaN checks must stay
    def sqrt_softplus_route(logits, probs_b, table, tokens, w_scale, ids, wts):
        """DeepSeek-V4's routing of T tokens, k = ids.shape[1] experts each: scores
        s = √softplus(logits (T, E)); ids[t] the top k of s + ``probs_b`` (float32 (E,),
        ``exp_probs_b``; ties to the lower id, NaN skipped: ``block.top_k_ids``) where ``table``
        is None, else ``table[tokens[t]]`` (``ffn_gate_tid2eid``, int32 (n_vocab, k));
        wts[t] = s[ids[t]] / Σ s[ids[t]] · w_scale. Returns 0, or -1 for a token id outside the
        table or a table entry outside 0..E-1 (nothing read out of bounds)."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n, e_n = logits.shape
        k = ids.shape[1]
        sc = np.empty(e_n, f32)
        choice = np.empty(e_n, f32)
        for t in range(t_n):
            for e in range(e_n):
                v = logits[t, e]
                sc[e] = np.sqrt(v if v > SOFTPLUS_THRESHOLD else np.log1p(np.exp(v)))
            if table is None:
                for e in range(e_n):
                    choice[e] = sc[e]
                    if probs_b is not None:
                        choice[e] += probs_b[e]
                top_k_ids(choice, k, ids, t)
            else:
                tok = tokens[t]
                if tok < 0 or tok >= table.shape[0]:
                    return -1
                for j in range(k):
                    e = table[tok, j]
                    if e < 0 or e >= e_n:
                        return -1
                    ids[t, j] = e
            tot = f32(0)
            for j in range(k):
                wts[t, j] = sc[ids[t, j]]
                tot += wts[t, j]
            for j in range(k):
                wts[t, j] = wts[t, j] / tot * f32(w_scale)
        return 0

    @njit(**_glue_kw)
    def _clamped_moe(y, tokens, eps, ffn_norm, tr, wr, probs_b, table, k_used, w_scale,
                     tg, wg, g0, tu, wu, u0, td, wd, n_ff, clamp_exp, qx, qh,
                     tsg, wsg, tsu, wsu, tsd, wsd, clamp_sh, f, chunks):
        """f = routed experts + shared expert of h = ffn_norm(y) (T, d), as block.moe_half
        without the residual; returns the number of touched experts, or -1 (f unset) for an
        id outside the table or the experts."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n, d = y.shape
        h, hs = _norm_and_bsums(y, ffn_norm, eps)
        n_expert = wr.shape[0]
        logits = np.empty((t_n, n_expert), f32)
        G = np.empty((t_n, wsg.shape[0]), f32)
        U = np.empty((t_n, wsu.shape[0]), f32)
        matmuls_sharing_x(tr, wr, logits, tsg, wsg, G, tsu, wsu, U, h, hs, chunks)
        ids = np.empty((t_n, k_used), np.int64)
        wts = np.empty((t_n, k_used), f32)
        if sqrt_softplus_route(logits, probs_b, table, tokens, w_scale, ids, wts) < 0:
            return -1
        touched = routed_ffn(t_n, h, hs, ids, wts, None, tg, wg, g0, tu, wu, u0, td, wd, clamp_exp,
                             routed_scratch(t_n * k_used, n_expert, n_ff, d, chunks), qx, qh, f, chunks)
        if touched < 0:
            return touched
        sh = np.empty((t_n, d), f32)
        _swiglu_down(G, U, tsd, wsd, sh, chunks, clamp_sh)
        for t in range(t_n):
            for c in range(d):
                f[t, c] += sh[t, c]
        return touched

    @njit(**_glue_kw)
    def v4_ffn_half(x, out, tokens, eps, hc_fn, hc_base, hc_scale, hc_iters, hc_eps,
                    ffn_norm, tr, wr, probs_b, table, k_used, w_scale,
                    tg, wg, g0, tu, wu, u0, td, wd, n_ff, clamp_exp, qx, qh,
                    tsg, wsg, tsu, wsu, tsd, wsd, clamp_sh, chunks):
        """out = the streams after a V4 block's MoE sublayer: x (T, n, d) float32 its input
        streams, out (T, n, d) written; ``tokens`` int64 (T,) the token ids (hash routing reads them).

        ``eps`` the model's RMS eps (``ffn_norm``'s and the mHC's normalisation, as deepseek4
        passes it); ``hc_fn``/``hc_base``/``hc_scale``, ``hc_iters``, ``hc_eps``: the sublayer's
        mHC (``hyper.hc_pre``). Router ``wr`` (QTag ``tr``) with ``probs_b`` (float32 (E,)) and
        ``table`` None, or ``table`` (int32 (n_vocab, k_used)) and ``probs_b`` None;
        ``k_used``, ``w_scale`` (``expert_weights_scale``). Routed experts as ``block.moe_half``
        takes them (``ExpertWeights._parts`` / ``_down``, ``n_ff``, int8 scratch ``qx``/``qh``
        or None) with ``clamp_exp`` (float32, ``swiglu_clamp_exp``); the shared expert's rows
        ``wsg``/``wsu``/``wsd`` with ``clamp_sh`` (float32, ``swiglu_clamp_shexp``).
        Returns the number of touched experts, or -1 (out untouched) for a token id outside
        the table or an expert id outside 0..E-1."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n, n, d = x.shape
        y = np.empty((t_n, d), f32)
        post = np.empty((t_n, n), f32)
        comb = np.empty((t_n, n, n), f32)
        hc_pre(x, hc_fn, hc_base, hc_scale, hc_iters, hc_eps, eps, y, post, comb)
        f = np.empty((t_n, d), f32)
        touched = _clamped_moe(y, tokens, eps, ffn_norm, tr, wr, probs_b, table, k_used, w_scale,
                               tg, wg, g0, tu, wu, u0, td, wd, n_ff, clamp_exp, qx, qh,
                               tsg, wsg, tsu, wsu, tsd, wsd, clamp_sh, f, chunks)
        if touched >= 0:
            hc_combine(f, x, post, comb, out)
        return touched

    return sqrt_softplus_route, _clamped_moe, v4_ffn_half


sqrt_softplus_route, _clamped_moe, v4_ffn_half = _build_entries(source_digest())
