"""Numba CPU kernels over raw GGUF quant blocks (numpy + numba only).

    matmul(x, w, qtype, *, name="", int8=None)
                                            x[B, cols] @ W^T from W's raw GGUF data
    moe_ffn(x, ids, weights, experts, *, owned=None, act="silu", int8=None)
                                            routed-expert FFN, tokens grouped by expert
    ExpertWeights(gate, up, down, ...)      one layer's *_exps tensors, used in place
    set_num_threads(n)                      threads the kernels use
    set_int8_activations(on)                llama.cpp-style int8 activations (VNNI / AVX2)
                                            (``int8=`` per call: True/False, "auto" = the types
                                            chosen for this CPU at load, None = this setting)
    supported_types()                       quant types with a kernel
    UnsupportedQuantType                    raised for the others, naming type and tensor

Layers: ``simd``/``simd8`` (explicit vector ops as LLVM IR), one decoder module per quant
family registered by ``GGMLQuantizationType`` (``floats``, ``legacy``, ``kquants``,
``nonlinear``, ``iquants``), ``rowdot``/``rowdot8`` (four rows x tokens), drivers ``matmul`` and ``moe``.
"""
from __future__ import annotations

# Importing the families registers their decoders.
from . import floats, iquants, kquants, legacy, nonlinear  # noqa: F401
from .matmul import grouped_matmul, matmul
from .moe import ExpertWeights, moe_ffn
from .registry import UnsupportedQuantType, supported_types
from .settings import set_int8_activations, set_num_threads

__all__ = ["matmul", "grouped_matmul", "moe_ffn", "ExpertWeights", "set_num_threads", "set_int8_activations",
           "supported_types", "UnsupportedQuantType"]
