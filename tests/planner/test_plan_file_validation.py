"""A hand-edited plan file is checked as a whole when loaded: every key's type and range,
the ``speculative:`` section included; each error is one line, ``<file>:<line>: <reason>``,
and the reason names the key. ``offload run --placement`` with such a file exits 2 with that
line and no traceback."""
from __future__ import annotations

import copy

import pytest
import yaml

from offload.cli import main as cli_main
from placement.errors import PlacementError
from placement.plan_file import load_plan_file
from offload.commands.run import DEFAULT_MODEL


@pytest.fixture(scope="module")
def good_plan(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("plan") / "plan.yaml"
    assert cli_main(["plan", str(DEFAULT_MODEL), "--devices", "CPU=16GiB", "-c", "512", "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["speculative"]["n_max"] >= 0          # the shipped model has a NextN head
    return doc


def _set(doc: dict, path: tuple, value) -> dict:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return doc


# (where, bad value, what the one-line message must say)
CASES = [
    (("speculative", "n_max"), "two", "speculative.n_max must be an integer >= 0, got 'two'"),
    (("speculative", "n_max"), -3, "speculative.n_max must be an integer >= 0, got -3"),
    (("speculative", "n_max"), 2.5, "speculative.n_max must be an integer >= 0, got 2.5"),
    (("speculative", "n_max"), True, "speculative.n_max must be an integer >= 0, got True"),
    (("speculative", "p_min"), 1.5, "speculative.p_min must be a number in [0, 1), got 1.5"),
    (("speculative", "p_min"), "high", "speculative.p_min must be a number in [0, 1), got 'high'"),
    (("speculative", "best_n_max"), -1, "speculative.best_n_max must be an integer >= 0, got -1"),
    (("speculative", "predicted_speedup"), float("nan"), "speculative.predicted_speedup must be a finite number"),
    (("speculative", "type"), "eagle", "speculative.type must be one of mtp, dspark, ngram, got 'eagle'"),
    (("speculative", "frobnicate"), 1, "speculative: unknown key 'frobnicate'"),
    (("speculative", "rows"), "many", "speculative.rows must be a list of mappings"),
    (("speculative", "profile"), {"hardware": 3}, "speculative.profile: "),
    (("speculative",), [1, 2], "speculative must be dict, got [1, 2]"),
    (("context",), 0, "context must be >= 1, got 0"),
    (("context",), "big", "context must be int, got 'big'"),
    (("ubatch",), 0, "ubatch must be >= 1, got 0"),
    (("cache_type",), "q9_9", "cache_type: "),
    (("layout", "n_gpu_layers"), 99, "layout.n_gpu_layers must be 0 .. block_count + 1 (6), got 99"),
    (("layout", "n_gpu_layers"), -2, "layout.n_gpu_layers must be 0 .. block_count + 1"),
    (("layout", "tensor_split"), [float("inf")], "layout.tensor_split must be a list of finite numbers >= 0"),
    (("layout", "block_count"), 0, "layout.block_count must be >= 1, got 0"),
    (("layout", "stride"), 2, "layout: unknown key 'stride'"),
    (("devices", 0, "budget"), -5, "devices[0].budget must be >= 0"),
    (("devices", 0, "budget"), "lots", "devices[0].budget"),
    (("rules",), [{"pattern": "(", "device": "CPU"}], "rules[0]"),
    (("notes",), [1], "notes must be a list of strings"),
    (("version",), 2, "unsupported plan version 2"),
    (("model",), "", "model must name the GGUF file"),
    (("routing",), {"kind": "plan"}, "routing: not a routing profile"),
    (("routing",), {"version": 1, "kind": "routing", "n_expert": 4, "n_expert_used": 2, "tokens": 2,
                    "layers": {"blk.1": [1, 1, 1]}}, "routing: routing profile: blk.1 needs 4"),
]


@pytest.mark.parametrize("path,value,message", CASES, ids=[".".join(map(str, c[0])) + f"={c[1]!r}" for c in CASES])
def test_bad_plan_file_is_refused_naming_the_key(good_plan, path, value, message):
    text = yaml.safe_dump(_set(good_plan, path, value), sort_keys=False)
    with pytest.raises(PlacementError) as err:
        load_plan_file(text, "plan.yaml")
    msg = str(err.value)
    print(msg)
    assert message in msg and msg.startswith("plan.yaml:") and "\n" not in msg


def test_the_good_plan_loads(good_plan):
    pf = load_plan_file(yaml.safe_dump(good_plan, sort_keys=False), "plan.yaml")
    assert pf.speculative.n_max == good_plan["speculative"]["n_max"]


def test_run_with_a_bad_plan_file_exits_2_with_one_line(good_plan, tmp_path, capsys):
    plan = tmp_path / "bad.yaml"
    plan.write_text(yaml.safe_dump(_set(good_plan, ("speculative", "n_max"), "two"), sort_keys=False))
    assert cli_main(["run", "--placement", str(plan), "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "speculative.n_max must be an integer >= 0, got 'two'" in err
