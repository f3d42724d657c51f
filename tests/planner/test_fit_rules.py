"""``--fit on``: the user's placement flags are hard constraints, the auto-fit places the rest.

On real-shaped GLM-4.5-Air, DeepSeek-V3 and gpt-oss-120b headers: (a) a rule pinning a few
blocks' attention to one GPU, (b) ``ffn_down_exps`` alone on the CPU, (c) ``--n-cpu-moe 10``
on three mismatched GPUs — each honours the pins, keeps every GPU at or above its target,
is tight, and gives the same map after the YAML and llama.cpp round trips; (d) a rule whose
pinned part alone overflows a GPU is refused, naming the rule and the bytes.
"""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

from offload.commands.plan import build_parser, plan_from_args
from placement.devices import CPU, parse_devices
from placement.errors import PlacementError
from placement.llama_args import llama_cpp_args
from placement.plan import build_plan
from placement.plan_file import load_plan_file, plan_to_yaml
from placement.planner import PlanOptions, make_plan
from placement.rules import first_match
from placement.tensors import Role
from tests.llama_cpp_ref import apply_flags
from tests.cli.test_cli_plan import offload

MODELS = ("glm-4.5-air", "deepseek-v3", "gpt-oss-120b")
TWO = "CUDA0=24GiB,CUDA1=24GiB,CPU=512GiB"
THREE = "CUDA0=24GiB,CUDA1=12GiB,CUDA2=8GiB,CPU=512GiB"      # mismatched
CASES = {   # name: argv after the model path (all with --fit on)
    "a-attention-pinned": ["--devices", TWO, "-c", "16384", "-ot", r"blk\.(3|4|5)\.attn_=CUDA1"],
    "b-down-exps-on-cpu": ["--devices", "CUDA0=24GiB,CUDA1=12GiB,CPU=512GiB", "-c", "16384", "-ot", r"\.ffn_down_exps=CPU"],
    "c-n-cpu-moe-3-gpus": ["--devices", THREE, "--fit-target", "1024,512,768", "-c", "16384",
                           "--n-cpu-moe", "10"],
}
IMPOSSIBLE = [r"-ot", r"blk\.(1[0-9]|2[0-9])\.=CUDA1"]          # 20 whole blocks, experts included


def _plan(fixture_paths, models, name, argv):
    args = build_parser().parse_args([fixture_paths[name], *argv, "--fit", "on"])
    return plan_from_args(args, models[name])


@pytest.fixture(scope="module")
def plans(fixture_paths, models):
    return {(name, case): _plan(fixture_paths, models, name, argv)
            for name in MODELS for case, argv in CASES.items()}


KEYS = [(name, case) for name in MODELS for case in CASES]


def _expert_block(name: str) -> str:
    return name.rsplit(".", 1)[0]


@pytest.mark.parametrize("key", KEYS, ids=["/".join(k) for k in KEYS])
def test_pins_honoured_targets_kept_and_tight(plans, key):
    plan, model, _ = plans[key]
    user = [r for r in plan.placement.rules if r.origin != "fit"]
    assert user, "the case pins something"
    by = plan.placement.placed_by(plan.tensors)
    open_cpu_blocks: dict[str, int] = defaultdict(int)
    n_pinned = 0
    for t in model.tensors:
        rule = first_match(user, t.name)
        if rule is not None:                          # a hard constraint: exactly where the rule says
            assert plan.tensors[t.name] == rule.device and by[t.name] == rule.origin, t.name
            n_pinned += 1
            continue
        assert by[t.name] in ("fit", plan.placement.layout_origin)
        if t.role is Role.ROUTED_EXPERTS:
            if plan.tensors[t.name] == CPU:
                open_cpu_blocks[_expert_block(t.name)] += t.n_bytes
        elif t.name != "token_embd.weight":           # MoE-aware: the open non-expert part is on a GPU
            assert plan.tensors[t.name] != CPU, t.name
    assert n_pinned > 0
    # a block's weight and bias stay together
    blocks = defaultdict(set)
    for t in model.tensors:
        if t.role is Role.ROUTED_EXPERTS and first_match(user, t.name) is None:
            blocks[_expert_block(t.name)].add(plan.tensors[t.name])
    assert all(len(d) == 1 for d in blocks.values())
    smallest = min(open_cpu_blocks.values(), default=None)
    assert smallest is not None, "the case spills something, so tightness is tested"
    for t in plan.totals:
        if t.name == CPU:
            assert t.free_after_bytes >= 0
            continue
        assert t.above_target_bytes >= 0, t            # every GPU at or above its own target
        assert t.above_target_bytes < smallest, t      # tight: no open CPU expert block would fit
        assert t.weights_bytes > 0


