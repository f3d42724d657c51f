"""``--spec-n-max auto`` (``offload.online_n_max``): the measured step costs, the choice the
policy makes from them and from the measured acceptance (hand-computed cases, alone and
beside other sequences), its probe at n = 0, the ε-greedy comparator, and end to end on
the shipped model: lossless (exact verify gives plain greedy's text, alone and batched) and
reported in the stats.

The hand-computed cases use 10,000 observed steps per position, so the prior
(``PRIOR_STEPS`` = 8 steps of the default profile) moves each a_j by < 1e-3: a_1 = 0.9,
a_2 = 0.8, a_3 = 0.1 give E(0..3) = 1, 1.9, 2.62, 2.692 tokens per step.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from offload.online_n_max import PROBE_EVERY, EpsilonGreedy, OnlineNMax, StepCosts
from offload.stats import RunStats

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"


def measured(rows_ms: dict[int, float], draft_ms: float = 0.0) -> StepCosts:
    """Forward times by rows and a steady drafting time per drafted token, as if measured."""
    costs = StepCosts()
    for r, ms in rows_ms.items():
        costs.record(r, ms / 1e3)
    costs.record_draft(draft_ms / 1e3)
    return costs


def policy_for(n_cap: int, costs: StepCosts, **kw) -> OnlineNMax:
    """A policy on hand-set costs: the batcher's kind, which times the forward passes itself
    (so the hand-made stats add no measurement)."""
    return OnlineNMax(n_cap, costs, timed_by_batcher=True, **kw)


def stats_with(accept: list[float], steps: int = 10_000) -> RunStats:
    st = RunStats(n_prompt=1)
    st.n_steps = steps
    reached, run = [], steps
    for a in accept:
        reached.append(run)
        run = round(run * a)
    st.reached_per_position = reached
    st.accepted_per_position = reached[1:] + [run]
    st.drafted_per_position = list(reached)
    return st


def test_step_costs_interpolate_and_extend_the_measured_line():
    costs = measured({1: 1.0, 5: 2.0})
    assert costs.time(3) == pytest.approx(1.5e-3)
    assert costs.time(9) == pytest.approx(3.0e-3)         # the line through both, beyond them
    one = measured({2: 1.0})                               # one count: 10 % of it per further row
    assert one.time(4) == pytest.approx(1.2e-3)
    assert StepCosts().time(3) is None


def test_auto_alone_picks_the_n_the_measured_rates_favour():
    """t(R) = 1, 1.2, 1.4, 1.6 ms for 1..4 rows: tokens/ms = 1, 1.583, 1.871, 1.683 → n = 2."""
    policy = policy_for(3, measured({1: 1.0, 4: 1.6}))
    assert policy(stats_with([0.9, 0.8, 0.1])) == 2
    assert policy.report() == {"policy": "auto", "n_max_chosen": 2, "n_max_mean": 2.0}


def test_auto_counts_the_other_sequences_of_the_step():
    """Measured: 1, 1.05, 1.1 ms for 1..3 rows, 2 ms at 9, 3 ms at 10. Alone: 1, 1.81, 2.38,
    2.15 tokens/ms → n = 2. Beside eight one-token sequences (8 rows, 8 tokens): 9/2 = 4.5
    at n = 0 against 9.9/3 = 3.3 at n = 1 (and less beyond) → n = 0."""
    costs = measured({1: 1.0, 2: 1.05, 3: 1.1, 9: 2.0, 10: 3.0})
    st = stats_with([0.9, 0.8, 0.1])
    alone = policy_for(3, costs)
    assert alone(st) == 2
    alone.close()
    others = [policy_for(3, costs) for _ in range(8)]
    for o in others:
        costs.share(id(o), 1, 1.0, 0.0)
    assert policy_for(3, costs)(st) == 0


def test_a_drafter_never_accepted_falls_to_zero_and_still_probes():
    policy = policy_for(4, measured({1: 1.0, 5: 1.8}))
    st = stats_with([0.0, 0.0, 0.0, 0.0])
    picks = []
    for _ in range(2 * PROBE_EVERY):
        picks.append(policy(st))
        st.n_steps += 1
    assert picks.count(1) == 2 and set(picks) == {0, 1}          # one probe per PROBE_EVERY steps
    assert picks[PROBE_EVERY - 1] == 1


def test_a_steps_own_overhead_makes_fewer_longer_steps_pay():
    """t(R) = 1, 1.5 ms for 1, 2 rows, 0.5 ms per drafted token, a_1 = 0.9: counting the
    forward and drafting only, n = 1 gives 1.9 tokens in 2 ms against 1 in 1 ms → n = 0; with
    2 ms a step costs the sequence besides (loop, hand-over), 1.9 in 4 ms beats 1 in 3 → n = 1."""
    st = stats_with([0.9])
    assert policy_for(1, measured({1: 1.0, 2: 1.5}, draft_ms=0.5))(st) == 0
    costs = measured({1: 1.0, 2: 1.5}, draft_ms=0.5)
    costs.record_overhead(0.002)
    assert policy_for(1, costs)(st) == 1


def test_no_probe_where_even_accepted_drafts_would_lose():
    """t(R) = 1, 2.5, 4, 5.5 ms for 1..4 rows and 0.5 ms per drafted token: with every draft
    accepted, n = 1 gives 2 tokens in 3 ms (0.67 per ms), n = 2 3 in 5 ms, against 1 per ms
    plain: a probe could only lose, so the policy never drafts."""
    policy = policy_for(3, measured({1: 1.0, 4: 5.5}, draft_ms=0.5))
    st = stats_with([0.0, 0.0, 0.0])
    picks = []
    for _ in range(3 * PROBE_EVERY):
        picks.append(policy(st))
        st.n_steps += 1
    assert set(picks) == {0}


def test_steady_drafting_time_is_timed_on_consecutive_drafting_steps_only():
    """A drafting step right after a plain one also runs the head over the pairs the plain
    steps left pending: its time is not the steady cost of a drafted token."""
    costs = StepCosts()
    policy = OnlineNMax(2, costs, timed_by_batcher=True)
    st = RunStats(n_prompt=1)
    for drafted, seconds in ((0, 0.0), (2, 0.010), (2, 0.002), (0, 0.0), (2, 0.012)):
        policy(st)
        st.n_steps += 1
        st.drafted += drafted
        st.draft_s += seconds
    policy(st)
    assert costs.draft_s == pytest.approx(0.001)          # only the second step's 2 ms / 2 drafts


def test_a_new_sequence_starts_from_what_earlier_ones_measured():
    """A sequence that drafted 100 steps with nothing accepted leaves that in the history; the
    next one (same costs, same drafter) chooses n = 0 at its first step, where the prior alone
    (a_1 = 0.77) would choose to draft. Another drafter's history does not apply."""
    costs = measured({1: 1.0, 4: 1.6})
    fresh = stats_with([0.0], steps=0)
    assert policy_for(3, costs)(fresh) > 0
    first = policy_for(3, costs)
    first(stats_with([0.0, 0.0, 0.0], steps=100))
    first.close()
    assert policy_for(3, costs)(fresh) == 0
    assert policy_for(3, costs, drafter="ngram")(fresh) > 0


