"""Placement and the KV cache beyond what tests/archs/test_every_arch.py checks over every
architecture (all on the CPU == each plan on virtual GPUs, batched == one token at a time):
a plan written as YAML runs the same model, a GPU plan without CUDA is refused, the f16 cache
stays close, truncate rolls back exactly, generation is reproducible, and every expert quant
type gives the same logits through the CPU kernels and through torch on a virtual GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import offload.runtime as rt
from tests.archs.test_every_arch import PLANS
from tests.tiny_models import TinySpec, write_tiny_model

IDS = [3, 17, 257, 101, 46, 290, 5, 77, 200, 12]
# Different code paths (quantized dot products in the CPU kernels vs float32 torch matmuls
# over dequantized weights) differ only by float32 summation order: ~1e-6 of the logit scale.
REL_TOL = 1e-4


@pytest.fixture(scope="module", params=["glm4moe", "qwen3moe", "glm4moe-tied"])
def tiny(request, tmp_path_factory):
    arch = request.param.split("-")[0]
    spec = TinySpec(arch=arch, nextn=arch == "glm4moe", n_rot=16 if arch == "glm4moe" else 32,
                    tied_output=request.param.endswith("tied"))
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", spec)


@pytest.fixture(scope="module")
def cpu_logits(tiny):
    # float activations pinned: the virtual GPUs compute in float32 whatever the CPU class,
    # so the CPU kernels must too (int8 ones, where a type and the CPU take them, have
    # their own bound in tests/kernels/test_decode_activations.py and tests/kernels/test_prefill.py)
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True, decode_activations="float",
                 int8_prefill=False) as s:
        assert set(s.plan.tensors.values()) == {"CPU"}
        return s.logits(IDS)


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


# MXFP4 (a value table, e8m0 scales) by default; the other types are the full tier (each decoder
# is checked against gguf-py on its own: tests/kernels/test_cpu_kernels.py, test_gpu_quant.py)
@pytest.mark.parametrize("qtype", ["MXFP4", *(pytest.param(t, marks=pytest.mark.full)
                                             for t in ("Q3_K", "Q2_K", "Q5_0", "IQ4_NL", "IQ4_XS", "BF16"))])
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
