"""The generation loop: speculative decoding with a drafter, and plain decoding as its
``n_max = 0`` case (one loop, mlx-lm's ``speculative_generate_step`` shape).

A drafter (``Drafter``: ``prime`` after the prompt, ``draft`` each step, ``accept`` after
verification, ``rollback`` at the end) is made per generation by ``make_drafter`` from
``SpecOptions.type``: ``mtp`` (``MtpDrafter``, a NextN head), ``ngram`` (``NgramDrafter``,
self-drafting from the context, no weights), or a kind a model registers (``register_drafter``:
DSpark). An MTP head drafts up to ``n_max`` tokens by chaining (its own hidden state and the
token it just drafted feed the next draft step, as llama.cpp's draft-mtp does), stopping
early when the draft's top probability falls under ``p_min``. The target then verifies the
pending token and the drafts — in one batch (``batched``), or one token at a time
(``exact``: the same single-token passes as plain decoding, so greedy output is
token-identical to it). Greedy keeps the longest prefix that matches the target's argmax;
sampling uses the standard rule (accept a draft d with probability min(1, p(d)/q(d)), else
draw from normalize(max(0, p − q))), so the output follows the target's distribution; a
draft made without a distribution (n-gram: q is a point mass on d) is accepted with
probability p(d), else replaced by a draw from p without d. The
target's token after the last accepted draft (its correction or bonus) ends the step.

Cache bookkeeping, with Q the trunk cache length at a step's start and x_Q the pending token
(sampled, not yet run through the trunk):

- the trunk cache holds x_0 .. x_{Q-1};
- head cache entry t is the pair (h_t, x_{t+1}) at RoPE position t+1, h_t the trunk's final
  hidden state (after ``output_norm``). At a step's start it holds the pairs before Q-k, and
  the k pending pairs (trunk states h_{Q-k..Q-1} with tokens x_{Q-k+1..Q}) run first: their
  last row gives draft 1. Chained drafts 2..n add entries computed from the head's own
  hidden state, so they are always rolled back (to Q); the trunk states of the accepted
  positions become the next step's pending pairs;
- verification appends x_Q and the drafts to the trunk; rejected ones are rolled back.

A ``guide`` (structured output: ``offload.server.constrain``) masks the logits every token is
chosen from — the target's rows before sampling or judging, and the drafter's before drafting,
so no draft that breaks the constraint reaches verification — and is advanced by each token
chosen (drafts advance a fork of it, dropped once drafted). ``on_token(token, row)`` sees each
yielded token with the target's unmasked logits row it was chosen at (logprobs);
``on_prompt_logits(start, rows)`` sees the prompt's rows (row i predicts token start + i + 1).

A ``finally`` leaves both caches holding exactly the yielded tokens (all but the last,
which is pending, as in plain decoding) whenever the generator stops. Generation stops at a
token in ``eos`` (yielded, then the loop ends, wherever it sits in an accepted draft), and
with one line naming the first non-finite block when a pass's logits are not finite
(``offload.nonfinite``: one reduction per pass; the block search only on failure).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from offload.cpu_ops import prompt_threads
from offload.errors import OffloadError
from offload.nonfinite import finite, nonfinite_error
from offload.profile import Profile
from offload.sampling import Sampler
from offload.stats import RunStats
from placement.draft import NGRAM_SIZE, NoDraftHead, check_n_max, check_ngram_size, check_p_min, spec_type

VERIFY_MODES = ("batched", "exact")


@dataclass(frozen=True)
class SpecOptions:
    n_max: int = 0              # longest draft per step; 0 = plain decoding
    p_min: float = 0.0          # stop drafting when the draft's top probability is below this
    verify: str = "batched"     # "batched" (one target pass) or "exact" (one pass per token)
    type: str = "mtp"           # the drafter: mtp | ngram | dspark (placement.draft.SPEC_TYPES)
    ngram_size: int = NGRAM_SIZE  # the n-gram drafter's longest lookup

    def __post_init__(self):
        check_n_max(self.n_max, "--spec-n-max")
        check_p_min(self.p_min, "--spec-p-min")
        check_ngram_size(self.ngram_size)
        if self.verify not in VERIFY_MODES:
            raise OffloadError(f"--spec-verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}")
        kind = spec_type(self.type)
        if kind == "none":
            raise OffloadError("--spec-type none is plain decoding: give n_max 0, not a drafter named none")
        object.__setattr__(self, "type", kind)

    def as_dict(self) -> dict:
        out = {"type": self.type, "n_max": self.n_max, "p_min": self.p_min, "verify": self.verify}
        if self.type == "ngram":
            out["ngram_size"] = self.ngram_size
        return out


class Guide(Protocol):
    """A constraint on the next token, stateful: ``mask`` the logits at the current state,
    ``accept`` a token (False when it breaks the constraint), ``fork`` a copy to draft on."""

    def mask(self, logits: np.ndarray) -> np.ndarray: ...

    def accept(self, token: int) -> bool: ...

    def fork(self) -> "Guide": ...


class DraftHead(Protocol):
    """What the loop needs of a draft head (``offload.models.shared.base.NextN`` is one)."""

    def new_cache(self): ...          # an object with ``length`` and ``truncate(n)``

    def __call__(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache, *,
                 logits: str = "all") -> tuple[torch.Tensor | None, torch.Tensor]: ...
        # logits (T, V) / last row (1, V) / None, and the head's hidden states (T, n_embd)


def judge(logits: np.ndarray, draft: int, q: np.ndarray | None, sampler: Sampler) -> int | None:
    """Verify one draft against the target's logits (V,) at its position. Returns None when
    the draft is accepted, else the token that replaces it. ``q``: the draft distribution the
    draft was sampled from (unused when greedy; None when sampling: a point mass on the draft,
    as an n-gram drafter proposes)."""
    if sampler.greedy:
        y = int(np.argmax(logits))
        return None if y == draft else y
    p = sampler.probs(logits)
    if q is None:                                        # q = one-hot(d): accept w.p. p(d)
        q = np.zeros_like(p)
        q[draft] = 1.0
    if sampler.rng.random() * q[draft] < p[draft]:       # u < p(d) / q(d), q(d) > 0 as d ~ q
        return None
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    # total > 0 whenever a rejection can happen (p(d) < q(d)); guard float round-off anyway
    return sampler.draw(residual / total if total > 0 else p)


def _rows(logits: torch.Tensor) -> np.ndarray:
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy()
    return logits.detach().to("cpu", torch.float32).numpy()


class Drafter(Protocol):
    """What the loop needs of a drafter, made per generation (``make_drafter``).

    ``uses_hidden``: it reads the trunk's states (``hidden`` below; else the loop passes them
    anyway and the drafter ignores them) and keeps a cache in ``state.nextn_cache`` whose
    entries follow the trunk's (the prompt cache reuses the trunk only as far as they reach)."""

    uses_hidden: bool
    # the methods that run passes of a model (a head, the drafter's own blocks): under
    # continuous batching these run on the thread that runs every pass (``compute``); the
    # others are bookkeeping and run on the sequence's own thread, saving a hand-off per call
    passes: frozenset[str]

    def prime(self, hidden: torch.Tensor, ids: Sequence[int], start: int = 0) -> None: ...
        # after the prompt: ``ids`` the whole prompt, ``hidden`` the trunk states of start..P-1

    def draft(self, x_q: int, q_len: int, n_cap: int) -> tuple[list[int], list[np.ndarray | None]]: ...
        # up to n_cap drafts after pending token x_q (trunk length q_len), and the distribution
        # each was drawn from (None: greedy, or a point mass — see ``judge``)

    def accept(self, q_len: int, x_q: int, hidden: torch.Tensor, accepted: list[int]) -> None: ...
        # after verification: x_q and the accepted drafts are in the trunk (``hidden``: their states)

    def rollback(self, keep: int) -> None: ...
        # generation ended: keep what the first ``keep`` tokens justify


