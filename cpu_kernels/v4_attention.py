"""DeepSeek-V4's attention sublayer for a few tokens of one sequence, as one compiled call over
raw GGUF weights and the block's float32 caches: mHC ``pre`` → ``attn_norm`` → attention of
any kind (window-only, HCA, CSA with the lightning indexer) → mHC ``post``/``comb``.

Why: the torch path runs this sublayer as ~150 small ops per decode token (projections,
norms, rotations, the compressors' pooling, the indexer's scores, the masked softmax), each a
few µs of dispatch, where the arithmetic of a reduced-width block is tens of µs. The math is
``gpu.compressed_attention``'s (its docstring has the formulas) and ``gpu.hyper``'s; only the
float rounding order differs.

    hc_pre(X) → y, post, comb;  a = attn_norm(y)
    [q_a | kv | compressor kv | compressor gate]  [indexer: kv | gate | proj]   (matmuls over a)
    qr = q_a_norm(q_a);  [q_b | indexer q_b]  (over qr)
    q: per-head RMS, rope tail;  kv: kv_norm, rope tail → window ring
    compressors: state rows ++ the new ones, every completed window → one entry (pooled by a
    per-channel softmax of the gates, normed, roped at its first position)
    indexer (CSA): Σ_h w_h·relu(q_h·k_s) per entry, the top k of the visible ones
    attention with the sink over the window rows it sees and the entries chosen; inverse rope
    o_b(o_a grouped) → hc_combine → the new streams

The caller (``offload.compiled_v4``) keeps the caches' bookkeeping (lengths, starts, counts:
a few integers computed exactly as the torch path's ``Dsv4Cache`` parts compute them, so both
paths read and write the same state) and passes them in; this writes the rows.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .block import _norm_and_bsums, matmuls_sharing_x, rms_norm
from .hyper import hc_combine, hc_pre
from .kv_rows import kv_axpy, kv_dot, kv_store_row
from .matmul import _grouped_kernel
from .moe import bsums_of_rows
from .registry import source_digest

f32 = np.float32
_kw = dict(nogil=True, cache=True, fastmath=True, error_model="numpy")
_glue_kw = {**_kw, "fastmath": False}      # as cpu_kernels.block: the chaining entry without fastmath


@njit(**_kw)
def rope_tail(x, pos, cos, sin, n_rot, inverse):
    """In place on the row x (D,): rotate its last n_rot dims at ``pos``, interleaved pairs
    (2j, 2j + 1) by angle j (``gpu.rope.Rope(interleaved=True)``); ``inverse``: by −angle."""
    o = x.shape[0] - n_rot
    for j in range(n_rot // 2):
        c, s = cos[pos, j], sin[pos, j]
        if inverse:
            s = -s
        a, b = x[o + 2 * j], x[o + 2 * j + 1]
        x[o + 2 * j] = a * c - b * s
        x[o + 2 * j + 1] = b * c + a * s


@njit(**_kw)
def _head_rms(q, n_head, d, eps):
    """In place on q (T, n_head·d): each head's row divided by its RMS (no weight)."""
    for t in range(q.shape[0]):
        for h in range(n_head):
            ss = f32(0)
            for c in range(d):
                ss += q[t, h * d + c] * q[t, h * d + c]
            r = f32(1) / np.sqrt(ss / f32(d) + f32(eps))
            for c in range(d):
                q[t, h * d + c] *= r


@njit(**_kw)
def visible(positions, t, ratio):
    """Entries query t may see: those whose window ended at or before its position."""
    return (positions[t] + 1) // ratio


@njit(nogil=True, cache=True, error_model="numpy")     # no fastmath: the NaN ordering stays
def top_entries(score, n_keys, positions, ratio, top_k, chosen):
    """chosen[t, s] for s < n_keys: entry s is visible to query t and among the ``top_k``
    highest scores of the visible ones (all of them when there are no more; ties: the lower
    index first), as the reference's top-k of the masked scores."""
    for t in range(score.shape[0]):
        n_vis = min(n_keys, visible(positions, t, ratio))
        for s in range(n_keys):
            chosen[t, s] = s < n_vis
        if n_vis > top_k:
            order = np.argsort(-score[t, :n_vis], kind="mergesort")
            for s in range(n_vis):
                chosen[t, s] = False
            for j in range(top_k):
                chosen[t, order[j]] = True


