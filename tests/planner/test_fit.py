"""Auto-fit on real-shaped models: tight, fills every GPU, MoE-aware, shrinks context, refuses."""
from __future__ import annotations

from collections import defaultdict

import pytest

from placement.devices import CPU, GIB, parse_devices
from placement.errors import PlacementError
from placement.fit import fit
from placement.memory import MemorySettings
from placement.tensors import Role

BOXES = {
    "qwen3-30b-a3b": ["CUDA0=8GiB,CPU=64GiB", "CUDA0=12GiB,CUDA1=6GiB,CPU=64GiB"],
    "glm-4.5-air": ["CUDA0=24GiB,CPU=128GiB", "CUDA0=24GiB,CUDA1=24GiB,CPU=128GiB"],
    "deepseek-v3": ["CUDA0=24GiB,CPU=512GiB", "CUDA0=24GiB,CUDA1=24GiB,CUDA2=12GiB,CPU=512GiB",
                    "CUDA0=80GiB,CUDA1=80GiB,CPU=384GiB"],
    "gpt-oss-120b": ["CUDA0=16GiB,CPU=96GiB", "CUDA0=24GiB,CUDA1=24GiB,CPU=64GiB"],
}
CASES = [(name, box) for name, boxes in BOXES.items() for box in boxes]


def _targets(devices, mib=1024):
    return {d.name: mib << 20 for d in devices if d.is_gpu}


def expert_blocks(tensors, placement):
    """blk.N.ffn_*_exps (weight and bias) → (set of devices, bytes)."""
    devs, size = defaultdict(set), defaultdict(int)
    for t in tensors:
        if t.role is Role.ROUTED_EXPERTS:
            key = t.name.rsplit(".", 1)[0]
            devs[key].add(placement[t.name])
            size[key] += t.n_bytes
    return {k: (devs[k], size[k]) for k in devs}


@pytest.mark.parametrize("name,box", CASES)
def test_fit_is_tight_and_fills_every_gpu(models, name, box):
    m = models[name]
    devices = parse_devices(box)
    plan = fit(m, devices, _targets(devices), MemorySettings(32768))
    blocks = expert_blocks(m.tensors, plan.tensors)
    assert all(len(d) == 1 for d, _ in blocks.values())           # a block's weight and bias stay together
    cpu_sizes = [size for d, size in blocks.values() if d == {CPU}]
    for t in plan.totals:
        if t.name == CPU:
            assert t.free_after_bytes >= 0
            continue
        assert t.above_target_bytes >= 0, t                          # respects the target
        if cpu_sizes:
            assert t.above_target_bytes < min(cpu_sizes), t          # tight: no CPU expert block would fit
        assert t.weights_bytes > 0                                   # every GPU is used
    # MoE-aware: everything but the input layer and routed experts is on a GPU
    for t in m.tensors:
        if t.role is not Role.ROUTED_EXPERTS and t.name != "token_embd.weight":
            assert plan.tensors[t.name] != CPU, t.name


def test_fit_multi_gpu_keeps_blocks_contiguous(models):
    m = models["deepseek-v3"]
    devices = parse_devices("CUDA0=24GiB,CUDA1=24GiB,CUDA2=12GiB,CPU=512GiB")
    plan = fit(m, devices, {"CUDA0": 1 << 30, "CUDA1": 2 << 30, "CUDA2": 512 << 20}, MemorySettings(65536))
    attn = [plan.tensors[f"blk.{i}.attn_q_a.weight"] for i in range(61)]
    assert attn == sorted(attn) and set(attn) == {"CUDA0", "CUDA1", "CUDA2"}   # one range per GPU, in order
    assert plan.tensors["output.weight"] == "CUDA2"


