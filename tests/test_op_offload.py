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
from tests.test_runtime_placement import REL_TOL
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

    from tests.test_cli_plan import offload

    yaml_path = Path(__file__).resolve().parents[1] / "bench" / "profiles" / "rtx4090_epyc.yaml"
    args = ["plan", fixture_paths["glm-4.5-air"], "--devices", "CUDA0=24GiB,CPU=128GiB", "-c", "32768",
            "--hw-profile", str(yaml_path)]
    op = json.loads(offload(*args, "--json").stdout)["op_offload"]
    glm = models["glm-4.5-air"]
    plan = make_plan(glm, parse_devices("CUDA0=24GiB,CPU=128GiB"), PlanOptions(ctx=32768))
    m = PrefillModel(plan, glm, complete_hardware(HardwareProfile.from_yaml(yaml_path), plan))
    assert op["threshold"] == m.threshold() and op["ubatch"] == 512
    assert op["prefill_tps"]["streamed"] == round(m.tokens_per_second(512, streamed=True), 2)
    assert f"passes of >= {m.threshold()} tokens" in offload(*args).stdout
