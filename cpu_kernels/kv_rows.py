"""KV cache rows in the cache's type, for compiled attention: store a row, dot a query with a
row, add a weighted row into an output. The cache is raw bytes (H_kv, cells, row bytes); a
row is one head's D values of one token.

Float caches (F32, F16, BF16) hold D values; block-quantized caches (Q8_0, Q4_0, Q4_1, Q5_0,
Q5_1, IQ4_NL: every quantized ``--cache-type``) hold D / 32 GGUF blocks, so rows never share a
block: appending one token and rolling it back are exact. Reads use the registry's
sub-block decoders (the expert kernels' own), so a cached row decodes exactly as a weight of
that type would. Storing a row quantizes it with ggml's reference rounding
(``quantize_row_*_ref`` in ggml-quants.c, = gguf-py's ``quantize_blocks``), compiled without
fastmath so that every division and rounding is IEEE's, bit for bit.

``kv_store_row(tag, buf, row, x, xo, d)``, ``kv_dot(tag, buf, row, x, xo, d)``,
``kv_axpy(tag, p, buf, row, y, yo, d)`` dispatch on the cache type's QTag at compile time
(jitted code only); ``quantize_rows`` is the Python entry (tests, the torch path's
reference).
"""
from __future__ import annotations

import numpy as np
from numba import njit
from numba.extending import overload

from .registry import QTagType, kernel_by_name
from .simd import (ld_u8, st_bf16, st_f16, st_f32, st_u8, vbf16, vf16, vf32, vfma, vlane, vload, vsplat,
                   vstore, vsum, vzero)

f32 = np.float32
_exact = dict(nogil=True, error_model="numpy")                # no fastmath: IEEE rounding
_fast = dict(nogil=True, fastmath=True, error_model="numpy")

FLOAT_TYPES = {"F32": (vf32, st_f32, 4), "F16": (vf16, st_f16, 2), "BF16": (vbf16, st_bf16, 2)}
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL")
KV_TYPES = tuple(FLOAT_TYPES) + QUANT_TYPES
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         np.float32)     # ggml's kvalues_iq4nl (= gguf.quants.IQ4_NL.kvalues)


@njit(**_exact)
def _roundf(v):
    """C's roundf (half away from zero), as gguf-py's np_roundf computes it exactly."""
    a = abs(v)
    fl = np.floor(a)
    b = fl + np.floor(f32(2) * (a - fl))
    return -b if v < 0 else b


@njit(**_exact)
def _signed_max(x, xo):
    """The value of largest magnitude (the first of ties), as ggml's ``max`` in q4_0/q5_0."""
    amax = f32(0)
    mx = f32(0)
    for j in range(32):
        if amax < abs(x[xo + j]):
            amax = abs(x[xo + j])
            mx = x[xo + j]
    return mx


# Codes are packed as they are made (pairs j, j + 16 share a byte: low nibbles are values
# 0..15), with no scratch array: this runs per block of every appended row.
@njit(**_exact)
def _put_high_bits(h, buf, at):
    """qh (Q5_0/Q5_1): bit j of a little-endian u32 = bit 4 of code j."""
    for b in range(4):
        st_u8(buf, at + b, (h >> (8 * b)) & 255)


# block_q8_0 { ggml_half d; int8_t qs[32]; }: d = amax / 127, q = roundf(x / d)
@njit(**_exact)
def quantize_q8_0(x, xo, buf, at):
    amax = f32(0)
    for j in range(32):
        amax = max(amax, abs(x[xo + j]))
    d = amax / f32(127)
    inv = f32(1) / d if d != 0 else f32(0)
    st_f16(buf, at, d)
    for j in range(32):
        st_u8(buf, at + 2 + j, np.int32(_roundf(x[xo + j] * inv)))


# block_q4_0 { ggml_half d; uint8_t qs[16]; }: d = max / -8, q = min(15, (int)(x / d + 8.5))
@njit(**_exact)
def quantize_q4_0(x, xo, buf, at):
    d = _signed_max(x, xo) / f32(-8)
    inv = f32(1) / d if d != 0 else f32(0)
    st_f16(buf, at, d)
    for j in range(16):
        lo = min(15, np.int32(x[xo + j] * inv + f32(8.5)))
        hi = min(15, np.int32(x[xo + j + 16] * inv + f32(8.5)))
        st_u8(buf, at + 2 + j, lo | (hi << 4))


