"""Hot experts: the VRAM a whole-tensor plan leaves above each GPU's target, filled with the
hottest single experts of CPU-resident blocks (placement.hot_experts), in the plan's table,
JSON, YAML and llama.cpp forms, and in the cost model."""
from __future__ import annotations

import json

import numpy as np
import pytest

from placement.cost import forward_features
from placement.devices import parse_devices
from placement.errors import PlacementError
from placement.hot_experts import slice_bytes
from placement.planner import PlanOptions, make_plan
from placement.routing import RoutingCounts, distinct_experts_uniform, uniform_counts
from placement.speculative import hot_gain, plan_footprint
from tests.cli.test_cli_plan import offload

BOX = "CUDA0=24GiB,CPU=128GiB"
TOKENS = 1000


def skewed(model, seed: int = 0, alpha: float = 0.8) -> RoutingCounts:
    """Zipf-like routing (a random hottest-first order per layer), k·TOKENS assignments per layer."""
    spec = model.spec
    rng = np.random.default_rng(seed)
    E, k = spec.n_expert, spec.n_expert_used
    weight = 1.0 / np.arange(1, E + 1) ** alpha
    layers = {}
    for i in range(spec.n_layer):
        if spec.is_moe_layer(i):
            share = np.empty(E)
            share[rng.permutation(E)] = weight / weight.sum()
            layers[i] = tuple(float(x) for x in share * k * TOKENS)
    return RoutingCounts(E, k, TOKENS, layers, source="zipf test")


@pytest.fixture(scope="module")
def glm(models):
    return models["glm-4.5-air"]


@pytest.fixture(scope="module")
def plans(glm):
    devices = parse_devices(BOX)
    base = make_plan(glm, devices, PlanOptions(ctx=32768))
    counts = skewed(glm)
    return base, make_plan(glm, devices, PlanOptions(ctx=32768, routing=counts)), counts


def _weights(plan):
    return {t.name: t.weights_bytes for t in plan.totals}


def test_hot_experts_fill_the_room_tightly_by_hits_per_byte(glm, plans):
    base, hot, counts = plans
    assert hot.tensors == base.tensors                      # the whole-tensor map is unchanged
    held = hot.hot_experts["CUDA0"]
    assert held and set(hot.hot_experts) == {"CUDA0"}
    moved = sum(slice_bytes(glm.tensors, i) * len(es) for i, es in held.items())
    # each device's weights_bytes includes them; the CPU no longer counts them
    assert _weights(hot)["CUDA0"] == _weights(base)["CUDA0"] + moved
    assert _weights(hot)["CPU"] == _weights(base)["CPU"] - moved
    cpu_layers = {i for i in counts.layers
                  if all(base.tensors[t.name] == "CPU" for t in glm.tensors
                         if t.layer == i and "_exps" in t.name)}
    assert set(held) <= cpu_layers
    gpu = next(t for t in hot.totals if t.name == "CUDA0")
    assert 0 <= gpu.above_target_bytes
    chosen = {(i, e) for i, es in held.items() for e in es}
    value = {(i, e): p / slice_bytes(glm.tensors, i)
             for i in cpu_layers for e, p in enumerate(counts.hit_rates(i))}
    left = [c for c in value if c not in chosen]
    # tight: no expert left on the CPU fits in what is left above the target
    assert gpu.above_target_bytes < min(slice_bytes(glm.tensors, i) for i, _ in left)
    # by hits per byte: any expert left on the CPU worth more per byte than a chosen one is bigger
    worst = min(value[c] for c in chosen)
    smallest = min(slice_bytes(glm.tensors, i) for i, _ in chosen)
    assert all(slice_bytes(glm.tensors, i) > smallest for (i, e) in left if value[i, e] > worst)