DrafterFactory = Callable[..., Drafter]     # (head, state, sampler, options, ubatch, guide) -> Drafter
_DRAFTERS: dict[str, tuple[DrafterFactory, bool]] = {}


def register_drafter(kind: str, factory: DrafterFactory, *, uses_hidden: bool = True) -> None:
    """Make ``SpecOptions(type=kind)`` draft with ``factory`` (a model module registers its own
    drafter kind when imported, as DSpark does); ``uses_hidden`` as ``Drafter.uses_hidden``."""
    _DRAFTERS[kind] = (factory, uses_hidden)


def drafter_uses_hidden(kind: str) -> bool:
    """Whether the drafter ``kind`` reads the trunk's states (a head-based kind not loaded yet
    counts as one)."""
    return _DRAFTERS.get(kind, (None, True))[1]


def make_drafter(options: SpecOptions, head, state, sampler: Sampler, ubatch: int,
                 guide: Guide | None = None) -> Drafter:
    """The drafter ``options.type`` names, for one generation on ``state``."""
    if options.type not in _DRAFTERS:
        raise OffloadError(f"--spec-type {options.type}: no such drafter is loaded")
    return _DRAFTERS[options.type][0](head, state, sampler, options, ubatch, guide)


class MtpDrafter:
    """A NextN (MTP) head's side of the loop: pending pairs, chaining, p_min, head-cache rollback."""

    uses_hidden = True
    passes = frozenset({"prime", "draft"})     # accept and rollback only keep pairs and truncate

    def __init__(self, head: DraftHead, cache, sampler: Sampler, options: SpecOptions, ubatch: int,
                 guide: Guide | None = None):
        self.head, self.cache, self.sampler, self.options, self.ubatch = head, cache, sampler, options, ubatch
        self.guide = guide
        self.pend_h: list[torch.Tensor] = []       # trunk states h_{Q-k..Q-1}, (rows, n_embd) pieces
        self.pend_tok: list[int] = []              # x_{Q-k+1..Q-1}; the pending token x_Q comes last
        self.valid = 0                             # head entries computed from trunk states
        self.ran = False                           # the head ran this step's pending pairs

    def prime(self, hidden: torch.Tensor, ids: Sequence[int], start: int = 0) -> None:
        """After the prompt: run the pairs whose token is known (start..P-2) now, keep the last
        trunk state pending for the token the prompt's logits will choose. ``hidden``: the
        trunk states of positions start..P-1 (the head cache already holds pairs 0..start-1)."""
        n = len(ids)
        assert self.cache.length == start, (self.cache.length, start)
        if n - start > 1:
            self._run(list(ids[start + 1:]), hidden[:n - 1 - start], start + 1, logits=False)
        self.valid = n - 1
        self.pend_h, self.pend_tok = [hidden[n - 1 - start:]], []

    def _run(self, tokens: list[int], hidden: torch.Tensor, pos0: int, *, logits: bool = True):
        """Head over pairs in ubatch chunks → (last row's logits (V,) or None, last h_mtp (1, n_embd))."""
        for s in range(0, len(tokens), self.ubatch):
            t = tokens[s:s + self.ubatch]
            last = logits and s + self.ubatch >= len(tokens)
            out, h = self.head(torch.as_tensor(t), hidden[s:s + self.ubatch],
                               torch.arange(pos0 + s, pos0 + s + len(t)), self.cache,
                               logits="last" if last else "none")
        return (out[-1] if logits else None), h[-1:]

    def _confident(self, logits: np.ndarray, q: np.ndarray | None) -> bool:
        """p_min against the draft's top probability: of q when sampling, of softmax(logits)
        when greedy (there it is the drafted token's probability, as in llama.cpp). Decided
        before drawing, so a draft that is made is a sample of exactly q."""
        p_min = self.options.p_min
        if p_min <= 0.0:
            return True
        if q is None:
            z = logits.astype(np.float64)
            top = 1.0 / np.exp(z - z.max()).sum()
        else:
            top = float(q.max())
        return top >= p_min

    def draft(self, x_q: int, q_len: int, n_cap: int) -> tuple[list[int], list[np.ndarray | None]]:
        """Run the pending pairs, then chain up to ``n_cap`` drafts. ``q_len``: trunk length Q."""
        tokens = self.pend_tok + [x_q]
        k = len(tokens)
        assert self.cache.length == q_len - k, (self.cache.length, q_len, k)
        pend = self.pend_h[0] if len(self.pend_h) == 1 else torch.cat(self.pend_h)
        logits, h = self._run(tokens, pend, q_len - k + 1)
        self.valid, self.ran = q_len, True
        drafts: list[int] = []
        qs: list[np.ndarray | None] = []
        guide = self.guide.fork() if self.guide is not None else None   # drafts advance a copy
        for j in range(n_cap):
            z = _rows(logits)
            if guide is not None:
                z = guide.mask(z)
            q = None if self.sampler.greedy else self.sampler.probs(z)
            if not self._confident(z, q):
                break
            d = int(np.argmax(z)) if q is None else self.sampler.draw(q)
            if guide is not None and not guide.accept(d):
                break
            drafts.append(d)
            qs.append(q)
            if j + 1 == n_cap:
                break
            # chained step: pair Q+j = (h_mtp of the last draft step, that draft) at position Q+j+1
            out, h = self.head(torch.as_tensor([d]), h, torch.tensor([q_len + j + 1]), self.cache,
                               logits="last")
            logits = out[-1]
        return drafts, qs

    def accept(self, q_len: int, x_q: int, hidden: torch.Tensor, accepted: list[int]) -> None:
        """After verification: drop the chained entries; the trunk states of x_q and the
        accepted drafts (``hidden``, rows 0..m) become the pending pairs. A step that did not
        draft (no budget left, or n_max chosen 0) adds them to the pairs still pending: kept as
        pieces, joined once when a draft runs them (a long run of plain steps stays O(1) a step)."""
        if self.ran:
            self.cache.truncate(q_len)
            self.pend_h, self.pend_tok = [hidden], list(accepted)
        else:
            self.pend_h.append(hidden)
            self.pend_tok.append(x_q)
            self.pend_tok.extend(accepted)
        self.ran = False

    def rollback(self, keep: int) -> None:
        self.cache.truncate(min(self.cache.length, self.valid, keep))


