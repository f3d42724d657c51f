"""Layer 1 for the torch side: every torch dequantizer in gpu.quant against
``gguf.quants.dequantize`` on random blocks, exact; and the chunked ``QuantTensor.linear``
against a float64 product."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize

import gpu.quant as gq
from tests.tiny_models import random_blocks


@pytest.mark.parametrize("qtype", sorted(gq.DEQUANTIZERS, key=lambda q: q.name), ids=lambda q: q.name)
def test_dequantizer_matches_gguf(qtype):
    rng = np.random.default_rng(int(qtype))
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype == Q.BF16:
        raw = (rng.standard_normal(7 * 64).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        raw = raw.view(np.uint8).reshape(7, 128)
    else:
        raw = random_blocks(rng, 7 * 3, qtype, 0.1).reshape(7, 3 * size)   # 7 rows of 3 blocks
    want = dequantize(raw, qtype)
    got = gq.dequantize(torch.from_numpy(raw), qtype).numpy()
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.F32])
def test_quant_tensor_linear_in_chunks(qtype, monkeypatch):
    monkeypatch.setattr(gq, "CHUNK_VALUES", 3 * 256)      # force several row chunks
    rng = np.random.default_rng(1)
    rows, cols = 10, 256
    if qtype == Q.F32:
        raw = rng.standard_normal((rows, cols)).astype(np.float32)
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = random_blocks(rng, rows * cols // block, qtype, 0.1).reshape(rows, cols // block * size)
    w = dequantize(raw, qtype).astype(np.float64)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    t = gq.QuantTensor.upload(raw, qtype, (rows, cols), torch.device("cpu"))
    assert t.nbytes == raw.nbytes                           # the file's bytes, unchanged
    got = t.linear(torch.from_numpy(x), torch.float32).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
