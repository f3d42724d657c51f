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
from .simd import (st_bf16, st_f16, st_f32, st_u8, vbf16, vf16, vf32, vfma, vlane, vload, vsplat,
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


@njit(**_exact)
def _pack_nibbles(q, buf, at):
    """qs[j] = q[j] | q[j + 16] << 4 (low nibbles are values 0..15)."""
    for j in range(16):
        st_u8(buf, at + j, (q[j] & 15) | ((q[j + 16] & 15) << 4))


@njit(**_exact)
def _pack_high(q, buf, at):
    """qh: bit j of a little-endian u32 = bit 4 of q[j] (Q5_0/Q5_1)."""
    for b in range(4):
        v = 0
        for j in range(8):
            v |= ((q[8 * b + j] >> 4) & 1) << j
        st_u8(buf, at + b, v)


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
    q = np.empty(32, np.int32)
    for j in range(32):
        q[j] = min(15, np.int32(x[xo + j] * inv + f32(8.5)))
    _pack_nibbles(q, buf, at + 2)


# block_q5_0 { ggml_half d; uint8_t qh[4]; uint8_t qs[16]; }: d = max / -16, q = min(31, (int)(x / d + 16.5))
@njit(**_exact)
def quantize_q5_0(x, xo, buf, at):
    d = _signed_max(x, xo) / f32(-16)
    inv = f32(1) / d if d != 0 else f32(0)
    st_f16(buf, at, d)
    q = np.empty(32, np.int32)
    for j in range(32):
        q[j] = min(31, np.int32(x[xo + j] * inv + f32(16.5)))
    _pack_high(q, buf, at + 2)
    _pack_nibbles(q, buf, at + 6)


@njit(**_exact)
def _min_max_codes(x, xo, levels, q):
    """ggml's q4_1/q5_1: m = min, d = (max - min) / levels, q = min(levels, (int)((x - m) / d + 0.5))."""
    lo = x[xo]
    hi = x[xo]
    for j in range(1, 32):
        lo = min(lo, x[xo + j])
        hi = max(hi, x[xo + j])
    d = (hi - lo) / f32(levels)
    inv = f32(1) / d if d != 0 else f32(0)
    for j in range(32):
        q[j] = min(levels, np.int32((x[xo + j] - lo) * inv + f32(0.5)))
    return d, lo


# block_q4_1 { ggml_half d; ggml_half m; uint8_t qs[16]; }
@njit(**_exact)
def quantize_q4_1(x, xo, buf, at):
    q = np.empty(32, np.int32)
    d, m = _min_max_codes(x, xo, 15, q)
    st_f16(buf, at, d)
    st_f16(buf, at + 2, m)
    _pack_nibbles(q, buf, at + 4)


# block_q5_1 { ggml_half d; ggml_half m; uint8_t qh[4]; uint8_t qs[16]; }
@njit(**_exact)
def quantize_q5_1(x, xo, buf, at):
    q = np.empty(32, np.int32)
    d, m = _min_max_codes(x, xo, 31, q)
    st_f16(buf, at, d)
    st_f16(buf, at + 2, m)
    _pack_high(q, buf, at + 4)
    _pack_nibbles(q, buf, at + 8)


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
# stores): codes for d = max / kvalues[0], then d refit by least squares with weights x²;
# a block below GROUP_MAX_EPS keeps d = 0 (its codes are then any: ggml leaves them unset).
@njit(**_exact)
def quantize_iq4_nl(x, xo, buf, at):
    v = IQ4_NL_VALUES
    amax = f32(0)
    mx = f32(0)
    for j in range(32):
        if abs(x[xo + j]) > amax:
            amax = abs(x[xo + j])
            mx = x[xo + j]
    d = f32(0)
    q = np.zeros(32, np.int32)
    if amax >= f32(1e-15):
        inv = f32(1) / (mx / v[0])
        sqx = f32(0)
        sq2 = f32(0)
        for j in range(32):
            xj = x[xo + j]
            q[j] = _best_index(v, inv * xj)
            c = v[q[j]]
            w = xj * xj
            sqx += w * c * xj
            sq2 += w * c * c
        d = sqx / sq2
    st_f16(buf, at, d)
    _pack_nibbles(q, buf, at + 2)


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
