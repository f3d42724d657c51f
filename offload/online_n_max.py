"""``--spec-n-max auto``: each sequence's n_max chosen online, every few steps, from what this
run measures — its own acceptance per draft position and the box's step costs at the
current batch size — instead of one n_max fixed before the run.

A step of n drafts yields E(n) = 1 + Σ_{i≤n} Π_{j≤i} a_j tokens (``placement.acceptance``),
a_j the sequence's conditional acceptance at position j: its counts so far, plus what earlier
sequences of this session or server measured with the same drafter (``StepCosts.history``,
worth at most ``HISTORY_STEPS`` steps), blended with a prior (the drafter's default profile)
worth ``PRIOR_STEPS`` steps, so a position nobody has drafted yet keeps the prior's value.
Under continuous batching the step is shared: with the other sequences' rows R_o and
expected tokens T_o (what their policies last chose), the policy picks the n that maximises
the whole step's tokens per second,

    (E(n) + T_o) / (t(R_o + 1 + n) + n · c_draft + C_o + o)

t(R) the batched forward's measured time at R rows (``StepCosts``: per row count, linear
between measured counts, the least-squares line beyond them), c_draft the drafting time per
drafted token in steady drafting (a step right after a drafted one: the first draft after
plain steps also runs the head over the pairs those steps left pending, a cost plain
decoding never pays), C_o the others' drafting time per step, o what a step costs a
sequence alone besides its forward and drafting (its loop and sampling: the median of the
measured step wall time less those; a cost a longer draft pays fewer times per token).
Under batching o is not counted: there a sequence's step is mostly waiting on the others'
work, which its own n does not shorten. A sequence alone is the case
R_o = T_o = C_o = 0, its forward timed by itself. The choice is re-made every ``EVERY``
steps. A sequence whose best is n = 0 drafts one token every ``PROBE_EVERY`` steps so its
a_1 stays measured (else a fall to 0 would be final) — unless even drafts that were all
accepted could not beat plain decoding at the measured costs, when probing could only
lose (the probe's head pass over the pending pairs is then pure cost).

``EpsilonGreedy`` is the blind alternative (ik_llama.cpp's ``--spec-autotune``): it keeps the
measured tokens per second of each n and takes the best, or with probability ε a random n.
``bench.parallel`` compares the two with fixed n_max.
"""
from __future__ import annotations

import random
import statistics
import threading
from collections import deque

from placement.acceptance import DEFAULT_DSPARK, DEFAULT_MTP, AcceptanceProfile

EVERY = 4               # steps between choices
PROBE_EVERY = 16        # at n = 0: one drafted step in this many keeps a_1 measured
PRIOR_STEPS = 8.0       # the prior profile counts as this many observed steps per position
HISTORY_STEPS = 64.0    # earlier sequences' acceptance counts as at most this many steps
ROW_PRIOR = 0.1         # with one row count measured: each further row costs this share of its time
WINDOW = 31             # step times kept per row count: their median is the cost (a pause or a
#                         busy neighbour moves one sample, not the estimate)
POLICIES = ("auto", "bandit")
AUTO_CAP = 6            # the longest draft an online policy may choose (a DSpark block: its own)


class Window:
    """The last ``WINDOW`` samples of one measured time, and their median (computed once per
    new sample). The caller serialises access."""

    def __init__(self):
        self._samples: deque = deque(maxlen=WINDOW)
        self._median: float | None = None

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self._median = None

    def __len__(self) -> int:
        return len(self._samples)

    def median(self) -> float | None:
        """None while empty."""
        if self._median is None and self._samples:
            self._median = statistics.median(self._samples)
        return self._median


