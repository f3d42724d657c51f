"""Sampling: greedy is argmax; the distribution drawn from is softmax(logits/T) restricted
by top-k / top-p exactly; draws follow it (chi-square); seeds reproduce."""
from __future__ import annotations

import numpy as np
import pytest

from offload.sampling import Penalties, PenaltyGuide, Sampler, with_penalties

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0], dtype=np.float32)


def softmax(z):
    e = np.exp(z - z.max())
    return e / e.sum()


def test_greedy_is_argmax():
    s = Sampler()
    assert s(LOGITS) == 5
    assert s.probs(LOGITS)[5] == 1.0


def test_temperature_top_k_top_p_distribution():
    p = Sampler(temperature=0.7).probs(LOGITS)
    np.testing.assert_allclose(p, softmax(LOGITS.astype(np.float64) / 0.7), rtol=1e-12)
    p = Sampler(temperature=1.0, top_k=2).probs(LOGITS)
    want = np.zeros(6)
    want[[5, 0]] = softmax(np.array([3.0, 2.0]))
    np.testing.assert_allclose(p, want, rtol=1e-12)
    full = softmax(LOGITS.astype(np.float64))
    # top_p: the smallest set of most likely tokens whose mass reaches p, renormalised
    order = np.argsort(-full)
    cut = np.searchsorted(np.cumsum(full[order]), 0.8) + 1
    p = Sampler(temperature=1.0, top_p=0.8).probs(LOGITS)
    assert set(np.nonzero(p)[0]) == set(order[:cut])
    np.testing.assert_allclose(p[order[:cut]], full[order[:cut]] / full[order[:cut]].sum(), rtol=1e-12)


def test_draws_follow_the_distribution_and_seed_reproduces():
    s = Sampler(temperature=1.0, seed=123)
    n = 20000
    draws = np.array([s(LOGITS) for _ in range(n)])
    counts = np.bincount(draws, minlength=6)
    expected = n * softmax(LOGITS.astype(np.float64))
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5   # chi-square, 5 degrees of freedom: p = 0.001 critical value
    again = Sampler(temperature=1.0, seed=123)
    assert [again(LOGITS) for _ in range(50)] == draws[:50].tolist()


def test_bad_parameters_are_refused():
    for kw in ({"temperature": -1}, {"top_p": 0.0}, {"top_k": -2}):
        with pytest.raises(ValueError):
            Sampler(**kw)


def test_min_p_and_llama_cpp_order():
    """top-p and min-p cut on the untempered distribution, then the temperature reshapes what
    is left (llama.cpp's chain: top_k, top_p, min_p, temperature)."""
    z = LOGITS.astype(np.float64)
    full = softmax(z)
    # min-p 0.3 keeps the tokens whose probability is at least 0.3 x the top one's
    keep = full >= 0.3 * full.max()
    p = Sampler(temperature=0.5, min_p=0.3).probs(LOGITS)
    assert set(np.nonzero(p)[0]) == set(np.nonzero(keep)[0]) == {0, 5}
    np.testing.assert_allclose(p[keep], softmax(z[keep] / 0.5), rtol=1e-12)
    # top-p 0.7 at temperature 2: the set is the one of the T = 1 distribution (tokens 5 and 0:
    # 0.63 + 0.23), not of the flatter T = 2 one (which would need a third token)
    p = Sampler(temperature=2.0, top_p=0.7).probs(LOGITS)
    assert set(np.nonzero(p)[0]) == {5, 0}
    np.testing.assert_allclose(p[[5, 0]], softmax(z[[5, 0]] / 2.0), rtol=1e-12)
    with pytest.raises(ValueError):
        Sampler(min_p=1.5)


def llama_penalised(row, history, repeat, presence, frequency, last_n):
    """llama.cpp's penalties sampler, written out: counts over the last ``last_n`` tokens."""
    out = np.array(row, dtype=np.float64)
    window = history[-last_n:] if last_n > 0 else history
    for tok in set(window):
        c = window.count(tok)
        out[tok] = out[tok] * repeat if out[tok] <= 0 else out[tok] / repeat
        out[tok] -= c * frequency + presence
    return out


