"""The prompt cache (``Session.generate(cache_prompt=True)``) on the shipped model: only the
tokens after the longest prefix shared with the previous sequence are evaluated, and the
result is what a fresh run gives — plain and speculative, for a conversation that grows
(each turn's prompt extends the last prompt and its answer), for a prompt that branches off
mid-way, and after a run stopped early.

Tokens are compared exactly: fixed inputs and greedy decoding, so the check is
deterministic; the reused KV differs from a fresh prefill only by batch-shape rounding
(float32 sums in another order), far below this model's top-2 logit gaps on these prompts.
The caches themselves are compared within 2e-3 of their largest entry (the f16 cache's one
rounding step, as in test_speculative_shipped); a stale or misplaced entry differs by O(1).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import offload.runtime as rt
from offload.errors import OffloadError
from offload.session import PromptCache, common_prefix
from offload.sampling import Sampler
from offload.speculative import generate_step

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
pytestmark = pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present")

TURNS = ["import os\n", "\ndef main(argv):\n    ", "\n\nclass Config:\n    "]


@pytest.fixture(scope="module")
def session():
    # float prompt activations: with int8 ones (the default) a fresh prefill and a reused
    # prefix + a short (float, <= 16-token) remainder differ by the int8 rounding
    # (tests/kernels/test_prefill.py), not only by batch shape
    with rt.load(SHIPPED, devices="CPU=16GiB", int8_prefill=False, quiet=True) as s:
        yield s


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([7], [8]) == 0


@pytest.mark.parametrize("spec", [{"n_max": 0}, {"n_max": 2, "verify": "exact"}, {"n_max": 3, "verify": "batched"}])
def test_growing_conversation_reuses_the_prefix_and_matches_fresh_runs(session, spec):
    session.prompt_cache = PromptCache()
    text = ""
    for turn, piece in enumerate(TURNS):
        text += piece
        ids = session.tokenize(text)
        got = list(session.generate(ids, max_tokens=12, stop_at_eos=False, cache_prompt=True, **spec))
        cached = session.stats.n_prompt_cached
        fresh = list(session.generate(ids, max_tokens=12, stop_at_eos=False, **spec))
        assert got == fresh, (turn, spec)
        assert session.stats.n_prompt_cached == 0
        if turn == 0:
            assert cached == 0
        else:
            # the previous prompt and (nearly all of) its answer are reused. With drafting the
            # head's cache lags the trunk (the pending pairs of the last step, n_max + 1 at most,
            # plus one per step at the end whose token budget left no room to draft) and only
            # its reach is reused; retokenizing at the seam may change the last shared token
            prev = prev_ids + prev_out
            lag = 2 * spec["n_max"] + 1
            assert common_prefix(prev, ids) - lag - 1 <= cached <= common_prefix(prev, ids)
            assert cached >= len(prev_ids) - 1
        text += session.detokenize(got)
        prev_ids, prev_out = ids, got


def test_branching_prompt_and_early_stop(session):
    session.prompt_cache = PromptCache()
    a = session.tokenize("def parse(text):\n    return text.split()\n")
    b = session.tokenize("def parse(text):\n    raise ValueError(text)\n")
    shared = common_prefix(a, b)
    assert 2 < shared < len(a)
    gen = session.generate(a, max_tokens=20, stop_at_eos=False, cache_prompt=True, n_max=2)
    first = [t for _, t in zip(range(5), gen)]
    gen.close()                                   # stopped early: the cache keeps what was yielded
    assert session.prompt_cache.tokens == a + first
    got = list(session.generate(b, max_tokens=10, stop_at_eos=False, cache_prompt=True, n_max=2, verify="exact"))
    assert session.stats.n_prompt_cached == shared - 1   # head pair shared-1 reads b[shared]: not reusable
    assert got == list(session.generate(b, max_tokens=10, stop_at_eos=False, n_max=2, verify="exact"))
    # the same prompt again, plain decoding: everything but the last prompt token is reused
    again = list(session.generate(b, max_tokens=10, stop_at_eos=False, cache_prompt=True))
    assert session.stats.n_prompt_cached == len(b) - 1
    assert again == got


def _kv(cache):
    return cache.k[:, :cache.length], cache.v[:, :cache.length]


def test_reused_caches_equal_a_fresh_run(session):
    m = session.model
    session.prompt_cache = PromptCache()
    ids = session.tokenize(TURNS[0] + TURNS[1])
    out = list(session.generate(ids, max_tokens=9, stop_at_eos=False, cache_prompt=True, n_max=2))
    more = ids + out + session.tokenize(TURNS[2])[1:]           # drop BOS: a continuation
    list(session.generate(more, max_tokens=6, stop_at_eos=False, cache_prompt=True, n_max=2))
    state, seq = session.prompt_cache.state, session.prompt_cache.tokens
    assert session.stats.n_prompt_cached > len(ids)
    with torch.inference_mode():
        fresh = m.new_state()
        m.forward(torch.tensor(seq[:state.n_past]), fresh, logits="none")
    for got, want in zip(state.caches, fresh.caches):
        for a, b in zip(_kv(got), _kv(want)):
            assert a.shape == b.shape
            assert (a.float() - b.float()).abs().max() <= 2e-3 * b.float().abs().max()


def test_n_cached_must_match_the_caches(session):
    m = session.model
    state = m.new_state()
    with pytest.raises(OffloadError, match="n_cached 3"):
        next(generate_step(m, [1, 2, 3, 4], state=state, sampler=Sampler(), n_cached=3))
    with pytest.raises(OffloadError, match="n_cached 4"):
        next(generate_step(m, [1, 2, 3, 4], state=state, sampler=Sampler(), n_cached=4))
