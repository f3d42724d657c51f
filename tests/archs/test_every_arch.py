"""Layer 3, one checker over every architecture ``tests.tiny_models.ARCHS`` writes, each at a
small spec (mlx-lm's ``tests/test_models.py`` runs one such checker over a tiny config of every
architecture):

- placement does not change the logits: all on the CPU (raw GGUF blocks through the CPU
  kernels) == each plan of ``PLANS`` on virtual GPUs (torch on dequantized copies), and what
  each device holds for weights is what the planner counted for it;
- a batched prompt == the same prompt one token at a time through the KV cache;
- several sequences stepped as one batch (continuous batching) == each sequence alone;
- after a full context the KV bytes each device holds are the plan's, device by device (blocks
  over two virtual GPUs and the CPU; the NextN head's cache too, where the model has one).

Transformers parity for every architecture is ``tests/archs/test_runtime_hf.py`` (``CASES``;
``test_every_architecture_has_a_case`` there holds it to ``ARCHS``); compute bytes measured
against the plan, per architecture, are ``tests/runtime/test_memory_runtime.py`` and
``tests/planner/test_compute_estimate.py``. A new architecture adds its ``TinyArch`` to ``ARCHS`` and
its spec to ``SPECS`` here.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

import offload.runtime as rt
from offload.errors import OffloadError
from tests.tiny_models import ARCHS, TinySpec, write_tiny_model

IDS = [3, 17, 257, 101, 46, 290, 5, 77, 200, 12]
# Different code paths (quantized dot products in the CPU kernels vs float32 torch matmuls
# over dequantized weights) differ only by float32 summation order: ~1e-6 of the logit scale.
REL_TOL = 1e-4

GPUS = "CUDA0=8GiB,CUDA1=8GiB,CPU=16GiB"
# plans made by the planner from llama.cpp-style flags; f32 KV so only the weights' code
# paths differ
PLANS = {
    "all-gpu": dict(devices="CUDA0=8GiB,CPU=16GiB", n_gpu_layers=-1),
    "experts-cpu": dict(devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True),
    "experts-gpu-rest-cpu": dict(devices="CUDA0=8GiB,CPU=16GiB", n_gpu_layers=0,
                                 override_tensor=["_exps=CUDA0"]),
    "three-devices": dict(devices=GPUS, tensor_split="1,1",
                          override_tensor=[r"blk\.[13]\.ffn_(gate|up|down)_exps=CPU"]),
    "split-expert-tensors": dict(devices=GPUS, tensor_split="0,1", override_tensor=["down_exps=CPU"]),
}
# float activations pinned on both sides: the virtual GPUs compute in float32 whatever the CPU
# class, so the CPU kernels must too (the int8 ones, where a type and the CPU take them,
# have their own bound in tests/kernels/test_decode_activations.py and tests/kernels/test_prefill.py)
FLOAT = {"cache_type": "f32", "decode_activations": "float", "int8_prefill": False}


@dataclass(frozen=True)
class ArchCase:
    spec: TinySpec
    n_gpu_layers: int          # for the KV check: the last blocks on CUDA0/CUDA1, the first on the CPU
    ctx: int = 300
    ubatch: int | None = None  # the KV check's micro-batches (None: the whole context in one)
    cells: tuple[int, ...] = ()  # the KV check: the distinct cache lengths, where worth holding
    refused: tuple[tuple[str, str], ...] = ()   # (plan, the one-line error the load gives)


SPECS = {
    "glm4moe": ArchCase(TinySpec(arch="glm4moe", nextn=True, n_rot=16), n_gpu_layers=4),
    "glm4moe-tied": ArchCase(TinySpec(arch="glm4moe", nextn=True, n_rot=16, tied_output=True), n_gpu_layers=4),
    # 4 blocks: with 3, -ngl cannot leave one block on the CPU and split the rest over two GPUs
    "qwen3moe": ArchCase(TinySpec(arch="qwen3moe", nextn=False, n_rot=32, n_layer=4), n_gpu_layers=4),
    "deepseek2": ArchCase(TinySpec(arch="deepseek2", n_layer=4, seed=42), n_gpu_layers=4),
    # 600 tokens in 16-token micro-batches: windowed blocks stop at 256 cells, full ones at 768
    "gpt-oss": ArchCase(TinySpec(arch="gpt-oss", n_layer=6, window=8, seed=35), n_gpu_layers=4,
                        ctx=600, ubatch=16, cells=(256, 768),
                        refused=(("split-expert-tensors", "experts with biases split across devices"),)),
    # window-only, CSA and HCA blocks, hash and √softplus routing; 300 tokens close 2 HCA windows
    "deepseek4": ArchCase(TinySpec(arch="deepseek4", head_dim=64, n_layer=4, compress_ratios=(0, 4, 128, 4),
                                   n_hash=1, window=16, rms_eps=1e-6, yarn_factor=4.0, yarn_orig_ctx=64,
                                   swiglu_limit=2.0, seed=44), n_gpu_layers=4),
}


def test_every_architecture_has_a_case():
    assert {c.spec.arch for c in SPECS.values()} == set(ARCHS)


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory):
    c = SPECS[request.param]
    return c, write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", c.spec)


@pytest.fixture(scope="module")
def cpu_logits(case):
    _, tiny = case
    with rt.load(tiny.path, devices="CPU=16GiB", quiet=True, **FLOAT) as s:
        assert set(s.plan.tensors.values()) == {"CPU"}
        return s.logits(IDS)


@pytest.mark.parametrize("plan", list(PLANS))
def test_plans_give_the_same_logits(case, cpu_logits, plan):
    c, tiny = case
    if plan in dict(c.refused):
        with pytest.raises(OffloadError, match=dict(c.refused)[plan]):
            rt.load(tiny.path, virtual_gpus=True, quiet=True, **FLOAT, **PLANS[plan])
        return
    with rt.load(tiny.path, virtual_gpus=True, quiet=True, **FLOAT, **PLANS[plan]) as s:
        got = s.logits(IDS)
        assert set(s.devices.torch_devices) == set(s.plan.tensors.values())
        # what each device holds is what the planner counted for it
        assert dict(s.allocated) == {t.name: t.weights_bytes for t in s.plan.totals if t.weights_bytes}
    assert np.abs(got - cpu_logits).max() < REL_TOL * np.abs(cpu_logits).max()


@pytest.mark.parametrize("plan", ["cpu", "all-gpu"])
def test_batched_prompt_matches_one_token_at_a_time(case, plan):
    """One batch of T tokens vs T single-token steps through the KV cache. Same math, other
    reduction shapes: float32 rounding only (1e-4 of the logit scale). Activations as loaded by
    default: 10 tokens is a decode-sized batch, so both sides take the same kind."""
    _, tiny = case
    kw = PLANS.get(plan, dict(devices="CPU=16GiB"))
    with rt.load(tiny.path, virtual_gpus=True, cache_type="f32", quiet=True, **kw) as s, torch.inference_mode():
        batched = s.logits(IDS)
        state = s.model.new_state()
        steps = np.stack([s.model.forward(torch.tensor([t]), state)[0][0].numpy() for t in IDS])
        assert state.n_past == len(IDS)
    assert np.abs(batched - steps).max() < REL_TOL * np.abs(batched).max()


@pytest.mark.parametrize("plan", ["cpu", "all-gpu"])
def test_several_sequences_stepped_together_match_each_alone(case, plan):
    """Continuous batching (``CausalLM.forward_batch``): three sequences at different
    lengths, stepped as one batch — a decode-sized step (1, 3 and 2 tokens: the compiled CPU
    blocks where they apply) and one with a 20-token prompt chunk among single tokens (the
    reference path) — give each sequence the logits, hidden states and cache lengths its own
    ``forward`` gives. Attention runs per sequence, everything else over all rows: float32
    rounding of other matmul shapes only (1e-4 of the logit scale). Each step is one ``forward``
    (deepseek4: its window, compressors and indexer per sequence inside it).
    Float activations: a single token alone takes the decode kind, inside a 22-row step the
    prompt kind, and with int8 ones those differ by their rounding (tests/kernels/test_prefill.py)."""
    _, tiny = case
    kw = PLANS.get(plan, dict(devices="CPU=16GiB"))
    rng = np.random.default_rng(9)
    prompts = [IDS[:4], IDS, IDS[:7]]
    steps = [[1, 3, 2], [1, 20, 1]]
    with rt.load(tiny.path, virtual_gpus=True, quiet=True, **FLOAT, **kw) as s, torch.inference_mode():
        model = s.model
        alone, together = [model.new_state() for _ in prompts], [model.new_state() for _ in prompts]
        for p, a, b in zip(prompts, alone, together):
            model.forward(torch.tensor(p), a, logits="none")
            model.forward(torch.tensor(p), b, logits="none")
        calls = []
        forward = model.forward
        for rows in steps:
            ids = [torch.tensor(rng.integers(1, 290, n)) for n in rows]
            want = [forward(t, a, logits="all") for t, a in zip(ids, alone)]
            calls.clear()
            model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
            try:
                got = model.forward_batch([(t, b, "all") for t, b in zip(ids, together)])
            finally:
                del model.forward
            assert len(calls) == (1 if model.batches_sequences else len(rows))
            for (zw, hw), (zg, hg), a, b in zip(want, got, alone, together):
                assert b.n_past == a.n_past
                assert zg.shape == zw.shape and hg.shape == hw.shape
                assert (zg - zw).abs().max() < REL_TOL * zw.abs().max(), rows
                assert (hg - hw).abs().max() < REL_TOL * hw.abs().max(), rows


def test_kv_per_device_is_the_plan_with_virtual_gpus(case, capsys):
    """Blocks spread over two virtual GPUs and the CPU, the NextN head (where there is one)
    drafting in-model: after a full context the KV bytes each device holds are the plan's,
    device by device."""
    c, tiny = case
    ubatch = {"ubatch": c.ubatch} if c.ubatch else {}
    with rt.load(tiny.path, devices=GPUS, tensor_split="1,1", n_gpu_layers=c.n_gpu_layers, virtual_gpus=True,
                 cache_type="f16", ctx=c.ctx, quiet=True, **ubatch) as s, torch.inference_mode():
        ids = torch.tensor(list(np.random.default_rng(6).integers(1, 290, c.ctx)))
        state = s.model.new_state()
        step = c.ubatch or c.ctx
        hidden = torch.cat([s.model.forward(ids[i:i + step], state, logits="none")[1]
                            for i in range(0, c.ctx, step)])
        if s.model.nextn is not None:
            s.model.nextn(ids[1:], hidden[:-1], ids[1:].clone(), state.nextn_cache, logits="none")
        allocated = s.memory(state)["kv"]
        planned = {t.name: t.kv_bytes for t in s.plan.totals if t.kv_bytes}
        cells = tuple(sorted({cache.k.shape[1] for cache in state.caches}))
    with capsys.disabled():
        for dev in sorted(planned):
            print(f"\n  {dev}: KV planned {planned[dev]:,} B, allocated {allocated.get(dev, 0):,} B", end="")
    if c.cells:
        assert cells == c.cells
    assert len(planned) == 3 and allocated == planned
