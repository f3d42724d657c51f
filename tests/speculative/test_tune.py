"""``offload tune`` (offload/tune.py, offload/commands/tune.py) on the shipped model.

- tune with a small budget and --max-n 2 writes a plan section that `offload run` reads back
  (the n_max run uses is the plan's), the other sections untouched;
- the measured routing profile is consistent (distinct experts <= min(E, B k), non-decreasing
  in B, exactly k at B = 1) and the window counting matches a brute-force count;
- acceptance measured with a draft head that is the target itself is 1.0 at every position;
- the fit recovers synthetic parameters on the shipped plan's footprint; the loop overheads
  and the choice rule reproduce hand-computed cases;
- bad input: one line, status 2, the plan file untouched;
- the per-expert routing counts include the NextN block (as drafting routes it) and the plan
  stores them; the measured op-offload rates replace the profile's; on a virtual-GPU plan tune
  compares the plan without and with hot experts, predicted and measured.

No timing is asserted: the timings only have to exist and be positive.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

import offload.runtime as rt
from offload import tune as measure
from offload.bench_tasks import TASKS
from offload.commands.tune import FIT_FREE, choose, read_prompts
from offload.tune_result import MeasuredRow
from placement.cost_fit import fit_profile
from placement.hardware import HardwareProfile
from placement.speculative import plan_footprint
from tests.nextn_split import split_nextn
from tests.speculative.test_speculative_shipped import TargetAsHead

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
pytestmark = pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present")


@pytest.fixture(scope="module")
def session():
    with rt.load(SHIPPED, devices="CPU=16GiB", quiet=True) as s:
        yield s


def cli(capsys, *args):
    from offload.cli import main
    rc = main([*map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def plan_file(capsys, tmp_path):
    path = tmp_path / "plan.yaml"
    assert cli(capsys, "plan", SHIPPED, "--devices", "CPU=16GiB", "-o", path)[0] == 0
    return path


# -- the command end to end ----------------------------------------------------------------

def test_tune_writes_a_plan_that_run_uses(capsys, tmp_path, plan_file):
    before = yaml.safe_load(plan_file.read_text())
    out_json = tmp_path / "tune.json"
    rc, out, err = cli(capsys, "tune", "--placement", plan_file, "--max-n", "2", "--budget", "8s", "-n", "24",
                       "--json", out_json)
    assert rc == 0, err
    after = yaml.safe_load(plan_file.read_text())
    assert {k: v for k, v in after.items() if k not in ("speculative", "routing")} == \
        {k: v for k, v in before.items() if k != "speculative"}
    assert after["routing"]["kind"] == "routing" and sorted(after["routing"]["layers"]) == \
        ["blk.1", "blk.2", "blk.3", "blk.4"]                 # the measured profile, NextN block included
    spec = after["speculative"]
    # both drafters were measured (the MTP head and n-gram lookup); the plan names the chosen
    # one, the other is the runner-up with the measured margin between them
    assert spec["source"] == "tune" and spec["type"] in ("mtp", "ngram") and spec["p_min"] == 0.0
    assert spec["runner_up"]["type"] == ({"mtp", "ngram"} - {spec["type"]}).pop()
    assert spec["runner_up"]["margin"] >= 0
    assert spec["n_max"] in (0, 1, 2)
    assert [r["n_max"] for r in spec["rows"]] == [0, 1, 2]
    # tune runs every n_max when the budget left holds a repeat of all of them, else the core
    # set around the forecast's best (plain, n_max 1, best ± 1): which one depends on this
    # box's speed, so the rows must be what tune announced it would run, core included
    announced = re.search(r"runs: (plain(?:, \w+ \d+)*); about", err)
    assert announced, err
    stages = [("none", 0)] + [(k, int(n)) for k, n in (x.split() for x in announced.group(1).split(", ")[1:])]
    assert [(r["drafter"], r["n_max"]) for r in spec["measured_rows"]] == stages
    assert {("none", 0), ("mtp", 1), ("ngram", 1)} <= set(stages) <= {("none", 0)} | {
        (k, n) for k in ("mtp", "ngram") for n in (1, 2)}
    assert (spec["type"] if spec["n_max"] else "none", spec["n_max"]) in stages
    assert all(r["tokens_per_s_mean"] > 0 and r["repeats"] >= 1 for r in spec["measured_rows"])
    prof = spec["profile"]
    assert prof["hardware"]["source"].startswith("measured")
    assert prof["acceptance"]["source"] == "measured" and len(prof["acceptance"]["accept"]) <= 2
    assert prof["routing"]["source"] == "measured" and len(prof["routing"]["distinct"]) == 3
    assert "predicted vs measured" in out and "drafter mtp" in out and "drafter ngram" in out
    assert "several sequences at once (forecast from the fitted costs" in out      # -np 1, 2, 4, 8
    assert [r["sequences"] for r in json.loads(out_json.read_text())["concurrency_forecast"]] == [1, 2, 4, 8]
    # the forecast's per-sequence term under batching, from plain decoding of 2 and 4 at once
    batched = json.loads(out_json.read_text())["batched_measured"]
    assert [b["sequences"] for b in batched] == [2, 4]
    assert all(b["tokens"] == b["sequences"] * 23 and b["tokens_per_s"] > 0 for b in batched)
    assert prof["hardware"]["batch_step_us"] >= 0 and "measured, plain decoding: 2 sequences" in out
    assert f"chosen: drafter {spec['type']}, n_max {spec['n_max']}" in out and "runner-up" in out
    assert "calibrate" in err and "passes" in err and "acceptance" in err and "runs" in err
    d = json.loads(out_json.read_text())
    assert d["chosen_n_max"] == spec["n_max"] and set(d["verify_ms"]) == {"1", "2", "3"}
    assert set(d["draft_ms"]) == {"1", "2", "3"}
    assert all(v > 0 for v in d["verify_ms"].values()) and all(v > 0 for v in d["draft_ms"].values())
    assert [(t["drafter"], t["n_max"]) for t in d["terms"]] == [s for s in stages if s[0] != "ngram"] + \
        [s for s in stages if s[0] == "ngram"]
    assert d["terms"][0]["draft_pred"] == 0.0
    assert all(t["draft_pred"] == 0.0 for t in d["terms"] if t["drafter"] == "ngram")
    assert d["chosen_drafter"] == spec["type"] and set(d["drafters"]) == {"mtp", "ngram"}

    # offload run takes the plan's n_max (and says so); its stats carry it
    stats = tmp_path / "stats.json"
    rc, _, err = cli(capsys, "run", "--placement", plan_file, "-n", "12", "--ignore-eos", "--stats-json", stats)
    assert rc == 0, err
    n = spec["n_max"]
    if n:
        assert f"n_max {n} (from the plan's speculative.n_max (tune))" in err, err
        assert json.loads(stats.read_text())["spec"]["n_max"] == n
    else:
        assert "speculative decoding off: n_max 0 from the plan's speculative.n_max (tune)" in err, err

    # a later `offload plan --placement` refresh keeps tune's choice and measured profile
    again = tmp_path / "again.yaml"
    assert cli(capsys, "plan", "--placement", plan_file, "-o", again)[0] == 0
    refreshed = yaml.safe_load(again.read_text())
    kept = refreshed["speculative"]
    assert kept["n_max"] == n and kept["source"] == "tune" and kept["profile"] == prof
    assert refreshed["routing"] == after["routing"]          # and tune's routing counts


# -- routing ---------------------------------------------------------------------------------

def test_routing_profile_is_consistent(session):
    texts = [session.tokenize(t) for t in TASKS.values()]
    routing, layers = measure.measure_routing(session, texts, 6)
    cfg = session.config
    assert layers == [1, 2, 3]               # blk.0 is dense; every MoE layer's experts are on the CPU
    d = routing.distinct
    assert d[0] == cfg.n_expert_used          # one token picks k distinct experts
    for b, x in enumerate(d, start=1):
        assert x <= min(cfg.n_expert, b * cfg.n_expert_used)
    assert all(x <= y for x, y in zip(d, d[1:]))
    assert routing.n_expert == cfg.n_expert and routing.n_expert_used == cfg.n_expert_used
    # the routers are the model's own again
    assert all(not isinstance(session.model.blocks[i].ffn.router, measure._RecordingRouter) for i in layers)


def test_distinct_per_batch_matches_brute_force():
    rng = np.random.default_rng(5)
    ids = [np.stack([rng.choice(8, 2, replace=False) for _ in range(t)]) for t in (9, 5)]
    got = measure.distinct_per_batch(ids, 3)
    want = []
    for b in range(1, 4):
        counts = [len(set(a[s:s + b].ravel().tolist())) for a in ids for s in range(a.shape[0] - 3 + 1)]
        want.append(sum(counts) / len(counts))
    assert got == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError):
        measure.distinct_per_batch([ids[1][:2]], 3)


# -- acceptance ------------------------------------------------------------------------------

def test_acceptance_of_the_target_as_its_own_head_is_one(session):
    """With one-token passes everywhere (ubatch 1, exact verify) the stand-in head sees the
    target's own logits, so every draft is accepted (as in test_speculative_shipped)."""
    prompts = [session.tokenize("import os\nimport sys\n\n\ndef main(argv):\n    ")]
    acc, runs = measure.measure_acceptance(session, prompts, n_max=3, p_min=0.0, n_tokens=20, verify="exact",
                                           ubatch=1, head=TargetAsHead(session.model, prompts[0][0]))
    assert acc.accept == (1.0, 1.0, 1.0) and acc.source == "measured"
    assert runs[0].drafted == runs[0].accepted > 0
    assert acc.expected_tokens(3) == 4.0