def _mtp_drafter(head, state, sampler, options, ubatch, guide) -> MtpDrafter:
    if head is None:
        raise NoDraftHead("the model", f"n_max {options.n_max}")
    return MtpDrafter(head, state.nextn_cache, sampler, options, ubatch, guide)


NGRAM_MIN = 2             # shortest n-gram looked up: a single token repeats too often to draft well
NGRAM_ENTRIES = 1 << 15   # per n-gram length: the table is bounded (a few MB), oldest entries go first


class NgramDrafter:
    """Self-drafting from the context (prompt lookup): the continuation of the longest earlier
    occurrence of the last tokens, no weights, no cache.

    For each length k in NGRAM_MIN..``options.ngram_size`` a table maps a k-gram's hash to
    where its latest occurrence ended (a hit is checked against the tokens, so a collision
    only costs a draft); a token's arrival indexes the k-grams that end just before it (so
    the current suffix is never its own match). A draft copies the tokens after the longest
    matching k-gram, up to n_cap; copying may run into the draft itself, which continues a
    period (``abab`` → ``ab...``). The drafts are proposals with no distribution (``judge``
    takes q as a point mass), so verification keeps the target's output exact; a ``guide``
    stops the draft at the first token it forbids."""

    uses_hidden = False
    passes = frozenset()

    def __init__(self, options: SpecOptions, guide: Guide | None = None):
        self.sizes = range(options.ngram_size, NGRAM_MIN - 1, -1)       # longest first
        self.guide = guide
        self.tokens: list[int] = []
        self.tables: dict[int, dict[int, int]] = {k: {} for k in self.sizes}
        self.indexed = 0       # k-grams ending before tokens[indexed] are in the tables

    def _extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)
        seq = self.tokens
        for end in range(max(self.indexed, 1), len(seq)):
            for k, table in self.tables.items():
                if end >= k:
                    key = hash(tuple(seq[end - k:end]))    # the hash, not the tuple: a few MB per table
                    table.pop(key, None)         # re-insert: the dict's order is recency
                    table[key] = end
                    if len(table) > NGRAM_ENTRIES:
                        del table[next(iter(table))]
        self.indexed = len(seq)

    def prime(self, hidden, ids: Sequence[int], start: int = 0) -> None:
        self.tokens, self.indexed = [], 0
        for table in self.tables.values():
            table.clear()
        self._extend(ids)

    def draft(self, x_q: int, q_len: int, n_cap: int) -> tuple[list[int], list[None]]:
        seq = self.tokens + [x_q]        # x_q is not indexed yet: no k-gram may end at it
        for k in self.sizes:
            if len(seq) <= k:
                continue
            suffix = seq[-k:]
            end = self.tables[k].get(hash(tuple(suffix)))
            if end is None or seq[end - k:end] != suffix:
                continue
            drafts: list[int] = []
            guide = self.guide.fork() if self.guide is not None else None
            while len(drafts) < n_cap:
                i = end + len(drafts)
                d = seq[i] if i < len(seq) else drafts[i - len(seq)]
                if guide is not None and not guide.accept(d):
                    break
                drafts.append(d)
            return drafts, [None] * len(drafts)
        return [], []

    def accept(self, q_len: int, x_q: int, hidden, accepted: list[int]) -> None:
        self._extend([x_q] + list(accepted))

    def rollback(self, keep: int) -> None:
        # the drafter ends with the generation; its tokens only ever held what was yielded
        del self.tokens[keep:]
        self.indexed = min(self.indexed, len(self.tokens))


