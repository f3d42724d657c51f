"""The fused dequant-matmul inside a whole model: a tiny model with quantized dense weights,
experts in RAM (CPU kernels) and everything else on a GPU device, gives the all-CPU logits.

``virtual``: the GPU device is torch's CPU device and the fused kernel is forced onto it
(``FUSED_DEVICE_TYPES``), run by Triton's interpreter — what this project's CI can check.
``cuda``: a real CUDA device (skipped without CUDA), f32 and the default bf16.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import gpu.fused as fused
import offload.runtime as rt
from gpu.qtypes import TILE_B
from tests.tiny_models import TinySpec, write_tiny_model

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"      # see tests/kernels/test_triton_kernels.py
pytest.importorskip("triton", reason="triton is not installed (pip install .[test])")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
IDS = [3, 17, 257, 101, 46, 290, 5, 77, 200, 12]     # a 10-token prompt: a fused (≤ 16) batch
# f32: quantized dot products (CPU kernels) vs float32 products over the same weights differ
# by summation order only (~1e-6 of the logit scale).
F32_TOL = 1e-4
# bf16 rounds activations and weights to 8 significant bits; a near-tie in a router's top-k
# can flip an expert, so even today's per-call-dequant path is off by ~1e-1 at a few logits
# (measured 0.11 on the Q6_K model). The fused kernel must be no worse than that path.
BF16_SLACK = 2.0


# Q6_K dense weights are the full tier: one more type through the whole model (its own compiled
# CPU blocks for the reference, ~20 s of a cold suite); the fused kernel's Q6_K branch is
# checked alone in test_triton_kernels, like every fused type
@pytest.fixture(scope="module", params=[Q.Q8_0, pytest.param(Q.Q6_K, marks=pytest.mark.full)],
                ids=lambda q: q.name)
def tiny(request, tmp_path_factory):
    # K-quant rows are multiples of 256 elements: n_ff and n_head·head_dim 256
    spec = TinySpec(dense_type=request.param, n_ff=256, n_head=8, seed=5)
    return write_tiny_model(tmp_path_factory.mktemp("fused") / "tiny.gguf", spec)


def _gpu_logits(tiny, monkeypatch, *, virtual: bool, gpu_dtype: str, use_fused: bool = True):
    """Logits with experts in RAM and the rest on CUDA0 (virtual: torch's CPU device, the
    fused kernel interpreted); ``use_fused`` False: today's per-call dequant path."""
    calls = []
    real = fused.linear
    monkeypatch.setattr(fused, "linear", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(fused, "CROSSOVER", TILE_B if use_fused else 0)
    if virtual:
        monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", ("cpu",))
    with rt.load(tiny.path, devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True, virtual_gpus=virtual,
                 gpu_dtype=gpu_dtype, cache_type="f32", quiet=True) as s:
        got = s.logits(IDS)
    assert bool(calls) == use_fused, "fused kernel calls: %d" % len(calls)
    return got


def _cpu_logits(tiny):
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as s:
        return s.logits(IDS)


def _check(tiny, monkeypatch, virtual: bool, gpu_dtype: str):
    want = _cpu_logits(tiny)
    err = np.abs(_gpu_logits(tiny, monkeypatch, virtual=virtual, gpu_dtype=gpu_dtype) - want).max()
    scale = np.abs(want).max()
    if gpu_dtype == "f32":
        assert err < F32_TOL * scale
    else:
        today = np.abs(_gpu_logits(tiny, monkeypatch, virtual=virtual, gpu_dtype=gpu_dtype,
                                   use_fused=False) - want).max()
        assert err <= BF16_SLACK * today + 1e-3 * scale, (err, today)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernels are compiled, not interpreted: "
                    "the cuda cases run instead")
@pytest.mark.parametrize("gpu_dtype", ["f32", "bf16"])
def test_virtual_gpu_fused_matches_cpu(tiny, monkeypatch, gpu_dtype):
    _check(tiny, monkeypatch, True, gpu_dtype)


@requires_cuda
@pytest.mark.parametrize("gpu_dtype", ["f32", "bf16"])
def test_cuda_fused_matches_cpu(tiny, monkeypatch, gpu_dtype):
    _check(tiny, monkeypatch, False, gpu_dtype)
