"""When a GPU-resident projection uses the fused dequant-matmul (``gpu.triton_matmul``)
instead of per-call chunked dequantization + a dense matmul.

Decode shapes read each weight once through the fused kernel; prefill-size batches, where a
dense matmul wins, keep the chunked path (``gpu.quant.QuantTensor.linear``). This module never
imports triton: ``import offload`` and ``offload plan`` must not pay for it (or need it).

The crossover batch (``CROSSOVER``, env ``OFFLOAD_FUSED_MAX_B``) is an estimate from the bytes
each path moves: for B ≤ 16 (one tile of the kernel) the fused kernel reads the raw blocks
once (0.56 B/param for Q4_K) while the chunked path reads them, writes bf16 (2 B/param) and
reads it back (2 B/param) before the same GEMM, so the fused kernel moves ~8× fewer bytes at
every B it supports. Above 16 rows it would re-run the dequantization per 16-row tile, so
the default crossover is the tile height. Set the env variable to 0 to switch fused kernels
off.
"""
from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch
from gguf import GGMLQuantizationType as Q

from gpu.errors import GpuSettingError
from gpu.qtypes import FUSED_TYPES, TILE_B

FUSED_DEVICE_TYPES = ("cuda",)  # the CPU / virtual-GPU path keeps the chunked dequant


def _crossover_from_env() -> int:
    text = os.environ.get("OFFLOAD_FUSED_MAX_B", str(TILE_B))
    if not text.isdigit() or int(text) > TILE_B:
        raise GpuSettingError(f"OFFLOAD_FUSED_MAX_B={text!r}: expected an integer 0..{TILE_B}")
    return int(text)


CROSSOVER = _crossover_from_env()   # largest batch that takes the fused kernel


@lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_fused(qtype: Q, device: torch.device, batch: int) -> bool:
    """The fused kernel for ``batch`` rows of x against a ``qtype`` weight on ``device``?"""
    return (device.type in FUSED_DEVICE_TYPES and qtype in FUSED_TYPES
            and 0 < batch <= CROSSOVER and triton_available())


FUSED_ATTENTION_ROWS = 64   # query rows (heads per KV head x tokens) one attention program holds


def use_fused_attention(k_type: Q, v_type: Q, widths: tuple[int, int], rows: int, device: torch.device) -> bool:
    """The Triton attention over a quantized cache (``gpu.triton_kv_attention``) for K and V
    caches of these types and row widths, ``rows`` query rows per KV head? Fused types,
    power-of-two widths, decode-sized batches (a prefill's rows would not fit one program's
    registers)."""
    return (device.type in FUSED_DEVICE_TYPES and CROSSOVER > 0 and triton_available()
            and k_type in FUSED_TYPES and v_type in FUSED_TYPES and rows <= FUSED_ATTENTION_ROWS
            and all(w >= 32 and not w & (w - 1) for w in widths))


def attend(q: torch.Tensor, keys, values, **kw) -> torch.Tensor:
    """``gpu.triton_kv_attention.attend_quantized``; imports triton on first use."""
    from gpu.triton_kv_attention import attend_quantized
    return attend_quantized(q, keys, values, **kw)


def linear(raw: torch.Tensor, qtype: Q, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` through the fused kernel: raw (rows, row_bytes) uint8, x (B, cols) →
    (B, rows) in x's dtype. Imports triton on first use."""
    from gpu.triton_matmul import fused_linear
    return fused_linear(raw, qtype, x)
