""""auto" decode activations follow the int8 / float choice measured on this CPU
(``offload.decode_int8``): measured once per type and expert shape, cached, read back, chosen
at load from one token's reads of the plan's CPU weights.

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


def _matrices(*types) -> dict[tuple, float]:
    """One token's reads of one matrix of each type (``token_reads``' non-expert parts)."""
    return {(t,): 1.0 for t in types}


def test_the_cache_decides_by_the_margin(measured, monkeypatch):
    """int8 where it read more than 5 % faster than float; in the margin, float (exact)."""
    _write(measured, {"Q4_0": (20.0, 25.0), "Q8_0": (20.0, 20.5), "Q4_K": (15.0, 14.0)})
    monkeypatch.setattr(di, "measure", _no_measuring)
    assert di.choose(_matrices(Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.F32, Q.TQ1_0), 2) == frozenset({Q.Q4_0})    # F32: no int8 path; TQ1_0: no kernel


def test_the_models_expert_shapes_decide_by_the_bytes_read(measured, monkeypatch):
    """A type is judged on one token's reads of it, each part at its own measured rate: the
    Zen 4 case (a big Q4_0 matrix 9 % faster with int8, the model's 512 x 256 experts 3 %
    slower) takes float where the experts are most of the bytes, int8 where the big matrices
    are. By hand: 1 byte of matrix + 3 of experts read in 1/17.5 + 3/9.2 = 0.383 s float,
    1/19.1 + 3/8.9 = 0.389 s int8."""
    experts = (Q.Q4_0, 512, 256, 8)
    _write(measured, {"Q4_0": (17.5, 19.1), "experts Q4_0 512x256 k8": (9.2, 8.9)})
    monkeypatch.setattr(di, "measure", _no_measuring)
    monkeypatch.setattr(di, "measure_experts", _no_measuring)
    assert di.choose({(Q.Q4_0,): 1.0, experts: 3.0}, 2) == frozenset()
    assert di.choose({(Q.Q4_0,): 30.0, experts: 1.0}, 2) == frozenset({Q.Q4_0})
    assert di.choose(_matrices(Q.Q4_0), 2) == frozenset({Q.Q4_0})


def test_a_missing_type_is_measured_and_cached(measured):
    """The measurement runs the real kernels (a small weight here) and adds the type to the
    file beside what was there; a corrupt file is measured again."""
    _write(measured, {"Q4_0": (20.0, 25.0)})
    lines = []
    chosen = di.choose(_matrices(Q.Q4_0, Q.Q4_K), 2, log=lines.append, n_bytes=1 << 20)
    doc = yaml.safe_load(measured.read_text())
    assert set(doc) == {"Q4_0", "Q4_K"} and doc["Q4_0"] == {"float_gbps": 20.0, "int8_gbps": 25.0}
    assert doc["Q4_K"]["float_gbps"] > 0 and doc["Q4_K"]["int8_gbps"] > 0
    assert Q.Q4_0 in chosen and (Q.Q4_K in chosen) == (doc["Q4_K"]["int8_gbps"] > di.MARGIN * doc["Q4_K"]["float_gbps"])
    assert len(lines) == 1 and "Q4_K" in lines[0] and "Q4_0" not in lines[0] and str(measured) in lines[0]
    measured.write_text("{not yaml")
    di.choose(_matrices(Q.Q4_K), 2, n_bytes=1 << 20)
    assert set(yaml.safe_load(measured.read_text())) == {"Q4_K"}


def test_a_missing_expert_shape_is_measured_and_cached(measured):
    """An expert shape not in the file runs through the real MoE kernel and is added beside
    the type's matrix rate, with one line naming it."""
    lines = []
    di.choose({(Q.Q4_K, 256, 256, 2): 1.0}, 2, log=lines.append, n_bytes=1 << 20)
    doc = yaml.safe_load(measured.read_text())
    assert set(doc) == {"Q4_K", "experts Q4_K 256x256 k2"}
    assert all(doc[k]["float_gbps"] > 0 and doc[k]["int8_gbps"] > 0 for k in doc)
    assert len(lines) == 2 and "experts Q4_K 256x256 k2" in lines[1]


@pytest.mark.skipif(not has_int8_dot(), reason="no integer dot product: decode is float whatever the choice")
def test_auto_follows_the_choice_for_this_cpu(measured, tmp_path):
    """A Q4_K model (Q4_K is in the built-in list): where the cache says its int8 path is
    slower here, "auto" binds the float path and its logits are "float"'s bit for bit; where
    it says faster, "auto" binds int8."""
    tiny = write_tiny_model(tmp_path / "q4k.gguf", SPECS["Q4_K"])
    with rt.load(tiny.path, cache_type="f32", quiet=True, decode_activations="float") as f:
        flt = torch.inference_mode()(_steps)(f.model)
    shape = _expert_key(tiny.path)
    _write(measured, {"Q4_K": (20.0, 15.0), shape: (20.0, 15.0)})
    with rt.load(tiny.path, cache_type="f32", quiet=True) as s:
        assert _moe_modes(s) and all(m == (False, False) for m in _moe_modes(s))
        auto = torch.inference_mode()(_steps)(s.model)
    for a, b in zip(flt, auto):
        np.testing.assert_array_equal(a, b)
    _write(measured, {"Q4_K": (15.0, 20.0), shape: (15.0, 20.0)})
    with rt.load(tiny.path, cache_type="f32", quiet=True) as s:
        assert all(m == (True, True) for m in _moe_modes(s))
    # the experts' shape outweighs the big matrix's rate: float although Q4_K's matrix says int8
    _write(measured, {"Q4_K": (15.0, 20.0), shape: (20.0, 15.0)})
    with rt.load(tiny.path, cache_type="f32", quiet=True) as s:
        assert all(m == (False, False) for m in _moe_modes(s))


def _expert_key(path) -> str:
    """The cache file's key for a model's routed expert shape."""
    from offload.gguf_model import open_model
    from placement.tensors import Role
    m = open_model(str(path))
    down = next(t for t in m.tensors if t.role == Role.ROUTED_EXPERTS and "down" in t.name)
    return f"experts {down.ggml_type.name} {down.shape[1]}x{down.shape[2]} k{m.spec.n_expert_used}"


def test_read_rates_are_the_chosen_paths_gbps(measured, monkeypatch):
    """The rate a decode token reads a part at is its type's chosen path's: int8 where that
    won by the margin (over all the type's parts), float otherwise (and float everywhere
    without an integer dot product)."""
    _write(measured, {"Q4_0": (14.0, 19.0), "Q8_0": (20.0, 20.5), "experts Q4_0 64x32 k2": (10.0, 11.0)})
    monkeypatch.setattr(di, "measure", _no_measuring)
    monkeypatch.setattr(di, "measure_experts", _no_measuring)
    experts = (Q.Q4_0, 64, 32, 2)
    want = {(Q.Q4_0,): 19.0, experts: 11.0} if has_int8_dot() else {(Q.Q4_0,): 14.0, experts: 10.0}
    assert di.read_rates({**_matrices(Q.Q4_0, Q.Q8_0, Q.F32), experts: 1.0}, 2) == {**want, (Q.Q8_0,): 20.0}


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
