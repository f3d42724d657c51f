"""The compiled attention over quantized caches on the CPU (cpu_kernels.kv_attention, through
gpu.attention.attend once a model load has installed it) against the torch tiles
(gpu.attention.attend_tiles) over the same cached bytes: GQA with K and V of different types,
several queries (causal), a sliding window and sinks (gpt-oss), MLA's latent passed as both
K and V, and the logits of tiny deepseek2 and gpt-oss models with q8_0 caches.

Tolerance: both read the same blocks as the same float32 values and differ only in summation
order (the tiles fold a running softmax, the kernel sums per row): observed ~1e-7 of the
largest output; 1e-5.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import gpu.attention as attention
import offload.cpu_ops as cpu_ops
from gpu.attention import attend_tiles
from gpu.kv_cache import KVCache

CPU = torch.device("cpu")


def _close(got, want):
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.fixture(autouse=True)
def compiled_read(monkeypatch):
    """What a model load installs (offload.cpu_ops.install_cpu_attention), undone after each test."""
    monkeypatch.setattr(attention, "CPU_QUANTIZED_ATTEND", cpu_ops.attend_quantized_cache)


def test_loading_a_model_installs_the_compiled_cpu_attention(monkeypatch):
    import offload.runtime as rt
    from offload.probe import SHIPPED_MODEL
    monkeypatch.setattr(attention, "CPU_QUANTIZED_ATTEND", None)
    with rt.load(SHIPPED_MODEL, devices="CPU=8GiB", quiet=True):
        assert attention.CPU_QUANTIZED_ATTEND is cpu_ops.attend_quantized_cache


@pytest.mark.parametrize("k_type,v_type", [(Q.Q8_0, Q.Q8_0), (Q.Q4_0, Q.IQ4_NL), (Q.Q5_1, Q.Q4_1)],
                         ids=lambda t: t.name)
def test_gqa_with_window_and_sinks_matches_the_torch_tiles(k_type, v_type):
    g = torch.Generator().manual_seed(5)
    cache = KVCache(2, 64, device=CPU, dtype=k_type, dtype_v=v_type)
    cache.append(torch.randn(2, 45, 64, generator=g), torch.randn(2, 45, 64, generator=g))
    keys, values = cache.append(torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g))
    q = torch.randn(3, 8, 64, generator=g)
    sinks = torch.randn(8, generator=g)
    for kw in ({}, {"window": 20}, {"sinks": sinks}, {"window": 7, "sinks": sinks, "scale": 0.3}):
        _close(attention.attend(q, keys, values, **kw), attend_tiles(q, keys, values, **kw))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda t: t.name)
def test_mla_latent_as_keys_and_values_matches_the_torch_tiles(qtype):
    """The absorbed MLA call (gpu.mla): one KV head of latent rows (kv_lora + rope = 96) as
    both K and V (the caller keeps the first kv_lora of the output)."""
    g = torch.Generator().manual_seed(6)
    cache = KVCache(1, 96, head_dim_v=0, device=CPU, dtype=qtype)
    latent, _ = cache.append(torch.randn(1, 70, 96, generator=g))
    q = torch.randn(2, 4, 96, generator=g)
    _close(attention.attend(q, latent, latent, scale=0.2), attend_tiles(q, latent, latent, scale=0.2))


@pytest.mark.parametrize("arch", ["deepseek2", "gpt-oss"])
def test_models_with_q8_0_caches_give_the_torch_tiles_logits(arch, tmp_path, monkeypatch):
    """Whole models whose blocks take the torch path on the CPU (MLA; sinks and windows), a
    12-token prompt then 3 decode steps: the compiled read against the torch tiles."""
    import offload.runtime as rt
    from tests.tiny_models import TinySpec, write_tiny_model
    spec = (TinySpec(arch="deepseek2", n_rot=32, nextn=False, seed=8) if arch == "deepseek2" else
            TinySpec(arch="gpt-oss", head_dim=64, n_head_kv=2, window=4, seed=9))
    tiny = write_tiny_model(tmp_path / "t.gguf", spec)
    ids = [3, 17, 257, 101, 46, 290, 5, 77, 200, 12, 64, 128]

    def run(impl):
        with rt.load(tiny.path, devices="CPU=8GiB", cache_type="q8_0", quiet=True) as s:
            monkeypatch.setattr(attention, "CPU_QUANTIZED_ATTEND", impl)      # after the load installed its own
            state = s.model.new_state()
            rows = [s.model.forward(torch.tensor(ids), state, logits="all")[0]]
            for t in (9, 33, 70):
                rows.append(s.model.forward(torch.tensor([t]), state, logits="all")[0])
        return torch.cat(rows)

    calls = []
    got = run(lambda *a, **kw: calls.append(1) or cpu_ops.attend_quantized_cache(*a, **kw))
    assert len(calls) >= 4 * (tiny.spec.n_layer - 1)        # every block, every pass took it
    _close(got, run(None))
