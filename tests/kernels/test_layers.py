"""-ngl / -ts layer layout, checked against llama.cpp's float32 arithmetic."""
from __future__ import annotations

import random

import pytest
from gguf import GGMLQuantizationType

from placement.errors import PlacementError
from placement.layers import LayerLayout
from placement.tensors import Role, TensorInfo
from tests.llama_cpp_ref import slot_device as llama_cpp_slot_device


def _t(name, layer, role=Role.ATTENTION):
    return TensorInfo(name, (1,), GGMLQuantizationType.F32, 4, layer, role)


def test_ngl_counts_the_output_layer():
    n_layer = 10
    for ngl, on_gpu in ((0, []), (1, ["out"]), (2, [9, "out"]), (11, list(range(10)) + ["out"]), (99, list(range(10)) + ["out"])):
        lay = LayerLayout(n_layer, ("CUDA0",), min(ngl, n_layer + 1), (1.0,))
        got = [il for il in range(n_layer) if lay.slot_device(il) == "CUDA0"]
        got += ["out"] if lay.device_of(_t("output.weight", None, Role.OUTPUT)) == "CUDA0" else []
        assert got == on_gpu, ngl
        assert lay.device_of(_t("output_norm.weight", None, Role.NORM)) == lay.slot_device(n_layer)
        assert lay.device_of(_t("token_embd.weight", None, Role.EMBEDDING)) == "CPU"   # input layer


def test_split_matches_llama_cpp_float32():
    rng = random.Random(0)
    for _ in range(300):
        n_layer = rng.randint(1, 95)
        n_gpu = rng.randint(1, 4)
        gpus = tuple(f"CUDA{i}" for i in range(n_gpu))
        ngl = rng.randint(0, n_layer + 1)
        if rng.random() < 0.5:     # whole slot counts summing to the GPU slots: what the planner emits
            cuts = sorted(rng.randint(0, ngl) for _ in range(n_gpu - 1))
            split = [b - a for a, b in zip([0] + cuts, cuts + [ngl])] if ngl else [1] * n_gpu
        else:                      # arbitrary user weights
            split = [rng.choice([0, 1, 2, 3, 24, 12, 48]) for _ in range(n_gpu)]
        if sum(split) == 0:
            split[0] = 1
        lay = LayerLayout(n_layer, gpus, ngl, tuple(float(x) for x in split))
        for slot in range(n_layer + 1):
            assert lay.slot_device(slot) == llama_cpp_slot_device(slot, n_layer, ngl, split, gpus), (n_layer, ngl, split, slot)


def test_layout_rejects():
    with pytest.raises(PlacementError, match="-ts has 1 values but there are 2 GPUs"):
        LayerLayout(4, ("CUDA0", "CUDA1"), 5, (1.0,))
    with pytest.raises(PlacementError, match="must not all be zero"):
        LayerLayout(4, ("CUDA0",), 5, (0.0,))
