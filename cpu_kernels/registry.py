"""The kernel registry, keyed by ``gguf.GGMLQuantizationType``.

Every supported type contributes a *sub-block decoder*: two Numba functions that describe
32 consecutive weights of a row (one sub-block, ggml's word: a 256-weight K-quant
super-block is 8 of them; Q2_K/Q3_K/Q6_K's 16-weight scale groups are their halves) as

    w[j] = d * v[j] + m0   (j < 16)        w[j] = d * v[j] + m1   (16 <= j < 32)

``scales(w, ob) -> (vd, vm)``: two 16-lane vectors for the block at byte offset ``ob`` of
the raw bytes ``w``, lanes ``2k`` and ``2k + 1`` holding (d, m) of the two halves of
sub-block ``k`` (decoded once per block and with vector ops: K-quant scales are packed,
and unpacking them per sub-block in scalar code costs as much as the dot product itself);
``quants(w, ob, k) -> (v0, v1)``: the two 16-lane vectors of sub-block ``k``.
``same_d``: both halves of a sub-block always share d (one multiply per sub-block, not two).
Optional, for the int8-activation path: ``codes(w, ob, j)``, the weights of sub-blocks 2j
and 2j + 1 as 64 unsigned 8-bit codes ``u`` (``pair8.I8x64``, from
``pair8.sub_block_pair_decoder``) with ``w = d * (u - code_offset) + m`` (256-weight types).
Optional for 32-weight types, their int8 path: ``block_pair`` = (decode_block_pair,
decode_block) from ``pair8.block_pair_decoder`` (two blocks per step), with
``block_pair_offset`` (codes minus values) and ``block_pair_min`` (the decoder gives mins).
The generic drivers (``rowdot``, ``matmul``, ``moe``) only ever see that contract, so a
new quant type is one decoder pair and one ``register`` call. Types whose ggml block holds 256
weights (K-quants, IQ4_XS) have 8 sub-blocks per block; 32-weight types have one. Float types
use a 32-element pseudo-block and a scalar tail for rows that are not a multiple of 32.

A ``QTag`` value (one per type) is passed into the compiled drivers: its Numba type names
the quant type, so each driver is specialised per type at compile time.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from numba import types
from numba.extending import NativeValue, models, register_model, typeof_impl, unbox


class UnsupportedQuantType(TypeError):
    """A tensor's quant type has no CPU kernel. The message names the type and tensor."""

    def __init__(self, qtype, name: str = ""):
        tname = getattr(qtype, "name", str(qtype))
        where = f" (tensor {name!r})" if name else ""
        supported = ", ".join(t.name for t in supported_types())
        super().__init__(f"no CPU kernel for quant type {tname}{where}; supported: {supported}")
        self.qtype = qtype
        self.tensor_name = name


@dataclass(frozen=True)
class QuantKernel:
    qtype: GGMLQuantizationType
    block_size: int          # weights per block (as ggml)
    type_size: int           # bytes per block (as ggml)
    sub_blocks_per_block: int  # 32-weight sub-blocks per block
    scales: Callable         # njit (w, block_byte_offset) -> (vd, vm)
    quants: Callable         # njit (w, block_byte_offset, k) -> (v0, v1)
    elem: Callable | None    # njit (w, byte_offset_of_row, col) -> float32; float types only
    same_d: bool             # d of both 16-weight halves of a sub-block is always equal
    codes: Callable | None   # intrinsic (w, block_byte_offset, j) -> 64 u8 codes of sub-blocks 2j, 2j+1
    code_offset: int         # codes = value + code_offset
    tag: "QTag"
    block_pair: tuple | None = None  # (decode_block_pair, decode_block): int8 path of 32-weight types
    block_pair_offset: int = 0       # block-pair codes = value + block_pair_offset
    block_pair_min: bool = False     # the block-pair decoder's mins are not all zero
    # scales' m can be nonzero: the float path then multiplies it by the activations' 16-column
    # sums (``layout.bsums_for`` skips computing them where every m is 0)
    has_min: bool = True

    @property
    def codes_small(self) -> bool:
        """Whether the int8 decoder's codes all stay below 128 (``pair8.I8x64.small``: AVX2
        multiplies them in one ``vpmaddubsw`` pair; the prompt GEMM reads them back from bytes)."""
        dec = self.codes if self.codes is not None else self.block_pair[0] if self.block_pair else None
        return bool(getattr(dec, "codes_small", False))

    @property
    def has_int8(self) -> bool:
        """Whether the type has an int8-activation decoder (codes or block_pair)."""
        return self.codes is not None or self.block_pair is not None


