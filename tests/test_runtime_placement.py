"""Placement invariance: the same model gives the same logits whatever the plan — all on the
CPU (raw GGUF blocks through the CPU kernels), all on a (virtual) GPU (dequantized torch
copies), experts split from the rest, layers spread over CUDA0/CUDA1/CPU, and one layer's
expert tensors split between devices. Plus batched-vs-sequential and KV rollback."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import offload.runtime as rt
from tests.tiny_models import TinySpec, write_tiny_model

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


@pytest.fixture(scope="module", params=["glm4moe", "qwen3moe", "glm4moe-tied"])
def tiny(request, tmp_path_factory):
    arch = request.param.split("-")[0]
    spec = TinySpec(arch=arch, nextn=arch == "glm4moe", n_rot=16 if arch == "glm4moe" else 32,
                    tied_output=request.param.endswith("tied"))
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", spec)


@pytest.fixture(scope="module")
def cpu_logits(tiny):
    # float activations pinned: the virtual GPUs compute in float32 whatever the CPU class,
    # so the CPU kernels must too (int8 ones, where a type and a VNNI CPU take them, have
    # their own bound in tests/test_decode_activations.py and tests/test_prefill.py)
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True, decode_activations="float",
                 int8_prefill=False) as s:
        assert set(s.plan.tensors.values()) == {"CPU"}
        return s.logits(IDS)


@pytest.mark.parametrize("plan", list(PLANS))
def test_plans_give_the_same_logits(tiny, cpu_logits, plan):
    with rt.load(tiny.path, virtual_gpus=True, cache_type="f32", quiet=True, decode_activations="float",
                 int8_prefill=False, **PLANS[plan]) as s:
        got = s.logits(IDS)
        assert set(s.devices.torch_devices) == set(s.plan.tensors.values())
        # what each device holds is what the planner counted for it
        assert dict(s.allocated) == {t.name: t.weights_bytes for t in s.plan.totals if t.weights_bytes}
    assert np.abs(got - cpu_logits).max() < REL_TOL * np.abs(cpu_logits).max()


def test_plan_file_round_trip_runs(tiny, cpu_logits, tmp_path):
    """A plan written as YAML by the planner and loaded back runs the same model."""
    from placement.plan_file import plan_to_yaml
    with rt.load(tiny.path, virtual_gpus=True, cache_type="f32", quiet=True, **PLANS["three-devices"]) as s:
        path = tmp_path / "plan.yaml"
        path.write_text(plan_to_yaml(s.plan))
        want = dict(s.plan.tensors)
    with rt.load(tiny.path, placement=path, virtual_gpus=True, quiet=True, decode_activations="float",
                 int8_prefill=False) as s:
        assert dict(s.plan.tensors) == want
        got = s.logits(IDS)
    assert np.abs(got - cpu_logits).max() < REL_TOL * np.abs(cpu_logits).max()


def test_gpu_plan_without_cuda_is_refused(tiny):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from offload.errors import OffloadError
    with pytest.raises(OffloadError, match=r"CUDA0 .*--virtual-gpus"):
        rt.load(tiny.path, devices="CUDA0=8GiB,CPU=16GiB", quiet=True)


@pytest.mark.parametrize("plan", ["cpu", "all-gpu"])
def test_batched_prompt_matches_one_token_at_a_time(tiny, plan):
    """One batch of T tokens vs T single-token steps through the KV cache. Same math, other
    reduction shapes: float32 rounding only (1e-4 of the logit scale)."""
    kw = PLANS.get(plan, dict(devices="CPU=16GiB"))
    with rt.load(tiny.path, virtual_gpus=True, cache_type="f32", quiet=True, **kw) as s, torch.inference_mode():
        batched = s.logits(IDS)
        state = s.model.new_state()
        steps = np.stack([s.model.forward(torch.tensor([t]), state)[0][0].numpy() for t in IDS])
        assert state.n_past == len(IDS)
    assert np.abs(batched - steps).max() < REL_TOL * np.abs(batched).max()


def test_f16_kv_cache_stays_close(tiny, cpu_logits):
    """The default --cache-type f16 rounds keys/values to 11 significant bits: logits move
    by ~1e-3 of their scale, far below anything that changes the model's behaviour."""
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f16", quiet=True) as s:
        got = s.logits(IDS)
    assert np.abs(got - cpu_logits).max() < 1e-2 * np.abs(cpu_logits).max()


def test_truncate_rolls_back_exactly(tiny):
    """Extending a sequence with junk, truncating, and continuing gives bit-identical logits
    to continuing directly (same ops on the same cache contents)."""
    with rt.load(tiny.path, devices="CPU=16GiB", quiet=True) as s, torch.inference_mode():
        m = s.model
        direct = m.new_state()
        m.forward(torch.tensor(IDS[:6]), direct)
        want, _ = m.forward(torch.tensor(IDS[6:]), direct)
        rolled = m.new_state()
        m.forward(torch.tensor(IDS[:6]), rolled)
        m.forward(torch.tensor([9, 8, 7, 250, 251, 252, 1, 2, 3]), rolled)   # rejected drafts
        rolled.truncate(6)
        assert rolled.n_past == 6
        got, _ = m.forward(torch.tensor(IDS[6:]), rolled)
    assert torch.equal(got, want)


def test_generate_is_reproducible_and_sampling_is_seeded(tiny):
    with rt.load(tiny.path, devices="CPU=16GiB", quiet=True) as s:
        g1 = list(s.generate(IDS, max_tokens=8, stop_at_eos=False))
        g2 = list(s.generate(IDS, max_tokens=8, stop_at_eos=False, ubatch=3))
        # greedy continuation == argmax of the logits of the full sequence, step by step
        seq = IDS + g1
        want = s.logits(seq).argmax(-1)[len(IDS) - 1:-1]
        t1 = list(s.generate(IDS, max_tokens=8, temperature=1.0, seed=5, stop_at_eos=False))
        t2 = list(s.generate(IDS, max_tokens=8, temperature=1.0, seed=5, stop_at_eos=False))
    assert g1 == g2 and len(g1) == 8
    assert g1 == want.tolist()
    assert t1 == t2


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q5_0", "IQ4_NL", "IQ4_XS", "MXFP4", "BF16"])
def test_expert_quant_types_agree_between_cpu_and_gpu(qtype, tmp_path):
    """The same experts through the CPU kernels (raw blocks) and through torch on a virtual
    GPU (raw blocks dequantized per call by gpu.quant): two independent decoders of each
    block layout must give the same logits. Float activations on the CPU (the GPU's math; by
    default a decode-sized batch of MXFP4 experts takes int8 activations there, ~1e-2 off)."""
    from gguf import GGMLQuantizationType as Q
    spec = TinySpec(expert_type=Q[qtype], seed=40 + len(qtype), nextn=False)
    tiny = write_tiny_model(tmp_path / f"{qtype}.gguf", spec)
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True, decode_activations="float") as s:
        on_cpu = s.logits(IDS)
    with rt.load(tiny.path, virtual_gpus=True, cache_type="f32", quiet=True, **PLANS["all-gpu"]) as s:
        on_gpu = s.logits(IDS)
    assert np.abs(on_gpu - on_cpu).max() < REL_TOL * np.abs(on_cpu).max()