# block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }: d = max / -16, q = min(31, (int)(x / d + 16.5))
@njit(**_exact)
def quantize_q5_0(x, xo, buf, at):
    d = _signed_max(x, xo) / f32(-16)
    inv = f32(1) / d if d != 0 else f32(0)
    st_f16(buf, at, d)
    h = 0
    for j in range(16):
        lo = min(31, np.int32(x[xo + j] * inv + f32(16.5)))
        hi = min(31, np.int32(x[xo + j + 16] * inv + f32(16.5)))
        st_u8(buf, at + 6 + j, (lo & 15) | ((hi & 15) << 4))
        h |= ((lo >> 4) & 1) << j | ((hi >> 4) & 1) << (j + 16)
    _put_high_bits(h, buf, at + 2)


@njit(**_exact)
def _min_max(x, xo, levels):
    """ggml's q4_1/q5_1 scale: (d = (max - min) / levels, m = min, 1 / d or 0); codes are
    min(levels, (int)((x - m) / d + 0.5))."""
    lo = x[xo]
    hi = x[xo]
    for j in range(1, 32):
        lo = min(lo, x[xo + j])
        hi = max(hi, x[xo + j])
    d = (hi - lo) / f32(levels)
    return d, lo, (f32(1) / d if d != 0 else f32(0))


# block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }
@njit(**_exact)
def quantize_q4_1(x, xo, buf, at):
    d, m, inv = _min_max(x, xo, 15)
    st_f16(buf, at, d)
    st_f16(buf, at + 2, m)
    for j in range(16):
        lo = min(15, np.int32((x[xo + j] - m) * inv + f32(0.5)))
        hi = min(15, np.int32((x[xo + j + 16] - m) * inv + f32(0.5)))
        st_u8(buf, at + 4 + j, lo | (hi << 4))


# block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }
@njit(**_exact)
def quantize_q5_1(x, xo, buf, at):
    d, m, inv = _min_max(x, xo, 31)
    st_f16(buf, at, d)
    st_f16(buf, at + 2, m)
    h = 0
    for j in range(16):
        lo = min(31, np.int32((x[xo + j] - m) * inv + f32(0.5)))
        hi = min(31, np.int32((x[xo + j + 16] - m) * inv + f32(0.5)))
        st_u8(buf, at + 8 + j, (lo & 15) | ((hi & 15) << 4))
        h |= ((lo >> 4) & 1) << j | ((hi >> 4) & 1) << (j + 16)
    _put_high_bits(h, buf, at + 4)


@njit(**_exact)
def _best_index(v, x):
    """ggml's best_index_int8: the nearest table entry (the lower one on a tie)."""
    if x <= v[0]:
        return 0
    if x >= v[15]:
        return 15
    lo, hi = 0, 15
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x < v[mid]:
            hi = mid
        else:
            lo = mid
    return hi - 1 if x - v[hi - 1] < v[hi] - x else hi


# block_iq4_nl { ggml_half d; uint8_t qs[16]; }: w = d * kvalues[q]. ggml's
# quantize_row_iq4_nl_ref (quantize_row_iq4_nl_impl with ntry -1, what llama.cpp's CPU cache
# stores): codes for d = max / kvalues[0], then d refit by least squares with weights x²,
# summed in ggml's order (j = 0..31); a block below GROUP_MAX_EPS keeps d = 0 and codes 0
# (ggml leaves them unset: any codes decode to 0 there).
@njit(**_exact)
def quantize_iq4_nl(x, xo, buf, at):
    v = IQ4_NL_VALUES
    amax = f32(0)
    mx = f32(0)
    for j in range(32):
        if abs(x[xo + j]) > amax:
            amax = abs(x[xo + j])
            mx = x[xo + j]
    if amax < f32(1e-15):
        st_f16(buf, at, f32(0))
        for j in range(16):
            st_u8(buf, at + 2 + j, 0)
        return
    inv = f32(1) / (mx / v[0])
    sqx = f32(0)
    sq2 = f32(0)
    for j in range(32):
        xj = x[xo + j]
        q = _best_index(v, inv * xj)
        c = v[q]
        w = xj * xj
        sqx += w * c * xj
        sq2 += w * c * c
        if j < 16:
            st_u8(buf, at + 2 + j, q)
        else:
            st_u8(buf, at + 2 + j - 16, ld_u8(buf, at + 2 + j - 16) | (q << 4))
    st_f16(buf, at, sqx / sq2)


