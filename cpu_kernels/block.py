"""One whole pre-norm decoder block (GQA attention + MoE or dense SwiGLU FFN) for a few
tokens, as two compiled calls over raw GGUF weights: ``attention_half`` then ``moe_half``
or ``dense_half``.

Why so few calls: at decode a block's weights are read in well under a millisecond on a
server, so what the block costs beyond its bytes — Python calls, eager torch ops, kernel
dispatch, about 40 of them per block — decides the speed. Here each block half is one entry
(``offload.compiled_block`` binds its arguments once at load and calls the compiled entry
points directly, skipping Numba's per-call type dispatch); an MoE block runs seven parallel
regions on Numba's thread pool:

    attn_norm → [q | k | v] → bias, q/k norm, RoPE, KV append → [attention over heads]
      → [o] + residual → ffn_norm → [router | shared gate | shared up]
      → top-k, tokens grouped by expert → [routed gate·up] → [routed down] → [shared down]
      → weighted sum + residual

Brackets are parallel regions (``matmuls_sharing_x``: row groups of up to three matrices that
read the same activations, as one work list; the routed phases are ``moe``'s). Everything between
them is a few hundred scalar operations per token. The math is the reference path's
(an architecture's ``DecoderBlock`` over ``gpu.*``); only the float rounding order differs.

``blocks_run`` steps a run of such blocks (the same argument types) in one call.
``attention_half_seqs`` is the attention half for several sequences stepped as one batch
(continuous batching): the norm and projections over every row, each sequence's rows over
its own cache; the MoE half then runs once over all of them.

Absent parts are ``None`` (no q/k bias or norm, no shared expert): Numba prunes those
branches when it specialises an entry for a block's argument types (quant tags included),
so each kind of block compiles once.
Every function uses ``error_model="numpy"``: non-finite or all-zero data give values
(NaN/inf propagate), never a Python exception from inside a kernel.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import overload
from numba.typed import List

from .kv_attention import attend_cache
from .kv_rows import kv_store_row
from .moe import _silu_glu, bsums_of_rows, routed_ffn, routed_scratch
from .registry import source_digest
from .rowdot import rows4, rows4_scratch

f32 = np.float32
SIGMOID, SOFTMAX = 0, 1        # router kinds (gpu.router.SigmoidRouter / SoftmaxRouter)

_kw = dict(nogil=True, cache=True, fastmath=True, error_model="numpy")
# The entries that only chain the phases (their own arithmetic: a residual add) compile without
# fastmath: with it, a block's numbers depended on whether its phases were compiled in this
# process or loaded from Numba's cache (logits 3.5e-6 apart, a cold process against a warm one,
# on a Sapphire Rapids Xeon; 'reassoc' alone did it). The phases keep fastmath.
_glue_kw = {**_kw, "fastmath": False}


# The KV cache is raw bytes (H_kv, cells, row bytes) of its type (the plan's --cache-type:
# F32, F16, BF16 or a block-quantized type; K and V may differ): ``kvt`` = (K tag, V tag)
# selects how a row is stored, dotted and accumulated (``kv_rows``).


def n_groups(w):
    """4-row groups of a weight (0 for None; jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(n_groups)
def _n_groups(w):
    if isinstance(w, types.NoneType):
        return lambda w: 0
    return lambda w: (w.shape[0] + 3) // 4


@njit(cache=True)
def typed_list(items):
    """A Numba typed List of a tuple's items (all of one type), built in compiled code. Why:
    built from Python (``List(items)``), a typed list compiles its append for the item type in
    every process — Numba does not cache those (~1 s of a warm process's model load: the run's
    bound arguments and caches) — where this compiles once per item type and count, cached."""
    out = List()
    for x in items:
        out.append(x)
    return out


def _build(salt):
    @njit(parallel=True, **_kw)
    def matmuls_sharing_x(t0, w0, y0, t1, w1, y1, t2, w2, y2, X, bsums, chunks):
        """y_i = X @ W_i^T for up to three matrices (w1/w2 may be None) over one work list
        of 4-row groups, so q/k/v (or router + shared gate + up) are one parallel region."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        g0, g1, g2 = n_groups(w0), n_groups(w1), n_groups(w2)
        items = g0 + g1 + g2
        pieces = max(1, min(items, chunks))
        for ch in prange(pieces):
            acc, cacc, res, toks, sc = rows4_scratch()
            for it in range(ch * items // pieces, (ch + 1) * items // pieces):
                if it < g0:
                    rows4(t0, w0, 4 * it, X, bsums, y0, acc, cacc, res, toks, sc)
                if w1 is not None:
                    if g0 <= it < g0 + g1:
                        rows4(t1, w1, 4 * (it - g0), X, bsums, y1, acc, cacc, res, toks, sc)
                if w2 is not None:
                    if it >= g0 + g1:
                        rows4(t2, w2, 4 * (it - g0 - g1), X, bsums, y2, acc, cacc, res, toks, sc)

    return matmuls_sharing_x


matmuls_sharing_x = _build(source_digest())


@njit(**_kw)
def rms_norm(x, w, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]²) + eps) · w (rows of any width)."""
    n = x.shape[1]
    for t in range(x.shape[0]):
        ss = f32(0)
        for c in range(n):
            ss += x[t, c] * x[t, c]
        r = f32(1) / np.sqrt(ss / f32(n) + f32(eps))
        for c in range(n):
            out[t, c] = x[t, c] * r * w[c]


@njit(**_kw)
def _heads(y, bias, norm, eps, n_heads, d, n_rot, positions, cos, sin):
    """In place on y (T, n_heads·d): + bias, per-head RMSNorm, NeoX RoPE on the first n_rot
    dims (pairs j, j + n_rot/2), as gpu.attention does before caching."""
    half = n_rot // 2
    for t in range(y.shape[0]):
        p = positions[t]
        for h in range(n_heads):
            o = h * d
            if bias is not None:
                for c in range(d):
                    y[t, o + c] += bias[o + c]
            if norm is not None:
                ss = f32(0)
                for c in range(d):
                    ss += y[t, o + c] * y[t, o + c]
                r = f32(1) / np.sqrt(ss / f32(d) + f32(eps))
                for c in range(d):
                    y[t, o + c] = y[t, o + c] * r * norm[c]
            for j in range(half):
                a = y[t, o + j]
                b = y[t, o + j + half]
                y[t, o + j] = a * cos[p, j] - b * sin[p, j]
                y[t, o + j + half] = b * cos[p, j] + a * sin[p, j]


@njit(nogil=True, cache=True, error_model="numpy")     # no fastmath: NaN checks must stay
def top_k_ids(choice, k, ids, t):
    """ids[t, :k] = the k largest of ``choice`` (E,), largest first; ties go to the lower id,
    NaN is skipped (when only NaN is left: the first ids not taken yet, whose weights are then
    NaN). ``choice`` is overwritten: a taken id's entry becomes NaN, so it is skipped too (a
    -inf mark let an all-NaN row take the same id k times)."""
    e_n = choice.shape[0]
    for j in range(k):
        best = -1
        for e in range(e_n):
            if choice[e] == choice[e] and (best < 0 or choice[e] > choice[best]):   # skips NaN
                best = e
        if best < 0:
            best = _first_untaken(ids, t, j)
        ids[t, j] = best
        choice[best] = f32(np.nan)


@njit(nogil=True, cache=True, error_model="numpy")
def _first_untaken(ids, t, j):
    """The lowest id not among ids[t, :j] (only where NaN leaves no choice: O(j) per id)."""
    e = 0
    while True:
        taken = False
        for i in range(j):
            taken = taken or ids[t, i] == e
        if not taken:
            return e
        e += 1


@njit(nogil=True, cache=True, error_model="numpy")     # no fastmath: NaN checks must stay
def _route(logits, bias, kind, k, norm, scale, ids, wts):
    """Per token: top-k experts and their weights, as gpu.router: sigmoid scores (+ bias for
    the choice only) or softmax probabilities; optionally normalised; scaled. Ties go to
    the lower expert id."""
    t_n, e_n = logits.shape
    sc = np.empty(e_n, f32)
    ch = np.empty(e_n, f32)
    for t in range(t_n):
        if kind == SIGMOID:
            for e in range(e_n):
                sc[e] = f32(1) / (f32(1) + np.exp(-logits[t, e]))
                ch[e] = sc[e]
            if bias is not None:
                for e in range(e_n):
                    ch[e] += bias[e]
        else:
            m = logits[t, 0]
            for e in range(1, e_n):
                m = max(m, logits[t, e])
            tot = f32(0)
            for e in range(e_n):
                sc[e] = np.exp(logits[t, e] - m)
                tot += sc[e]
            for e in range(e_n):
                sc[e] = sc[e] / tot
                ch[e] = sc[e]
        top_k_ids(ch, k, ids, t)
        tot = f32(0)
        for j in range(k):
            wts[t, j] = sc[ids[t, j]]
            tot += wts[t, j]
        for j in range(k):
            if norm:
                wts[t, j] = wts[t, j] / tot
            wts[t, j] *= f32(scale)


def _build_entries(salt):
    # The entry points link matmuls_sharing_x / attend_cache / moe's phases (and through them the decoders
    # of other files) into their own compiled code: they carry the package's source digest
    # so that Numba's cache never serves them with an older decoder inlined.
    # The entries call each other as module globals, never as closure variables: Numba's cache key
    # hashes the pickled closure, and a pickled dispatcher carries a per-process id (and its
    # signatures so far), so a closure over one missed the cache in every new process.
    global _norm_and_bsums, _swiglu, _swiglu_down, _qkv, _cache_and_attend, _out, attention_half
    global attention_half_seqs, dense_half, moe_half, blocks_run

    @njit(**_kw)
    def _norm_and_bsums(x, w, eps):
        """(rms_norm(x) · w, its per-16 sums): a block half's normalised input."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        xn = np.empty(x.shape, f32)
        xs = np.empty((x.shape[0], x.shape[1] // 16), f32)
        rms_norm(x, w, eps, xn)
        bsums_of_rows(xn, xn.shape[0], xs)
        return xn, xs

    @njit(**_kw)
    def _swiglu(tg, gw, tu, uw, td, dw, X, bsums, Y, chunks):
        """Y = down(silu(gate(X)) · up(X)) (dense FFN or shared expert)."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n = X.shape[0]
        n_ff = gw.shape[0]
        G = np.empty((t_n, n_ff), f32)
        U = np.empty((t_n, n_ff), f32)
        matmuls_sharing_x(tg, gw, G, tu, uw, U, None, None, None, X, bsums, chunks)
        _swiglu_down(G, U, td, dw, Y, chunks, f32(0))

    @njit(**_kw)
    def _swiglu_down(G, U, td, dw, Y, chunks, clamp):
        """Y = down(silu(G) · U), G overwritten; ``clamp`` (float32 from every caller: one
        specialisation) a limit > 0 for DeepSeek-V4's clamped SwiGLU (``moe._silu_glu``), 0 none."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        for t in range(G.shape[0]):
            for c in range(G.shape[1]):
                G[t, c] = _silu_glu(G[t, c], U[t, c], clamp)
        gs = np.empty((G.shape[0], G.shape[1] // 16), f32)
        bsums_of_rows(G, G.shape[0], gs)
        matmuls_sharing_x(td, dw, Y, None, None, None, None, None, None, G, gs, chunks)

    @njit(**_kw)
    def _qkv(x, positions, cos, sin, eps, n_kv, attn_norm, tq, wq, bq, tk, wk, bk, tv, wv, bv, q_norm, k_norm,
             n_head, n_rot, chunks):
        """attn_norm, the q/k/v projections (one work list), biases, per-head norms and RoPE:
        (q, k, v) as (T, heads · d) rows."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n = x.shape[0]
        d = wq.shape[0] // n_head
        xn, xs = _norm_and_bsums(x, attn_norm, eps)
        q = np.empty((t_n, n_head * d), f32)
        k = np.empty((t_n, n_kv * d), f32)
        v = np.empty((t_n, n_kv * d), f32)
        matmuls_sharing_x(tq, wq, q, tk, wk, k, tv, wv, v, xn, xs, chunks)
        _heads(q, bq, q_norm, eps, n_head, d, n_rot, positions, cos, sin)
        _heads(k, bk, k_norm, eps, n_kv, d, n_rot, positions, cos, sin)
        if bv is not None:
            for t in range(t_n):
                for c in range(n_kv * d):
                    v[t, c] += bv[c]
        return q, k, v

    @njit(**_kw)
    def _cache_and_attend(q, k, v, lo, hi, kvt, kc, vc, n_past, n_head, att):
        """Rows lo..hi (one sequence's) of k/v into its cache at cells n_past.., then their
        queries attend over that cache into att's rows lo..hi."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        kt, vt = kvt
        n_kv = kc.shape[0]
        d = q.shape[1] // n_head
        kf, vf = k.reshape(-1), v.reshape(-1)
        for t in range(lo, hi):              # one row per head and token (a quantized one: D / 32 blocks)
            cell = n_past + t - lo
            for g in range(n_kv):
                kv_store_row(kt, kc, g * kc.strides[0] + cell * kc.strides[1], kf, (t * n_kv + g) * d, d)
                kv_store_row(vt, vc, g * vc.strides[0] + cell * vc.strides[1], vf, (t * n_kv + g) * d, d)
        attend_cache(q[lo:hi].reshape(hi - lo, n_head, d), kt, kc, vt, vc, n_past + hi - lo, d,
                     f32(1) / np.sqrt(f32(d)), None, 0, att[lo:hi].reshape(hi - lo, n_head, d))

    @njit(**_kw)
    def _out(att, to, wo, x, y, chunks):
        """y = x + o(att)."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        atts = np.empty((att.shape[0], att.shape[1] // 16), f32)
        bsums_of_rows(att, att.shape[0], atts)
        matmuls_sharing_x(to, wo, y, None, None, None, None, None, None, att, atts, chunks)
        for t in range(x.shape[0]):
            for c in range(x.shape[1]):
                y[t, c] += x[t, c]

    @njit(**_glue_kw)
    def attention_half(x, y, positions, cos, sin, kvt, kc, vc, n_past, eps,
                       attn_norm, tq, wq, bq, tk, wk, bk, tv, wv, bv, to, wo, q_norm, k_norm,
                       n_head, n_rot, chunks):
        """y = x + attention(attn_norm(x)) for x (T, n_embd) at cache cells n_past.. (written
        here: the caller has made room and advances the cache length by T afterwards).

        ``w*`` raw GGUF rows, ``t*`` their QTags, ``b*`` biases or None, ``q_norm``/``k_norm``
        per-head RMSNorm weights or None; ``cos``/``sin`` (positions, n_rot/2) tables; ``kc``,
        ``vc`` the cache's raw bytes, ``kvt`` its (K, V) types' QTags.
        """
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        q, k, v = _qkv(x, positions, cos, sin, eps, kc.shape[0], attn_norm, tq, wq, bq, tk, wk, bk, tv, wv, bv,
                       q_norm, k_norm, n_head, n_rot, chunks)
        att = np.empty(q.shape, f32)
        _cache_and_attend(q, k, v, 0, x.shape[0], kvt, kc, vc, n_past, n_head, att)
        _out(att, to, wo, x, y, chunks)

    @njit(**_glue_kw)
    def attention_half_seqs(x, y, positions, cos, sin, kvt, kcs, vcs, starts, n_pasts, eps,
                            attn_norm, tq, wq, bq, tk, wk, bk, tv, wv, bv, to, wo, q_norm, k_norm,
                            n_head, n_rot, chunks):
        """``attention_half`` for several sequences stepped as one batch (continuous
        batching): rows starts[s]..starts[s+1] are sequence s's, at its cache (``kcs[s]``,
        ``vcs[s]``, typed lists) cells n_pasts[s]..; the norm and the q/k/v and o projections
        run once over every row, the cache writes and attention per sequence."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        q, k, v = _qkv(x, positions, cos, sin, eps, kcs[0].shape[0], attn_norm, tq, wq, bq, tk, wk, bk, tv, wv,
                       bv, q_norm, k_norm, n_head, n_rot, chunks)
        att = np.empty(q.shape, f32)
        for s in range(len(n_pasts)):
            _cache_and_attend(q, k, v, starts[s], starts[s + 1], kvt, kcs[s], vcs[s], n_pasts[s], n_head, att)
        _out(att, to, wo, x, y, chunks)

    @njit(**_glue_kw)
    def dense_half(y, eps, ffn_norm, tg, wg, tu, wu, td, wd, chunks):
        """y += down(silu(gate(h)) · up(h)), h = ffn_norm(y): a dense FFN block's second half."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n, n_embd = y.shape
        xn, xs = _norm_and_bsums(y, ffn_norm, eps)
        f = np.empty((t_n, n_embd), f32)
        _swiglu(tg, wg, tu, wu, td, wd, xn, xs, f, chunks)
        for t in range(t_n):
            for c in range(n_embd):
                y[t, c] += f[t, c]

    @njit(**_glue_kw)
    def moe_half(y, eps, ffn_norm, tr, wr, probs_b, route_kind, k_used, w_norm, w_scale,
                 tg, wg, g0, tu, wu, u0, td, wd, n_ff, qx, qh, tsg, wsg, tsu, wsu, tsd, wsd, chunks):
        """y += routed experts + shared expert of h = ffn_norm(y): an MoE block's second half.

        Router ``wr`` with ``probs_b`` (or None), ``route_kind``, ``k_used``, ``w_norm``,
        ``w_scale``; routed experts ``wg``/``wu``/``wd`` (gate and up may be one fused tensor:
        row offsets ``g0``/``u0``; ``n_ff`` rows each) and their int8 activation scratch ``qx``/``qh``
        (``moe.routed_int8_scratch``, bound at load; None: float activations); the shared expert
        ``wsg``/``wsu``/``wsd`` or None. Routed outputs are summed in moe_ffn's order (assignments sorted by expert).
        """
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n, n_embd = y.shape
        xn, xs = _norm_and_bsums(y, ffn_norm, eps)
        n_expert = wr.shape[0]
        logits = np.empty((t_n, n_expert), f32)
        if wsg is not None:                              # router and shared gate/up together
            n_sh = wsg.shape[0]
            G = np.empty((t_n, n_sh), f32)
            U = np.empty((t_n, n_sh), f32)
            matmuls_sharing_x(tr, wr, logits, tsg, wsg, G, tsu, wsu, U, xn, xs, chunks)
        else:
            matmuls_sharing_x(tr, wr, logits, None, None, None, None, None, None, xn, xs, chunks)
        ids = np.empty((t_n, k_used), np.int64)
        wts = np.empty((t_n, k_used), f32)
        _route(logits, probs_b, route_kind, k_used, w_norm, w_scale, ids, wts)
        f = np.empty((t_n, n_embd), f32)           # routed experts (moe.routed_ffn: the hybrid hand-off's step too)
        routed_ffn(t_n, xn, xs, ids, wts, None, tg, wg, g0, tu, wu, u0, td, wd, f32(0),
                   routed_scratch(t_n * k_used, n_expert, n_ff, n_embd, chunks), qx, qh, f, chunks)
        if wsg is not None:
            sh = np.empty((t_n, n_embd), f32)
            _swiglu_down(G, U, tsd, wsd, sh, chunks, f32(0))
            for t in range(t_n):
                for c in range(n_embd):
                    f[t, c] += sh[t, c]
        for t in range(t_n):
            for c in range(n_embd):
                y[t, c] += f[t, c]

    @njit(**_glue_kw)
    def blocks_run(x, y, positions, cos, sin, kvt, caches, n_past, seqs, bound, moe_args, dense_args, chunks):
        """A run of consecutive blocks in one call: for each block i, its attention half then
        ``moe_half`` (``moe_args`` the per-block argument tuples, ``dense_args`` None) or
        ``dense_half`` (the other way round); Numba prunes the absent kinds.

        ``bound[i]`` = (eps, attention arguments after eps) of block i. One sequence
        (``seqs`` None): ``attention_half`` over ``caches[i]``, block i's raw (kc, vc) cache
        bytes, every cache holding ``n_past`` cells. Several stepped as one batch (``caches``
        None): ``seqs`` = (kcs, vcs, starts, n_pasts), ``attention_half_seqs`` over block i's
        ``kcs[i][s]``, ``vcs[i][s]`` (sequence s's rows starts[s]..starts[s+1] at cells
        n_pasts[s]..: every block's caches hold the same lengths). The caches are the caller's
        Numba typed lists, with room for the new rows made by the caller. x and y (T, n_embd)
        are both overwritten; returns the one holding the result. Why: a decode step then
        costs one Python → compiled transition per run of blocks instead of two per block
        (plus the wrapper's Python around each: ~70 µs a block with several sequences)."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        for i in range(len(bound)):
            eps, attn = bound[i]
            if caches is not None:
                kc, vc = caches[i]
                attention_half(x, y, positions, cos, sin, kvt, kc, vc, n_past, eps, *attn, chunks)
            if seqs is not None:
                kcs, vcs, starts, n_pasts = seqs
                attention_half_seqs(x, y, positions, cos, sin, kvt, kcs[i], vcs[i], starts, n_pasts, eps, *attn,
                                    chunks)
            if moe_args is not None:
                moe_half(y, eps, *moe_args[i], chunks)
            if dense_args is not None:
                dense_half(y, eps, *dense_args[i], chunks)
            x, y = y, x
        return x

    return (_norm_and_bsums, _swiglu, _swiglu_down, _qkv, _cache_and_attend, _out, attention_half,
            attention_half_seqs, dense_half, moe_half, blocks_run)


(_norm_and_bsums, _swiglu, _swiglu_down, _qkv, _cache_and_attend, _out, attention_half, attention_half_seqs,
 dense_half, moe_half, blocks_run) = _build_entries(source_digest())
