"""A plan survives its two serialized forms: the YAML file and the llama.cpp flags."""
from __future__ import annotations

import pytest

from offload.commands.plan import build_parser, plan_from_args
from placement.errors import PlacementError
from placement.llama_args import llama_cpp_args
from placement.plan import build_plan
from placement.plan_file import load_plan_file, plan_to_yaml
from tests.llama_cpp_ref import apply_flags

PLANS = {   # name: (model, argv after the model path)
    "fit-1gpu": ("deepseek-v3", ["--devices", "CUDA0=24GiB,CPU=512GiB", "-c", "32768"]),
    "fit-3gpu": ("deepseek-v3", ["--devices", "CUDA0=24GiB,CUDA1=24GiB,CUDA2=12GiB,CPU=512GiB",
                                 "--fit-target", "1024,2048,512", "-c", "65536"]),
    "fit-glm-nextn": ("glm-4.5-air", ["--devices", "CUDA0=24GiB,CUDA1=16GiB,CPU=128GiB", "-c", "32768",
                                      "--cache-type", "q8_0"]),
    "fit-glm-k-v-types": ("glm-4.5-air", ["--devices", "CUDA0=24GiB,CPU=128GiB", "-c", "32768",
                                          "-ctk", "q8_0", "-ctv", "iq4_nl"]),
    "fit-shrunk-ctx": ("glm-4.5-air", ["--devices", "CUDA0=12GiB,CPU=128GiB"]),
    "fit-split-file": ("gpt-oss-120b", ["--devices", "CUDA0=24GiB,CUDA1=24GiB,CPU=64GiB", "-c", "16384"]),
    "cpu-only": ("gpt-oss-120b", ["--devices", "CPU=128GiB", "-c", "8192"]),
    "fit-parallel": ("glm-4.5-air", ["--devices", "CUDA0=24GiB,CPU=128GiB", "-c", "8192", "-np", "4"]),
    "flags": ("qwen3-30b-a3b", ["--devices", "CUDA0=24GiB,CUDA1=24GiB,CPU=64GiB", "-ngl", "30", "-ts", "3,1",
                                "--n-cpu-moe", "10", "-ot", r"blk\.4[0-5]\.ffn_.*=CPU,blk\.2[0-9]\.ffn_up_exps=CUDA1",
                                "-c", "8192", "-ub", "256"]),
    "flags-default-split": ("qwen3-30b-a3b", ["--devices", "CUDA0=10GiB,CUDA1=7GiB,CPU=64GiB", "--cpu-moe",
                                              "-c", "4096"]),
    "fit-draft": ("deepseek-v3", ["--devices", "CUDA0=48GiB,CPU=512GiB", "-c", "32768", "--draft", "DRAFT"]),
    "flags-draft": ("deepseek-v3", ["--devices", "CUDA0=48GiB,CPU=512GiB", "-c", "32768", "--draft", "DRAFT",
                                    "--cpu-moe"]),
}


@pytest.fixture(scope="module")
def plans(models, fixture_paths):
    out = {}
    for key, (name, argv) in PLANS.items():
        argv = [fixture_paths["deepseek-v3-mtp"] if a == "DRAFT" else a for a in argv]
        args = build_parser().parse_args([fixture_paths[name], *argv])
        out[key] = plan_from_args(args, models[name])
    return out


@pytest.mark.parametrize("key", PLANS)
def test_yaml_round_trip_gives_the_same_map(plans, key):
    plan, model, draft = plans[key]
    loaded = load_plan_file(plan_to_yaml(plan), "plan.yaml")
    again = build_plan(model, loaded.placement, loaded.settings, loaded.devices, loaded.targets,
                       mode="plan file", draft=draft)
    assert again.tensors == plan.tensors
    assert again.draft_tensors == plan.draft_tensors
    assert again.settings == plan.settings and again.totals == plan.totals
    assert loaded.speculative is None


