"""The speculative loop (``offload.speculative``) on small exact cases, no model file:

- the acceptance rule alone, and the whole loop (drafting, verification, rollback,
  bonus tokens), keep the target's output distribution — chi-square on a 5-token vocabulary,
  fixed seeds, with a check that the test would catch the draft's distribution leaking in;
- greedy with a draft that always agrees is fully accepted; one that never agrees yields
  the target's tokens, one per step;
- the caches hold exactly the yielded tokens (but the last) when the generator stops.
- under a guide (a token constraint, as structured output uses), the output follows the
  target chain masked by it, and no constrained-out token is drafted or yielded.

The target here is a first-order Markov chain (row ``P[x]`` of logits after token x) and
the draft head another one (``Q``): small stand-ins for the trunk and the NextN head that
obey the same interfaces, so every token distribution is known exactly.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from offload.errors import USER_ERRORS, OffloadError
from offload.sampling import Sampler
from offload.speculative import SpecOptions, generate_step, judge
from offload.stats import RunStats
from placement.draft import NoDraftHead

V = 5
RNG = np.random.default_rng(2024)
P_LOGITS = RNG.normal(0.0, 1.2, (V, V))       # target: logits of the next token after x
Q_LOGITS = RNG.normal(0.0, 1.2, (V, V))       # draft head: its own guess of the same
# chi-square critical values at p = 0.001 (a 1-in-1000 false alarm) by degrees of freedom
CHI2_CRIT = {4: 18.47, 14: 36.12, 15: 37.70, 16: 39.25, 17: 40.79, 18: 42.31, 19: 43.82, 20: 45.31,
             21: 46.80, 22: 48.27, 23: 49.73, 24: 51.18}


class Cache:
    """Token list with the KV-cache protocol (``length``, ``truncate``)."""

    def __init__(self):
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self.length
        del self.tokens[n:]


class State:
    def __init__(self, head_cache=None):
        self.trunk, self.nextn_cache = Cache(), head_cache

    @property
    def n_past(self) -> int:
        return self.trunk.length

    def truncate(self, n: int) -> None:
        self.trunk.truncate(n)


class MarkovLM:
    """forward(ids) → logits row i = P_LOGITS[ids[i]]; hidden = the ids (as floats)."""

    def __init__(self, table=P_LOGITS):
        self.table = torch.tensor(table, dtype=torch.float32)
        self.passes = 0

    def forward(self, ids, state, *, logits="all"):
        self.passes += 1
        state.trunk.tokens += ids.tolist()
        h = ids.float()[:, None]
        z = self.table[ids]
        return (z if logits == "all" else z[-1:] if logits == "last" else None), h


class MarkovHead:
    """Draft head: on pair (h_t, x_{t+1}) returns Q_LOGITS[x_{t+1}] (a guess of x_{t+2}).
    Checks the loop's bookkeeping: positions are the tokens' own, one head entry per pair."""

    def __init__(self, table=Q_LOGITS):
        self.table = torch.tensor(table, dtype=torch.float32)
        self.calls = 0

    def new_cache(self):
        return Cache()

    def __call__(self, tokens, hidden, positions, cache, *, logits="all"):
        self.calls += 1
        assert len(tokens) == len(hidden) == len(positions)
        assert positions.tolist() == list(range(cache.length + 1, cache.length + 1 + len(tokens)))
        cache.tokens += tokens.tolist()
        z = self.table[tokens]
        return (z if logits == "all" else z[-1:] if logits == "last" else None), hidden


def generate(prompt, n, *, n_max, temperature=1.0, top_k=0, seed=0, head=None, verify="batched", p_min=0.0,
             lm=None, stats=None):
    head = head if head is not None else MarkovHead()
    lm = lm if lm is not None else MarkovLM()
    state = State(head.new_cache())
    gen = generate_step(lm, prompt, state=state, sampler=Sampler(temperature=temperature, top_k=top_k, seed=seed),
                        head=head, options=SpecOptions(n_max=n_max, p_min=p_min, verify=verify), ubatch=4,
                        max_tokens=n, stats=stats if stats is not None else RunStats())
    return list(gen), state


def markov_probs(table, temperature=1.0, top_k=0):
    s = Sampler(temperature=temperature, top_k=top_k)
    return np.array([s.probs(row) for row in table])


def chi2(counts: np.ndarray, expected: np.ndarray) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_judge_alone_keeps_the_target_distribution():
    """One draft d ~ q, then the rule: the output token must follow p exactly."""
    p_s = Sampler(temperature=1.0, seed=7)
    p, q = markov_probs(P_LOGITS)[2], markov_probs(Q_LOGITS)[2]
    n = 40000
    out = np.empty(n, dtype=int)
    for i in range(n):
        d = p_s.draw(q)
        fix = judge(P_LOGITS[2], d, q, p_s)
        out[i] = d if fix is None else fix
    counts = np.bincount(out, minlength=V)
    assert chi2(counts, n * p) < CHI2_CRIT[V - 1]
    assert chi2(n * q, n * p) > 10 * CHI2_CRIT[V - 1]     # the draft's own distribution would fail


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_loop_output_follows_the_target_chain(temperature, top_k):
    """Tokens 2 and 3 of a generation come from speculative steps (n_max 2: drafts accepted,
    rejected and resampled, bonus tokens): their joint distribution is the target chain's,
    with the draft distribution q transformed by the same temperature/top-k as p."""
    p = markov_probs(P_LOGITS, temperature, top_k)
    q = markov_probs(Q_LOGITS, temperature, top_k)
    n = 5000
    counts = np.zeros((V, V))
    drafted = accepted = 0
    for seed in range(n):
        stats = RunStats()
        out, _ = generate([1, 3], 3, n_max=2, temperature=temperature, top_k=top_k, seed=seed, stats=stats)
        counts[out[1], out[2]] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    # token 1 ~ p[3]; tokens 2, 3 follow the chain
    want = np.einsum("a,ab,bc->bc", p[3], p, p)
    draft_only = np.einsum("a,ab,bc->bc", p[3], q, q)
    keep = want > 0                                 # top-k leaves some pairs impossible
    assert counts[~keep].sum() == 0
    crit = CHI2_CRIT[int(keep.sum()) - 1]
    assert chi2(counts[keep], n * want[keep]) < crit
    assert chi2(n * draft_only[keep], n * want[keep]) > 10 * crit
    assert 0 < accepted < drafted                   # both branches of the rule were exercised


def test_greedy_agreeing_draft_is_fully_accepted_and_disagreeing_one_never():
    agree, _ = generate([0], 13, n_max=3, temperature=0.0, head=MarkovHead(P_LOGITS))
    stats = RunStats()
    lm = MarkovLM()
    out, state = generate([0], 13, n_max=3, temperature=0.0, head=MarkovHead(P_LOGITS), lm=lm, stats=stats)
    assert stats.acceptance_per_position == [1.0, 1.0, 1.0] and stats.mean_accepted_length == 4.0
    assert lm.passes == 1 + 3                       # prompt + 3 verify passes of 4 tokens for 12 tokens
    # greedy target chain, token by token
    want, x = [], 0
    for _ in range(13):
        x = int(np.argmax(P_LOGITS[x]))
        want.append(x)
    assert out == agree == want
    # a draft head that always proposes a token the target never picks
    contrary = np.full((V, V), -10.0)
    contrary[np.arange(V), (np.argmax(P_LOGITS, axis=1) + 1) % V] = 10.0
    stats = RunStats()
    out, _ = generate([0], 13, n_max=3, temperature=0.0, head=MarkovHead(contrary), stats=stats)
    assert out == want and stats.accepted == 0 and stats.mean_accepted_length == 1.0


def test_exact_and_batched_verify_agree_and_count_passes():
    for verify in ("batched", "exact"):
        stats = RunStats()
        lm = MarkovLM()
        out, _ = generate([0, 1], 20, n_max=2, temperature=0.0, verify=verify, lm=lm, stats=stats)
        if verify == "batched":
            ref = out
            assert stats.n_eval == stats.n_steps == lm.passes - 1
        else:
            assert out == ref
            assert stats.n_eval == lm.passes - 1 == stats.n_steps + stats.accepted


def test_p_min_stops_drafting_on_an_unsure_head():
    flat = np.zeros((V, V))                          # uniform: top probability 0.2
    stats = RunStats()
    out, _ = generate([0], 10, n_max=3, temperature=0.0, head=MarkovHead(flat), p_min=0.5, stats=stats)
    assert stats.drafted == 0 and len(out) == 10
    stats = RunStats()
    generate([0], 10, n_max=3, temperature=0.0, head=MarkovHead(flat), p_min=0.1, stats=stats)
    assert stats.drafted > 0


@pytest.mark.parametrize("verify", ["batched", "exact"])
def test_caches_hold_the_yielded_tokens_when_the_generator_stops(verify):
    prompt = [0, 2, 4]
    for stop_after in range(1, 9):
        head = MarkovHead()
        state = State(head.new_cache())
        gen = generate_step(MarkovLM(), prompt, state=state, sampler=Sampler(temperature=1.0, seed=stop_after),
                            head=head, options=SpecOptions(n_max=3, verify=verify), max_tokens=50)
        got = list(itertools.islice(gen, stop_after))
        gen.close()
        seq = prompt + got
        assert state.trunk.tokens == seq[:-1]
        # head entry t is the pair (h_t, x_{t+1}): its tokens are x_1 .. x_L
        head_tokens = state.nextn_cache.tokens
        assert head_tokens == seq[1:1 + len(head_tokens)] and len(head_tokens) <= len(seq) - 1


def test_n_max_0_never_calls_the_head_and_needs_none():
    head = MarkovHead()
    stats = RunStats()
    lm = MarkovLM()
    state = State()
    out = list(generate_step(lm, [0], state=state, sampler=Sampler(), head=None, options=SpecOptions(n_max=0),
                             max_tokens=6, stats=stats))
    assert head.calls == 0 and lm.passes == 6 and stats.n_eval == 5 and stats.drafted == 0
    assert len(out) == 6 and stats.spec == {}
    with pytest.raises(NoDraftHead, match="n_max 2: the model has no NextN"):
        list(generate_step(lm, [0], state=State(), sampler=Sampler(), head=None, options=SpecOptions(n_max=2)))


def test_bad_options_are_refused():
    for kw, flag in (({"n_max": -1}, "--spec-n-max must be an integer >= 0"),
                     ({"n_max": "two"}, "--spec-n-max must be an integer >= 0"),
                     ({"p_min": 1.0}, r"--spec-p-min must be a number in \[0, 1\)"),
                     ({"verify": "lazy"}, "--spec-verify")):
        with pytest.raises(USER_ERRORS, match=flag):
            SpecOptions(**kw)


def test_stats_per_position_and_conditional_acceptance():
    """llama.cpp's per-position rate (accepted/drafted at j) and the cost model's conditional
    a_j, where a step whose token budget stopped short of position j does not count."""
    s = RunStats()
    s.record_step(3, 1, 3)      # drafts 1-3, first accepted
    s.record_step(3, 3, 3)      # all accepted
    s.record_step(2, 2, 2)      # budget allowed two: both accepted
    s.record_step(0, 0, 3)      # p_min stopped drafting at once
    assert s.drafted_per_position == [3, 3, 2] and s.accepted_per_position == [3, 2, 1]
    assert s.reached_per_position == [4, 3, 1]
    assert s.acceptance_per_position == pytest.approx([1.0, 2 / 3, 0.5])
    assert s.acceptance_conditional == pytest.approx([3 / 4, 2 / 3, 1.0])
    assert s.mean_accepted_length == pytest.approx(1 + 6 / 4) and s.acceptance == pytest.approx(6 / 8)
    d = s.as_dict()
    assert d["drafted"] == 8 and d["accepted"] == 6 and d["acceptance_per_position"] == s.acceptance_per_position


# -- end of sequence ------------------------------------------------------------------------
# A deterministic chain for greedy decoding: after x comes NEXT[x]; EOS is token 3.
NEXT = [1, 2, 3, 4, 0]
EOS = 3
CHAIN = np.full((V, V), -10.0)
CHAIN[np.arange(V), NEXT] = 10.0


def _run_chain(prompt, *, n_max, verify="batched", eos=(EOS,), max_tokens=12):
    lm, head = MarkovLM(CHAIN), MarkovHead(CHAIN)       # the head drafts exactly the target's tokens
    state, stats = State(head.new_cache()), RunStats()
    out = list(generate_step(lm, prompt, state=state, sampler=Sampler(), head=head if n_max else None,
                             options=SpecOptions(n_max=n_max, verify=verify), ubatch=4,
                             max_tokens=max_tokens, eos=eos, stats=stats))
    return out, state, stats, lm, head


def test_plain_decoding_stops_at_eos():
    out, state, stats, lm, _ = _run_chain([0], n_max=0)
    assert out == [1, 2, 3] and stats.n_gen == 3
    assert state.trunk.tokens == [0, 1, 2]          # the EOS is yielded, never run (pending)
    assert lm.passes == 3                            # prompt, then tokens 1 and 2
    free, *_ = _run_chain([0], n_max=0, eos=())      # the control: without EOS it goes on
    assert free == [1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2]


@pytest.mark.parametrize("verify", ["batched", "exact"])
def test_eos_inside_an_accepted_draft_rolls_the_caches_back_to_it(verify):
    """Pending 1, drafts 2 3 4 0 all accepted (a perfect head): the step produces 2 3 4 0 1,
    but the EOS (3) ends the output there and both caches roll back to the tokens before it —
    the same state plain decoding leaves."""
    out, state, stats, lm, head = _run_chain([0], n_max=4, verify=verify)
    assert out == [1, 2, 3]
    assert stats.accepted == 4                       # the draft really ran past the EOS
    assert state.trunk.tokens == [0, 1, 2]
    assert state.nextn_cache.length <= 3
    # head entry t is the pair (h_t, x_{t+1}): the entries kept are of the yielded sequence
    assert state.nextn_cache.tokens == [1, 2, 3][:state.nextn_cache.length]
    plain, plain_state, *_ = _run_chain([0], n_max=0)
    assert out == plain and state.trunk.tokens == plain_state.trunk.tokens


@pytest.mark.parametrize("n_max", [0, 3])
def test_eos_as_the_first_generated_token(n_max):
    out, state, stats, lm, head = _run_chain([1, 2], n_max=n_max)
    assert out == [3] and stats.n_gen == 1
    assert lm.passes == 1 and stats.n_eval == 0      # only the prompt ran
    assert state.trunk.tokens == [1, 2]
    assert head.calls == (1 if n_max else 0)         # priming the head with the prompt's pair
    assert state.nextn_cache.length == (1 if n_max else 0)


class NanLM(MarkovLM):
    """The chain, but the forward pass that sees token ``bad`` returns NaN logits."""

    def __init__(self, bad):
        super().__init__(CHAIN)
        self.bad = bad

    def forward(self, ids, state, *, logits="all"):
        z, h = super().forward(ids, state, logits=logits)
        if z is not None and self.bad in ids.tolist():
            z = torch.full_like(z, float("nan"))
        return z, h


@pytest.mark.parametrize("n_max,before,at", [(0, [1, 2], 3),      # the pass over token 2 computes token 3
                                             (2, [1], 2)])        # pending 1 + drafts 2 3 in one pass
def test_non_finite_logits_stop_generation_in_one_line(n_max, before, at):
    head = MarkovHead(CHAIN)
    gen = generate_step(NanLM(bad=2), [0], state=State(head.new_cache()), sampler=Sampler(),
                        head=head if n_max else None, options=SpecOptions(n_max=n_max), ubatch=4, max_tokens=8)
    got = []
    with pytest.raises(OffloadError, match=f"non-finite logits at generated token {at}") as err:
        for t in gen:
            got.append(t)
    assert got == before and "\n" not in str(err.value)
    with pytest.raises(OffloadError, match="non-finite logits at the prompt"):
        list(generate_step(NanLM(bad=0), [0], state=State(), sampler=Sampler(), max_tokens=4))


class NoRepeat:
    """A guide (``offload.speculative.Guide``): no token may repeat the one before it. Its
    state is that last token; the drafter drafts on a fork."""

    def __init__(self, last: int, log: list | None = None, refused: list | None = None):
        self.last, self.log = last, log if log is not None else []
        self.refused = refused if refused is not None else []     # shared with its forks

    def mask(self, logits):
        out = np.array(logits, dtype=np.float32)
        out[self.last] = -np.inf
        return out

    def accept(self, token: int) -> bool:
        self.log.append(token)
        if token == self.last:
            self.refused.append(token)
            return False
        self.last = token
        return True

    def fork(self):
        return NoRepeat(self.last, [], self.refused)


@pytest.mark.parametrize("verify", ["batched", "exact"])
def test_a_guide_constrains_drafts_and_target_alike(verify):
    """Under a constraint, tokens 2 and 3 follow the target chain masked by it (each row
    without the token before it), with drafts drawn from the masked draft rows: the
    acceptance rule then keeps the masked target's distribution. No constrained-out token is
    ever yielded or drafted; the guide advances by exactly the yielded tokens."""
    no_self = np.where(np.eye(V, dtype=bool), -np.inf, 0.0)
    p, q = markov_probs(P_LOGITS + no_self), markov_probs(Q_LOGITS + no_self)
    n = 5000
    counts = np.zeros((V, V))
    drafted = accepted = 0
    for seed in range(n):
        stats, guide = RunStats(), NoRepeat(3)
        gen = generate_step(MarkovLM(), [1, 3], state=State(MarkovHead().new_cache()),
                            sampler=Sampler(temperature=1.0, seed=seed), head=MarkovHead(),
                            options=SpecOptions(n_max=2, verify=verify), ubatch=4, max_tokens=3, stats=stats,
                            guide=guide)
        out = list(gen)
        assert guide.log == out and all(a != b for a, b in zip([3] + out, out)) and not guide.refused
        counts[out[1], out[2]] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    want = np.einsum("a,ab,bc->bc", p[3], p, p)
    keep = want > 0
    assert counts[~keep].sum() == 0
    crit = CHI2_CRIT[int(keep.sum()) - 1]
    assert chi2(counts[keep], n * want[keep]) < crit
    unmasked = markov_probs(P_LOGITS)
    assert chi2(n * np.einsum("a,ab,bc->bc", p[3], unmasked, unmasked)[keep], n * want[keep]) > 10 * crit
    assert 0 < accepted < drafted


def test_loop_under_penalties_and_min_p_follows_the_penalised_chain():
    """Repetition penalties change each row by the history (prompt included) and min-p cuts
    it: speculative steps (n_max 2, drafts judged against the penalised rows, the draft head's
    rows penalised by a fork of the same history) give tokens 2 and 3 the joint distribution
    of the penalised chain, written out here from llama.cpp's formulas (chi-square)."""
    from offload.sampling import Penalties, with_penalties
    from tests.runtime.test_sampling import llama_penalised

    pen = dict(repeat=1.6, presence=0.5, frequency=0.3, last_n=3)
    sampler_kw = dict(temperature=0.9, min_p=0.1)

    def row_probs(x, history):
        z = llama_penalised(P_LOGITS[x], history, pen["repeat"], pen["presence"], pen["frequency"], pen["last_n"])
        return Sampler(**sampler_kw).probs(z)

    prompt = [1, 3]
    want = np.zeros((V, V))
    for a in range(V):
        pa = row_probs(3, prompt)[a]
        for b in range(V):
            pb = row_probs(a, prompt + [a])[b]
            want[b] += pa * pb * row_probs(b, prompt + [a, b])
    n = 5000
    counts = np.zeros((V, V))
    drafted = accepted = 0
    for seed in range(n):
        stats = RunStats()
        head, state = MarkovHead(), None
        state = State(head.new_cache())
        out = list(generate_step(MarkovLM(), prompt, state=state, sampler=Sampler(**sampler_kw, seed=seed),
                                 head=head, options=SpecOptions(n_max=2), ubatch=4, max_tokens=3, stats=stats,
                                 guide=with_penalties(None, Penalties(**pen), prompt)))
        counts[out[1], out[2]] += 1
        drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    keep = want > 0
    assert counts[~keep].sum() == 0
    crit = CHI2_CRIT.get(int(keep.sum()) - 1)
    assert crit is not None, int(keep.sum())
    assert chi2(counts[keep], n * want[keep]) < crit
    plain = np.einsum("a,ab,bc->bc", markov_probs(P_LOGITS, 0.9)[3], markov_probs(P_LOGITS, 0.9),
                      markov_probs(P_LOGITS, 0.9))
    assert chi2(n * plain[keep], n * want[keep]) > 3 * crit      # the test sees the penalties
    assert 0 < accepted < drafted


@pytest.mark.parametrize("kind", ["mtp", "ngram"])
def test_only_a_drafters_passes_run_through_compute(kind):
    """Under continuous batching ``compute`` runs a drafter's calls on the thread of every pass:
    each head pass runs inside it, bookkeeping (accept, rollback; all of the n-gram drafter)
    does not, and the text is the one without ``compute``."""
    inside, routed = [False], []

    def compute(fn, *args, **kwargs):
        routed.append(fn.__name__)
        inside[0] = True
        try:
            return fn(*args, **kwargs)
        finally:
            inside[0] = False

    class CheckedHead(MarkovHead):
        def __call__(self, *args, **kwargs):
            assert inside[0], "a head pass ran outside compute"
            return super().__call__(*args, **kwargs)

    def run(compute):
        head = CheckedHead() if compute else MarkovHead()
        state = State(head.new_cache())
        options = SpecOptions(n_max=2, type=kind, verify="batched")
        return list(generate_step(MarkovLM(), [0, 1, 0, 1, 0], state=state, sampler=Sampler(temperature=0.0),
                                  head=head, options=options, ubatch=4, max_tokens=24, compute=compute))

    assert run(compute) == run(None)
    assert set(routed) == ({"prime", "draft"} if kind == "mtp" else set())