@pytest.mark.parametrize("key", KEYS, ids=["/".join(k) for k in KEYS])
def test_round_trips_give_the_same_map(plans, key):
    plan, model, draft = plans[key]
    loaded = load_plan_file(plan_to_yaml(plan), "plan.yaml")
    again = build_plan(model, loaded.placement, loaded.settings, loaded.devices, loaded.targets,
                       mode="plan file", draft=draft)
    assert again.tensors == plan.tensors and again.totals == plan.totals
    assert again.placement.placed_by(again.tensors) == plan.placement.placed_by(plan.tensors)  # who pinned what
    tensors, _ = apply_flags(llama_cpp_args(plan), [t.name for t in model.tensors], model.spec.n_layer)
    assert tensors == dict(plan.tensors)


def test_the_cases_do_what_they_say(plans):
    glm = plans["glm-4.5-air", "a-attention-pinned"][0].tensors
    assert glm["blk.4.attn_q.weight"] == "CUDA1" and glm["blk.4.ffn_gate_inp.weight"] == "CUDA0"
    ds = plans["deepseek-v3", "b-down-exps-on-cpu"][0]
    assert ds.tensors["blk.60.ffn_down_exps.weight"] == CPU and ds.tensors["blk.60.ffn_up_exps.weight"] != CPU
    oss = plans["gpt-oss-120b", "c-n-cpu-moe-3-gpus"][0]
    assert {oss.tensors[f"blk.{i}.ffn_up_exps.weight"] for i in range(10)} == {CPU}
    assert {"CUDA0", "CUDA1", "CUDA2"} <= set(oss.tensors.values())
    for key, (plan, _, _) in plans.items():            # the fit did place something beside the pins
        assert any(r.origin == "fit" for r in plan.placement.rules) or plan.placement.layout_origin == "fit", key


@pytest.mark.parametrize("name", MODELS)
def test_pinned_part_overflowing_a_gpu_is_refused_naming_the_rule(fixture_paths, models, name):
    with pytest.raises(PlacementError) as err:
        _plan(fixture_paths, models, name, ["--devices", TWO, "-c", "16384", *IMPOSSIBLE])
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("cannot fit: your flags alone put ") and " on CUDA1 (weights " in msg
    assert r"rule 'blk\.(1[0-9]|2[0-9])\.=CUDA1' (-ot) " in msg and "GiB" in msg


def test_fit_on_without_flags_is_the_auto_fit(fixture_paths, models):
    argv = ["--devices", TWO, "-c", "16384"]
    auto = plan_from_args(build_parser().parse_args([fixture_paths["glm-4.5-air"], *argv]), models["glm-4.5-air"])[0]
    on = _plan(fixture_paths, models, "glm-4.5-air", argv)[0]
    assert on.tensors == auto.tensors and on.totals == auto.totals and on.mode == auto.mode == "auto-fit"


def test_fit_auto_with_flags_is_the_flags_alone(fixture_paths, models):
    m = models["glm-4.5-air"]
    devices = parse_devices(TWO)
    flags = make_plan(m, devices, PlanOptions.from_flags(ctx=16384, n_cpu_moe=40))
    off = make_plan(m, devices, PlanOptions.from_flags(ctx=16384, n_cpu_moe=40, fit="off"))
    assert flags.mode == off.mode == "flags" and flags.tensors == off.tensors
    assert flags.placement.rules == off.placement.rules and len(flags.placement.rules) == 1


def test_fit_on_keeps_user_ngl_and_ts(models):
    m = models["deepseek-v3"]
    plan = make_plan(m, parse_devices(TWO), PlanOptions.from_flags(ctx=8192, n_gpu_layers=40, tensor_split="1,1",
                                                                   fit="on"))
    assert plan.placement.layout.n_gpu_layers == 40 and plan.placement.layout.tensor_split == (20.0, 20.0)
    assert all(plan.tensors[f"blk.{i}.attn_q_a.weight"] == CPU for i in range(22))        # -ngl 40 of 62 slots
    assert plan.tensors["blk.21.ffn_up_exps.weight"] == CPU
    assert plan.tensors["blk.22.attn_q_a.weight"] == "CUDA0" and plan.tensors["blk.60.attn_q_a.weight"] == "CUDA1"
    assert plan.placement.layout_origin == "-ngl 40 -ts"
    assert any(r.origin == "fit" for r in plan.placement.rules)          # the fit still chose the experts


