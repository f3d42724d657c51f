"""Op offload: prompt batches at or above a threshold stream the RAM-resident experts to a GPU.
Numerics against the CPU path on virtual GPUs; the threshold from the cost model."""
from __future__ import annotations

import numpy as np
import pytest

import offload.runtime as rt
from offload.errors import OffloadError
from placement.devices import parse_devices
from placement.hardware import HardwareProfile
from placement.op_offload import LLAMA_CPP_MIN_BATCH, PrefillModel, choose_threshold
from placement.planner import PlanOptions, make_plan
from placement.speculative import complete_hardware
from tests.runtime.test_runtime_placement import REL_TOL
from tests.tiny_models import TinySpec, write_tiny_model

IDS = [(7 * i) % 280 + 3 for i in range(40)]          # 40 >= llama.cpp's 32: the streamed path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", TinySpec())


def test_streamed_experts_give_the_cpu_logits(tiny):
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", int8_prefill=False, quiet=True) as s:
        want = s.logits(IDS)          # float activations, as the streamed GPU experts
    plan = dict(devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True, cache_type="f32", virtual_gpus=True, quiet=True)
    with rt.load(tiny.path, op_offload="on", **plan) as s:
        assert s.op_offload_min == LLAMA_CPP_MIN_BATCH
        got = s.logits(IDS)
        assert s.profile.seconds["op_offload"] > 0            # the streamed path ran
        streamed = s.profile.seconds["op_offload"]
        s.logits(IDS[:LLAMA_CPP_MIN_BATCH - 1])               # below the threshold: the CPU path
        assert s.profile.seconds["op_offload"] == streamed
    assert np.abs(got - want).max() < REL_TOL * np.abs(want).max()
    with rt.load(tiny.path, op_offload="auto", **plan) as s:  # auto never streams to a virtual GPU
        assert s.op_offload_min is None


def test_on_without_a_gpu_is_refused(tiny):
    with pytest.raises(OffloadError, match="no GPU to stream"):
        rt.load(tiny.path, devices="CPU=16GiB", op_offload="on", quiet=True)


def test_threshold_is_where_streaming_starts_to_win(models):
    glm = models["glm-4.5-air"]
    plan = make_plan(glm, parse_devices("CUDA0=24GiB,CPU=128GiB"), PlanOptions(ctx=32768))
    hw = complete_hardware(HardwareProfile.from_dict({"cpu_read_gbps": 250,
                                                      "gpus": {"CUDA0": {"name": "NVIDIA GeForce RTX 4090"}}}), plan)
    m = PrefillModel(plan, glm, hw)
    t = choose_threshold("auto", m)
    assert t is not None and 1 < t
    assert m.expert_seconds(t, streamed=True) < m.expert_seconds(t, streamed=False)
    assert m.expert_seconds(t - 1, streamed=True) >= m.expert_seconds(t - 1, streamed=False)
    assert m.tokens_per_second(2 * t, streamed=True) > m.tokens_per_second(2 * t, streamed=False)
    assert choose_threshold("off", m) is None and choose_threshold("on", m) == LLAMA_CPP_MIN_BATCH
    # a faster link moves the threshold down, a faster CPU up
    fast_link = complete_hardware(HardwareProfile.from_dict({"cpu_read_gbps": 250, "gpus": {
        "CUDA0": {"read_gbps": 800, "link_gbps": 100}}}), plan)
    fast_cpu = complete_hardware(HardwareProfile.from_dict({"cpu_read_gbps": 250, "cpu_batched_gflops": 4000,
                                                            "gpus": {"CUDA0": {"name": "NVIDIA GeForce RTX 4090"}}}), plan)
    assert PrefillModel(plan, glm, fast_link).threshold() < t < PrefillModel(plan, glm, fast_cpu).threshold()


def test_plan_prints_the_auto_threshold(fixture_paths, models):
    import json
    from pathlib import Path

    from tests.cli.test_cli_plan import offload

    yaml_path = Path(__file__).resolve().parents[2] / "bench" / "profiles" / "rtx4090_epyc.yaml"
    args = ["plan", fixture_paths["glm-4.5-air"], "--devices", "CUDA0=24GiB,CPU=128GiB", "-c", "32768",
            "--hw-profile", str(yaml_path)]
    op = json.loads(offload(*args, "--json").stdout)["op_offload"]
    glm = models["glm-4.5-air"]
    plan = make_plan(glm, parse_devices("CUDA0=24GiB,CPU=128GiB"), PlanOptions(ctx=32768))
    m = PrefillModel(plan, glm, complete_hardware(HardwareProfile.from_yaml(yaml_path), plan))
    assert op["threshold"] == m.threshold() and op["ubatch"] == 512
    assert op["prefill_tps"]["streamed"] == round(m.tokens_per_second(512, streamed=True), 2)
    assert f"passes of >= {m.threshold()} tokens" in offload(*args).stdout


