"""-ot semantics: first match wins, comma lists, --cpu-moe / --n-cpu-moe regexes."""
from __future__ import annotations

import re

import pytest

from placement.errors import PlacementError
from placement.rules import (EXPERTS_REGEX, Rule, assign, cpu_moe_rules, first_match, layers_regex,
                             n_cpu_moe_rules, parse_override)
from placement.tensors import Role, TensorInfo
from gguf import GGMLQuantizationType


def _t(name, layer=None, role=Role.OTHER):
    return TensorInfo(name, (1,), GGMLQuantizationType.F32, 4, layer, role)


def test_first_match_wins_and_comma_lists():
    rules = parse_override("blk\\.1\\.ffn_.*=CUDA1,exps=cpu") + parse_override("blk\\.1\\.=CUDA0")
    assert [(r.pattern, r.device) for r in rules] == [("blk\\.1\\.ffn_.*", "CUDA1"), ("exps", "CPU"), ("blk\\.1\\.", "CUDA0")]
    assert first_match(rules, "blk.1.ffn_up_exps.weight").device == "CUDA1"   # first of three matches
    assert first_match(rules, "blk.2.ffn_up_exps.weight").device == "CPU"
    assert first_match(rules, "blk.1.attn_q.weight").device == "CUDA0"
    assert first_match(rules, "blk.10.attn_q.weight") is None                 # re.search, but "blk\.1\." needs the dot
    placed = assign([_t("blk.1.attn_q.weight", 1), _t("blk.7.attn_q.weight", 7)], rules, lambda t: "FALLBACK")
    assert placed == {"blk.1.attn_q.weight": "CUDA0", "blk.7.attn_q.weight": "FALLBACK"}


def test_search_not_match():
    """llama.cpp uses std::regex_search: a pattern may match anywhere in the name."""
    assert Rule("exps", "CPU").matches("blk.0.ffn_down_exps.weight")
    assert not Rule("^exps", "CPU").matches("blk.0.ffn_down_exps.weight")


@pytest.mark.parametrize("value,match", [
    ("blk\\.(=CPU", r"bad regex 'blk\\\.\(' in -ot"),
    ("exps", "is not PATTERN=DEVICE"),
    ("=CPU", "is not PATTERN=DEVICE"),
    ("exps=GPU0", "unknown device 'GPU0'"),
])
def test_parse_override_rejects(value, match):
    with pytest.raises(PlacementError, match=match):
        parse_override(value)


EXPERT_NAMES = ["blk.{}.ffn_up_exps.weight", "blk.{}.ffn_down_exps.weight", "blk.{}.ffn_gate_exps.weight",
                "blk.{}.ffn_gate_up_exps.weight", "blk.{}.ffn_down_exps.bias", "blk.{}.ffn_up_chexps.weight"]
NOT_EXPERTS = ["blk.{}.ffn_up_shexp.weight", "blk.{}.ffn_gate_inp.weight", "blk.{}.exp_probs_b.bias",
               "blk.{}.ffn_up.weight", "blk.{}.attn_q.weight", "blk.{}.nextn.eh_proj.weight"]


def test_cpu_moe_rule_matches_every_routed_expert_and_nothing_else():
    (rule,) = cpu_moe_rules()
    assert rule.pattern == EXPERTS_REGEX and rule.device == "CPU"
    for layer in (0, 46, 61):     # 46: GLM-4.5-Air's NextN block; its experts are matched alike
        assert all(rule.matches(n.format(layer)) for n in EXPERT_NAMES)
        assert not any(rule.matches(n.format(layer)) for n in NOT_EXPERTS)


def test_n_cpu_moe_equals_llama_cpp_per_block_rules():
    """llama.cpp pushes blk\\.i + LLM_FFN_EXPS_REGEX for i < N; our single rule matches the same names."""
    names = [n.format(i) for i in range(130) for n in EXPERT_NAMES + NOT_EXPERTS]
    for n in (0, 1, 9, 10, 11, 30, 47, 61, 100):
        llama = [re.compile(rf"blk\.{i}\.ffn_(up|down|gate|gate_up)_(ch|)exps") for i in range(n)]
        ours = n_cpu_moe_rules(n)
        for name in names:
            assert any(r.search(name) for r in llama) == any(r.matches(name) for r in ours), (n, name)
    with pytest.raises(PlacementError, match="--n-cpu-moe must be >= 0"):
        n_cpu_moe_rules(-1)


def test_layers_regex_matches_exactly_the_set():
    for lo in range(0, 125):
        for hi in range(lo, 125, 7):
            regex = re.compile(layers_regex(range(lo, hi + 1)))
            assert {n for n in range(1100) if regex.fullmatch(str(n))} == set(range(lo, hi + 1)), (lo, hi)
    picked = [0, 1, 2, 5, 7, 8, 9, 10, 11, 99, 100, 101]
    regex = re.compile(layers_regex(picked))
    assert [n for n in range(200) if regex.fullmatch(str(n))] == picked
