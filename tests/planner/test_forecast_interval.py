"""The forecast's interval (placement/uncertainty.py) and the profile fields behind it
(HardwareProfile.measured, the in-cache read rate): fixed inputs, pure math."""
from __future__ import annotations

import dataclasses

import pytest

from placement.acceptance import DEFAULT_MTP, AcceptanceProfile
from placement.cost import speculation_table
from placement.hardware import HardwareProfile, ProfileError
from placement.uncertainty import (MEASURED_SPREAD, PRIOR_SPREAD, ForecastInterval, InputSpread, forecast_interval,
                                   format_inputs)
from tests.planner.test_cost import _hand_footprint, _hand_profile

KINDS = tuple(PRIOR_SPREAD)


def _spread(**factors) -> InputSpread:
    """Every range zero-width except the ``factors`` given (kind -> (lo, hi))."""
    return InputSpread({k: factors.get(k, (1.0, 1.0)) for k in KINDS}, factors.get("draft", (1.0, 1.0)),
                       factors.get("accept", 0.0), (), False)


@pytest.mark.parametrize("acc", [AcceptanceProfile(accept=(0.5, 0.5)),
                                 AcceptanceProfile(accept=(0.8, 0.6, 0.4), cont=(0.9, 0.7), p_min=0.2)])
def test_zero_width_ranges_give_the_table_itself(acc):
    """The step time taken apart term by term (``step_coefficients``) is ``step_time``."""
    fp, hw = _hand_footprint(), _hand_profile(step_us=300.0, spec_step_us=50.0)
    table = speculation_table(fp, hw, acceptance=acc, max_n=3)
    iv = forecast_interval(fp, hw, table, spread=_spread())
    for row, (lo, hi) in zip(table.rows, iv.speedup):
        assert lo == pytest.approx(row.speedup, rel=1e-12) and hi == pytest.approx(row.speedup, rel=1e-12)
    assert iv.plain_tps == pytest.approx((table.plain_tps, table.plain_tps), rel=1e-12)


def test_one_term_range_is_the_table_at_its_ends():
    """Only the per-pass cost uncertain (x0.5-3): each row's range is spanned by the tables
    computed with forward_us at its two ends."""
    fp, hw = _hand_footprint(), _hand_profile()
    acc = AcceptanceProfile(accept=(0.5, 0.5))
    table = speculation_table(fp, hw, acceptance=acc, max_n=2)
    iv = forecast_interval(fp, hw, table, spread=_spread(forward=(0.5, 3.0)))
    ends = [speculation_table(fp, dataclasses.replace(hw, forward_us=hw.forward_us * f), acceptance=acc, max_n=2)
            for f in (0.5, 3.0)]
    for n, (lo, hi) in enumerate(iv.speedup):
        s = [t.rows[n].speedup for t in ends]
        assert lo == pytest.approx(min(s), rel=1e-12) and hi == pytest.approx(max(s), rel=1e-12)
    assert iv.plain_tps == pytest.approx((ends[1].plain_tps, ends[0].plain_tps), rel=1e-12)


def test_acceptance_and_draft_ranges_hand_computed():
    """a_j +- 0.1 and the draft pass x1-2 on the hand footprint at n = 1: S = E·T0/T1 with
    T1 = first + T_verify(2) (first: 0.043 or 0.044 s, half each at a = 0.5)."""
    fp, hw = _hand_footprint(), _hand_profile()
    acc = AcceptanceProfile(accept=(0.5,))
    table = speculation_table(fp, hw, acceptance=acc, max_n=1)
    iv = forecast_interval(fp, hw, table, spread=_spread(draft=(1.0, 2.0), accept=0.1))
    v0 = 0.01 + 0.02 + 2 * (0.01 + 0.01 * 2 + 0.003) + 5 * 4000 / 10e9
    v1 = 0.01 + 0.02 + 2 * (0.01 + 0.01 * 3 + 0.003) + 5 * 2 * 4000 / 10e9

    def s(a, d):
        first = (1 - a) * 0.043 + a * 0.044
        return (1 + a) * v0 / (d * first + v1)
    assert iv.speedup[1] == pytest.approx((s(0.4, 2.0), s(0.6, 1.0)), rel=1e-12)


