"""Placement invariance: the same model gives the same logits whatever the plan — all on the
CPU (raw GGUF blocks through the CPU kernels), all on a (virtual) GPU (dequantized torch
copies), experts split from the rest, layers spread over CUDA0/CUDA1/CPU, and one layer's
expert tensors split between devices. Plus batched-vs-sequential and KV rollback."""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import offload.runtime as rt
from tests.tiny_models import TinySpec, write_tiny_model

IDS = [3, 17, 257, 101, 46, 290, 5, 77, 200, 12]
# Different code paths (quantized dot products in the CPU kernels vs float32 torch matmuls
# over dequantized weights) differ only by float32 summation order: ~1e-6 of the logit scale.
REL_TOL = 1e-4


def _plan(names, rule):
    """name → device from ``rule(name)`` (a stand-in for the planner's map in these tests)."""
    return {n: rule(n) for n in names}


def _layer(name):
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


PLANS = {
    "all-cuda0": lambda n: "CUDA0",
    "experts-cpu": lambda n: "CPU" if "_exps" in n else "CUDA0",
    "experts-gpu-rest-cpu": lambda n: "CUDA0" if "_exps" in n else "CPU",
    "three-devices": lambda n: ("CPU" if "_exps" in n and _layer(n) % 2 else
                                "CUDA1" if (_layer(n) or 0) >= 2 else "CUDA0"),
    "split-expert-tensors": lambda n: "CPU" if "down_exps" in n else "CUDA1",
}


@pytest.fixture(scope="module", params=["glm4moe", "qwen3moe"])
def tiny(request, tmp_path_factory):
    spec = TinySpec(arch=request.param, nextn=request.param == "glm4moe", n_rot=16 if request.param == "glm4moe" else 32)
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", spec)


@pytest.fixture(scope="module")
def cpu_logits(tiny):
    with rt.load(tiny.path, placement="CPU", quiet=True) as s:
        return s.logits(IDS)


@pytest.mark.parametrize("plan", list(PLANS))
def test_plans_give_the_same_logits(tiny, cpu_logits, plan):
    placement = _plan(tiny.weights, PLANS[plan])
    with rt.load(tiny.path, placement=placement, virtual_gpus=True, quiet=True) as s:
        got = s.logits(IDS)
        used = {d for d in placement.values()}
        assert set(s.devices.torch_devices) == used
    assert np.abs(got - cpu_logits).max() < REL_TOL * np.abs(cpu_logits).max()


def test_gpu_plan_without_cuda_is_refused(tiny):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from offload._standins import OffloadError
    with pytest.raises(OffloadError, match=r"CUDA0 .*--virtual-gpus"):
        rt.load(tiny.path, placement="CUDA0", quiet=True)


@pytest.mark.parametrize("placement", ["CPU", "CUDA0"])
def test_batched_prompt_matches_one_token_at_a_time(tiny, placement):
    """One batch of T tokens vs T single-token steps through the KV cache. Same math, other
    reduction shapes: float32 rounding only (1e-4 of the logit scale)."""
    with rt.load(tiny.path, placement=placement, virtual_gpus=True, quiet=True) as s, torch.inference_mode():
        batched = s.logits(IDS)
        state = s.model.new_state()
        steps = np.stack([s.model.forward(torch.tensor([t]), state)[0][0].numpy() for t in IDS])
        assert state.n_past == len(IDS)
    assert np.abs(batched - steps).max() < REL_TOL * np.abs(batched).max()


def test_truncate_rolls_back_exactly(tiny):
    """Extending a sequence with junk, truncating, and continuing gives bit-identical logits
    to continuing directly (same ops on the same cache contents)."""
    with rt.load(tiny.path, quiet=True) as s, torch.inference_mode():
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
    with rt.load(tiny.path, quiet=True) as s:
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