register_drafter("mtp", _mtp_drafter)
register_drafter("ngram", lambda head, state, sampler, options, ubatch, guide: NgramDrafter(options, guide),
                 uses_hidden=False)


def generate_step(model, prompt: Sequence[int], *, state, sampler: Sampler, head: DraftHead | None = None,
                  options: SpecOptions = SpecOptions(), ubatch: int = 512, max_tokens: int = 128,
                  eos: Collection[int] = (), stats: RunStats | None = None,
                  profile: Profile | None = None, n_cached: int = 0, guide: Guide | None = None,
                  on_token: Callable[[int, np.ndarray], None] | None = None,
                  on_prompt_logits: Callable[[int, np.ndarray], None] | None = None,
                  compute: Callable | None = None, n_policy: Callable | None = None) -> Iterator[int]:
    """Yield up to ``max_tokens`` token ids continuing ``prompt`` (token ids) on ``state``
    (``state.nextn_cache`` is the head's). ``model``: ``forward(ids, state,
    logits="all"|"last"|"none") -> (logits, final hidden states)``. When ``options.n_max > 0``
    the drafter ``options.type`` names drafts (``make_drafter``), with ``head`` (a NextN head
    for ``mtp``, the DSpark drafter for ``dspark``; ``ngram`` needs none). ``stats`` is filled
    as it goes.

    ``n_cached``: the caches already hold the first ``n_cached`` prompt tokens (trunk, and
    with drafting the head's pairs 0..n_cached-1) — a reused prompt prefix; only the rest of
    the prompt is evaluated. 0 = fresh caches.

    ``guide``, ``on_token``, ``on_prompt_logits``: see the module's docstring.

    ``compute``: ``compute(fn, *args)`` runs the drafter's calls (under continuous batching:
    ``Batcher.call``, on the thread that runs every pass, ``offload.batching``); None: here.

    ``n_policy``: ``policy(stats) -> n``, each step's n_max (at most ``options.n_max``) chosen
    online (``offload.online_n_max``); None: ``options.n_max`` every step."""
    ids = [int(i) for i in prompt]
    stats = stats if stats is not None else RunStats(n_prompt=len(ids))
    if not 0 <= n_cached < len(ids) or state.n_past != n_cached:
        raise OffloadError(f"n_cached {n_cached}: need 0 <= n_cached < {len(ids)} prompt tokens "
                           f"and caches holding exactly that many (they hold {state.n_past})")
    stats.n_prompt_cached = n_cached
    profile = profile if profile is not None else Profile()
    drafting = options.n_max > 0
    drafter = make_drafter(options, head, state, sampler, ubatch, guide) if drafting else None
    if drafter is not None and compute is not None:
        drafter = _Elsewhere(drafter, compute)
    if drafting:
        stats.spec = options.as_dict()
    keep_hidden = drafter is not None and drafter.uses_hidden
    n_prompt = len(ids)

    profile.reset()
    t0 = time.perf_counter()
    with torch.inference_mode(), prompt_threads(min(ubatch, n_prompt - n_cached)):
        hidden = []
        for s in range(n_cached, n_prompt, ubatch):
            last = s + ubatch >= n_prompt
            logits, h = model.forward(torch.as_tensor(ids[s:s + ubatch]), state,
                                      logits="all" if on_prompt_logits else "last" if last else "none")
            if keep_hidden:
                hidden.append(h)
            if on_prompt_logits is not None:
                on_prompt_logits(s, _rows(logits))
        if not finite(logits):
            raise nonfinite_error(model, ids, "the prompt")
        row = _rows(logits[-1])
        with profile.time("sampling"):
            tok = _choose(sampler, guide, row)
        if drafting:
            drafter.prime(torch.cat(hidden) if keep_hidden else None, ids, n_cached)
    stats.prompt_s, stats.prompt_profile = time.perf_counter() - t0, profile.snapshot()
    profile.reset()

    emitted, rows = [tok], [row]
    seq = list(ids)                  # prompt + yielded tokens: what a non-finite search reruns
    try:
        while True:
            for t, row in zip(emitted, rows):
                stats.n_gen += 1
                seq.append(t)
                if on_token is not None:
                    on_token(t, row)
                yield t
                if t in eos or stats.n_gen >= max_tokens:
                    return
            t1 = time.perf_counter()
            with torch.inference_mode():
                try:
                    n_step = options.n_max if n_policy is None else min(options.n_max, n_policy(stats))
                    emitted, rows = _step(model, state, drafter, sampler, options, emitted[-1],
                                          n_cap=min(n_step, max_tokens - stats.n_gen - 1),
                                          stats=stats, profile=profile, guide=guide)
                except _NonFinite as bad:
                    raise nonfinite_error(model, seq[:-1] + bad.tokens,
                                          f"generated token {stats.n_gen + 1}") from None
            stats.eval_s += time.perf_counter() - t1
    finally:
        # the caches hold exactly the yielded tokens but the last (pending)
        keep = n_prompt + stats.n_gen - 1
        if state.n_past > keep:
            state.truncate(keep)
        if drafter is not None:
            drafter.rollback(keep)
        stats.eval_profile = profile.snapshot()