@pytest.mark.parametrize("fused,chunk_experts", [(False, None), (True, None), (False, 2), (True, 1)])
def test_staged_streaming_equals_the_resident_experts(fused, chunk_experts):
    """``StreamedExperts`` through ``StagingBuffers`` (double-buffered, stage by stage, whole
    tensors or chunks of ``chunk_experts`` experts of the largest tensor) against
    ``TorchExperts`` holding the same raw Q8_0 bytes, with an ``owned`` mask, over two calls
    that reuse the buffers. Same dequantized weights and float32 math: 1e-5 of the largest
    value covers the different summation order of the per-stage matmuls."""
    import torch
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    from gpu.experts import ExpertSubset, StagingBuffers, StreamedExperts, TorchExperts
    from gpu.quant import QuantTensor

    rng = np.random.default_rng(7)
    E, n_ff, n_embd, k = 6, 32, 64, 2
    shapes = ({"gate_up": (E, 2 * n_ff, n_embd)} if fused else
              {"gate": (E, n_ff, n_embd), "up": (E, n_ff, n_embd)}) | {"down": (E, n_embd, n_ff)}
    raw = {s: quantize(rng.standard_normal(shape).astype(np.float32), Q.Q8_0) for s, shape in shapes.items()}
    cpu = torch.device("cpu")
    stages = {s: (raw[s], Q.Q8_0, shapes[s]) for s in shapes}
    owned = np.ones(E, dtype=bool)
    owned[2] = False                                   # held elsewhere (a hot expert): not streamed
    held = np.flatnonzero(owned)
    resident = TorchExperts(**{s: QuantTensor.upload(raw[s][held], Q.Q8_0, (len(held),) + shapes[s][1:], cpu)
                               for s in shapes})
    want_of = ExpertSubset(resident, held.tolist(), E)
    largest = max(r.nbytes for r in raw.values())
    staging = StagingBuffers(cpu, largest if chunk_experts is None else chunk_experts * largest // E)
    got_of = StreamedExperts(stages, device=cpu, compute_dtype=torch.float32, owned=owned, staging=staging)
    assert staging.device_bytes == 2 * staging.n_bytes
    for t in (9, 40):
        x = torch.from_numpy(rng.standard_normal((t, n_embd)).astype(np.float32))
        ids = torch.from_numpy(np.stack([rng.choice(E, k, replace=False) for _ in range(t)]))
        w = torch.from_numpy(rng.random((t, k)).astype(np.float32))
        want, got = want_of(x, ids, w), got_of(x, ids, w)
        assert torch.abs(got - want).max() <= 1e-5 * torch.abs(want).max()


def test_staging_buffers_are_a_chunk_within_one_expert_and_the_whole_tensor(models):
    """The staging rule (``placement.limits.staging_buffer_bytes``: gpu.experts' StagingBuffers
    and placement.compute's term both call it): a small tensor whole, a huge expert's slice
    whole, else one chunk; the plan counts two buffers of the largest streamed tensor's."""
    from placement import compute
    from placement.limits import STAGING_CHUNK_BYTES, staging_buffer_bytes

    assert staging_buffer_bytes(1000, 4) == 1000
    assert staging_buffer_bytes(16 * STAGING_CHUNK_BYTES, 8) == 2 * STAGING_CHUNK_BYTES
    ds = models["deepseek-v3"]
    big = max((t for t in ds.tensors if t.n_experts), key=lambda t: t.n_bytes)
    assert compute.tensor_staging_bytes(big) == 256 << 20 < big.n_bytes       # DeepSeek-V3: chunked
    plan = make_plan(ds, parse_devices("CUDA0=24GiB,CPU=384GiB"), PlanOptions(ctx=8192))
    staged = compute.op_offload_staging_bytes(ds.tensors, lambda t: plan.tensors[t.name])
    assert staged == {"CUDA0": 2 << 28}
    assert compute.op_offload_staging_bytes(ds.tensors, lambda t: plan.tensors[t.name], ("CUDA0",)) == {}
