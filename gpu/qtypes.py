"""Quant-type facts the torch dequantizers (``gpu.quant``), the fused-kernel choice
(``gpu.fused``) and the Triton kernel (``gpu.triton_matmul``) share. A leaf: gguf only, no
torch, no triton, so every one of them imports it and none imports another for a table.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

# 16-entry value tables indexed by a 4-bit code, as gguf-py's (= ggml's) kvalues:
# kvalues_iq4nl (IQ4_NL, IQ4_XS) and kvalues_mxfp4 (e2m1 values doubled, 0.5 -> 1; the
# block scale is halved to match: ggml_e8m0_to_fp32_half).
IQ4_NL_VALUES: tuple[int, ...] = tuple(gguf_quants.IQ4_NL.kvalues)
MXFP4_VALUES: tuple[int, ...] = tuple(gguf_quants.MXFP4.kvalues)
VALUE_TABLES: dict[Q, tuple[int, ...]] = {Q.IQ4_NL: IQ4_NL_VALUES, Q.IQ4_XS: IQ4_NL_VALUES,
                                          Q.MXFP4: MXFP4_VALUES}

# The fused kernel's decode branches (``gpu.triton_matmul._dequant``), type -> the
# compile-time id the kernel switches on (gguf's own type code). A type has a fused kernel
# exactly when it has a branch here; the kernel takes its branch constants from this table.
FUSED_KERNEL_IDS: dict[Q, int] = {q: int(q) for q in (
    Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4, Q.IQ4_XS, Q.Q4_K, Q.Q5_K, Q.Q6_K)}
FUSED_TYPES = frozenset(FUSED_KERNEL_IDS)

TILE_B = 16   # rows of x per fused-kernel tile (tl.dot needs ≥ 16)
