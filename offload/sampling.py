"""Token sampling as llama.cpp samples: greedy, or top-k → top-p → min-p → temperature, seeded;
and the repetition penalties, which change the logits from the tokens seen so far.

``Sampler.probs`` gives the distribution a token is actually drawn from, which speculative
sampling needs for its acceptance rule. The filters run in llama.cpp's order
(``common_params_sampling``: penalties, top_k, top_p, min_p, temperature, dist): top-p and
min-p cut on the untempered distribution, and the temperature reshapes only what survives.

``Penalties`` (``--repeat-penalty``, ``--presence-penalty``, ``--frequency-penalty`` over the
last ``--repeat-last-n`` tokens, prompt included, as llama-server feeds its sampler) are
stateful, so they take the generate loop's ``Guide`` shape (``PenaltyGuide``): every row a token
is chosen or judged from is penalised by the history at that point, drafts included, so
speculative decoding keeps the penalised target distribution.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# llama.cpp's defaults (common/common.h, common_params_sampling): what `offload run` and
# `offload serve` sample with unless told otherwise; --temp 0 is greedy
LLAMA_TEMPERATURE, LLAMA_TOP_K, LLAMA_TOP_P, LLAMA_MIN_P = 0.8, 40, 0.95, 0.05
LLAMA_REPEAT_LAST_N = 64


@dataclass
class Sampler:
    temperature: float = 0.0     # 0 → greedy (argmax)
    top_k: int = 0               # 0 → off
    top_p: float = 1.0           # 1 → off
    seed: int | None = None
    min_p: float = 0.0           # 0 → off: drop tokens under min_p × the top token's probability

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError("need temperature >= 0, top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1")
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """logits (V,) → float64 probabilities (V,) of the distribution sampled from."""
        z = np.asarray(logits)
        if self.greedy:
            p = np.zeros(z.shape, dtype=np.float64)
            p[int(np.argmax(z))] = 1.0
            return p
        # every later filter only narrows top-k's survivors, so the chain runs on them alone:
        # a sort and softmaxes over a 129k vocabulary cost 8 ms a token (bench.sampling)
        ids = _top_k_ids(z, self.top_k)
        zc = z[ids].astype(np.float64)
        keep = np.ones(zc.shape, dtype=bool)
        if self.top_p < 1.0:
            p = _softmax(zc)
            order = np.argsort(-p, kind="stable")
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            cut = int(np.searchsorted(np.cumsum(p[order]), self.top_p)) + 1
            keep[order[cut:]] = False
        if self.min_p > 0.0:
            keep &= zc >= zc[keep].max() + np.log(self.min_p)
        p = np.zeros(z.shape, dtype=np.float64)
        p[ids[keep]] = _softmax(zc[keep] / self.temperature)
        return p

    def draw(self, p: np.ndarray) -> int:
        """One token from probabilities p (V,): the token ``Generator.choice(V, p=p)`` takes
        (the same one uniform, the same cumulative sums), walking only the tokens with a
        probability."""
        if self.greedy:
            return int(np.argmax(p))
        ids = np.flatnonzero(p > 0)         # a mask first: flatnonzero of floats is 10x slower
        cdf = np.cumsum(p[ids])
        cdf /= cdf[-1]
        return int(ids[np.searchsorted(cdf, self.rng.random(), side="right")])

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        return self.draw(self.probs(logits))


_GROUP = 64     # logits per group at most: a cheap bound that leaves a few hundred candidates


def _top_k_ids(z: np.ndarray, k: int) -> np.ndarray:
    """The ids (ascending) of the tokens whose logit is at least the k-th largest, ties
    included; every id when k is off or covers the vocabulary. The logits fall into n groups
    (token i in group i mod n, so the maxima are up to 64 contiguous rows' elementwise max);
    the k-th largest group maximum bounds the k-th largest logit from below (k groups each hold
    a logit at least that high), so only logits over it are partitioned."""
    v = z.size
    if not 0 < k < v:
        return np.arange(v)
    g = min(_GROUP, v // (4 * k))       # at least 4k groups, so the bound is a tight one
    pool = None
    if g >= 2:
        n = v // g
        maxima = z[:n * g].reshape(g, n).max(axis=0)
        if n * g < v:
            maxima = np.append(maxima, z[n * g:].max())
        pool = np.flatnonzero(z >= np.partition(maxima, -k)[-k])
    zp = z if pool is None else z[pool]
    kth = np.partition(zp, -k)[-k]
    return np.flatnonzero(zp >= kth) if pool is None else pool[zp >= kth]


def _softmax(z: np.ndarray) -> np.ndarray:
    p = np.exp(z - z.max())
    return p / p.sum()


@dataclass(frozen=True)
class Penalties:
    """llama.cpp's repetition penalties over the last ``last_n`` tokens (0: off, -1: all):
    a seen token's logit is divided by ``repeat`` when positive, multiplied when not, then
    lowered by ``frequency`` × its count and ``presence`` once."""
    repeat: float = 1.0
    last_n: int = LLAMA_REPEAT_LAST_N
    presence: float = 0.0
    frequency: float = 0.0

    def __post_init__(self):
        if self.repeat <= 0:
            raise ValueError(f"the repeat penalty must be > 0, got {self.repeat}")
        if self.last_n < -1:
            raise ValueError(f"the repeat window must be >= -1, got {self.last_n}")

    @property
    def active(self) -> bool:
        return self.last_n != 0 and (self.repeat != 1.0 or self.presence != 0.0 or self.frequency != 0.0)


class PenaltyGuide:
    """``Penalties`` as the generate loop's ``Guide``: ``mask`` penalises a row by the tokens in
    the window, ``accept`` slides the window, ``fork`` copies it for drafting."""

    def __init__(self, penalties: Penalties, history: Sequence[int] = ()):
        self.penalties = penalties
        n = penalties.last_n
        self.window: deque[int] = deque(maxlen=None if n < 0 else n)
        self.counts: Counter[int] = Counter()
        for t in history[-n:] if n > 0 else history:
            self.accept(int(t))

    def mask(self, logits: np.ndarray) -> np.ndarray:
        if not self.counts:
            return logits
        pen = self.penalties
        z = np.array(logits, copy=True)
        n = len(self.counts)
        ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=n)
        counts = np.fromiter(self.counts.values(), dtype=np.float64, count=n)     # the keys' order
        inside = (ids >= 0) & (ids < z.shape[-1])
        ids, counts = ids[inside], counts[inside]
        v = z[ids].astype(np.float64)
        v = np.where(v > 0, v / pen.repeat, v * pen.repeat)
        v -= counts * pen.frequency + (counts > 0) * pen.presence
        z[ids] = v
        return z

    def accept(self, token: int) -> bool:
        w = self.window
        if w.maxlen is not None and len(w) == w.maxlen:
            old = w[0]
            self.counts[old] -= 1
            if not self.counts[old]:
                del self.counts[old]
        w.append(token)
        self.counts[token] += 1
        return True

    def fork(self) -> PenaltyGuide:
        twin = PenaltyGuide.__new__(PenaltyGuide)
        twin.penalties, twin.window, twin.counts = self.penalties, deque(self.window, self.window.maxlen), \
            Counter(self.counts)
        return twin


class GuideChain:
    """Several guides as one: masks in order (penalties before a structured-output mask), each
    advanced by every token; a token is accepted when every guide accepts it."""

    def __init__(self, *guides):
        self.guides = guides

    def mask(self, logits: np.ndarray) -> np.ndarray:
        for g in self.guides:
            logits = g.mask(logits)
        return logits

    def accept(self, token: int) -> bool:
        return all([g.accept(token) for g in self.guides])    # a list: every guide advances

    def fork(self) -> GuideChain:
        return GuideChain(*(g.fork() for g in self.guides))


def with_penalties(guide, penalties: Penalties | None, history: Sequence[int]):
    """The guide a generation runs with: ``guide`` (or none) preceded by the penalties when any
    is set."""
    if penalties is None or not penalties.active:
        return guide
    pg = PenaltyGuide(penalties, history)
    return pg if guide is None else GuideChain(pg, guide)


@dataclass(frozen=True)
class SamplingDefaults:
    """What ``offload serve`` samples a request with when the request leaves a field out
    (its flags; llama.cpp's defaults, as llama-server's)."""
    temperature: float = LLAMA_TEMPERATURE
    top_k: int = LLAMA_TOP_K
    top_p: float = LLAMA_TOP_P
    min_p: float = LLAMA_MIN_P
    repeat_penalty: float = 1.0
    repeat_last_n: int = LLAMA_REPEAT_LAST_N
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None          # a request without a seed: None = a fresh one each time

    def of(self, request) -> dict:
        """``Session.generate``'s sampling keywords for a request (its fields, None = default)."""
        def pick(name):
            value = getattr(request, name, None)
            return getattr(self, name) if value is None else value
        pen = Penalties(repeat=pick("repeat_penalty"), last_n=pick("repeat_last_n"),
                        presence=pick("presence_penalty"), frequency=pick("frequency_penalty"))
        return dict(temperature=pick("temperature"), top_k=pick("top_k"), top_p=pick("top_p"),
                    min_p=pick("min_p"), penalties=pen if pen.active else None)
