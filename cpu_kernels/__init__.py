"""Numba CPU kernels over raw GGUF quant blocks: mat-vec / small mat-mat per quant type
and the fused expert FFN for a token batch grouped by expert. numpy + numba only."""
from __future__ import annotations

# Importing the families registers their decoders.
from . import floats, kquants, legacy, nonlinear  # noqa: F401
from .matmul import matmul
from .moe import ExpertWeights, moe_ffn
from .registry import UnsupportedQuantType, supported_types
from .settings import set_int8_activations, set_num_threads

__all__ = ["matmul", "moe_ffn", "ExpertWeights", "set_num_threads", "set_int8_activations",
           "supported_types", "UnsupportedQuantType"]
