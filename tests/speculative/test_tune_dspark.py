"""``offload tune`` with a DSpark drafter (a dflash --draft) on the tiny deepseek4 trunk: it
measures DSpark beside n-gram lookup — acceptance per position, its draft call per block size,
the injection of the kept tokens, verify — fits, predicts with the block cost terms, runs both,
and writes the best (drafter, n_max, p_min) with the runner-up and the margin. No timing is
asserted: the timings only have to exist and be positive."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.archs.test_dspark import TRUNK
from tests.speculative.test_bench_dspark import cli
from tests.tiny_models import write_tiny_dspark, write_tiny_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune-dspark")
    return write_tiny_model(d / "trunk.gguf", TRUNK).path, write_tiny_dspark(d / "dspark.gguf", TRUNK).path


def test_tune_measures_dspark_and_ngram_and_writes_the_choice(pair, tmp_path, capsys):
    trunk, draft = pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat on the mat and the dog\n\nsome text to continue with more words\n")
    out, js = tmp_path / "plan.yaml", tmp_path / "tune.json"
    # the small budget and -n keep this near 25 s; no --spec-type: dspark (the dflash draft) and ngram.
    # 20 s, not tune's 8 s minimum: the rows below need every n_max run, which a tight budget on a
    # loaded box trims to the core set
    rc, stdout, err = cli(capsys, "tune", trunk, "--draft", draft, "--devices", "CPU=16GiB", "-c", "512",
                          "--prompts", prompts, "--max-n", "2", "--budget", "20s", "-n", "16", "-o", out,
                          "--json", js)
    assert rc == 0, err
    spec = yaml.safe_load(out.read_text())["speculative"]
    assert spec["source"] == "tune" and spec["type"] in ("dspark", "ngram")
    assert spec["runner_up"]["type"] == ({"dspark", "ngram"} - {spec["type"]}).pop()
    assert spec["runner_up"]["margin"] >= 0
    assert {(r["drafter"], r["n_max"]) for r in spec["measured_rows"]} >= {("none", 0), ("dspark", 1), ("dspark", 2)}
    doc = json.loads(js.read_text())
    assert doc["head_drafter"] == "dspark" and set(doc["drafters"]) == {"dspark", "ngram"}
    # a block drafter's passes: its draft call per block size and the injection of B kept tokens
    assert set(doc["draft_ms"]) == {"1", "2"} and set(doc["inject_ms"]) == {"1", "2", "3"}
    assert all(t > 0 for t in [*doc["draft_ms"].values(), *doc["inject_ms"].values()])
    assert [t for t in doc["terms"] if t["drafter"] == "dspark" and t["n_max"] and t["draft_pred"] > 0]
    acc = doc["acceptance"]["0.0"]["accept"]
    assert all(0 <= a <= 1 for a in acc)
    for needle in ("drafter dspark:", "predicted vs measured (dspark", "drafter ngram", "T_inject(B)",
                   "chosen: drafter", "runner-up: drafter"):
        assert needle in stdout, needle


def test_tune_dspark_without_a_dflash_draft_is_one_line(pair, capsys):
    rc, _, err = cli(capsys, "tune", pair[0], "--devices", "CPU=16GiB", "-c", "512", "--spec-type", "dspark",
                     "--budget", "8s")
    assert rc == 2 and err.count("\n") == 1 and "needs a DSpark drafter" in err, err