@pytest.mark.parametrize("key", PLANS)
def test_llama_cpp_flags_give_the_same_map(plans, key):
    plan, model, draft = plans[key]
    args = llama_cpp_args(plan)
    # llama-server's -c is every slot's together (-np): each of ours has the whole --ctx
    assert args[args.index("-c") + 1] == str(plan.settings.ctx * plan.settings.parallel)
    assert ("-np" in args) == (plan.settings.parallel > 1)
    tensors, draft_tensors = apply_flags(args, [t.name for t in model.tensors], model.spec.n_layer,
                                         [t.name for t in draft.tensors] if draft else ())
    assert tensors == dict(plan.tensors)
    assert draft_tensors == dict(plan.draft_tensors)


def test_the_plans_are_not_trivial(plans):
    """Guard against the checks above passing on degenerate maps."""
    fit3 = plans["fit-3gpu"][0]
    assert {"CUDA0", "CUDA1", "CUDA2", "CPU"} <= set(fit3.tensors.values())
    flags = plans["flags"][0].tensors
    assert flags["blk.25.ffn_up_exps.weight"] == "CUDA1"          # user rule sends it off its block's GPU
    assert flags["blk.5.ffn_up_exps.weight"] == "CPU"            # --n-cpu-moe 10 (and -ngl 30 leaves 0-18 there)
    assert flags["blk.41.ffn_down_exps.weight"] == "CPU"         # user -ot first
    assert flags["blk.30.attn_q.weight"] == "CUDA0" and flags["blk.47.attn_q.weight"] == "CUDA1"
    assert flags["blk.10.attn_q.weight"] == "CPU"                # -ngl 30: the last 30 of 49 slots
    assert plans["fit-shrunk-ctx"][0].settings.ctx < 131072
    assert plans["fit-draft"][0].draft_tensors["blk.61.nextn.eh_proj.weight"] == "CUDA0"
    assert plans["flags-draft"][0].draft_tensors["blk.61.ffn_up_exps.weight"] == "CPU"


GOOD = """\
version: 1
model: m.gguf
context: 4096
devices:
- {name: CUDA0, budget: 24GiB, target: 1024MiB}
- {name: CPU, budget: 64GiB}
layout: {block_count: 48, n_gpu_layers: 49, tensor_split: [49]}
rules:
- {pattern: 'exps', device: CPU}
- {pattern: 'blk\\.3\\.', device: CUDA0}
"""


def test_good_plan_file_loads():
    pf = load_plan_file(GOOD, "p.yaml")
    assert [r.pattern for r in pf.placement.rules] == ["exps", "blk\\.3\\."]
    assert pf.targets == {"CUDA0": 1 << 30, "CPU": 0} and pf.settings.ctx == 4096


@pytest.mark.parametrize("old,new,line,match", [
    ("model: m.gguf", "model: [m.gguf", 3, "malformed YAML: expected ',' or ']'"),   # where the parser stops
    ("device: CUDA0}", "device: CUDA3}", 10, r"rules\[1\]: device CUDA3 is not among the plan's devices \(CUDA0, CPU\)"),
    ("'exps'", "'(exps'", 9, r"rules\[0\]: bad regex '\(exps'"),
    ("tensor_split: [49]", "tensor_split: [40, 9]", 7, "-ts has 2 values but there are 1 GPUs"),
    ("context: 4096", "contxt: 4096", 3, "unknown key 'contxt'"),
    ("- {name: CPU, budget: 64GiB}\n", "", 5, "needs a CPU entry"),
    ("version: 1", "version: 2", 1, "unsupported plan version 2"),
    ("name: CUDA0", "name: GPU0", 5, "unknown device 'GPU0'"),
    ("budget: 24GiB", "budget: lots", 5, "cannot read size 'lots'"),
    ("context: 4096", "context: four", 3, "context must be int"),
])
def test_bad_plan_files_name_the_line(old, new, line, match):
    text = GOOD.replace(old, new, 1)
    assert text != GOOD
    with pytest.raises(PlacementError, match=match) as err:
        load_plan_file(text, "p.yaml")
    assert str(err.value).startswith(f"p.yaml:{line}: ")
