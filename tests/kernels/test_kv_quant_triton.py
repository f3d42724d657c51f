"""The Triton attention over a quantized KV cache (gpu.triton_kv_attention) against the torch
tiles (gpu.attention.attend_tiles) over the same bytes: every quantized cache type (K and V
of different types too), a partial last tile, several queries (causal), a sliding window and sinks.

Without CUDA the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before the
module is imported, as tests/kernels/test_triton_kernels.py does). Tolerance: both dequantize
the same blocks to the same float32 values and differ only in summation order and the online
rescaling (observed ~1e-7 of the largest output); 1e-5.
"""
from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from gpu.attention import attend_tiles
from gpu.kv_cache import KVCache

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"      # read at decoration and again at launch: left set
tka = pytest.importorskip("gpu.triton_kv_attention", reason="triton is not installed (pip install .[test])")

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("k_type,v_type", [(Q.Q8_0, Q.Q8_0), (Q.Q8_0, Q.Q4_0), (Q.Q4_1, Q.IQ4_NL), (Q.Q5_0, Q.Q5_1)],
                         ids=lambda t: t.name)
def test_triton_attention_matches_the_torch_tiles(k_type, v_type):
    g = torch.Generator().manual_seed(9)
    cache = KVCache(2, 64, device=DEV, dtype=k_type, dtype_v=v_type)
    cache.append(torch.randn(2, 67, 64, generator=g).to(DEV), torch.randn(2, 67, 64, generator=g).to(DEV))
    keys, values = cache.append(torch.randn(2, 3, 64, generator=g).to(DEV), torch.randn(2, 3, 64, generator=g).to(DEV))
    q = torch.randn(3, 4, 64, generator=g).to(DEV)
    sinks = torch.randn(4, generator=g).to(DEV)
    for kw in ({}, {"window": 20, "sinks": sinks}):
        got = tka.attend_quantized(q, keys, values, **kw)
        want = attend_tiles(q, keys, values, **kw)
        assert (got - want).abs().max() < 1e-5 * want.abs().max()