def test_measured_terms_narrow_the_interval():
    fp = _hand_footprint()
    prior = _hand_profile()
    measured = dataclasses.replace(prior, measured=tuple(prior.linear_params()))
    acc = AcceptanceProfile(accept=(0.7, 0.6), source="offload tune")
    wide = InputSpread.of(prior, DEFAULT_MTP)
    narrow = InputSpread.of(measured, acc)
    assert wide.terms["forward"] == PRIOR_SPREAD["forward"] and not wide.acceptance_measured
    assert narrow.terms["forward"] == MEASURED_SPREAD and narrow.acceptance_measured
    assert narrow.accept_delta < wide.accept_delta and narrow.draft[1] < wide.draft[1]
    t_prior = speculation_table(fp, prior, acceptance=acc, max_n=3)
    i_prior = forecast_interval(fp, prior, t_prior, spread=wide)
    i_meas = forecast_interval(fp, measured, t_prior)
    for row, (plo, phi), (mlo, mhi) in zip(t_prior.rows, i_prior.speedup, i_meas.speedup):
        assert plo <= mlo <= row.speedup <= mhi <= phi
    assert "uncalibrated" in format_inputs(prior, wide, fp)
    text = format_inputs(measured, narrow, fp)
    assert text.startswith("measured on this box: ") and "uncalibrated" not in text
    assert "acceptance: measured (+-0.05)" in text


def test_break_even_range_and_advice_when_the_interval_crosses_one():
    fp, hw = _hand_footprint(), _hand_profile()
    table = speculation_table(fp, hw, acceptance=AcceptanceProfile(accept=(0.9,)), max_n=3)
    spread = _spread()
    crossing = ForecastInterval((90.0, 110.0), ((1.0, 1.0), (1.1, 1.4), (0.95, 1.3), (0.7, 1.02)), spread)
    assert crossing.break_even == (1, 3) and crossing.crosses_one
    text = crossing_text = table.format(crossing)
    assert "break-even n_max: 1-3 " in text and "run `offload tune`" in text
    assert "[90-110]" in text and " 0.95-1.30x" in crossing_text
    clear = ForecastInterval((90.0, 110.0), ((1.0, 1.0), (1.1, 1.4), (1.05, 1.3), (0.7, 0.9)), spread)
    assert clear.break_even == (2, 2) and not clear.crosses_one
    text = table.format(clear)
    assert f"break-even n_max: {table.break_even_n} " in text and "offload tune" not in text
    # without an interval the table is as before: no range column, no advice
    plain = table.format()
    assert "range" not in plain and "[" not in plain.splitlines()[0] and "offload tune" not in plain
    assert clear.to_dict()["break_even_n_max"] == [2, 2] and crossing.to_dict()["crosses_1x"] is True


def test_profile_measured_and_cache_rate_round_trip(tmp_path):
    hw = HardwareProfile(cpu_read_gbps=20.0, forward_us=400.0, measured=("forward", "cpu_read", "forward"),
                         cpu_cache_bytes=32 << 20, cpu_cache_read_gbps=60.0)
    assert hw.measured == ("cpu_read", "forward")
    path = tmp_path / "hw.yaml"
    import yaml
    path.write_text(yaml.safe_dump(hw.to_dict()))
    back = HardwareProfile.from_yaml(path)
    assert back == hw
    assert hw.for_cpu_weights(16 << 20).cpu_read_gbps == 60.0 and hw.for_cpu_weights(1 << 30).cpu_read_gbps == 20.0
    assert HardwareProfile().for_cpu_weights(0) == HardwareProfile()
    # a profile without them writes what it always wrote
    assert not {"measured", "cpu_cache_bytes", "cpu_cache_read_gbps"} & set(HardwareProfile().to_dict())
    fitted = HardwareProfile().with_linear_params({"forward": 1e-4}, source="fit")
    assert fitted.measured == ("forward",)
    with pytest.raises(ProfileError, match="measured: unknown parameter"):
        HardwareProfile.from_dict({"measured": ["gpu_read:CUDA0"]})
    with pytest.raises(ProfileError, match="measured must be a list"):
        HardwareProfile.from_dict({"measured": "forward"})


def test_draft_pass_term_is_charged_to_head_passes_only():
    """``draft_pass``: the NextN head's own per-pass cost, in every draft pass and no target
    pass (the footprint marks the head's pass); a profile without it writes what it wrote."""
    fp = _hand_footprint()
    fp = dataclasses.replace(fp, draft=dataclasses.replace(fp.draft, draft_head=True))
    acc = AcceptanceProfile(accept=(0.5,))
    base, extra = _hand_profile(), _hand_profile(draft_pass_us=500.0)
    t0 = speculation_table(fp, base, acceptance=acc, max_n=1)
    t1 = speculation_table(fp, extra, acceptance=acc, max_n=1)
    assert t1.rows[0].step_s == t0.rows[0].step_s
    assert t1.draft_s == pytest.approx(t0.draft_s + 5e-4, rel=1e-12)
    assert t1.rows[1].step_s == pytest.approx(t0.rows[1].step_s + 5e-4, rel=1e-12)   # n = 1: one head pass
    assert "draft_pass_us" not in base.to_dict() and extra.to_dict()["draft_pass_us"] == 500.0
    assert HardwareProfile.from_dict(extra.to_dict()) == extra