class StepCosts:
    """Measured forward time by the rows it carried (the batcher records every step; the median of
    the last ``WINDOW`` per row count), the steady drafting time per drafted token, and the
    acceptance earlier sequences measured per drafter (``history``)."""

    def __init__(self):
        self._times: dict[int, Window] = {}
        self._pts: list[tuple[int, float]] | None = None   # (rows, median) by rows; None: recompute
        self._lock = threading.Lock()
        self.shares: dict[int, tuple[int, float, float]] = {}   # policy id → (rows, E tokens, draft s)
        self._draft = Window()                   # steady drafting time per drafted token
        self._over = Window()                    # a sequence's step time outside forward and drafting
        self.history: dict[str, tuple[list[int], list[int]]] = {}   # drafter → (reached, accepted) per position

    def record_draft(self, seconds: float) -> None:
        with self._lock:
            self._draft.add(seconds)

    def record_overhead(self, seconds: float) -> None:
        with self._lock:
            self._over.add(seconds)

    @property
    def overhead_s(self) -> float:
        """The median time a step costs a sequence beyond the forward pass and drafting: its
        loop and sampling (recorded by sequences alone; 0 until then)."""
        with self._lock:
            return self._over.median() or 0.0

    @property
    def draft_s(self) -> float | None:
        """The median steady drafting time per drafted token (None: not measured yet)."""
        with self._lock:
            return self._draft.median()

    def remember(self, drafter: str, reached: list[int], accepted: list[int]) -> None:
        """Add a finished sequence's per-position counts to ``drafter``'s history."""
        with self._lock:
            old_r, old_a = self.history.get(drafter, ([], []))
            n = max(len(old_r), len(reached))
            pad = lambda v: list(v) + [0] * (n - len(v))        # noqa: E731
            self.history[drafter] = ([x + y for x, y in zip(pad(old_r), pad(reached))],
                                     [x + y for x, y in zip(pad(old_a), pad(accepted))])

    def recalled(self, drafter: str) -> tuple[list[int], list[int]]:
        with self._lock:
            return self.history.get(drafter, ([], []))

    def record(self, rows: int, seconds: float) -> None:
        with self._lock:
            self._times.setdefault(rows, Window()).add(seconds)
            self._pts = None

    def time(self, rows: int) -> float | None:
        """t(rows): the measured median, linear between measured counts, the least-squares line
        of all of them beyond (one count measured: ``ROW_PRIOR`` of it per further row)."""
        with self._lock:
            if self._pts is None:       # the medians once per new sample, not per lookup
                self._pts = sorted((r, w.median()) for r, w in self._times.items())
            pts = self._pts
        if not pts:
            return None
        if len(pts) == 1:
            r0, t0 = pts[0]
            return max(t0 * 1e-3, t0 * (1 + ROW_PRIOR * (rows - r0)))
        for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
            if r0 <= rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        n = len(pts)
        mr = sum(r for r, _ in pts) / n
        mt = sum(t for _, t in pts) / n
        slope = max(0.0, sum((r - mr) * (t - mt) for r, t in pts) / sum((r - mr) ** 2 for r, _ in pts))
        return max(min(t for _, t in pts), mt + slope * (rows - mr))

    def others(self, me: int) -> tuple[int, float, float]:
        with self._lock:
            rest = [v for k, v in self.shares.items() if k != me]
        return sum(r for r, _, _ in rest), sum(e for _, e, _ in rest), sum(d for _, _, d in rest)

    def share(self, me: int, rows: int, tokens: float, draft_s: float) -> None:
        with self._lock:
            self.shares[me] = (rows, tokens, draft_s)

    def leave(self, me: int) -> None:
        with self._lock:
            self.shares.pop(me, None)


def prior_for(spec_type: str) -> AcceptanceProfile:
    return DEFAULT_DSPARK if spec_type == "dspark" else DEFAULT_MTP