def test_acceptance_from_counts_hand_computed():
    # 10 steps; position 1 reached 10, accepted 6; position 2 reached 6, accepted 3;
    # under p_min: position 1 drafted 8 of 10 steps, position 2 drafted 4 of those 8.
    r = measure.Decode([1], [1] * 20, 2, 1.0, 10, 12, 9, 0.1, 0.5, [6, 3], [8, 4], [10, 6])
    a = measure.acceptance_from([r], 2, 0.3)
    assert a.accept == pytest.approx((0.6, 0.5)) and a.cont == pytest.approx((0.8, 0.5)) and a.p_min == 0.3
    assert measure.acceptance_from([r], 2, 0.0).cont == (1.0,)


# -- fit and loop overheads ------------------------------------------------------------------

def test_fit_recovers_synthetic_parameters_on_the_shipped_footprint(session):
    from offload.gguf_model import open_model
    fp = plan_footprint(session.plan, open_model(str(SHIPPED)), None)
    texts = [session.tokenize(t) for t in TASKS.values()]
    routing, _ = measure.measure_routing(session, texts, 5)
    truth = HardwareProfile(cpu_read_gbps=3.0, cpu_compute_gbps=12.0, cpu_layer_us=900.0, forward_us=400.0)
    params = truth.linear_params()
    from placement.cost import forward_features
    t = lambda feats: sum(c * params[k] for k, c in feats.items())  # noqa: E731
    verify = {b: t(forward_features(fp.target, b, n_embd=fp.n_embd, routing=routing)) for b in range(1, 6)}
    draft = t(forward_features(fp.draft, 1, n_embd=fp.n_embd, routing=routing))
    fit = fit_profile(fp, HardwareProfile(), verify_s=verify, draft_s=draft, free=FIT_FREE, routing=routing)
    got = fit.profile
    assert got.cpu_read_gbps == pytest.approx(3.0, rel=1e-6)
    assert got.cpu_compute_gbps == pytest.approx(12.0, rel=1e-6)
    assert got.cpu_layer_us == pytest.approx(900.0, rel=1e-6)
    assert got.forward_us == pytest.approx(400.0, rel=1e-6)
    assert fit.max_rel_error < 1e-9