def test_fit_spills_the_first_blocks_experts_of_each_gpu(models):
    m = models["glm-4.5-air"]
    devices = parse_devices("CUDA0=24GiB,CPU=128GiB")
    plan = fit(m, devices, _targets(devices), MemorySettings(32768))
    on_gpu = [i for i in range(1, 47) if plan.tensors[f"blk.{i}.ffn_up_exps.weight"] == "CUDA0"]
    assert on_gpu and on_gpu == list(range(on_gpu[0], 47))           # the NextN block 46 keeps its experts


def test_fit_with_separate_draft(models):
    m, draft = models["deepseek-v3"], models["deepseek-v3-mtp"]
    devices = parse_devices("CUDA0=48GiB,CPU=512GiB")
    plan = fit(m, devices, _targets(devices), MemorySettings(32768), draft=draft)
    assert plan.drafting == "--draft" and plan.placement.draft_device == "CUDA0"
    assert all(dev == "CUDA0" for name, dev in plan.draft_tensors.items() if "_exps" not in name)
    gpu = plan.totals[0]
    assert gpu.kv_bytes == 62 * 32768 * 576 * 2                       # 61 trunk blocks + the draft block
    cpu_blocks = [s for d, s in expert_blocks(list(m.tensors) + list(draft.tensors),
                                              {**plan.tensors, **plan.draft_tensors}).values() if d == {CPU}]
    assert 0 <= gpu.above_target_bytes < min(cpu_blocks)


def test_fit_shrinks_context_in_256_steps_only_as_far_as_needed(models):
    m = models["glm-4.5-air"]
    devices = parse_devices("CUDA0=12GiB,CPU=128GiB")
    start = m.spec.n_ctx_train
    plan = fit(m, devices, _targets(devices), MemorySettings(start), ctx_floor=4096)
    ctx = plan.settings.ctx
    assert 4096 <= ctx < start and (start - ctx) % 256 == 0
    assert any("context reduced" in n for n in plan.notes)
    with pytest.raises(PlacementError, match="cannot fit the non-expert part"):
        fit(m, devices, _targets(devices), MemorySettings(ctx + 256))     # one step more does not fit


def test_fit_explicit_context_is_not_shrunk(models):
    m = models["glm-4.5-air"]
    devices = parse_devices("CUDA0=12GiB,CPU=128GiB")
    with pytest.raises(PlacementError, match=r"cannot fit the non-expert part on the GPUs: needs .* GiB"):
        fit(m, devices, _targets(devices), MemorySettings(131072), ctx_floor=None)


def test_fit_refuses_when_dense_part_cannot_fit(models):
    m = models["deepseek-v3"]
    devices = parse_devices("CUDA0=8GiB,CPU=512GiB")
    with pytest.raises(PlacementError) as err:
        fit(m, devices, _targets(devices), MemorySettings(32768), ctx_floor=4096)
    msg = str(err.value)
    assert "even at context 4096" in msg and "CUDA0 7.00 GiB above" in msg and "\n" not in msg


def test_fit_refuses_when_cpu_cannot_hold_the_rest(models):
    m = models["gpt-oss-120b"]
    devices = parse_devices("CUDA0=24GiB,CPU=16GiB")
    with pytest.raises(PlacementError, match="cannot fit: CPU needs .* for what does not fit on the GPUs but has 16.00 GiB"):
        fit(m, devices, _targets(devices), MemorySettings(8192))


def test_fit_without_gpu_is_all_cpu(models):
    m = models["gpt-oss-120b"]
    plan = fit(m, parse_devices("CPU=128GiB"), {}, MemorySettings(32768))
    assert set(plan.tensors.values()) == {CPU} and plan.placement.layout.n_gpu_layers == 0


def test_fit_target_per_gpu(models):
    m = models["qwen3-30b-a3b"]
    devices = parse_devices("CUDA0=12GiB,CUDA1=12GiB,CPU=64GiB")
    plan = fit(m, devices, {"CUDA0": 1 * GIB, "CUDA1": 4 * GIB}, MemorySettings(8192))
    free = {t.name: t.free_after_bytes for t in plan.totals}
    assert free["CUDA0"] >= 1 * GIB and free["CUDA1"] >= 4 * GIB
