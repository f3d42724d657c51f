"""Attention over a KV cache in its own type on the CPU, every cached row read in place through
``kv_rows``' decoders (no dequantized copy of the cache, or of a tile of it): the compiled
blocks' attention half (``cpu_kernels.block``) and, for a quantized cache, the layers those
blocks do not take (MLA's latent cache, gpt-oss's sinks and windows, any torch-path block on
the CPU, through ``offload.cpu_ops.attend_quantized_cache``).

``attend_cache(q, kt, kc, vt, vc, n_keys, dv, scale, sinks, window, out)``: q (T, H, Dk)
float32; kc, vc the caches' raw bytes (H_kv, cells, row bytes) of types ``kt``, ``vt``
(QTags), of which the first ``n_keys`` cells are valid; query i sits at cell n_keys − T + i
and sees cells up to it (the last ``window`` of them when window > 0);
``sinks`` (H,) float32 logits that join each head's softmax with no value, or None; writes
out (T, H, Dv). V is read from the first ``dv`` values of each V row, so MLA passes the latent
cache as both K (the whole ``kv_lora + rope`` row) and V (its first ``kv_lora`` values).
Softmax as ``gpu.attention.attend_tiles`` computes it (max-subtracted, sink column first).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .kv_rows import kv_axpy, kv_dot
from .registry import source_digest

f32 = np.float32
_kw = dict(nogil=True, cache=True, fastmath=True, error_model="numpy")


def _build(salt):
    @njit(parallel=True, **_kw)
    def attend_cache(q, kt, kc, vt, vc, n_keys, dv, scale, sinks, window, out):
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        t, n_head, dk = q.shape
        n_kv = kc.shape[0]
        group = n_head // n_kv
        ks0, ks1 = kc.strides[0], kc.strides[1]
        vs0, vs1 = vc.strides[0], vc.strides[1]
        qf = q.reshape(-1)
        of = out.reshape(-1)
        for hi in prange(n_head * t):             # one (head, query) per iteration
            h = hi // t
            i = hi - h * t
            g = h // group
            last = n_keys - t + i                 # this query's own cell
            lo = 0
            if window > 0 and last - window + 1 > 0:
                lo = last - window + 1
            qo = (i * n_head + h) * dk
            oo = (i * n_head + h) * dv
            s = np.empty(last + 1 - lo, f32)
            m = f32(-np.inf)
            if sinks is not None:
                m = sinks[h]
            for j in range(lo, last + 1):
                sj = kv_dot(kt, kc, g * ks0 + j * ks1, qf, qo, dk) * f32(scale)
                s[j - lo] = sj
                m = max(m, sj)
            tot = f32(0)
            if sinks is not None:
                tot = np.exp(sinks[h] - m)
            for j in range(last + 1 - lo):
                e = np.exp(s[j] - m)
                s[j] = e
                tot += e
            inv = f32(1) / tot
            for c in range(dv):
                of[oo + c] = f32(0)
            for j in range(lo, last + 1):
                kv_axpy(vt, s[j - lo] * inv, vc, g * vs0 + j * vs1, of, oo, dv)

    return attend_cache


attend_cache = _build(source_digest())