def _run(eval_s, steps, draft_s, verify_s, sample_s=0.0):
    return measure.Decode([1], [1] * 10, 2, eval_s, steps, 0, 0, draft_s, verify_s, [], [], [], "none", sample_s)


def test_loop_overheads_hand_computed():
    # the loop's own time per step is what the stats book to neither drafting nor verifying:
    # plain runs 0.5, 0.3, 0.4 ms/step -> median 0.4 ms; drafting runs 1.0 and 0.6 ms/step ->
    # median 0.8 ms, of which 0.4 ms is the plain loop's: +0.4 ms when drafting.
    pt = measure.PassTimes({1: [0.010]}, {1: [0.003]})
    pt.plain = [_run(0.105, 10, 0.0, 0.100), _run(0.103, 10, 0.0, 0.100), _run(0.104, 10, 0.0, 0.100)]
    pt.spec = [_run(0.084, 4, 0.030, 0.050), _run(0.0824, 4, 0.030, 0.050)]
    step, extra = pt.loop_overheads()
    assert step == pytest.approx(0.0004, rel=1e-9) and extra == pytest.approx(0.0004, rel=1e-9)
    # choosing the tokens is timed inside the verify step, yet no pass time holds it: it is the
    # loop's too (0.1 ms/step of sampling in every plain run, 0.2 in every drafting one)
    pt.plain = [_run(0.105, 10, 0.0, 0.100, 0.001), _run(0.103, 10, 0.0, 0.100, 0.001),
                _run(0.104, 10, 0.0, 0.100, 0.001)]
    pt.spec = [_run(0.084, 4, 0.030, 0.050, 0.0008), _run(0.0824, 4, 0.030, 0.050, 0.0008)]
    step, extra = pt.loop_overheads()
    assert step == pytest.approx(0.0005, rel=1e-9) and extra == pytest.approx(0.0005, rel=1e-9)