_QUANTIZE = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1,
             "Q5_0": quantize_q5_0, "Q5_1": quantize_q5_1, "IQ4_NL": quantize_iq4_nl}


def kv_store_row(tag, buf, row, x, xo, d):
    """Store x[xo:xo + d] (float32) as the cache row at byte ``row`` (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def kv_dot(tag, buf, row, x, xo, d):
    """x[xo:xo + d] · the cache row at byte ``row``, float32 (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def kv_axpy(tag, p, buf, row, y, yo, d):
    """y[yo:yo + d] += p · the cache row at byte ``row`` (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(kv_store_row)
def _kv_store_row(tag, buf, row, x, xo, d):
    if not isinstance(tag, QTagType):
        return None
    if tag.qname in FLOAT_TYPES:
        _, st, es = FLOAT_TYPES[tag.qname]

        def store(tag, buf, row, x, xo, d):
            for c in range(d):
                st(buf, row + c * es, x[xo + c])
        return store
    if tag.qname in _QUANTIZE:
        quantize, size = _QUANTIZE[tag.qname], kernel_by_name(tag.qname).type_size

        def store(tag, buf, row, x, xo, d):
            for b in range(d // 32):
                quantize(x, xo + 32 * b, buf, row + b * size)
        return store
    return None


@overload(kv_dot)
def _kv_dot(tag, buf, row, x, xo, d):
    if not isinstance(tag, QTagType):
        return None
    if tag.qname in FLOAT_TYPES:
        ld, _, es = FLOAT_TYPES[tag.qname]

        def dot(tag, buf, row, x, xo, d):
            a = vzero()
            for c in range(0, d, 16):
                a = vfma(vload(x, xo + c), ld(buf, row + c * es), a)
            return vsum(a)
        return dot
    if tag.qname in _QUANTIZE:
        k = kernel_by_name(tag.qname)
        scales, quants, size = k.scales, k.quants, k.type_size

        # per block d · (x · v) + m · Σx (both halves share d and m: same_d, one sub-block),
        # kept in lanes: one horizontal sum per row, not two per block
        def dot(tag, buf, row, x, xo, d):
            a = vzero()
            for b in range(d // 32):
                ob = row + b * size
                vd, vm = scales(buf, ob)
                v0, v1 = quants(buf, ob, 0)
                x0 = vload(x, xo + 32 * b)
                x1 = vload(x, xo + 32 * b + 16)
                a = vfma(vsplat(vlane(vd, 0)), vfma(x0, v0, x1 * v1), a)
                a = vfma(vsplat(vlane(vm, 0)), x0 + x1, a)
            return vsum(a)
        return dot
    return None


@overload(kv_axpy)
def _kv_axpy(tag, p, buf, row, y, yo, d):
    if not isinstance(tag, QTagType):
        return None
    if tag.qname in FLOAT_TYPES:
        ld, _, es = FLOAT_TYPES[tag.qname]

        def axpy(tag, p, buf, row, y, yo, d):
            pv = vsplat(p)
            for c in range(0, d, 16):
                vstore(y, yo + c, vfma(pv, ld(buf, row + c * es), vload(y, yo + c)))
        return axpy
    if tag.qname in _QUANTIZE:
        k = kernel_by_name(tag.qname)
        scales, quants, size = k.scales, k.quants, k.type_size

        def axpy(tag, p, buf, row, y, yo, d):
            for b in range(d // 32):
                ob = row + b * size
                vd, vm = scales(buf, ob)
                v0, v1 = quants(buf, ob, 0)
                pd = vsplat(p * vlane(vd, 0))
                pm = vsplat(p * vlane(vm, 0))
                o = yo + 32 * b
                vstore(y, o, vfma(pd, v0, vload(y, o) + pm))
                vstore(y, o + 16, vfma(pd, v1, vload(y, o + 16) + pm))
        return axpy
    return None


@njit(cache=True, **_fast)
def quantize_rows(tag, x, out):
    """x float32 (N, D) → out uint8 (N, row bytes): each row stored as the cache stores it."""
    for i in range(x.shape[0]):
        kv_store_row(tag, out[i], 0, x[i], 0, x.shape[1])


@njit(cache=True, **_fast)
def dot_rows(tag, raw, x, out):
    """out[i] = x[i] · row i of raw (N, row bytes): the compiled read, for tests."""
    for i in range(raw.shape[0]):
        out[i] = kv_dot(tag, raw[i], 0, x[i], 0, x.shape[1])