def test_penalties_are_llama_cpps_and_slide_with_the_window():
    pen = Penalties(repeat=1.3, last_n=4, presence=0.4, frequency=0.25)
    history = [5, 0, 5, 3, 5, 1]            # the window is the last 4: 5, 3, 5, 1
    g = PenaltyGuide(pen, history)
    want = llama_penalised(LOGITS, history, 1.3, 0.4, 0.25, 4)
    np.testing.assert_allclose(g.mask(LOGITS), want, rtol=1e-6)
    assert g.mask(LOGITS)[0] == LOGITS[0]   # token 0 left the window
    twin = g.fork()
    g.accept(2)                             # the window slides: 3, 5, 1, 2
    np.testing.assert_allclose(g.mask(LOGITS), llama_penalised(LOGITS, history + [2], 1.3, 0.4, 0.25, 4),
                               rtol=1e-6)
    np.testing.assert_allclose(twin.mask(LOGITS), want, rtol=1e-6)     # a fork is its own copy
    assert not Penalties().active and not Penalties(repeat=1.5, last_n=0).active
    with pytest.raises(ValueError):
        Penalties(repeat=0.0)


def test_greedy_with_a_repeat_penalty_moves_off_a_seen_token():
    """Greedy picks the argmax of the penalised row: a strong repeat penalty on token 5 (the
    top logit) hands the choice to token 0."""
    g = with_penalties(None, Penalties(repeat=2.0), [5])
    assert Sampler()(g.mask(LOGITS)) == 0
    assert with_penalties(None, Penalties(), [5]) is None          # nothing set: no guide


def full_vocab_probs(z, temperature, top_k, top_p, min_p):
    """The chain as defined, over the whole vocabulary (the sampler works on top-k's survivors
    only; this is what it must equal)."""
    z = np.asarray(z, dtype=np.float64)
    keep = np.ones(z.shape, dtype=bool)
    if 0 < top_k < z.size:
        keep &= z >= np.sort(z)[-top_k]
    if top_p < 1.0:
        p = softmax(np.where(keep, z, -np.inf))
        order = np.argsort(-p, kind="stable")
        cut = int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1
        top = np.zeros_like(keep)
        top[order[:cut]] = True
        keep &= top
    if min_p > 0.0:
        keep &= z >= z[keep].max() + np.log(min_p)
    return softmax(np.where(keep, z / temperature, -np.inf))


@pytest.mark.parametrize("vocab", [37, 4096, 129_280])
def test_the_chain_on_top_k_survivors_equals_the_whole_vocabulary_chain(vocab):
    """The sampler looks for top-k's survivors by block maxima, not a sort of the vocabulary:
    the same support and probabilities (to float64 rounding of sums over fewer terms) with ties
    at the k-th value, masked (-inf) tokens, fewer finite tokens than k, and every filter off."""
    rng = np.random.default_rng(7)
    z = (rng.standard_normal(vocab) * 3).astype(np.float32)
    z[rng.choice(vocab, vocab // 5, replace=False)] = -np.inf       # a guide's mask
    z[rng.choice(vocab, 3, replace=False)] = np.sort(z)[-20]        # ties at the 20th value
    few = np.full(vocab, -np.inf, dtype=np.float32)
    few[[1, vocab - 2, vocab // 2]] = [0.5, 1.5, 0.5]
    for row in (z, few):
        for temperature, top_k, top_p, min_p in [(0.8, 40, 0.95, 0.05), (1.0, 20, 1.0, 0.0), (0.5, 0, 0.9, 0.0),
                                                 (1.3, 1, 1.0, 0.0), (0.8, 40, 1.0, 0.2), (1.0, 0, 1.0, 0.0)]:
            got = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p).probs(row)
            want = full_vocab_probs(row, temperature, top_k, top_p, min_p)
            assert set(np.flatnonzero(got)) == set(np.flatnonzero(want))
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_a_draw_is_numpys_choice_from_the_same_seed():
    """``draw`` walks only the tokens with a probability, yet takes the very token
    ``Generator.choice(V, p=p)`` takes from the same stream (one uniform each)."""
    p = Sampler(temperature=1.0, top_k=50).probs(np.random.default_rng(3).standard_normal(129_280))
    s, ref = Sampler(temperature=1.0, seed=11), np.random.default_rng(11)
    assert [s.draw(p) for _ in range(300)] == [int(ref.choice(p.size, p=p)) for _ in range(300)]