def test_json_shows_who_placed_each_tensor(fixture_paths):
    r = offload("plan", fixture_paths["glm-4.5-air"], *CASES["a-attention-pinned"], "--fit", "on", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["placed_by"]["blk.3.attn_q.weight"] == "-ot" and doc["tensors"]["blk.3.attn_q.weight"] == "CUDA1"
    assert doc["placed_by"]["blk.3.ffn_gate_inp.weight"] == "fit" and doc["layout_origin"] == "fit"
    assert {doc["placed_by"][n] for n in doc["tensors"] if "_exps" in n} <= {"fit"}
    assert doc["mode"] == "auto-fit around your flags"


def test_library_and_cli_make_the_same_plan(fixture_paths, models):
    """``offload.load``'s keywords and the CLI's flags reach the same planner."""
    from offload.runtime import plan_for
    m = models["gpt-oss-120b"]
    cli = plan_from_args(build_parser().parse_args(
        [fixture_paths["gpt-oss-120b"], "--devices", THREE, "-c", "8192", "--fit-target", "1024,512,768",
         "-ot", r"blk\.1\.attn_=CUDA2", "--n-cpu-moe", "10", "--fit", "on"]), m)[0]
    lib = plan_for(m, devices=THREE, ctx=8192, fit_target="1024,512,768", override_tensor=r"blk\.1\.attn_=CUDA2",
                   n_cpu_moe=10, fit="on")
    assert lib.tensors == cli.tensors and lib.totals == cli.totals
    with pytest.raises(PlacementError, match="unknown planning option 'n_cpu_mo'"):
        plan_for(m, devices=THREE, n_cpu_mo=10)


def test_fit_on_with_a_separate_draft(fixture_paths, models):
    """The user's rules pin the --draft head's tensors too (llama.cpp -otd); round trips hold."""
    argv = ["--devices", "CUDA0=48GiB,CUDA1=24GiB,CPU=512GiB", "-c", "32768", "-ot", r"ffn_down_exps=CPU",
            "--draft", fixture_paths["deepseek-v3-mtp"]]
    plan, model, draft = _plan(fixture_paths, models, "deepseek-v3", argv)
    assert plan.draft_tensors["blk.61.ffn_down_exps.weight"] == CPU
    assert plan.draft_tensors["blk.61.nextn.eh_proj.weight"] == plan.placement.draft_device != CPU
    assert plan.placement.placed_by(plan.draft_tensors, draft=True)["blk.61.ffn_down_exps.weight"] == "-ot"
    assert all(t.above_target_bytes >= 0 for t in plan.totals if t.name != CPU)
    loaded = load_plan_file(plan_to_yaml(plan), "plan.yaml")
    again = build_plan(model, loaded.placement, loaded.settings, loaded.devices, loaded.targets,
                       mode="plan file", draft=draft)
    assert again.tensors == plan.tensors and again.draft_tensors == plan.draft_tensors
    tensors, draft_tensors = apply_flags(llama_cpp_args(plan), [t.name for t in model.tensors], model.spec.n_layer,
                                         [t.name for t in draft.tensors])
    assert tensors == dict(plan.tensors) and draft_tensors == dict(plan.draft_tensors)


def test_fit_on_shrinks_the_context_only_without_c(models):
    """The pinned attention takes its KV along; the context shrinks (steps of 256) only as far as needed."""
    m, devices = models["glm-4.5-air"], parse_devices("CUDA0=8GiB,CUDA1=6GiB,CPU=128GiB")
    pin = dict(override_tensor=r"blk\.([0-9]|1[0-9])\.attn_=CUDA1", fit="on")
    plan = make_plan(m, devices, PlanOptions.from_flags(**pin))
    ctx = plan.settings.ctx
    assert 4096 <= ctx < m.spec.n_ctx_train and (m.spec.n_ctx_train - ctx) % 256 == 0
    assert any("context reduced" in n for n in plan.notes)
    assert {plan.tensors[f"blk.{i}.attn_q.weight"] for i in range(20)} == {"CUDA1"}
    assert all(t.above_target_bytes >= 0 for t in plan.totals)
    with pytest.raises(PlacementError, match="cannot fit the non-expert part on the GPUs: needs"):
        make_plan(m, devices, PlanOptions.from_flags(ctx=ctx + 256, **pin))


def test_table_says_who_placed_what(fixture_paths):
    r = offload("plan", fixture_paths["glm-4.5-air"], *CASES["a-attention-pinned"], "--fit", "on", "--spec-type", "none")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("placed by: "))
    assert line.startswith("placed by: -ot: 24 tensors (") and "; fit: 779 tensors (" in line   # 3 blocks x 8 attn_*


def test_fit_on_with_ngl_alone_cuts_the_gpu_slots_itself(models):
    m = models["deepseek-v3"]
    plan = make_plan(m, parse_devices(THREE), PlanOptions.from_flags(ctx=8192, n_gpu_layers=30, fit="on"))
    layout = plan.placement.layout
    assert layout.n_gpu_layers == 30 and sum(layout.tensor_split) == 30 and min(layout.tensor_split) > 0
    assert plan.placement.layout_origin == "-ngl 30, the rest by the fit"
    assert {plan.tensors[f"blk.{i}.attn_q_a.weight"] for i in range(32)} == {CPU}     # 62 slots - 30
    assert {plan.tensors[f"blk.{i}.attn_q_a.weight"] for i in range(32, 61)} == {"CUDA0", "CUDA1", "CUDA2"}
    assert all(t.above_target_bytes >= 0 for t in plan.totals)