def test_json_yaml_round_trip_and_llama_cpp_note(fixture_paths, tmp_path):
    path = fixture_paths["glm-4.5-air"]
    routing = tmp_path / "routing.yaml"
    from offload.gguf_model import open_model
    routing.write_text(skewed(open_model(path)).to_yaml())
    args = ["plan", path, "--devices", BOX, "-c", "32768", "--routing", str(routing)]
    r = offload(*args, "--json", "-o", str(tmp_path / "plan.yaml"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    hot = doc["hot_experts"]
    assert list(hot) == ["CUDA0"] and all(k.startswith("blk.") for k in hot["CUDA0"])
    assert all(isinstance(e, int) for es in hot["CUDA0"].values() for e in es)
    assert "cannot express partial expert tensors" in doc["llama_cpp_note"]
    forecast = doc["hot_experts_forecast"]["predicted_plain_tps"]
    assert forecast["with"] > forecast["without"]
    back = json.loads(offload("plan", "--placement", str(tmp_path / "plan.yaml"), "--json").stdout)
    assert back["hot_experts"] == hot and back["tensors"] == doc["tensors"]
    assert back["devices"] == doc["devices"]
    # the emitted flags are the nearest whole-tensor map: the same as without the profile
    emit = offload(*args, "--emit", "llama.cpp")
    plain = offload("plan", path, "--devices", BOX, "-c", "32768", "--emit", "llama.cpp")
    assert emit.returncode == 0 and emit.stdout == plain.stdout
    assert "llama.cpp cannot express partial expert tensors" in emit.stderr
    table = offload(*args)
    assert "hot experts of blocks" in table.stdout and "hot experts: predicted plain decode" in table.stdout


def test_bad_profiles_and_plan_files_are_one_line(fixture_paths, tmp_path):
    path = fixture_paths["glm-4.5-air"]
    other = tmp_path / "other.yaml"
    other.write_text(RoutingCounts(32, 4, 10, {1: (40 / 32,) * 32}, source="x").to_yaml())
    r = offload("plan", path, "--devices", BOX, "--routing", str(other))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "is for 32 experts (top-4) but" in r.stderr and "has 128 (top-8)" in r.stderr
    assert offload("plan", path, "--routing", str(tmp_path / "missing.yaml")).returncode == 2
    plan = tmp_path / "plan.yaml"
    assert offload("plan", path, "--devices", BOX, "-c", "32768", "-o", str(plan)).returncode == 0
    text = plan.read_text()
    # block 46's experts are on the GPU: a hot expert cannot come from it
    plan.write_text(text + "hot_experts: {CUDA0: {blk.46: [1, 2]}}\n")
    r = offload("plan", "--placement", str(plan))
    assert r.returncode == 2 and "hot experts of blk.46: its expert tensors are not all on the CPU" in r.stderr
    plan.write_text(text + "hot_experts: {CUDA1: {blk.2: [1]}}\n")
    r = offload("plan", "--placement", str(plan))
    assert r.returncode == 2 and "CUDA1 is not one of the plan's GPUs" in r.stderr


def test_cost_model_reads_what_the_hot_experts_take_off_the_cpu(glm, plans):
    base, hot, counts = plans
    fp_base = plan_footprint(base, glm, None)
    fp_hot = plan_footprint(hot, glm, None)
    f0 = forward_features(fp_base.target, 1, n_embd=fp_base.n_embd, hits=counts)
    f1 = forward_features(fp_hot.target, 1, n_embd=fp_hot.n_embd, hits=counts)
    # one token reads expert e with probability p_e: the CPU reads Σ_hot p_e·slice fewer bytes
    # and the GPU as many more
    moved = sum(counts.hit_rates(i)[list(es)].sum() * slice_bytes(glm.tensors, i)
                for i, es in hot.hot_experts["CUDA0"].items())
    assert f0["cpu_read"] - f1["cpu_read"] == pytest.approx(moved, rel=1e-9)
    assert f1["gpu_read:CUDA0"] - f0["gpu_read:CUDA0"] == pytest.approx(moved, rel=1e-9)
    gain = hot_gain(hot, glm, None, hits=counts)
    assert gain.tps_with > gain.tps_without


def test_uniform_hit_rates_equal_the_uniform_model_and_skew_lowers_u_of_b(glm, plans):
    base, _, counts = plans
    fp = plan_footprint(base, glm, None)
    flat = uniform_counts(128, 8, list(counts.layers))
    for b in (1, 2, 4, 7):
        a = forward_features(fp.target, b, n_embd=fp.n_embd)
        u = forward_features(fp.target, b, n_embd=fp.n_embd, hits=flat)
        assert a.keys() == u.keys() and all(u[key] == pytest.approx(a[key], rel=1e-9) for key in a)
        layer = next(iter(counts.layers))
        assert flat.distinct_for_batch(layer, b) == pytest.approx(distinct_experts_uniform(128, 8, b))
        if b > 1:
            assert counts.distinct_for_batch(layer, b) < distinct_experts_uniform(128, 8, b)


def test_mapping_keeps_the_share_of_the_hottest_fraction():
    """A 4-expert profile mapped onto 8 experts: the hottest quarter keeps its held-out share,
    split evenly between the two experts of its slot (with one prompt, in-sample)."""
    src = RoutingCounts(4, 1, 10, {1: (1.0, 6.0, 0.0, 3.0)}, source="s")
    m = src.mapped_onto(8, 2, [3, 4])
    assert sorted(m.layers) == [3, 4] and m.tokens == 10
    for layer in (3, 4):
        assert m.layers[layer] == pytest.approx((6.0, 6.0, 3.0, 3.0, 1.0, 1.0, 0.0, 0.0))


def test_mapping_sends_the_nextn_block_to_the_nextn_block():
    """With ``nextn`` the profile's NextN block maps onto the target's NextN block, and the
    trunk layers map by depth among the trunk layers only (the NextN curve never lands on
    a trunk layer); with no target NextN block the profile's is left out."""
    src = RoutingCounts(4, 1, 10, {1: (10.0, 0.0, 0.0, 0.0), 2: (0.0, 10.0, 0.0, 0.0),
                                   3: (5.0, 5.0, 0.0, 0.0)}, source="s")
    m = src.mapped_onto(4, 1, [5, 6, 7, 8, 9], nextn=(3, 9))
    assert m.layers[9] == pytest.approx((5.0, 5.0, 0.0, 0.0))
    assert all(m.layers[i] == pytest.approx((10.0, 0.0, 0.0, 0.0)) for i in (5, 6))
    assert all(m.layers[i] == pytest.approx((10.0, 0.0, 0.0, 0.0)) for i in (7, 8))   # layer 2's, sorted hottest first
    none = src.mapped_onto(4, 1, [5, 6], nextn=(3, None))
    assert sorted(none.layers) == [5, 6] and none.layers[6] == pytest.approx((10.0, 0.0, 0.0, 0.0))
    with pytest.raises(PlacementError, match="NextN"):
        src.mapped_onto(4, 1, [5, 6], nextn=(4, 6))


def test_held_out_ranking_scores_each_prompt_on_the_others_ranking():
    """Two prompts that use disjoint experts: the expert the other prompt ranks hottest gets
    none of a prompt's hits at rank 1; in-sample ranking would credit the skew to rank 1 and 2."""
    from placement.routing import PromptCounts
    a = PromptCounts("a", 2, {1: (2.0, 0.0, 0.0, 0.0)})
    b = PromptCounts("b", 2, {1: (0.0, 2.0, 0.0, 0.0)})
    r = RoutingCounts(4, 1, 4, {1: (2.0, 2.0, 0.0, 0.0)}, source="t", prompts=(a, b))
    assert r.held_out_shares(1) == pytest.approx((0.0, 1.0, 0.0, 0.0))
    assert r.held_out_shares(1, in_sample=True) == pytest.approx((0.5, 0.5, 0.0, 0.0))
    assert RoutingCounts.from_yaml(r.to_yaml(), "r.yaml") == r
    with pytest.raises(PlacementError, match="prompt 'b' does not count the same layers"):
        RoutingCounts.from_yaml(r.to_yaml().replace("    blk.1: [0, 2, 0, 0]", "    blk.2: [0, 2, 0, 0]"),
                                "r.yaml")
