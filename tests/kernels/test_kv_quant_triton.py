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
        want = attend_tiles(q, keys, values, **kw)
        for splits in (None, 1, 3):          # the cache in one span, the device's default, three spans
            got = tka.attend_quantized(q, keys, values, splits=splits, **kw)
            assert (got - want).abs().max() < 1e-5 * want.abs().max(), (kw.keys(), splits)


def test_attention_routes_decode_batches_to_the_kernel(monkeypatch):
    """gpu.attention.attend takes the kernel for separate K and V caches of fused types with
    power-of-two widths and decode-sized batches, on a device listed in FUSED_DEVICE_TYPES; the
    torch tiles otherwise. The routed result equals the tiles' (tolerance as above)."""
    from gpu import attention, fused
    monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", (DEV.type,))
    assert fused.use_fused_attention(Q.Q8_0, Q.Q4_0, (64, 64), 16, DEV)
    assert not fused.use_fused_attention(Q.Q8_0, Q.Q4_0, (64, 64), fused.FUSED_ATTENTION_ROWS + 1, DEV)
    assert not fused.use_fused_attention(Q.Q8_0, Q.Q4_0, (64, 96), 16, DEV)      # not a power of two
    assert not fused.use_fused_attention(Q.Q8_0, Q.Q2_K, (64, 64), 16, DEV)      # no fused decoder
    assert not fused.use_fused_attention(Q.Q8_0, Q.Q8_0, (64, 64), 16, torch.device("meta"))
    monkeypatch.setattr(fused, "CROSSOVER", 0)                                  # OFFLOAD_FUSED_MAX_B=0
    assert not fused.use_fused_attention(Q.Q8_0, Q.Q8_0, (64, 64), 16, DEV)
    monkeypatch.undo()
    monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", (DEV.type,))
    monkeypatch.setattr(attention, "CPU_QUANTIZED_ATTEND", None)    # on the CPU the compiled read comes first
    g = torch.Generator().manual_seed(4)
    cache = KVCache(2, 64, device=DEV, dtype=Q.Q8_0, dtype_v=Q.Q5_1)
    keys, values = cache.append(torch.randn(2, 40, 64, generator=g).to(DEV), torch.randn(2, 40, 64, generator=g).to(DEV))
    q = torch.randn(2, 4, 64, generator=g).to(DEV)
    calls = []
    monkeypatch.setattr(fused, "attend", lambda *a, **kw: calls.append(1) or tka.attend_quantized(*a, **kw))
    got = attention.attend(q, keys, values)
    want = attend_tiles(q, keys, values)
    assert calls and (got - want).abs().max() < 1e-5 * want.abs().max()
