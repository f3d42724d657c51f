"""The two ends of a pass over raw GGUF rows, one compiled call each: ``embed_rows`` (the
token-embedding lookup: only the rows asked for, dequantized with the registry's sub-block
decoders) and ``output_head`` (output norm + lm_head).

Why: at decode the blocks are a few compiled calls, and what surrounds them — gguf's numpy
``dequantize`` for one row, torch's eager RMSNorm, ``matmul``'s registry lookup and Numba
dispatch — cost as much as a small block
(``bench.pass_cost``). Callers bind the weights once and call the compiled entry points
(``cpu_kernels.entry.first_call``).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .block import matmuls_sharing_x, rms_norm
from .dispatch import elem, layout, quants, scales
from .moe import bsums_of_rows
from .registry import source_digest
from .simd import vfma, vload, vsplat, vstore

f32 = np.float32
_kw = dict(nogil=True, cache=True, fastmath=True, error_model="numpy")


def _build(salt):
    # both inline decoders of other files: they carry the package's source digest (registry)

    @njit(**_kw)
    def embed_rows(tag, w, ids, out):
        """out[i] = row ids[i] of the raw weight w (uint8 [rows, row_bytes]) as float32,
        ``w = d · v + m`` per 16-weight half (registry contract), float types' tail columns
        by ``elem``. Returns the index of the first id outside 0..rows-1 (rows before it are
        written), or -1."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        rows, rs = w.shape[0], w.strides[0]
        cols = out.shape[1]
        bb, n_sub, _ = layout(tag)
        n_sub_blocks = cols // 32
        of = out.reshape(-1)
        sc = np.empty(32, f32)
        for i in range(ids.shape[0]):
            r = ids[i]
            if r < 0 or r >= rows:
                return i
            ro = r * rs
            for b in range(n_sub_blocks // n_sub):
                ob = ro + b * bb
                vd, vm = scales(tag, w, ob)
                vstore(sc, 0, vd)             # lanes 2k, 2k + 1: (d, m) of sub-block k's halves
                vstore(sc, 16, vm)
                for k in range(n_sub):
                    v0, v1 = quants(tag, w, ob, k)
                    o = i * cols + 32 * (b * n_sub + k)
                    vstore(of, o, vfma(v0, vsplat(sc[2 * k]), vsplat(sc[16 + 2 * k])))
                    vstore(of, o + 16, vfma(v1, vsplat(sc[2 * k + 1]), vsplat(sc[17 + 2 * k])))
            for c in range(n_sub_blocks * 32, cols):
                out[i, c] = elem(tag, w, ro, c)
        return -1

    @njit(**_kw)
    def output_head(x, eps, norm_w, tag, w, row0, h, logits, chunks):
        """h = rms_norm(x) · norm_w for all T rows of x (the draft head reads them), then
        logits = h[row0:] @ W^T over the raw lm_head rows w (one parallel region, ``matmuls_sharing_x``)."""
        _salt = salt  # noqa: F841
        rms_norm(x, norm_w, eps, h)
        n = logits.shape[0]
        hl = np.empty((n, h.shape[1]), f32)       # C-contiguous rows for the row-dot drivers
        hl[:] = h[row0:]
        hs = np.empty((n, h.shape[1] // 16), f32)
        bsums_of_rows(hl, n, hs)
        if n:
            matmuls_sharing_x(tag, w, logits, None, None, None, None, None, None, hl, hs, chunks)

    return embed_rows, output_head


embed_rows, output_head = _build(source_digest())
