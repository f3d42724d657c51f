""""auto" decode activations follow the int8 / float choice measured on this CPU
(``offload.decode_int8``): measured once per type, cached, read back, chosen at load.

The suite pins the built-in list (tests/conftest.py: ``OFFLOAD_DECODE_INT8=prior``); these
tests lift the pin and point the cache at a temp folder. The choice rule is held with cache
files of stated GB/s (what a measurement on another CPU would have written), the
measurement itself on a small real weight.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from gguf import GGMLQuantizationType as Q

import offload.runtime as rt
from cpu_kernels import settings
from cpu_kernels.simd8 import has_int8_dot
from offload import decode_int8 as di
from tests.kernels.test_decode_activations import SPECS, _moe_modes, _steps
from tests.tiny_models import write_tiny_model


@pytest.fixture
def measured(tmp_path, monkeypatch):
    """The measured choice on (the pin lifted), its cache in a temp folder, the process's
    chosen set reset afterwards."""
    monkeypatch.setenv("OFFLOAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(di.PRIOR_ENV, raising=False)
    yield di.cache_file(settings.apply_threads())
    settings.set_decode_int8_types(None)


def _write(path, rates: dict[str, tuple[float, float]]):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({t: {"float_gbps": f, "int8_gbps": i} for t, (f, i) in rates.items()}))


def _no_measuring(*a, **k):
    raise AssertionError("measured although the cache has the type")


def test_the_cache_decides_by_the_margin(measured, monkeypatch):
    """int8 where it read more than 5 % faster than float; in the margin, float (exact)."""
    _write(measured, {"Q4_0": (20.0, 25.0), "Q8_0": (20.0, 20.5), "Q4_K": (15.0, 14.0)})
    monkeypatch.setattr(di, "measure", _no_measuring)
    assert di.choose([Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.F32, Q.TQ1_0], 2) == frozenset({Q.Q4_0})    # F32: no int8 path; TQ1_0: no kernel


def test_a_missing_type_is_measured_and_cached(measured):
    """The measurement runs the real kernels (a small weight here) and adds the type to the
    file beside what was there; a corrupt file is measured again."""
    _write(measured, {"Q4_0": (20.0, 25.0)})
    lines = []
    chosen = di.choose([Q.Q4_0, Q.Q4_K], 2, log=lines.append, n_bytes=1 << 20)
    doc = yaml.safe_load(measured.read_text())
    assert set(doc) == {"Q4_0", "Q4_K"} and doc["Q4_0"] == {"float_gbps": 20.0, "int8_gbps": 25.0}
    assert doc["Q4_K"]["float_gbps"] > 0 and doc["Q4_K"]["int8_gbps"] > 0
    assert Q.Q4_0 in chosen and (Q.Q4_K in chosen) == (doc["Q4_K"]["int8_gbps"] > di.MARGIN * doc["Q4_K"]["float_gbps"])
    assert len(lines) == 1 and "Q4_K" in lines[0] and "Q4_0" not in lines[0] and str(measured) in lines[0]
    measured.write_text("{not yaml")
    di.choose([Q.Q4_K], 2, n_bytes=1 << 20)
    assert set(yaml.safe_load(measured.read_text())) == {"Q4_K"}


@pytest.mark.skipif(not has_int8_dot(), reason="no integer dot product: decode is float whatever the choice")
def test_auto_follows_the_choice_for_this_cpu(measured, tmp_path):
    """A Q4_K model (Q4_K is in the built-in list): where the cache says its int8 path is
    slower here, "auto" binds the float path and its logits are "float"'s bit for bit; where
    it says faster, "auto" binds int8."""
    tiny = write_tiny_model(tmp_path / "q4k.gguf", SPECS["Q4_K"])
    with rt.load(tiny.path, cache_type="f32", quiet=True, decode_activations="float") as f:
        flt = torch.inference_mode()(_steps)(f.model)
    _write(measured, {"Q4_K": (20.0, 15.0)})
    with rt.load(tiny.path, cache_type="f32", quiet=True) as s:
        assert _moe_modes(s) and all(m == (False, False) for m in _moe_modes(s))
        auto = torch.inference_mode()(_steps)(s.model)
    for a, b in zip(flt, auto):
        np.testing.assert_array_equal(a, b)
    _write(measured, {"Q4_K": (15.0, 20.0)})
    with rt.load(tiny.path, cache_type="f32", quiet=True) as s:
        assert all(m == (True, True) for m in _moe_modes(s))


def test_path_rates_are_the_chosen_paths_gbps(measured, monkeypatch):
    """The rate a decode token reads a type at is its chosen path's: int8 where that won by the
    margin, float otherwise (and float everywhere without an integer dot product)."""
    _write(measured, {"Q4_0": (14.0, 19.0), "Q8_0": (20.0, 20.5)})
    monkeypatch.setattr(di, "measure", _no_measuring)
    want = {Q.Q4_0: 19.0 if has_int8_dot() else 14.0, Q.Q8_0: 20.0}
    assert di.path_rates([Q.Q4_0, Q.Q8_0, Q.F32], 2) == want


def test_a_plans_cpu_weights_read_at_their_types_rates(measured, monkeypatch, tmp_path):
    """``probe.weights_read_gbps``: one token's bytes of each part over its rate, against a hand
    count on a tiny Q4_K-expert, F32-dense model: the routed experts (k/E of their tensors) at
    the rate of their shape, the other matrices (all their bytes) at their type's (F32 has no
    int8 decoder: the fallback), the embedding and the NextN block not at all; each on the
    path the type decodes with here. A plan with no weight on the CPU has none."""
    from offload.gguf_model import open_model
    from offload.probe import weights_read_gbps
    from placement.devices import CPU
    from placement.tensors import Role
    monkeypatch.setattr(di, "measure", _no_measuring)
    monkeypatch.setattr(di, "measure_experts", _no_measuring)
    model = open_model(str(write_tiny_model(tmp_path / "q4k.gguf", SPECS["Q4_K"]).path))
    k = model.spec.n_expert_used
    routed = [t for t in model.tensors if t.role == Role.ROUTED_EXPERTS and not t.nextn]
    down = next(t for t in routed if "down" in t.name)
    _write(measured, {"Q4_K": (10.0, 16.0), f"experts Q4_K {down.shape[1]}x{down.shape[2]} k{k}": (7.0, 12.0)})
    shaped = 12.0 if has_int8_dot() else 7.0
    experts = sum(t.n_bytes * k / t.n_experts for t in routed)
    other = sum(t.n_bytes for t in model.tensors if t.role not in (Role.ROUTED_EXPERTS, Role.EMBEDDING)
                and not t.nextn and len(t.shape) >= 2)
    assert {t.ggml_type for t in routed} == {Q.Q4_K} and experts and other
    placed = {t.name: CPU for t in model.tensors}
    got = weights_read_gbps(model.tensors, placed, k, 30.0)
    assert got == pytest.approx((experts + other) / (experts / shaped + other / 30.0), rel=1e-12)
    assert weights_read_gbps(model.tensors, {}, k, 30.0) is None


def test_expert_reads_are_measured_through_the_moe_kernel():
    """``measure_experts`` runs one token through k real experts of the shape (a 1 MiB set
    here): both paths give a finite, positive rate."""
    f, i = di.measure_experts(Q.Q4_K, 256, 256, 2, n_bytes=1 << 20, repeat=2)
    assert 0 < f < float("inf") and 0 < i < float("inf")
