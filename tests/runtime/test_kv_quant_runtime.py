"""Quantized KV caches through the planner and the runtime: every type the planner accepts
runs, each device holds the plan's cache bytes, K and V may differ (-ctk / -ctv), and what
a cache cannot take is refused by the planner in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import offload.runtime as rt
from gguf import GGMLQuantizationType as Q
from offload.compiled_block import ENV
from placement.errors import PlacementError
from placement.llama_args import llama_cpp_args
from placement.memory import CACHE_TYPES, FLOAT_CACHE_TYPES
from placement.plan_file import load_plan_file, plan_to_yaml
from tests.tiny_models import TinySpec, write_tiny_model

GPUS = "CUDA0=8GiB,CUDA1=8GiB,CPU=16GiB"
QUANTIZED = [n for n, t in CACHE_TYPES.items() if t not in FLOAT_CACHE_TYPES]
CTX = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kvq") / "glm.gguf", TinySpec(arch="glm4moe", nextn=True, n_rot=16))


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):
    """deepseek2 with a latent row of 64 + 32 = 96 values (three blocks of 32)."""
    return write_tiny_model(tmp_path_factory.mktemp("kvq") / "ds2.gguf",
                            TinySpec(arch="deepseek2", n_layer=3, n_rot=32))


def kv_after_full_context(path, monkeypatch, **options):
    """(allocated, planned) KV bytes per device after a full context on two virtual GPUs and
    the CPU (reference blocks: the torch path on every device, no Numba specialisation per type)."""
    monkeypatch.setenv(ENV, "reference")
    with rt.load(path, devices=GPUS, tensor_split="1,1", n_gpu_layers=4, virtual_gpus=True, ctx=CTX,
                 quiet=True, **options) as s, torch.inference_mode():
        state = s.model.new_state()
        ids = torch.tensor(np.random.default_rng(3).integers(1, 290, CTX))
        logits, hidden = s.model.forward(ids, state, logits="last")
        if s.model.nextn is not None:
            s.model.nextn(ids[1:], hidden[:-1], ids[1:].clone(), state.nextn_cache, logits="none")
        assert torch.isfinite(logits).all()
        return s.memory(state)["kv"], {t.name: t.kv_bytes for t in s.plan.totals if t.kv_bytes}, state.caches[0]


@pytest.mark.parametrize("options", [dict(cache_type=n) for n in QUANTIZED]
                         + [dict(cache_type_k="q8_0", cache_type_v="q4_0"), dict(cache_type_k="q4_1")],
                         ids=QUANTIZED + ["k-q8_0-v-q4_0", "k-q4_1-v-f16"])
def test_runtime_cache_bytes_are_the_plan_per_device(tiny, monkeypatch, options):
    allocated, planned, cache = kv_after_full_context(tiny.path, monkeypatch, **options)
    assert len(planned) == 3 and allocated == planned
    assert cache.k.dtype == torch.uint8 and isinstance(cache.k_type, Q)


def test_mla_latent_cache_quantized(tiny_mla, monkeypatch):
    allocated, planned, cache = kv_after_full_context(tiny_mla.path, monkeypatch, cache_type="q8_0")
    assert allocated == planned and cache.k_type == Q.Q8_0 and cache.v is None and cache.k.shape[2] == 96 // 32 * 34


def test_planner_refuses_what_a_cache_cannot_take(tmp_path, tiny_mla):
    """One line each, from the planner: a head row that is not whole blocks, -ctv on a K-only
    cache (deepseek4's K = V caches too, as llama.cpp requires)."""
    odd = write_tiny_model(tmp_path / "ds2-80.gguf", TinySpec(arch="deepseek2", n_layer=3))   # latent 64 + 16
    cases = [
        (dict(path=odd.path, cache_type="q8_0"), "--cache-type q8_0 needs KV rows of a multiple of 32 values; "
                                                 "this model's K (head_dim_k) rows have 80"),
        (dict(path=tiny_mla.path, cache_type_k="q8_0", cache_type_v="q4_0"), "-ctv q4_0 differs from -ctk q8_0"),
    ]
    dsv4 = write_tiny_model(tmp_path / "dsv4.gguf", TinySpec(arch="deepseek4", head_dim=64, n_layer=4,
                                                             compress_ratios=(0, 4, 128, 4)))
    cases.append((dict(path=dsv4.path, cache_type_k="q8_0", cache_type_v="f16"), "-ctv f16 differs from -ctk q8_0"))
    for kw, words in cases:
        path = kw.pop("path")
        with pytest.raises(PlacementError, match=words.replace("(", r"\(").replace(")", r"\)")) as e:
            with rt.load(path, devices="CPU=16GiB", ctx=256, quiet=True, **kw):
                pass
        assert "\n" not in str(e.value)


def test_plan_file_and_llama_flags_carry_k_and_v_types(tiny):
    plan = rt.plan_for(rt.open_model(tiny.path), devices="CPU=16GiB", ctx=512, cache_type_k="q8_0", cache_type_v="q4_0")
    loaded = load_plan_file(plan_to_yaml(plan), "plan.yaml")
    assert loaded.settings == plan.settings and loaded.settings.v_type == "q4_0"
    args = llama_cpp_args(plan)
    assert args[args.index("-ctk") + 1] == "q8_0" and args[args.index("-ctv") + 1] == "q4_0" and "-fa" in args


def test_gpt_oss_window_caches_quantized(tmp_path, monkeypatch):
    """Sliding-window caches (shifted as they fill) and sinks over quantized cells: the plan's
    bytes, and logits near the f32 cache's. This random model amplifies cache rounding (its f16
    cache is 5.6e-3 off the f32 one, bf16 1.0e-1); q8_0's half step, 1/254 of a block's largest
    value, lies between f16's and bf16's relative rounding, so its bound does too: 3e-2 of the
    largest logit (observed 9.1e-3; a misplaced window row shows at 1e-1 or more)."""
    oss = write_tiny_model(tmp_path / "oss.gguf", TinySpec(arch="gpt-oss", n_layer=6, window=8, seed=35))
    allocated, planned, cache = kv_after_full_context(oss.path, monkeypatch, cache_type="q8_0")
    assert allocated == planned and cache.k.dtype == torch.uint8
    ids = torch.tensor(np.random.default_rng(4).integers(1, 290, 40))
    logits = {}
    for t in ("f32", "q8_0"):
        with rt.load(oss.path, devices="CPU=16GiB", ctx=256, cache_type=t, quiet=True) as s, torch.inference_mode():
            state = s.model.new_state()
            s.model.forward(ids[:30], state, logits="none")
            logits[t] = torch.cat([s.model.forward(ids[i:i + 1], state, logits="last")[0] for i in range(30, 40)])
    err = (logits["q8_0"] - logits["f32"]).abs().max() / logits["f32"].abs().max()
    print(f"gpt-oss q8_0 vs f32: {err:.2e}")
    assert err < 3e-2


DSV4 = TinySpec(arch="deepseek4", head_dim=64, n_layer=4, compress_ratios=(0, 4, 128, 4))


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_deepseek4_caches_quantized(tmp_path, monkeypatch, cache_type):
    """deepseek4's window ring, compressed entries and indexer keys in a quantized type (the
    compressors' state stays float32): each device holds the plan's bytes on virtual GPUs; a
    verify batch rolled back across the HCA boundary (position 128) leaves the caches as plain
    decoding would, bit for bit (each entry is quantized once, from the same rows); and the
    q8_0 logits stay near the f32 cache's: 3e-2 of the largest logit, as gpt-oss's (observed
    8.3e-3; a misplaced row or entry shows at 1e-1 or more). q4_0's distance is printed, not
    bounded: on this random model a 16-level step moves the indexer's top-k choices, which
    moves logits by a lot (4.2e-1 observed), as it does between any two 4-bit caches."""
    dsv4 = write_tiny_model(tmp_path / "dsv4.gguf", DSV4)
    allocated, planned, cache = kv_after_full_context(dsv4.path, monkeypatch, cache_type=cache_type)
    assert allocated == planned and cache.window.k.dtype == torch.uint8
    ids = torch.tensor(np.random.default_rng(5).integers(1, 290, 140))
    logits = {}
    for t in ("f32", cache_type):
        with rt.load(dsv4.path, devices="CPU=16GiB", ctx=256, cache_type=t, quiet=True) as s, torch.inference_mode():
            plain, rolled = s.model.new_state(), s.model.new_state()
            s.model.forward(ids[:126], plain, logits="none")
            s.model.forward(ids[:126], rolled, logits="none")
            s.model.forward(ids[126:131], rolled, logits="none")      # a verify batch over position 128 ...
            rolled.truncate(126)                                       # ... rejected
            rows = []
            for i in range(126, 140):
                a = s.model.forward(ids[i:i + 1], plain, logits="last")[0]
                b = s.model.forward(ids[i:i + 1], rolled, logits="last")[0]
                assert torch.equal(a, b), (t, i)
                rows.append(a)
            logits[t] = torch.cat(rows)
    err = (logits[cache_type] - logits["f32"]).abs().max() / logits["f32"].abs().max()
    print(f"deepseek4 {cache_type} vs f32: {err:.2e}")
    if cache_type == "q8_0":
        assert err < 3e-2
