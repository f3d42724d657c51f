"""``offload bench`` with a DSpark drafter (a dflash --draft) on the tiny deepseek4 trunk: by default
it runs dspark and ngram beside the baseline, prints one table per drafter, and its JSONL records
have, for dspark, exactly the fields and per-position arrays the other drafters' have; --spec-type
mtp with a dflash draft is one line."""
from __future__ import annotations

import json
import warnings

from tests.archs.test_dspark import TRUNK
from tests.tiny_models import write_tiny_dspark, write_tiny_model


def cli(capsys, *args):
    from offload.cli import main
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main([*map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bench_runs_dspark_beside_ngram_and_the_baseline(tmp_path, capsys):
    trunk = write_tiny_model(tmp_path / "trunk.gguf", TRUNK).path
    draft = write_tiny_dspark(tmp_path / "dspark.gguf", TRUNK).path
    jsonl = tmp_path / "bench.jsonl"
    rc, out, err = cli(capsys, "bench", trunk, "--draft", draft, "--devices", "CPU=16GiB", "-c", "1024",
                       "--tasks", "code", "--n-max", "1,3", "--repeat", "1", "-n", "12", "--jsonl", jsonl)
    assert rc == 0, err
    assert "drafter dspark:" in out and "drafter ngram:" in out and "dspark n=3" in out
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    runs = {r["stage"]: r for r in recs if r["kind"] == "run"}
    sums = {r["stage"]: r for r in recs if r["kind"] == "summary"}
    assert set(runs) == set(sums) == {"baseline", "dspark n=1", "dspark n=3", "ngram n=1", "ngram n=3"}
    for stage in ("dspark n=1", "dspark n=3"):
        # the same record as every drafter's (llama-spec-bench's fields and accepted-length definition)
        assert runs[stage].keys() == runs["ngram n=3"].keys() and sums[stage].keys() == sums["ngram n=3"].keys()
        r, s = runs[stage], sums[stage]
        n = s["n_max"]
        assert r["drafter"] == s["drafter"] == "dspark" and r["tokens"] == 12 and r["drafted"] > 0
        assert len(r["drafted_per_position"]) == len(r["accepted_per_position"]) == n
        assert len(s["acceptance_per_position"]) == len(s["acceptance_conditional"]) == n
        assert s["mean_accepted_length"] == 1 + s["accepted"] / r["steps"]
        assert s["same_text_as_baseline"] is not None


def test_bench_mtp_with_a_dflash_draft_is_one_line(tmp_path, capsys):
    trunk = write_tiny_model(tmp_path / "trunk.gguf", TRUNK).path
    draft = write_tiny_dspark(tmp_path / "dspark.gguf", TRUNK).path
    rc, out, err = cli(capsys, "bench", trunk, "--draft", draft, "--devices", "CPU=16GiB", "--spec-type", "mtp")
    assert rc == 2 and err.count("\n") == 1 and "draft with --spec-type dspark" in err and out == "", err
