"""Issue 13 end to end: a tiny glm4moe whose routed experts are IQ2_XXS (random valid
blocks) runs with its experts on the CPU (the IQ2_XXS kernels, raw blocks in place) and
equals the same model with those experts written as their dequantized F32 values (the F32
kernels): through ``rt.load`` logits and through ``offload run``'s text.

Tolerance: both files hold bit-identical weight values, so the code paths differ only by
float32 summation order (~1e-6 of the logit scale); REL_TOL = 1e-4 as in the placement
tests. Perturbing those experts by 1% moves the logits by ~1e-2 of their scale (checked
when this test was written), so the bound does see the experts."""
from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import offload.runtime as rt
from tests.tiny_models import TinySpec, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
IDS = [3, 17, 257, 101, 46, 290, 5, 77, 200, 12]
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("iq2_xxs")
    spec = TinySpec(expert_type=Q.IQ2_XXS, seed=13)
    return (write_tiny_model(d / "iq2_xxs.gguf", spec),
            write_tiny_model(d / "f32.gguf", replace(spec, experts_as_f32=True)))


def _logits(path):
    # float activations on both sides: IQ2_XXS experts decode with int8 activations by
    # default (placement.limits.DECODE_INT8_TYPES), F32 ones cannot; this compares decoders
    with rt.load(path, devices="CPU=16GiB", cache_type="f32", quiet=True, decode_activations="float") as s:
        assert set(s.plan.tensors.values()) == {"CPU"}
        return s.logits(IDS)


def test_iq2_xxs_experts_equal_their_f32_values(pair):
    iq, f32 = pair
    assert all(np.array_equal(iq.weights[n], f32.weights[n]) for n in iq.weights)
    a, b = _logits(iq.path), _logits(f32.path)
    rel = np.abs(a - b).max() / np.abs(b).max()
    print(f"IQ2_XXS experts vs their F32 values: max |dlogit| / max |logit| = {rel:.2e}")
    assert rel < REL_TOL


def test_offload_run_gives_the_same_text(pair):
    # the f32 cache and float activations of _logits: the process loads the kernels that test
    # compiled instead of compiling the f16-cache variants (~10 s on two cores)
    out = []
    for m in pair:
        p = subprocess.run([sys.executable, "-m", "offload", "run", str(m.path), "-p", "def the", "-n", "12",
                            "--ignore-eos", "--decode-activations", "float", "--cache-type", "f32", "--temp", "0"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        out.append(p.stdout)
    assert out[0] == out[1] and out[0].strip()