def _build_entries(salt):
    # Everything here links other files' kernels (block's norms and matmuls, kv_rows' row
    # reads and writes, hyper's mixing) into its own compiled code: it carries the package's
    # source digest so that Numba's cache never serves it with an older callee inlined, and
    # the functions call each other as module globals (block.py says why).
    global compress_windows, _update_state, index_scores, attend_sink, v4_attention_half

    @njit(**_kw)
    def compress_windows(rows, first, done, now, ratio, overlap, d, ape, norm_w, eps, cos, sin, n_rot, kt, out, at0):
        """Entries of windows done..now−1 from the state ``rows`` (positions first.., each row kv
        (coff·d) then gate (coff·d)), stored in the cache type ``kt`` as rows at0, at0 + 1, … of
        ``out`` (raw bytes, one row per entry): per channel a softmax over the window's slots of
        gate + ape weighs the kv values (CSA, ``overlap``: window w−1's first half then window w's
        second half, 2·ratio slots, none before window 0); then RMS norm × ``norm_w`` and the rope
        tail at position w·ratio (``gpu.compressed_attention.Compressor``)."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        width = ape.shape[1]
        n_slot = 2 * ratio if overlap else ratio
        kv = np.empty((n_slot, d), f32)
        z = np.empty((n_slot, d), f32)
        e = np.empty((1, d), f32)
        en = np.empty((1, d), f32)
        for w in range(done, now):
            for s in range(ratio):
                at = w * ratio + s - first
                if overlap:
                    prev = max(at - ratio, 0)
                    for c in range(d):
                        kv[s, c] = rows[prev, c]
                        z[s, c] = rows[prev, width + c] + ape[s, c]
                        kv[ratio + s, c] = rows[at, d + c]
                        z[ratio + s, c] = rows[at, width + d + c] + ape[s, d + c]
                else:
                    for c in range(d):
                        kv[s, c] = rows[at, c]
                        z[s, c] = rows[at, width + c] + ape[s, c]
            # window 0 of CSA has no previous window: its first ratio slots weigh exactly 0 (the
            # reference's −inf gates), so they are left out rather than given an infinity
            lo = ratio if overlap and w == 0 else 0
            for c in range(d):
                m = z[lo, c]
                for s in range(lo + 1, n_slot):
                    m = max(m, z[s, c])
                tot = f32(0)
                acc = f32(0)
                for s in range(lo, n_slot):
                    p = np.exp(z[s, c] - m)
                    tot += p
                    acc += p * kv[s, c]
                e[0, c] = acc / tot
            rms_norm(e, norm_w, eps, en)
            rope_tail(en[0], w * ratio, cos, sin, n_rot, False)
            kv_store_row(kt, out, (at0 + w - done) * out.strides[0], en[0], 0, d)

    @njit(**_kw)
    def _update_state(kvp, gp, buf, held, keep, ratio, overlap, d, ape, norm_w, eps, cos, sin, n_rot, length0,
                      kt, entries, count):
        """A compressor's step (``Compressor.__call__`` with ``CompressorState.extend``): the held
        state rows (positions length0 − held ..) plus the T new [kv | gate] rows; the windows they
        complete → entries (raw rows of type ``kt``) count ..; then the rows from ``keep``
        (relative to the first held) back into ``buf``. Returns the new entry count."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n, cw = kvp.shape
        rows = np.empty((held + t_n, 2 * cw), f32)
        rows[:held] = buf[:held]
        rows[held:, :cw] = kvp
        rows[held:, cw:] = gp
        first = length0 - held
        done, now = length0 // ratio, (length0 + t_n) // ratio
        if now > done:
            compress_windows(rows, first, done, now, ratio, overlap, d, ape, norm_w, eps, cos, sin, n_rot, kt,
                             entries, count)
        kept = rows.shape[0] - keep
        buf[:kept] = rows[keep:]
        return count + now - done

    @njit(parallel=True, **_kw)
    def index_scores(q, wts, kt, keys, n_keys, d, positions, ratio, n_head, out):
        """out[t, s] = Σ_h wts[t, h] · relu(q[t, h] · keys[s]) for the entries s < n_keys query t
        sees (s < (positions[t] + 1) // ratio); the others are not written. ``keys`` raw rows of
        the cache type ``kt``, q (T, n_head·d)."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n = q.shape[0]
        for s in prange(n_keys):
            for t in range(t_n):
                if s >= visible(positions, t, ratio):
                    continue
                acc = f32(0)
                for h in range(n_head):
                    dot = kv_dot(kt, keys, s * keys.strides[0], q[t], h * d, d)
                    if dot > 0:
                        acc += wts[t, h] * dot
                out[t, s] = acc

    @njit(parallel=True, **_kw)
    def attend_sink(q, kt, win, win_start, n_cells, q0, window, entries, chosen, sinks, out):
        """out[t, h] = softmax-with-sink(q[t, h] · keysᵀ / √d) @ keys, keys = K = V (raw rows of
        the cache type ``kt``): window cells c < n_cells (cache index win_start + c) that query t
        (cache index q0 + t) sees (not after it, fewer than ``window`` back) and the entries with
        ``chosen[t, s]`` (None: none). q, out (T, H, d); ``sinks`` (H,) one logit per head with no
        value (``gpu.compressed_attention.attend_with_sink``)."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n, n_head, d = q.shape
        n_ent = 0 if chosen is None else chosen.shape[1]
        scale = f32(1) / np.sqrt(f32(d))
        ws = win.strides[0]
        for it in prange(t_n * n_head):
            t, h = it // n_head, it % n_head
            qi = q0 + t
            lo = max(0, qi - window + 1 - win_start)
            hi = min(n_cells, qi + 1 - win_start)
            n_win = max(0, hi - lo)
            sc = np.empty(n_win + n_ent, f32)
            qh = q[t, h]
            m = sinks[h]
            for j in range(n_win):
                sc[j] = kv_dot(kt, win, (lo + j) * ws, qh, 0, d) * scale
                m = max(m, sc[j])
            if chosen is not None:                  # None: a window-only block (pruned at compile time)
                es = entries.strides[0]
                for s in range(n_ent):
                    if chosen[t, s]:
                        sc[n_win + s] = kv_dot(kt, entries, s * es, qh, 0, d) * scale
                        m = max(m, sc[n_win + s])
            tot = np.exp(sinks[h] - m)
            for j in range(n_win):
                sc[j] = np.exp(sc[j] - m)
                tot += sc[j]
            if chosen is not None:
                for s in range(n_ent):
                    if chosen[t, s]:
                        sc[n_win + s] = np.exp(sc[n_win + s] - m)
                        tot += sc[n_win + s]
            inv = f32(1) / tot
            oh = out[t, h]
            oh[:] = 0
            for j in range(n_win):
                kv_axpy(kt, sc[j] * inv, win, (lo + j) * ws, oh, 0, d)
            if chosen is not None:
                es = entries.strides[0]
                for s in range(n_ent):
                    if chosen[t, s]:
                        kv_axpy(kt, sc[n_win + s] * inv, entries, s * es, oh, 0, d)

    @njit(**_glue_kw)
    def v4_attention_half(x, out, positions, eps, hc, attn_norm, proj, shape, cos, sin, win, comp, index, chunks):
        """out = the streams after block's attention sublayer, for streams x (T, n, n_embd) at
        ``positions`` (T,) int64.

        ``hc`` (fn, base, scale, iters, hc_eps) the attention's mHC; ``proj`` (tqa, wqa,
        q_a_norm, tqb, wqb, tkv, wkv, kv_norm, toa, woa, tob, wob, sinks): QTags and raw rows
        of q_a, q_b, kv, o_a (grouped), o_b, the norms' weights and the sinks; ``shape``
        (n_head, head_dim, n_rot, o_groups, window); ``cos``/``sin`` the block's rope tables
        (positions, n_rot / 2). ``win`` (tag, cells, start, length): the cache type's QTag (every
        part of a block's cache has it: ``kv_rows``), the window ring's raw rows (C, row bytes),
        its first cell's cache index and the positions seen before this call; the T new rows go
        to cells length − start .. (the caller made room and advances the length).

        ``comp`` None (window-only) or the compressor: (tkv, wkv, tg, wg, ape, norm, ratio,
        overlap, buf, held, keep, entries, count): weights, ``ape``, norm weight, the float32
        state rows ``buf`` (``held`` valid; rows from ``keep`` stay after this call), the
        entries' raw rows (count valid; room for the new). ``index`` None (not CSA) or
        (compressor tuple as ``comp``'s, tqb, wqb, tpr, wpr, n_head, head_dim, top_k) of the
        lightning indexer.
        Returns (the attention compressor's, the indexer's) new entry counts (0 where none)."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t_n, n_str, n_embd = x.shape
        fn, base, scale, iters, hc_eps = hc
        tqa, wqa, q_a_norm, tqb, wqb, tkv, wkv, kv_norm, toa, woa, tob, wob, sinks = proj
        n_head, d, n_rot, o_groups, window = shape
        kt, kbuf, win_start, length0 = win
        y = np.empty((t_n, n_embd), f32)
        post = np.empty((t_n, n_str), f32)
        comb = np.empty((t_n, n_str, n_str), f32)
        hc_pre(x, fn, base, scale, iters, hc_eps, eps, y, post, comb)
        a, a_s = _norm_and_bsums(y, attn_norm, eps)

        qa = np.empty((t_n, wqa.shape[0]), f32)
        kv = np.empty((t_n, d), f32)
        n_comp = n_idx = 0
        if comp is not None:
            ctkv, cwkv, ctg, cwg = comp[0], comp[1], comp[2], comp[3]
            ckv = np.empty((t_n, cwkv.shape[0]), f32)
            cg = np.empty((t_n, cwg.shape[0]), f32)
            matmuls_sharing_x(tqa, wqa, qa, tkv, wkv, kv, ctkv, cwkv, ckv, a, a_s, chunks)
            matmuls_sharing_x(ctg, cwg, cg, None, None, None, None, None, None, a, a_s, chunks)
        else:
            matmuls_sharing_x(tqa, wqa, qa, tkv, wkv, kv, None, None, None, a, a_s, chunks)

        qr, qr_s = _norm_and_bsums(qa, q_a_norm, eps)
        q = np.empty((t_n, n_head * d), f32)
        if index is not None:
            icomp, itqb, iwqb, itpr, iwpr, ih, idim, top_k = index
            iq = np.empty((t_n, iwqb.shape[0]), f32)
            matmuls_sharing_x(tqb, wqb, q, itqb, iwqb, iq, None, None, None, qr, qr_s, chunks)
            ikv = np.empty((t_n, icomp[1].shape[0]), f32)
            ig = np.empty((t_n, icomp[3].shape[0]), f32)
            iw = np.empty((t_n, iwpr.shape[0]), f32)
            matmuls_sharing_x(icomp[0], icomp[1], ikv, icomp[2], icomp[3], ig, itpr, iwpr, iw, a, a_s, chunks)
        else:
            matmuls_sharing_x(tqb, wqb, q, None, None, None, None, None, None, qr, qr_s, chunks)

        _head_rms(q, n_head, d, eps)
        kvn = np.empty((t_n, d), f32)
        rms_norm(kv, kv_norm, eps, kvn)
        q3 = q.reshape(t_n, n_head, d)
        off = length0 - win_start
        for t in range(t_n):
            p = positions[t]
            for h in range(n_head):
                rope_tail(q3[t, h], p, cos, sin, n_rot, False)
            rope_tail(kvn[t], p, cos, sin, n_rot, False)
            kv_store_row(kt, kbuf, (off + t) * kbuf.strides[0], kvn[t], 0, d)

        if comp is not None:
            ape, cnorm, ratio, overlap, buf, held, keep, entries, count = comp[4:]
            n_comp = _update_state(ckv, cg, buf, held, keep, ratio, overlap, d, ape, cnorm, eps, cos, sin, n_rot,
                                   length0, kt, entries, count)
            chosen = np.zeros((t_n, n_comp), np.bool_)
            if index is not None:
                iape, inorm, iratio, ioverlap, ibuf, iheld, ikeep, ientries, icount = icomp[4:]
                n_idx = _update_state(ikv, ig, ibuf, iheld, ikeep, iratio, ioverlap, idim, iape, inorm, eps, cos,
                                      sin, n_rot, length0, kt, ientries, icount)
                iq3 = iq.reshape(t_n, ih, idim)
                for t in range(t_n):
                    for h in range(ih):
                        rope_tail(iq3[t, h], positions[t], cos, sin, n_rot, False)
                wscale = f32(idim ** -0.5 * ih ** -0.5)
                for t in range(t_n):
                    for h in range(ih):
                        iw[t, h] *= wscale
                score = np.empty((t_n, n_idx), f32)
                index_scores(iq, iw, kt, ientries, n_idx, idim, positions, iratio, ih, score)
                top_entries(score, n_idx, positions, iratio, top_k, chosen)
            else:
                for t in range(t_n):
                    for s in range(min(n_comp, visible(positions, t, ratio))):
                        chosen[t, s] = True

        att = np.empty((t_n, n_head, d), f32)
        if comp is not None:
            attend_sink(q3, kt, kbuf, win_start, off + t_n, length0, window, entries, chosen, sinks, att)
        else:
            attend_sink(q3, kt, kbuf, win_start, off + t_n, length0, window, kbuf, None, sinks, att)
        for t in range(t_n):
            for h in range(n_head):
                rope_tail(att[t, h], positions[t], cos, sin, n_rot, True)
        ga = att.reshape(t_n * o_groups, n_head * d // o_groups)
        ga_s = np.empty((ga.shape[0], ga.shape[1] // 16), f32)
        bsums_of_rows(ga, ga.shape[0], ga_s)
        oa = np.empty((t_n, woa.shape[0]), f32)
        _grouped_kernel(toa, woa, ga, ga_s, oa, o_groups, chunks)
        oa_s = np.empty((t_n, oa.shape[1] // 16), f32)
        bsums_of_rows(oa, t_n, oa_s)
        o = np.empty((t_n, n_embd), f32)
        matmuls_sharing_x(tob, wob, o, None, None, None, None, None, None, oa, oa_s, chunks)
        hc_combine(o, x, post, comb, out)
        return n_comp, n_idx

    return compress_windows, _update_state, index_scores, attend_sink, v4_attention_half


compress_windows, _update_state, index_scores, attend_sink, v4_attention_half = _build_entries(source_digest())
