"""``matmul``: y[B, rows] = x[B, cols] @ W^T straight from a GGUF tensor's raw blocks."""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from placement.limits import DECODE_TOKENS, DX_PAD, S4_PAD, XQ_PAD, wants_int8

from . import settings
from .entry import first_call
from .gemm8 import LANES, decode4, pack_tiles, row_buffers, tile4
from .layout import activations, bsums_for, row_cols, weight_bytes
from .registry import get_kernel, source_digest
from .rowdot import TOKEN_TILE, dot4, rows4, rows4_scratch
from .rowdot8 import dot4_i8, quantize_rows
from .simd import vlane
from .simd8 import has_int8_dot

f32 = np.float32


def _build(salt):
    @njit(parallel=True, nogil=True, cache=True, fastmath=True, error_model="numpy")
    def matmul_kernel(tag, w, X, bsums, Y, chunks):
        """Y[t, r] = W[r] . X[t]; w: uint8 [rows, row_bytes]; row groups of 4 split into
        ``chunks`` parallel pieces (one per thread: numba.get_num_threads() inside a
        jitted function would make it uncacheable)."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        groups = (w.shape[0] + 3) // 4
        chunks = max(1, min(groups, chunks))
        for ch in prange(chunks):
            acc, cacc, res, toks, sc = rows4_scratch()
            for g in range(ch * groups // chunks, (ch + 1) * groups // chunks):
                rows4(tag, w, 4 * g, X, bsums, Y, acc, cacc, res, toks, sc)
    @njit(parallel=True, nogil=True, cache=True, fastmath=True, error_model="numpy")
    def matmul_i8_kernel(tag, w, xq, dx, bsums, xs4, dx8, Y, chunks):
        """As matmul_kernel with int8-quantized activations (``rowdot8``)."""
        _salt = salt  # noqa: F841
        rows = w.shape[0]
        rs = w.strides[0]
        wf = w.reshape(-1)                  # flat bytes (rowdot.dot4)
        n = Y.shape[0]
        cols = bsums.shape[1] * 16
        groups = (rows + 3) // 4
        chunks = max(1, min(groups, chunks))
        for ch in prange(chunks):
            acc = np.empty(TOKEN_TILE * 64, f32)
            cacc = np.empty(TOKEN_TILE * 4, f32)
            res = np.empty((TOKEN_TILE, 4), f32)
            toks = np.empty(TOKEN_TILE, np.int64)
            for g in range(ch * groups // chunks, (ch + 1) * groups // chunks):
                r0 = 4 * g
                last = rows - 1
                nr = min(4, rows - r0)
                for t0 in range(0, n, TOKEN_TILE):
                    nt = min(TOKEN_TILE, n - t0)
                    for i in range(nt):
                        toks[i] = t0 + i
                    dot4_i8(tag, wf, r0 * rs, min(r0 + 1, last) * rs, min(r0 + 2, last) * rs,
                            min(r0 + 3, last) * rs, cols, xq, dx, bsums, xs4, dx8, toks, nt, acc, cacc, res)
                    for i in range(nt):
                        for r in range(nr):
                            Y[t0 + i, r0 + r] = res[i, r]
    @njit(parallel=True, nogil=True, cache=True, fastmath=True, error_model="numpy")
    def grouped_kernel(tag, w, X, bsums, Y, groups, chunks):
        """Y[t, r] = W[r] . X[t·groups + r // (rows / groups)]: row group g of W takes the
        activations of group g only (X: [T·groups, cols]); rows per group a multiple of 4, so
        each row quad lies in one group. The same dot4 per (row, token) as matmul_kernel."""
        _salt = salt  # noqa: F841
        rows = w.shape[0]
        rs = w.strides[0]
        wf = w.reshape(-1)                  # flat bytes (rowdot.dot4)
        last = rows - 1
        per = rows // groups
        n = Y.shape[0]
        cols = X.shape[1]
        quads = (rows + 3) // 4
        chunks = max(1, min(quads, chunks))
        for ch in prange(chunks):
            acc, cacc, res, toks, sc = rows4_scratch()
            for q in range(ch * quads // chunks, (ch + 1) * quads // chunks):
                r0 = 4 * q
                g = r0 // per
                nr = min(4, rows - r0)
                for t0 in range(0, n, TOKEN_TILE):
                    nt = min(TOKEN_TILE, n - t0)
                    for i in range(nt):
                        toks[i] = (t0 + i) * groups + g
                    dot4(tag, wf, r0 * rs, min(r0 + 1, last) * rs, min(r0 + 2, last) * rs,
                         min(r0 + 3, last) * rs, cols, X, bsums, toks, nt, acc, cacc, res, sc)
                    for i in range(nt):
                        for r in range(nr):
                            Y[t0 + i, r0 + r] = res[i, r]
    @njit(parallel=True, nogil=True, cache=True, fastmath=True, error_model="numpy")
    def matmul_gemm8_kernel(tag, w, xq, dx, bsums, Y, chunks):
        """As matmul_i8_kernel for a prompt batch: the tokens packed into tiles of 16 lanes
        once (``gemm8.pack_lanes``), then every group of 4 rows against every tile."""
        _salt = salt  # noqa: F841
        rows = w.shape[0]
        rs = w.strides[0]
        wf = w.reshape(-1)                  # flat bytes (rowdot.dot4)
        n = Y.shape[0]
        cols = bsums.shape[1] * 16
        n_tiles = (n + LANES - 1) // LANES
        src = np.full(n_tiles * LANES, -1, np.int64)
        src[:n] = np.arange(n)
        xt, dt, bt, sx, sd, sb = pack_tiles(xq, dx, bsums, src)
        groups = (rows + 3) // 4
        chunks = max(1, min(groups, chunks))
        for ch in prange(chunks):
            cw, sdr, skr = row_buffers(cols)
            for g in range(ch * groups // chunks, (ch + 1) * groups // chunks):
                r0 = 4 * g
                last = rows - 1
                nr = min(4, rows - r0)
                decode4(tag, wf, r0 * rs, min(r0 + 1, last) * rs, min(r0 + 2, last) * rs,
                        min(r0 + 3, last) * rs, cols, cw, sdr, skr)
                for j in range(n_tiles):
                    a = tile4(tag, cols, cw, sdr, skr, xt, j * sx, dt, j * sd, bt, j * sb)
                    nt = min(LANES, n - LANES * j)
                    for r in range(nr):
                        for i in range(nt):
                            Y[LANES * j + i, r0 + r] = vlane(a[r], i)
    return matmul_kernel, matmul_i8_kernel, grouped_kernel, matmul_gemm8_kernel


_matmul_kernel, _matmul_i8_kernel, _grouped_kernel, _matmul_gemm8_kernel = _build(source_digest())


def int8_rows(rows: int, cols: int):
    """Empty (xq, dx, bsums, xs4, dx8) for ``rows`` rows of ``cols`` values, as
    ``rowdot8.quantize_rows`` fills them (its padding included): allocated once where a
    caller binds int8 scratch (the routed experts' decode step), per call otherwise."""
    return (np.empty((rows, cols + XQ_PAD), np.int8), np.empty((rows, cols // 32 + DX_PAD), f32),
            np.empty((rows, cols // 16), f32), np.empty((rows, cols // 4 + S4_PAD), f32),
            np.empty((rows, cols // 4 + S4_PAD), f32))


def quantized_activations(X: np.ndarray):
    """(xq, dx, bsums, xs4, dx8) for the int8 path (see ``rowdot8.quantize_rows``)."""
    q = int8_rows(*X.shape)
    quantize_rows(X, *q)
    return q


def use_int8(kern, int8: bool | str | None = None) -> bool:
    """int8 activations for this type: ``int8`` (True/False; ``placement.limits.AUTO``: the
    type is in the set chosen for this CPU, ``settings.decode_int8_types``; None: the process
    setting), as ``placement.limits.wants_int8`` says, where the type has an int8 decoder and
    the CPU a u8 x s8 dot product."""
    want = wants_int8(settings.int8_activations() if int8 is None else int8, kern.qtype,
                      settings.decode_int8_types())
    return want and kern.has_int8 and has_int8_dot()


def matmul(x, w, qtype, *, name: str = "", int8: bool | str | None = None) -> np.ndarray:
    """``x @ W.T`` for a GGUF weight ``W`` given as its raw data.

    x: float32 [B, cols] (or [cols], giving [rows]); w: ``ReaderTensor.data`` of a 2-D
    tensor, or ``data[e]`` for one expert of a 3-D ``*_exps`` tensor, used in place.
    Returns float32 [B, rows]. Unsupported ``qtype`` -> ``UnsupportedQuantType`` naming
    the type and ``name``. ``int8``: int8 activations for this call (``use_int8``; None: the
    process setting, ``set_int8_activations``).
    """
    kern = get_kernel(qtype, name)
    wb = weight_bytes(w, kern, 2, name)
    cols = row_cols(wb.shape[1], kern)
    squeeze = np.ndim(x) == 1
    X = activations(np.atleast_2d(x), cols, name or "matmul")
    Y = np.empty((X.shape[0], wb.shape[0]), f32)
    if X.shape[0] and wb.shape[0]:
        n_threads = settings.apply_threads()
        if use_int8(kern, int8):
            xq, dx, bsums, xs4, dx8 = quantized_activations(X)
            if X.shape[0] > DECODE_TOKENS:             # a prompt batch: tokens in lanes (gemm8)
                _matmul_gemm8_kernel(kern.tag, wb, xq, dx, bsums, Y, n_threads)
            else:
                _matmul_i8_kernel(kern.tag, wb, xq, dx, bsums, xs4, dx8, Y, n_threads)
        else:
            _matmul_kernel(kern.tag, wb, X, bsums_for(X, kern), Y, n_threads)
    return Y[0] if squeeze else Y


def grouped_matmul(x, w, qtype, groups: int, *, name: str = "") -> np.ndarray:
    """A grouped projection (deepseek4's ``attn_output_a``, which llama.cpp views as
    ``groups`` matrices): x float32 [B, groups, cols] → [B, rows], where output rows
    g·rows/groups … (g+1)·rows/groups − 1 are group g's rows of W times x[:, g]. One parallel
    call, each weight row read once (not groups × the product and its diagonal). Float
    activations at every batch size (a group's product is 1/groups of the full one)."""
    return BoundMatmul(w, qtype, name=name, groups=groups)(x)


class BoundMatmul:
    """``matmul`` (and ``grouped_matmul`` with ``groups``) for one weight: its kernel, raw rows
    and column count resolved once, and float calls made through the compiled entry point after
    the first (``cpu_kernels.entry``: no Numba dispatch, which types each argument per call).
    A decode step makes a dozen such calls per deepseek4 block; int8 calls go through
    ``matmul``."""

    def __init__(self, w, qtype, *, name: str = "", groups: int = 0):
        self.w, self.qtype, self.name, self.groups = w, qtype, name, groups
        self.kern = get_kernel(qtype, name)
        self.wb = weight_bytes(w, self.kern, 2, name)
        self.cols = row_cols(self.wb.shape[1], self.kern)
        if groups and (self.wb.shape[0] % groups or (self.wb.shape[0] // groups) % 4):
            raise ValueError(f"{name or 'grouped_matmul'}: {self.wb.shape[0]} rows do not split into {groups} "
                             "groups of a multiple of 4")
        self._entry = None

    def __call__(self, x, *, int8: bool | str | None = None) -> np.ndarray:
        """x float32 [B, cols] (grouped: [B, groups, cols]) → [B, rows]."""
        if self.groups:
            b = np.shape(x)[0]
            X = activations(np.reshape(x, (-1, self.cols)), self.cols, self.name or "grouped_matmul")
            if X.shape[0] != b * self.groups:
                raise ValueError(f"{self.name or 'grouped_matmul'}: activations of shape {np.shape(x)}, expected "
                                 f"[B, {self.groups}, {self.cols}]")
            kernel, tail = _grouped_kernel, (self.groups,)
        else:
            if np.ndim(x) != 2 or use_int8(self.kern, int8):
                return matmul(x, self.w, self.qtype, name=self.name, int8=int8)
            b = np.shape(x)[0]
            X = activations(x, self.cols, self.name or "matmul")
            kernel, tail = _matmul_kernel, ()
        Y = np.empty((b, self.wb.shape[0]), f32)
        if b and self.wb.shape[0]:
            args = (self.kern.tag, self.wb, X, bsums_for(X, self.kern), Y, *tail, settings.apply_threads())
            if self._entry is None:
                self._entry, _ = first_call(kernel, args)
            else:
                self._entry(*args)
        return Y
