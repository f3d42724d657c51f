"""The n-gram drafter (``offload.speculative.NgramDrafter``) and the drafter choice in the loop,
on the small exact Markov chains of ``test_speculative`` (no model file):

- lookup: the continuation of the longest earlier match, the most recent occurrence, never
  the current suffix itself, copying through a period, a bounded table;
- under exact verification the output is the target's: greedy equals plain decoding for every
  n_max 1–5, sampling keeps the target's distribution (chi-square; q is a point mass);
- ``--spec-type`` spellings (llama.cpp's too) and the one-line errors.
"""
from __future__ import annotations

import numpy as np
import pytest

from offload import speculative
from offload.errors import USER_ERRORS
from offload.sampling import Sampler
from offload.speculative import NgramDrafter, SpecOptions, generate_step
from offload.stats import RunStats
from placement.draft import spec_type
from tests.speculative.test_speculative import CHI2_CRIT, P_LOGITS, V, MarkovLM, State, chi2, markov_probs


def _drafter(tokens, size=4, guide=None):
    d = NgramDrafter(SpecOptions(n_max=1, type="ngram", ngram_size=size), guide)
    d.prime(None, tokens)
    return d


def test_draft_copies_what_followed_the_longest_latest_match():
    #          0  1  2  3  4  5  6  7  8  9
    d = _drafter([5, 6, 7, 1, 9, 6, 7, 2, 8, 5])
    # pending 6: suffix (5, 6) matched at 0..1 -> continues 7 1 9 (the 2-gram (6,7) is not the suffix)
    assert d.draft(6, 10, 3) == ([7, 1, 9], [None] * 3)
    # pending 7 after ... 5: suffix (5, 7) never seen, no 1-gram lookups: no draft
    assert d.draft(7, 10, 3) == ([], [])
    # the latest of two occurrences of (6, 7) wins (position 5..6, continuing 2 8)
    d = _drafter([5, 6, 7, 1, 9, 6, 7, 2, 8, 3, 6])
    assert d.draft(7, 11, 2)[0] == [2, 8]


def test_longer_matches_beat_shorter_ones_and_n_cap_bounds_the_draft():
    # (1, 2) occurs twice: after 0 1 2 comes 3, after 9 1 2 comes 4; the suffix is 0 1 2
    d = _drafter([0, 1, 2, 3, 3, 9, 1, 2, 4, 4, 0, 1])
    assert d.draft(2, 12, 5)[0] == [3, 3, 9, 1, 2]     # the 3-gram (0, 1, 2) decides
    assert d.draft(2, 12, 1)[0] == [3]


def test_a_period_is_continued_through_the_draft_itself():
    d = _drafter([1, 2, 1, 2, 1])
    # suffix (1, 2, 1, 2) matched ending at 3 (tokens 0..3): continues 1, then the draft itself
    assert d.draft(2, 5, 6)[0] == [1, 2, 1, 2, 1, 2]


def test_accepted_tokens_extend_the_tables_and_rollback_trims_them():
    d = _drafter([4, 3])
    assert d.draft(0, 2, 3)[0] == []
    d.accept(2, 0, None, [4])           # sequence 4 3 0 4: (0, 4)? no; (4,) is too short
    assert d.tokens == [4, 3, 0, 4]
    assert d.draft(3, 4, 2)[0] == [0, 4]      # suffix (4, 3) seen at 0..1, followed by 0 4
    d.rollback(2)
    assert d.tokens == [4, 3]


def test_the_table_is_bounded(monkeypatch):
    monkeypatch.setattr(speculative, "NGRAM_ENTRIES", 8)
    d = _drafter(list(range(100)), size=3)
    assert all(len(t) <= 8 for t in d.tables.values())
    assert d.draft(99, 100, 2)[0] == []              # the old k-grams are gone, the new ones kept
    d = _drafter(list(range(100)) + [96, 97], size=3)
    assert d.draft(98, 102, 1)[0] == [99]


def _plain(prompt, n, table):
    lm = MarkovLM(table)
    return list(generate_step(lm, prompt, state=State(), sampler=Sampler(), max_tokens=n))