class QTag:
    """Run-time token for one quant type; its Numba type carries the type's name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"QTag({self.name})"


class QTagType(types.Dummy):
    def __init__(self, qname: str):
        self.qname = qname
        super().__init__(name=f"QTag[{qname}]")


@typeof_impl.register(QTag)
def _typeof_qtag(val, c):
    return QTagType(val.name)


register_model(QTagType)(models.OpaqueModel)


@unbox(QTagType)
def _unbox_qtag(typ, obj, c):
    # The tag's information is all in its type; nothing to carry at run time.
    return NativeValue(c.context.get_dummy_value())

_KERNELS: dict[GGMLQuantizationType, QuantKernel] = {}
_BY_NAME: dict[str, QuantKernel] = {}


def register(qtype: GGMLQuantizationType, *, sub_blocks_per_block: int, scales: Callable,
             quants: Callable, same_d: bool, elem: Callable | None = None,
             codes: Callable | None = None, code_offset: int = 0, block_pair: tuple | None = None,
             block_pair_offset: int = 0, block_pair_min: bool = False, has_min: bool = True) -> None:
    """Register the decoders of ``qtype`` (``elem``: scalar loader, float types only;
    ``codes``: int8-path decoder of 256-weight types; ``block_pair``: of 32-weight types;
    ``has_min`` False: ``scales`` always returns m = 0)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if elem is not None:               # float types: a 32-element pseudo-block
        type_size = type_size * 32 // block_size
        block_size = 32
    if block_size != 32 * sub_blocks_per_block:
        raise ValueError(f"{qtype.name}: block of {block_size} is not "
                         f"{sub_blocks_per_block} sub-blocks of 32")
    one = sub_blocks_per_block == 1
    if (codes is not None and one) or (block_pair is not None and not one):
        raise ValueError(f"{qtype.name}: int8 decoders are codes for 256-weight blocks, block_pair for 32")
    k = QuantKernel(qtype, block_size, type_size, sub_blocks_per_block, scales, quants, elem,
                    same_d, codes, code_offset, QTag(qtype.name), block_pair, block_pair_offset,
                    block_pair_min, has_min)
    _KERNELS[qtype] = k
    _BY_NAME[qtype.name] = k


def supported_types() -> tuple[GGMLQuantizationType, ...]:
    """Quant types that have a CPU kernel, in enum order."""
    return tuple(sorted(_KERNELS, key=int))


def get_kernel(qtype, name: str = "") -> QuantKernel:
    """The kernel for ``qtype``; ``UnsupportedQuantType`` (naming ``name``) if none."""
    try:
        qtype = GGMLQuantizationType(qtype)
    except ValueError:
        raise UnsupportedQuantType(qtype, name) from None
    k = _KERNELS.get(qtype)
    if k is None:
        raise UnsupportedQuantType(qtype, name)
    return k


def kernel_by_name(qname: str) -> QuantKernel:
    """Used at Numba typing time, where only the tag's name is known."""
    return _BY_NAME[qname]


def source_digest() -> str:
    """Hash of this package's sources. Numba's on-disk cache only notices edits to the file
    that defines a cached function; the drivers inline decoders from other files, so they
    carry this digest as a closure variable, which Numba does put in its cache key."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]