class _Elsewhere:
    """``drafter`` whose pass-running methods (``Drafter.passes``; every method where it
    declares none) run through ``compute(fn, *args, **kwargs)``; its other methods and plain
    attributes read through."""

    def __init__(self, drafter, compute):
        self._obj, self._compute = drafter, compute
        self._passes = getattr(drafter, "passes", None)

    def __getattr__(self, name):
        value = getattr(self._obj, name)
        if not callable(value) or (self._passes is not None and name not in self._passes):
            return value
        return lambda *args, **kwargs: self._compute(value, *args, **kwargs)


class _NonFinite(Exception):
    """A verify pass gave non-finite logits; ``tokens``: that pass's (pending token first)."""

    def __init__(self, tokens: list[int]):
        super().__init__()
        self.tokens = tokens


def _choose(sampler: Sampler, guide: Guide | None, row: np.ndarray) -> int:
    """The next token from the target's logits ``row``, within the guide's constraint."""
    if guide is None:
        return sampler(row)
    tok = sampler(guide.mask(row))
    guide.accept(tok)
    return tok


def _judge(row: np.ndarray, draft: int, q: np.ndarray | None, sampler: Sampler, guide: Guide | None) -> int | None:
    """``judge`` within the guide's constraint; the guide advances by the token kept."""
    if guide is None:
        return judge(row, draft, q, sampler)
    fix = judge(guide.mask(row), draft, q, sampler)
    guide.accept(draft if fix is None else fix)
    return fix