def test_bandit_tries_every_n_then_keeps_the_fastest():
    bandit = EpsilonGreedy(2, epsilon=0.0)
    st = SimpleNamespace(n_gen=1, eval_s=0.0)
    rate = {0: 1.0, 1: 3.0, 2: 2.0}           # tokens per second of each n
    picks = []
    for _ in range(8):
        n = bandit(st)
        picks.append(n)
        st.n_gen += 3
        st.eval_s += 3 / rate[n]
    assert picks[:3] == [0, 1, 2] and set(picks[3:]) == {1}


@pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present")
def test_auto_is_lossless_alone_and_batched_and_reported():
    import offload.runtime as rt

    prompts = ["import os\n", "def main(argv):\n    ", "class Config:\n    "]
    with rt.load(SHIPPED, devices="CPU=16GiB", int8_prefill=False, quiet=True) as s:
        plain = [list(s.generate(p, max_tokens=24, stop_at_eos=False)) for p in prompts]
        auto = [list(s.generate(p, max_tokens=24, stop_at_eos=False, n_max="auto", verify="exact"))
                for p in prompts]
        assert auto == plain
        assert s.stats.spec["n_max_policy"]["policy"] == "auto" and s.stats.n_steps > 0
        together = s.generate_batch(prompts, max_tokens=24, stop_at_eos=False, n_max="auto", verify="exact")
        assert together == plain
        assert all(st.spec["n_max_policy"]["policy"] == "auto" for st in s.batch_stats)
        assert s._batcher.costs.time(2) is not None              # the batcher timed its steps
        with pytest.raises(Exception, match="a number, or one of auto, bandit"):
            list(s.generate("x", max_tokens=2, n_max="fast"))
