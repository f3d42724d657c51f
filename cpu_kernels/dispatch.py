"""Compile-time dispatch from a ``QTag`` to the registered decoder of its quant type.

Inside a jitted driver ``scales(tag, ...)`` / ``quants(tag, ...)`` resolve, while Numba types the driver, to the
decoders registered for ``tag``'s type, so every driver is specialised per quant type and
nothing is looked up at run time.
"""
from __future__ import annotations

import numpy as np
from numba.extending import overload

from .registry import QTagType, kernel_by_name

f32 = np.float32


def scales(tag, w, ob):
    """(vd, vm) of the block at byte ob (see registry; jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def quants(tag, w, ob, k):
    """(v0, v1) of sub-block k of the block at byte ob (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def codes(tag, w, ob, j):
    """64 unsigned 8-bit codes of sub-blocks 2j, 2j + 1 (int8 path; jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def code_offset(tag):
    """float32 offset between codes and values (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def layout(tag):
    """(bytes per block, sub-blocks per block, same_d) (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def elem(tag, w, ro, c):
    """Weight at column c of the row at byte ro, float types only (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(scales)
def _scales(tag, w, ob):
    if isinstance(tag, QTagType):
        fn = kernel_by_name(tag.qname).scales
        return lambda tag, w, ob: fn(w, ob)
    return None


@overload(quants)
def _quants(tag, w, ob, k):
    if isinstance(tag, QTagType):
        fn = kernel_by_name(tag.qname).quants
        return lambda tag, w, ob, k: fn(w, ob, k)
    return None


@overload(layout)
def _layout(tag):
    if isinstance(tag, QTagType):
        kern = kernel_by_name(tag.qname)
        type_size, n_sub, same_d = kern.type_size, kern.sub_blocks_per_block, kern.same_d
        return lambda tag: (type_size, n_sub, same_d)
    return None


@overload(elem)
def _elem(tag, w, ro, c):
    if isinstance(tag, QTagType):
        fn = kernel_by_name(tag.qname).elem
        if fn is None:       # quantized rows are whole blocks: no tail ever
            return lambda tag, w, ro, c: f32(0)
        return lambda tag, w, ro, c: fn(w, ro, c)
    return None


@overload(codes)
def _codes(tag, w, ob, j):
    if isinstance(tag, QTagType):
        fn = kernel_by_name(tag.qname).codes
        if fn is not None:
            return lambda tag, w, ob, j: fn(w, ob, j)
    return None


@overload(code_offset)
def _code_offset(tag):
    if isinstance(tag, QTagType):
        off = f32(kernel_by_name(tag.qname).code_offset)
        return lambda tag: off
    return None


def decode_block_pair(tag, w, ob):
    """Int8 path of 32-weight types: (codes, d, m) of the two consecutive blocks at ob
    (``pair8.block_pair_decoder``; jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def decode_block(tag, w, ob):
    """(codes, d, m) of the block at ob alone, the second block's lanes zero: a row's odd
    last block (``pair8.block_pair_decoder``; jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


def has_offsets(tag):
    """Whether the type's blocks have offsets m (``QuantKernel.has_min``): a compile-time
    constant, so code for the others drops the m terms, zero there (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(has_offsets)
def _has_offsets(tag):
    if isinstance(tag, QTagType):
        has_min = kernel_by_name(tag.qname).has_min
        return lambda tag: has_min
    return None


def block_pair_offset_min(tag):
    """(code offset, has_min) of the block-pair decoder (jitted code only)."""
    raise NotImplementedError("only callable from jitted code")


@overload(decode_block_pair)
def _decode_block_pair(tag, w, ob):
    if isinstance(tag, QTagType) and kernel_by_name(tag.qname).block_pair is not None:
        fn = kernel_by_name(tag.qname).block_pair[0]
        return lambda tag, w, ob: fn(w, ob)
    return None


@overload(decode_block)
def _decode_block(tag, w, ob):
    if isinstance(tag, QTagType) and kernel_by_name(tag.qname).block_pair is not None:
        fn = kernel_by_name(tag.qname).block_pair[1]
        return lambda tag, w, ob: fn(w, ob)
    return None


@overload(block_pair_offset_min)
def _block_pair_offset_min(tag):
    if isinstance(tag, QTagType):
        kern = kernel_by_name(tag.qname)
        off, has_min = kern.block_pair_offset, kern.block_pair_min
        return lambda tag: (off, has_min)
    return None
