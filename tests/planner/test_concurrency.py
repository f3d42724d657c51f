"""Several sequences at once (``placement.concurrency``): aggregate t/s and break-even n_max
per number of active sequences, hand-computed on test_cost's round-number box, and
``offload plan``'s table whose one-sequence row is the n_max table's."""
from __future__ import annotations

import json

import pytest

from placement.acceptance import AcceptanceProfile
from placement.concurrency import concurrency_table
from placement.footprint import DecodeFootprint, FootprintError
from tests.planner.test_cost import _hand_footprint, _hand_profile


def verify_s(b: int) -> float:
    """test_cost's hand footprint, one pass of b tokens: forward 0.01 + head 0.02, per layer
    dense 0.01 + U(b) experts x 0.01 + 0.003 layer terms, 5 copies of b x 4000 bytes at 10 GB/s;
    U(b) = 4 (1 - (1/2)^b) distinct experts of E = 4, k = 2."""
    u = 4 * (1 - 0.5 ** b)
    return 0.03 + 2 * (0.013 + 0.01 * u) + 5 * b * 4000 / 10e9


def test_hand_computed_rows_for_a_free_drafter():
    """n-gram drafting (no passes): S sequences verify S(1 + n) tokens in one pass. With a = 0.5,
    E(1) = 1.5, so S(1) at S sequences = 1.5 v(S) / v(2S); plain aggregate = S / v(S)."""
    fp = _hand_footprint()
    headless = DecodeFootprint(fp.target, None, fp.n_embd)
    rows = concurrency_table(headless, _hand_profile(), acceptance=AcceptanceProfile(accept=(0.5,)), max_n=1,
                             draft_kind="free", sequences=(1, 2, 4))
    for row, s in zip(rows, (1, 2, 4)):
        assert row.sequences == s
        assert row.plain_tps == pytest.approx(s / verify_s(s), rel=1e-12)
        gain = 1.5 * verify_s(s) / verify_s(2 * s)
        assert row.best_n == 1 and row.break_even_n == 1
        assert row.speedup == pytest.approx(gain, rel=1e-12)
        assert row.best_tps == pytest.approx(s * 1.5 / verify_s(2 * s), rel=1e-12)
    # 1.241, 1.328, 1.448: with E = 4 experts a batch of 2S tokens touches hardly more than S do
    assert [round(r.speedup, 3) for r in rows] == [1.241, 1.328, 1.448]


def test_each_sequence_pays_its_own_loop_time():
    """The loop's step time (sampling, the generation loop) is each sequence's: plain aggregate
    = S / (v(S) + S · step)."""
    fp = _hand_footprint()
    headless = DecodeFootprint(fp.target, None, fp.n_embd)
    hw = _hand_profile().with_linear_params({"step": 0.004, "spec_step": 0.0}, source="hand")
    rows = concurrency_table(headless, hw, acceptance=AcceptanceProfile(accept=(0.5,)), max_n=1,
                             draft_kind="free", sequences=(1, 4))
    for row, s in zip(rows, (1, 4)):
        assert row.plain_tps == pytest.approx(s / (verify_s(s) + s * 0.004), rel=1e-12)
        assert row.best_tps == pytest.approx(s * 1.5 / (verify_s(2 * s) + s * 0.004), rel=1e-12)


def test_one_sequence_is_the_n_max_table_and_bad_input():
    from placement.cost import speculation_table
    fp, hw = _hand_footprint(), _hand_profile()
    acc = AcceptanceProfile(accept=(0.5, 0.5))
    one, = concurrency_table(fp, hw, acceptance=acc, max_n=2, sequences=(1,))
    tab = speculation_table(fp, hw, acceptance=acc, max_n=2)
    assert one.plain_tps == pytest.approx(tab.plain_tps, rel=1e-12)
    assert (one.best_n, one.break_even_n) == (tab.best.n, tab.break_even_n)
    with pytest.raises(FootprintError):
        concurrency_table(DecodeFootprint(fp.target, None, fp.n_embd), hw, acceptance=acc, max_n=2)
    with pytest.raises(ValueError):
        concurrency_table(fp, hw, acceptance=acc, max_n=2, sequences=(0,))


def test_offload_plan_prints_and_saves_the_table(capsys):
    from offload.cli import main
    from offload.probe import SHIPPED_MODEL
    assert main(["plan", str(SHIPPED_MODEL), "--devices", "CPU=16GiB", "--no-probe", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["concurrency_forecast"]
    assert [r["sequences"] for r in rows] == [1, 2, 4, 8]
    spec = doc["speculative"]
    assert rows[0]["plain_tps"] == pytest.approx(spec["predicted_plain_tps"], rel=1e-3)
    assert rows[0]["best_n_max"] == spec["best_n_max"] and rows[0]["break_even_n_max"] == spec["break_even_n_max"]
    assert all(b["plain_tps"] > a["plain_tps"] for a, b in zip(rows, rows[1:]))   # batching pays on this box
    assert main(["plan", str(SHIPPED_MODEL), "--devices", "CPU=16GiB", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert "several sequences at once" in out and "break-even" in out


def test_batched_sequences_pay_the_measured_per_sequence_step():
    """With ``batch_step_us`` (``offload tune``'s batched runs) S >= 2 sequences each add that to
    a step, one sequence its own loop (``step_us``); ``batch_step_us`` reads it back from a
    measured step: the step minus the cost model's pass of S rows, per sequence."""
    from dataclasses import replace

    from placement.concurrency import batch_step_us
    from placement.hardware import HardwareProfile, ProfileError
    fp = _hand_footprint()
    headless = DecodeFootprint(fp.target, None, fp.n_embd)
    hw = replace(_hand_profile().with_linear_params({"step": 0.004, "spec_step": 0.0}, source="hand"),
                 batch_step_us=9000.0)
    rows = concurrency_table(headless, hw, acceptance=AcceptanceProfile(accept=(0.5,)), max_n=1,
                             draft_kind="free", sequences=(1, 2, 4))
    assert rows[0].plain_tps == pytest.approx(1 / (verify_s(1) + 0.004), rel=1e-12)
    for row, s in zip(rows[1:], (2, 4)):
        assert row.plain_tps == pytest.approx(s / (verify_s(s) + s * 0.009), rel=1e-12)
        assert batch_step_us(headless, hw, s, verify_s(s) + s * 0.009) == pytest.approx(9000.0, rel=1e-9)
    assert batch_step_us(headless, hw, 4, 0.5 * verify_s(4)) == 0.0        # the pass alone is slower
    assert HardwareProfile.from_dict(hw.to_dict()).batch_step_us == 9000.0
    assert "batch_step_us" not in _hand_profile().to_dict()
    with pytest.raises(ProfileError, match="batch_step_us"):
        HardwareProfile.from_dict({**hw.to_dict(), "batch_step_us": -1})
