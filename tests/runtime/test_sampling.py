"""Sampling: greedy is argmax; the distribution drawn from is softmax(logits/T) restricted
by top-k / top-p exactly; draws follow it (chi-square); seeds reproduce."""
from __future__ import annotations

import numpy as np
import pytest

from offload.sampling import Sampler

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