def _step(model, state, drafter: Drafter | None, sampler: Sampler, options: SpecOptions, x_q: int,
          *, n_cap: int, stats: RunStats, profile: Profile,
          guide: Guide | None = None) -> tuple[list[int], list[np.ndarray]]:
    """One draft → verify → accept step from pending token ``x_q``; returns the tokens it
    produced (accepted drafts, then the target's correction or bonus token) and the target's
    logits row each was chosen at."""
    q_len = state.n_past
    drafts, qs = [], []
    if drafter is not None and n_cap > 0:
        t = time.perf_counter()
        drafts, qs = drafter.draft(x_q, q_len, n_cap)
        stats.draft_s += time.perf_counter() - t
    t = time.perf_counter()
    out: list[int] = []
    out_rows: list[np.ndarray] = []
    rows: list[torch.Tensor] = []            # trunk states of x_q and the accepted drafts
    if options.verify == "batched" or not drafts:
        seq = [x_q] + drafts
        logits, h = model.forward(torch.as_tensor(seq), state, logits="all" if drafts else "last")
        stats.n_eval += 1
        if not finite(logits):
            raise _NonFinite(seq)
        z = _rows(logits)
        with profile.time("sampling"):
            for i, d in enumerate(drafts):
                fix = _judge(z[i], d, qs[i], sampler, guide)
                out_rows.append(z[i])
                if fix is not None:
                    out.append(fix)
                    break
                out.append(d)
            else:
                out.append(_choose(sampler, guide, z[len(drafts)]))
                out_rows.append(z[len(drafts)])
        if state.n_past != q_len + len(out):     # rejected drafts (plain decoding: nothing to drop)
            state.truncate(q_len + len(out))
        if drafter is not None and drafter.uses_hidden:
            rows.append(h[:len(out)])
    else:                                   # exact: one target pass per token, as plain decoding
        for i, tok in enumerate([x_q] + drafts):
            logits, h = model.forward(torch.as_tensor([tok]), state, logits="last")
            stats.n_eval += 1
            if not finite(logits):
                raise _NonFinite(([x_q] + drafts)[:i + 1])
            rows.append(h)
            z = _rows(logits[-1])
            with profile.time("sampling"):
                fix = _judge(z, drafts[i], qs[i], sampler, guide) if i < len(drafts) else _choose(sampler, guide, z)
            out_rows.append(z)
            if i == len(drafts) or fix is not None:
                out.append(fix)
                break
            out.append(drafts[i])
    stats.verify_s += time.perf_counter() - t
    n_acc = len(out) - 1
    if drafter is not None:
        # what the drafter takes in of the kept tokens is drafting's cost (DSpark's injection)
        t = time.perf_counter()
        drafter.accept(q_len, x_q, torch.cat(rows) if drafter.uses_hidden else None, out[:n_acc])
        stats.draft_s += time.perf_counter() - t
    stats.record_step(len(drafts), n_acc, n_cap if drafter is not None else 0)
    return out, out_rows