# a greedy chain that loops with period 5 after a transient, so the n-gram drafter has matches
LOOP = np.full((V, V), -10.0)
LOOP[np.arange(V), [2, 3, 4, 0, 1]] = 10.0
LOOP[0, 3] = 9.5        # near-tie: the greedy token is still 2


@pytest.mark.parametrize("verify", ["batched", "exact"])
@pytest.mark.parametrize("n_max", [1, 2, 3, 4, 5])
def test_greedy_ngram_drafting_equals_plain_decoding(n_max, verify):
    prompt = [1, 3, 0, 2, 4, 1, 3]
    plain = _plain(prompt, 30, LOOP)
    lm, stats = MarkovLM(LOOP), RunStats()
    out = list(generate_step(lm, prompt, state=State(), sampler=Sampler(),
                             options=SpecOptions(n_max=n_max, type="ngram", ngram_size=3, verify=verify),
                             max_tokens=30, stats=stats))
    assert out == plain
    assert stats.accepted > 0 and stats.spec["type"] == "ngram"
    if verify == "batched":
        assert lm.passes < 30                # drafts of a loop are accepted: fewer target passes


def test_sampled_ngram_drafting_keeps_the_target_distribution():
    """Pairs (x_1, x_2) after a prompt in which every (1, x_1) was followed by some token, so
    x_2 is always drafted: their frequencies must follow the target chain, not the draft's
    point masses (chi-square, 24 degrees of freedom, p = 0.001)."""
    probs = markov_probs(P_LOGITS)
    prompt = [1, 0, 3, 1, 1, 4, 1, 2, 0, 1, 3, 2, 1, 4, 1, 1]
    n = 3000
    counts = np.zeros((V, V))
    drafted = 0
    for seed in range(n):
        stats = RunStats()
        out = list(generate_step(MarkovLM(), prompt, state=State(), sampler=Sampler(temperature=1.0, seed=seed),
                                 options=SpecOptions(n_max=3, type="ngram"), max_tokens=3, stats=stats))
        counts[out[0], out[1]] += 1
        drafted += stats.drafted
    expected = n * probs[prompt[-1]][:, None] * probs       # P(x1 | 1) · P(x2 | x1)
    assert drafted == n                        # every run drafted x_2 (its one draft: max_tokens 3)
    assert chi2(counts.ravel(), expected.ravel()) < CHI2_CRIT[24]


def test_spec_type_spellings():
    assert [spec_type(s) for s in ("mtp", "draft-mtp", "DSpark", "draft-dspark", "ngram", "ngram-simple",
                                   "ngram-map-k", "suffix", "none")] == \
        ["mtp", "mtp", "dspark", "dspark", "ngram", "ngram", "ngram", "ngram", "none"]
    for bad in ("eagle3", "draft-simple", ""):
        with pytest.raises(USER_ERRORS, match="--spec-type"):
            spec_type(bad)


def test_bad_ngram_options_are_one_line_errors():
    with pytest.raises(USER_ERRORS, match="--spec-ngram-size-n"):
        SpecOptions(n_max=2, type="ngram", ngram_size=1)
    with pytest.raises(USER_ERRORS, match="--spec-type"):
        SpecOptions(n_max=2, type="medusa")


def test_a_hash_collision_costs_a_draft_never_a_wrong_one(monkeypatch):
    """The tables keep hashes; a hit is checked against the tokens. With every k-gram hashing
    alike the table remembers only the latest k-gram per length, so most lookups miss — but
    no draft continues a k-gram other than the current suffix."""
    monkeypatch.setattr(speculative, "hash", lambda key: 0, raising=False)
    d = _drafter([5, 6, 7, 1, 9, 6, 7, 2, 8, 5])
    assert d.draft(6, 10, 3) == ([], [])          # (5, 6) was overwritten by later k-grams
    # the one 2-gram left is the latest, (4, 5) ending at 2: the suffix (4, 5) really is it
    d = _drafter([4, 5, 4])
    assert d.draft(5, 3, 1)[0] == [4]