def test_a_decode_books_the_time_its_tokens_were_chosen_in(session):
    """``decode`` carries the eval profile's sampling time: a few µs a token greedy, more with
    llama.cpp's chain (its top-k over the vocabulary), and inside the verify time either way."""
    prompt = session.tokenize("The quick brown fox")
    greedy = measure.decode(session, prompt, n_tokens=12)
    sampled = measure.decode(session, prompt, n_tokens=12, **measure.RUN_SAMPLING)
    for r in (greedy, sampled):
        assert 0 < r.sample_s < r.verify_s
    assert len(sampled.tokens) == 12


def test_choice_rule():
    def row(n, sp):
        return MeasuredRow(n_max=n, repeats=len(sp), tokens_per_s_mean=1.0, tokens_per_s_std=0.0,
                           speedup_mean=float(np.mean(sp)), speedup_std=0.0, speedups=tuple(sp),
                           expected_tokens=1.0, step_ms=1.0, draft_ms=0.0, verify_ms=1.0)
    base = row(0, [1.0, 1.0, 1.0])
    # n=2 is better than the predicted 1 in every repeat by ~0.1: clearly better
    measured = [base, row(1, [1.10, 1.12, 1.08]), row(2, [1.20, 1.21, 1.19])]
    assert choose(1, measured)[0] == 2
    # within noise (paired differences +0.1, -0.1, +0.05): keep the prediction
    measured = [base, row(1, [1.10, 1.12, 1.08]), row(2, [1.20, 1.02, 1.13])]
    assert choose(1, measured)[0] == 1
    # one repeat cannot tell noise from a difference
    assert choose(1, [row(0, [1.0]), row(1, [1.1]), row(2, [1.3])])[0] == 1


