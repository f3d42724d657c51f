"""KV cache growth: doubling, rollback, and never past the planner's cell count."""
from __future__ import annotations

import torch

import offload.runtime as rt
from gpu.kv_cache import KVCache
from tests.tiny_models import TinySpec, write_tiny_model


def kv(t: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(start, start + t, dtype=torch.float32).reshape(1, t, 1).expand(2, t, 3)
    return x, -x


def test_growth_doubles_but_stops_at_max_cells():
    c = KVCache(2, 3, device=torch.device("cpu"), capacity=256, max_cells=1024)
    c.append(*kv(1000))
    assert c.k.shape[1] == 1000                    # need beats doubling (512)
    c.append(*kv(1, 1000))
    assert c.k.shape[1] == 1024                    # doubling (2000) capped at the plan's cells
    k, v = c.append(*kv(23, 1001))
    assert c.k.shape[1] == 1024 and k.shape == (2, 1024, 3)
    assert torch.equal(k[0, :, 0], torch.arange(1024, dtype=torch.float32)) and torch.equal(v, -k)


def test_uncapped_cache_doubles_and_rollback_keeps_the_prefix():
    c = KVCache(2, 3, device=torch.device("cpu"), capacity=4)
    c.append(*kv(5))
    assert c.k.shape[1] == 8
    c.truncate(2)
    k, _ = c.append(*kv(3, 2))
    assert c.length == 5 and torch.equal(k[0, :, 0], torch.arange(5, dtype=torch.float32))


def test_runtime_caches_hold_no_more_cells_than_the_plan(tmp_path):
    tiny = write_tiny_model(tmp_path / "tiny.gguf", TinySpec(seed=3))
    with rt.load(tiny.path, devices="CPU=16GiB", quiet=True, ctx=768) as s:            # the plan counts 768 cells
        prompt = [3 + i % 250 for i in range(700)]                # ids below the tiny vocab
        state = s.model.new_state()
        s.model.forward(torch.tensor(prompt), state, logits="none")        # 700 cells
        s.model.forward(torch.tensor(prompt[:1]), state, logits="none")    # doubling would take 1400
        assert {c.k.shape[1] for c in state.caches} == {768}
        assert state.nextn_cache is None or state.nextn_cache.k.shape[1] <= 768