class OnlineNMax:
    """One sequence's ``auto`` policy: ``policy(stats)`` → the n_max for its next step.

    ``costs``: the step costs (and history) it reads and adds to — the batcher's under
    batching (which times the forward passes itself: ``timed_by_batcher``), else one the
    session keeps across its generations. ``drafter``: the kind whose history applies."""

    def __init__(self, n_cap: int, costs: StepCosts, prior: AcceptanceProfile = DEFAULT_MTP, *,
                 drafter: str = "mtp", timed_by_batcher: bool = False):
        self.n_cap, self.prior, self.drafter = n_cap, prior, drafter
        self.shared = timed_by_batcher
        self.costs = costs
        self.n = min(n_cap, 2)                   # until measured: the default profile's usual best
        self.chosen: list[int] = []              # every choice, for the report
        self._steps, self._since_draft = 0, 0
        self._last = (0, 0.0, 0, 0.0, 0.0)       # (n_steps, verify_s, drafted, draft_s, eval_s) at the last call
        self._drafted_before = False             # the step before the last one drafted
        self._stats = None
        reached, accepted = costs.recalled(drafter)
        scale = min(1.0, HISTORY_STEPS / reached[0]) if reached and reached[0] else 0.0
        self._hist = ([r * scale for r in reached], [a * scale for a in accepted])

    def expected(self, stats, n: int, accept_all: bool = False) -> float:
        total, run = 1.0, 1.0
        reached, acc = stats.reached_per_position, stats.accepted_per_position
        h_r, h_a = self._hist
        for j in range(n):
            if not accept_all:
                r = (reached[j] if j < len(reached) else 0) + (h_r[j] if j < len(h_r) else 0.0)
                a = (acc[j] if j < len(acc) else 0) + (h_a[j] if j < len(h_a) else 0.0)
                run *= (a + PRIOR_STEPS * self.prior.a(j + 1)) / (r + PRIOR_STEPS)
            total += run
        return total

    def __call__(self, stats) -> int:
        self._stats = stats
        steps, verify_s, drafted, draft_s = stats.n_steps, stats.verify_s, stats.drafted, stats.draft_s
        last = self._last
        if steps > last[0]:
            k = steps - last[0]
            rows = 1 + round((drafted - last[2]) / k)
            if not self.shared:                  # alone: this sequence's own verify pass is the forward
                self.costs.record(rows, (verify_s - last[1]) / k)
                # and the rest of its step is its own (under batching it is mostly waiting on the
                # other sequences, which its own n does not shorten: not counted there)
                self.costs.record_overhead(max(0.0, (stats.eval_s - last[4] - (verify_s - last[1])
                                                     - (draft_s - last[3])) / k))
            if drafted > last[2] and self._drafted_before and steps - last[0] == 1:
                self.costs.record_draft((draft_s - last[3]) / (drafted - last[2]))    # steady drafting
            self._drafted_before = drafted > last[2]
        self._last = (steps, verify_s, drafted, draft_s, stats.eval_s)
        per_draft = self.costs.draft_s
        if steps == 0 or steps - self._steps >= EVERY:
            self._steps = steps
            self.n = self._choose(stats, per_draft)
            self.chosen.append(self.n)
        n = self.n
        self._since_draft = 0 if n > 0 else self._since_draft + 1
        if n == 0 and self.n_cap > 0 and self._since_draft >= PROBE_EVERY:
            self._since_draft = 0
            if self._could_gain(stats, per_draft):
                n = 1
        self.costs.share(id(self), 1 + n, self.expected(stats, n), n * (per_draft or 0.0))
        return n

    def _rate(self, stats, n: int, per_draft: float, accept_all: bool = False) -> float | None:
        rows_o, tokens_o, draft_o = self.costs.others(id(self))
        t = self.costs.time(rows_o + 1 + n)
        if t is None:
            return None
        return (self.expected(stats, n, accept_all) + tokens_o) / (t + n * per_draft + draft_o + self.costs.overhead_s)

    def _choose(self, stats, per_draft: float | None) -> int:
        if per_draft is None and self.n > 0:
            return self.n                        # drafting not timed yet: keep drafting until it is
        best, best_rate = self.n, None
        for n in range(self.n_cap + 1 if per_draft is not None else 1):
            rate = self._rate(stats, n, per_draft or 0.0)
            if rate is None:
                return self.n                    # nothing measured yet: keep the start value
            if best_rate is None or rate > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        return best

    def _could_gain(self, stats, per_draft: float | None) -> bool:
        """Whether some n ≥ 1 beats n = 0 if every draft were accepted (unknown costs: yes)."""
        if per_draft is None:
            return True
        plain = self._rate(stats, 0, per_draft)
        if plain is None:
            return True
        return any((self._rate(stats, n, per_draft, accept_all=True) or 0.0) > plain
                   for n in range(1, self.n_cap + 1))

    def close(self) -> None:
        self.costs.leave(id(self))
        st = self._stats
        if st is not None and st.reached_per_position:
            self.costs.remember(self.drafter, st.reached_per_position, st.accepted_per_position)

    def report(self) -> dict:
        return {"policy": "auto", "n_max_chosen": self.chosen[-1] if self.chosen else self.n,
                "n_max_mean": sum(self.chosen) / len(self.chosen) if self.chosen else float(self.n)}


class EpsilonGreedy:
    """The blind policy: each n's measured tokens per second (of this sequence's steps), the
    best taken, or with probability ``epsilon`` a random n (seeded: reproducible)."""

    def __init__(self, n_cap: int, epsilon: float = 0.1, seed: int = 0):
        self.n_cap, self.epsilon = n_cap, epsilon
        self._rng = random.Random(seed)
        self._tokens = [0.0] * (n_cap + 1)
        self._seconds = [0.0] * (n_cap + 1)
        self._last = (0, 0.0)
        self.n = min(n_cap, 2)
        self.chosen: list[int] = []

    def __call__(self, stats) -> int:
        gen, spent = stats.n_gen, stats.eval_s
        if self.chosen:                          # the step just taken was drafted with self.n
            self._tokens[self.n] += gen - self._last[0]
            self._seconds[self.n] += spent - self._last[1]
        self._last = (gen, spent)
        untried = [n for n in range(self.n_cap + 1) if self._seconds[n] == 0]
        if untried:
            self.n = untried[0]
        elif self._rng.random() < self.epsilon:
            self.n = self._rng.randrange(self.n_cap + 1)
        else:
            self.n = max(range(self.n_cap + 1), key=lambda n: self._tokens[n] / self._seconds[n])
        self.chosen.append(self.n)
        return self.n

    def close(self) -> None:
        pass

    def report(self) -> dict:
        return {"policy": "bandit", "n_max_chosen": self.n,
                "n_max_mean": sum(self.chosen) / len(self.chosen) if self.chosen else float(self.n)}