def test_read_prompts(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\nline two\n\n\nsecond\n")
    assert read_prompts(str(f)) == ["first prompt\nline two", "second"]
    f.write_text("def f():\n\n    return 1\n---\nclass A:\n    pass\n")
    assert read_prompts(str(f)) == ["def f():\n\n    return 1", "class A:\n    pass"]


# -- bad input -------------------------------------------------------------------------------

@pytest.mark.full      # a second 8 s tune; the default tier's tune measures n-grams beside MTP
def test_tune_without_a_draft_head_chooses_among_ngram_and_plain(capsys, tmp_path):
    """A model without a NextN head (the shipped trunk) is tuned with the n-gram drafter:
    verify passes only (no head), a plan section of type ngram (or n_max 0) that run uses."""
    trunk = tmp_path / "trunk.gguf"
    split_nextn(SHIPPED, trunk, tmp_path / "mtp.gguf")
    plan = tmp_path / "plan.yaml"
    rc, out, err = cli(capsys, "tune", trunk, "--devices", "CPU=16GiB", "--max-n", "2", "--budget", "8s",
                       "-n", "24", "-o", plan)
    assert rc == 0, err
    spec = yaml.safe_load(plan.read_text())["speculative"]
    assert spec["type"] == "ngram" and spec["runner_up"] is None and spec["source"] == "tune"
    assert {r["drafter"] for r in spec["measured_rows"]} == {"none", "ngram"}
    assert "drafter ngram" in out and "drafter mtp" not in out and "no draft head" in out
    rc, _, err = cli(capsys, "run", "--placement", plan, "-n", "8", "--ignore-eos")
    assert rc == 0, err
    assert (f"ngram from the context (longest lookup 12), n_max {spec['n_max']} (from the plan's" in err
            if spec["n_max"] else "n_max 0 from the plan's speculative.n_max (tune)" in err), err


def test_bad_input_is_one_line_status_2_and_leaves_the_plan(capsys, tmp_path, plan_file):
    trunk, draft = tmp_path / "trunk.gguf", tmp_path / "mtp.gguf"
    split_nextn(SHIPPED, trunk, draft)
    other_plan = tmp_path / "other.yaml"
    assert cli(capsys, "plan", trunk, "--devices", "CPU=16GiB", "-o", other_plan)[0] == 0
    empty, binary = tmp_path / "empty.txt", tmp_path / "bin.txt"
    empty.write_text("\n\n  \n")
    binary.write_bytes(b"\xff\xfe\x00prompt")
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text(" ".join(["x = 1"] * 400))
    original = plan_file.read_bytes()
    never = tmp_path / "never.json"
    cases = [
        (("--placement", plan_file, "--budget", "5s"), "at least 8s"),
        (("--placement", plan_file, "--budget", "soon"), "--budget"),
        (("--placement", plan_file, "--max-n", "0"), "--max-n"),
        (("--placement", plan_file, "--spec-p-min", "1.5"), "--spec-p-min"),
        (("--placement", plan_file, "--prompts", tmp_path / "missing.txt"), "missing.txt"),
        (("--placement", plan_file, "--prompts", empty), "no prompt"),
        (("--placement", plan_file, "--prompts", binary), "not UTF-8"),
        (("--placement", plan_file, "--prompts", long_prompt), "context"),
        ((trunk, "--placement", plan_file), "is a plan for"),
        (("--placement", other_plan, "--spec-type", "mtp"), "no NextN"),
        (("--placement", plan_file, "--spec-type", "eagle3"), "--spec-type"),
        ((trunk, "--devices", "CPU=16GiB", "--spec-type", "draft-mtp", "-o", tmp_path / "never.yaml"), "no NextN"),
    ]
    for args, needle in cases:
        rc, out, err = cli(capsys, "tune", *args, "--json", never)
        lines = err.strip().splitlines()
        assert rc == 2 and lines[-1].startswith("offload: error:") and needle in lines[-1], (args, err)
        assert "Traceback" not in err and out == ""
    assert plan_file.read_bytes() == original
    assert not never.exists() and not (tmp_path / "never.yaml").exists()


def test_help_names_every_phase(capsys):
    with pytest.raises(SystemExit):
        cli(capsys, "tune", "--help")
    out = capsys.readouterr().out
    for word in ("calibrate", "passes", "routing", "acceptance", "fit", "runs", "--budget", "--prompts",
                 "--max-n", "-o", "--json", "---"):
        assert word in out, word


def test_measured_rows_hand_computed():
    """Speedup = tokens/s over the baseline's of the same repeat: repeat 0 9 vs 18 t/s (2.0),
    repeat 1 9 vs 12 t/s (4/3); mean 5/3. n_max 1 made 18 tokens in 10 steps: E = 1.8."""
    from offload.commands.tune import _measured_rows
    from offload.tune_result import RunRecord

    def rec(rep, n, eval_s, steps):
        return RunRecord(rep, "p", measure.Decode([1], [1] * 10, n, eval_s, steps, 0, 0, 0.0, eval_s, [], [], [],
                                                  "ngram" if n else "none"))
    rows = _measured_rows([rec(0, 0, 1.0, 9), rec(0, 1, 0.5, 5), rec(1, 0, 1.0, 9), rec(1, 1, 0.75, 5)],
                          [("none", 0), ("ngram", 1)])
    base, one = rows
    assert base.speedups == (1.0, 1.0) and one.repeats == 2 and (base.drafter, one.drafter) == ("none", "ngram")
    assert one.speedups == pytest.approx((2.0, 4 / 3)) and one.speedup_mean == pytest.approx(5 / 3)
    assert one.expected_tokens == pytest.approx(1.8) and one.step_ms == pytest.approx(125.0)
    assert one.section_dict()["speedup_mean"] == 1.6667 and "speedups" not in one.section_dict()


# -- routing counts (NextN included), the op-offload rates, hot experts ---------------------

def test_routing_counts_include_the_nextn_block_and_restore_the_routers(session):
    texts = [session.tokenize(TASKS["code"])[:40], session.tokenize(TASKS["story"])[:30]]
    counts = measure.routing_counts(session, texts, ["code", "story"], source="test", model="m", max_batch=3)
    cfg = session.config
    nextn = measure.own_nextn_layer(session)
    assert nextn == cfg.n_layer == 4                          # the shipped model: blk.4 is its NextN block
    assert sorted(counts.layers) == measure.moe_layers(session) + [nextn]
    for layer, c in counts.layers.items():                    # every token routed once per layer, NextN too
        assert sum(c) == cfg.n_expert_used * 70
    assert [p.tokens for p in counts.prompts] == [40, 30]
    assert counts.layers[nextn] != counts.layers[1]
    assert counts.distinct[0] == cfg.n_expert_used
    # the head's routing is what drafting would route: the same pairs through the head directly
    head = session.model.nextn
    assert not isinstance(head.block.ffn.router, measure._RecordingRouter)
    assert all(not isinstance(b.ffn.router, measure._RecordingRouter) for b in session.model.blocks
               if isinstance(getattr(b, "ffn", None), measure.MoE))
    import torch
    ids = texts[1]
    rec = measure._RecordingRouter(head.block.ffn.router)
    with torch.inference_mode():
        state = session.model.new_state(head)
        z, h = session.model.forward(torch.as_tensor(ids), state, logits="last")
        head.block.ffn.router = rec
        try:
            head(torch.as_tensor(ids[1:] + [int(torch.argmax(z[-1]))]), h, torch.arange(1, len(ids) + 1),
                 state.nextn_cache, logits="none")
        finally:
            head.block.ffn.router = rec.router
    direct = np.bincount(np.concatenate(rec.ids).ravel(), minlength=cfg.n_expert)
    assert list(counts.prompts[1].layers[nextn]) == [float(x) for x in direct]


def test_flops_per_assignment_is_two_per_expert_parameter(session):
    from offload.gguf_model import open_model
    from placement.op_offload import flops_per_assignment

    m = open_model(SHIPPED)
    tensors, spec = m.tensors, m.spec
    # gate, up: (n_ff, n_embd); down: (n_embd, n_ff) per expert
    assert flops_per_assignment(tensors, 1) == 2.0 * 3 * spec.n_ff_exp * spec.n_embd
    got = measure.measure_cpu_batched(session, tensors, batch=64, repeats=1)
    assert got is not None and got[0] > 0 and got[1] == 1 and got[2] > 0


def test_measured_rates_replace_the_profile_values():
    from offload.commands.tune import with_prefill_rates
    from placement.hardware import GpuProfile

    hw = HardwareProfile(gpus={"CUDA0": GpuProfile("x", 900.0, 25.0), "CUDA1": GpuProfile("y", 900.0, 25.0)})
    rates = measure.PrefillRates(42.0, 1, 512, 0.1, {"CUDA0": 12.5}, ())
    out = with_prefill_rates(hw, rates)
    assert out.cpu_batched_gflops == 42.0 and out.gpus["CUDA0"].link_gbps == 12.5
    assert out.gpus["CUDA1"] == hw.gpus["CUDA1"]
    kept = with_prefill_rates(hw, measure.PrefillRates(None, None, 512, 0.0, {}, ("no CPU layer",)))
    assert kept == hw


def test_tune_on_virtual_gpus_compares_hot_experts_and_stores_routing_and_rates(capsys, tmp_path):
    """A plan with room for hot experts on a (virtual) GPU: tune writes the routing it measured
    into the plan (and --routing-out), the measured CPU batched rate into the profile, and
    compares the plan without and with hot experts, predicted and measured."""
    from placement.plan_file import load_plan_file
    from placement.routing import RoutingCounts

    plan = tmp_path / "plan.yaml"
    assert cli(capsys, "plan", SHIPPED, "--devices", "CUDA0=20MiB,CPU=4GiB", "--cpu-moe", "--fit", "on",
               "--fit-target", "0", "-o", plan)[0] == 0
    out_json, routing = tmp_path / "tune.json", tmp_path / "routing.yaml"
    rc, out, err = cli(capsys, "tune", "--placement", plan, "--virtual-gpus", "--max-n", "2", "--budget", "8s",
                       "-n", "16", "--json", out_json, "--routing-out", routing)
    assert rc == 0, err
    d = json.loads(out_json.read_text())
    pf = load_plan_file(plan.read_text(), str(plan))
    assert pf.routing is not None and sorted(pf.routing.layers) == [1, 2, 3, 4]
    assert RoutingCounts.from_file(str(routing)) == pf.routing
    rates = d["op_offload_rates"]
    assert rates["cpu_batched_gflops"] > 0 and rates["link_gbps"] == {}
    assert any("CUDA0" in n and "no CUDA device" in n for n in rates["notes"])
    hw = pf.speculative.profile.hardware
    assert hw.cpu_batched_gflops == rates["cpu_batched_gflops"]     # what offload run --placement reads
    hot = d["hot_experts"]
    assert hot["virtual_gpus"] is True and "CUDA0" in hot["hot_experts"]
    assert all(v > 0 for side in hot["measured_plain_tps"].values() for v in side)
    assert len(hot["measured_plain_tps"]["without"]) == len(hot["measured_plain_tps"]["with"]) >= 1
    assert hot["predicted_plain_tps"]["with"] >= hot["predicted_plain_tps"]["without"] > 0
    assert "without hot experts" in out and "CPU-backed" in out
