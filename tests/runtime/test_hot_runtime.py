"""Hot experts at run time (``--virtual-gpus``): a CPU block's routed tokens split between the
experts held on a GPU and the CPU kernels' rest, summed; logits equal the all-CPU plan's, and
each device holds the plan's weights to the byte."""
from __future__ import annotations

import numpy as np
import pytest

import offload.runtime as rt
from offload.cpu_ops import RoutedHandoff
from offload.gguf_model import open_model
from placement.devices import parse_devices
from placement.plan import build_plan
from placement.planner import PlanOptions, make_plan
from tests.runtime.test_runtime_placement import IDS, REL_TOL
from tests.tiny_models import TinySpec, write_tiny_model

HOT = {"CUDA0": {1: (0, 3, 5), 2: (1, 2)}, "CUDA1": {1: (2, 7), 2: (0,)}}


@pytest.fixture(scope="module", params=["glm4moe", "qwen3moe"])
def tiny(request, tmp_path_factory):
    arch = request.param
    spec = TinySpec(arch=arch, nextn=arch == "glm4moe", n_rot=16 if arch == "glm4moe" else 32)
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", spec)


def test_hot_experts_give_the_all_cpu_logits_and_the_plans_bytes(tiny):
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as s:
        want = s.logits(IDS)
    model = open_model(str(tiny.path))
    base = make_plan(model, parse_devices("CUDA0=8GiB,CUDA1=8GiB,CPU=16GiB"),
                     PlanOptions(cpu_moe=True, fit="on", ctx=256, cache_type="f32", tensor_split=(1.0, 1.0)))
    plan = build_plan(model, base.placement, base.settings, base.devices, base.targets, mode="test",
                      hot_experts=HOT)
    with rt.load_plan(model, plan, virtual_gpus=True, quiet=True) as s:
        got = s.logits(IDS)
        moe = s.model.blocks[1].ffn
        assert len(moe.hot) == 2 and not moe.owned[[0, 2, 3, 5, 7]].any() and moe.owned.sum() == len(moe.owned) - 5
        # the 10-token batch's CPU side went through the compiled hand-off, bound with the mask
        assert isinstance(moe._handoff, RoutedHandoff) and np.array_equal(moe._handoff.owned, moe.owned)
        assert dict(s.allocated) == {t.name: t.weights_bytes for t in plan.totals if t.weights_bytes}
    assert np.abs(got - want).max() < REL_TOL * np.abs(want).max()


def test_the_cpu_side_skips_the_hot_experts(tiny):
    """With every expert of block 1 hot, the CPU kernels' part of block 1 is exactly zero."""
    model = open_model(str(tiny.path))
    base = make_plan(model, parse_devices("CUDA0=8GiB,CPU=16GiB"),
                     PlanOptions(cpu_moe=True, fit="on", ctx=256, cache_type="f32"))
    n_expert = model.spec.n_expert
    plan = build_plan(model, base.placement, base.settings, base.devices, base.targets, mode="test",
                      hot_experts={"CUDA0": {1: tuple(range(n_expert))}})
    with rt.load_plan(model, plan, virtual_gpus=True, quiet=True) as s:
        moe = s.model.blocks[1].ffn
        x = np.random.default_rng(0).standard_normal((4, model.spec.n_embd)).astype(np.float32)
        ids = np.tile(np.arange(model.spec.n_expert_used), (4, 1))
        w = np.ones((4, model.spec.n_expert_used), dtype=np.float32)
        assert not np.any(moe.experts(x, ids, w, moe.owned))


def test_load_with_a_routing_profile_plans_and_runs_hot_experts(tiny, tmp_path):
    """offload.load(routing=PATH): the planner fills CUDA0's room with hot experts (room for
    all of them here, but only experts with a hit are placed) and the run gives the all-CPU logits."""
    from placement.routing import RoutingCounts

    spec = open_model(str(tiny.path)).spec
    moe = [i for i in range(spec.n_layer_trunk) if spec.is_moe_layer(i)]
    counts = {i: tuple(float(x) for x in np.r_[np.full(spec.n_expert_used, 10.0), np.zeros(spec.n_expert - spec.n_expert_used)])
              for i in moe}
    path = tmp_path / "routing.yaml"
    path.write_text(RoutingCounts(spec.n_expert, spec.n_expert_used, 10, counts, source="test").to_yaml())
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as s:
        want = s.logits(IDS)
    with rt.load(tiny.path, devices="CUDA0=64MiB,CPU=16GiB", cpu_moe=True, fit="on", fit_target=0, ctx=256,
                 cache_type="f32", routing=str(path), virtual_gpus=True, quiet=True) as s:
        # only the experts with hits are worth VRAM: the first k of each MoE layer
        assert s.plan.hot_experts == {"CUDA0": {i: tuple(range(spec.n_expert_used)) for i in moe}}
        got = s.logits(IDS)
        assert dict(s.allocated) == {t.name: t.weights_bytes for t in s.plan.totals if t.weights_bytes}
    assert np.abs(got - want).max() < REL_TOL * np.abs(want).max()


def test_hot_experts_of_the_nextn_block_give_the_all_cpu_draft_logits(tiny):
    """The routing profile covers the NextN block (drafting routes through it), so the planner
    may hold its experts hot: the draft head's logits equal the all-CPU plan's."""
    import torch

    model = open_model(str(tiny.path))
    spec = model.spec
    if not spec.n_nextn:
        pytest.skip("no NextN block")
    nextn = spec.n_layer - 1
    base = make_plan(model, parse_devices("CUDA0=8GiB,CPU=16GiB"),
                     PlanOptions(cpu_moe=True, fit="on", ctx=256, cache_type="f32"))
    plan = build_plan(model, base.placement, base.settings, base.devices, base.targets, mode="test",
                      hot_experts={"CUDA0": {nextn: (0, 2, 5)}})
    ids = torch.as_tensor(IDS)

    def draft_logits(s) -> np.ndarray:
        with torch.inference_mode():
            state = s.model.new_state()
            _, h = s.model.forward(ids, state, logits="none")
            z, _ = s.model.nextn(ids[1:], h[:-1], torch.arange(1, len(IDS)), state.nextn_cache, logits="all")
            return z.numpy()

    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as s:
        want = draft_logits(s)
    with rt.load_plan(model, plan, virtual_gpus=True, quiet=True) as s:
        assert len(s.model.nextn.block.ffn.hot) == 1
        got = draft_logits(s)
        assert dict(s.allocated) == {t.name: t.weights_bytes for t in plan.totals if t.weights_bytes}
    assert np.abs(got - want).max() < REL_TOL * np.abs(want).max()
