"""``--spec-n-max auto``: each sequence's n_max chosen online, every few steps, from what this
run measures — its own acceptance per draft position and the box's step costs at the
current batch size — instead of one n_max fixed before the run.

A step of n drafts yields E(n) = 1 + Σ_{i≤n} Π_{j≤i} a_j tokens (``placement.acceptance``),
a_j the sequence's conditional acceptance at position j: its counts so far, blended with a
prior (the drafter's default profile) worth ``PRIOR_STEPS`` steps, so a position it has not
drafted yet keeps the prior's value. Under continuous batching the step is shared: with the
other sequences' rows R_o and expected tokens T_o (what their policies last chose), the
policy picks the n that maximises the whole step's tokens per second,

    (E(n) + T_o) / (t(R_o + 1 + n) + n · c_draft + C_o)

t(R) the batched forward's measured time at R rows (``StepCosts``: per row count, linear
between measured counts, the least-squares line beyond them), c_draft the sequence's
measured drafting time per drafted token, C_o the others' drafting time per step. A sequence
alone is the case R_o = T_o = C_o = 0, its forward timed by itself. The choice is re-made
every ``EVERY`` steps; a sequence whose best is n = 0 still drafts one token every
``PROBE_EVERY`` steps so its a_1 stays measured (else a fall to 0 would be final).

``EpsilonGreedy`` is the blind alternative (ik_llama.cpp's ``--spec-autotune``): it keeps the
measured tokens per second of each n and takes the best, or with probability ε a random n.
``bench.parallel`` compares the two with fixed n_max.
"""
from __future__ import annotations

import random
import threading

from placement.acceptance import DEFAULT_DSPARK, DEFAULT_MTP, AcceptanceProfile

EVERY = 4               # steps between choices
PROBE_EVERY = 16        # at n = 0: one drafted step in this many keeps a_1 measured
PRIOR_STEPS = 8.0       # the prior profile counts as this many observed steps per position
ROW_PRIOR = 0.1         # with one row count measured: each further row costs this share of its time
EMA = 0.2               # weight of a new step time in its row count's running mean
POLICIES = ("auto", "bandit")
AUTO_CAP = 6            # the longest draft an online policy may choose (a DSpark block: its own)


class StepCosts:
    """Measured forward time by the rows it carried (the batcher records every step)."""

    def __init__(self):
        self._mean: dict[int, float] = {}
        self._lock = threading.Lock()
        self.shares: dict[int, tuple[int, float, float]] = {}   # policy id → (rows, E tokens, draft s)

    def record(self, rows: int, seconds: float) -> None:
        with self._lock:
            old = self._mean.get(rows)
            self._mean[rows] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def time(self, rows: int) -> float | None:
        """t(rows): the measured mean, linear between measured counts, the least-squares line
        of all of them beyond (one count measured: ``ROW_PRIOR`` of it per further row)."""
        with self._lock:
            pts = sorted(self._mean.items())
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
    """One sequence's ``auto`` policy: ``policy(stats)`` → the n_max for its next step."""

    def __init__(self, n_cap: int, costs: StepCosts | None, prior: AcceptanceProfile = DEFAULT_MTP):
        self.n_cap, self.prior = n_cap, prior
        self.shared = costs is not None          # the batcher times the forward passes
        self.costs = costs if costs is not None else StepCosts()
        self.n = min(n_cap, 2)                   # until measured: the default profile's usual best
        self.chosen: list[int] = []              # every choice, for the report
        self._steps, self._since_draft = 0, 0
        self._last = (0, 0.0, 0)                 # (n_steps, verify_s, drafted) at the last call

    def expected(self, stats, n: int) -> float:
        total, run = 1.0, 1.0
        reached, acc = stats.reached_per_position, stats.accepted_per_position
        for j in range(n):
            r = reached[j] if j < len(reached) else 0
            a = acc[j] if j < len(acc) else 0
            run *= (a + PRIOR_STEPS * self.prior.a(j + 1)) / (r + PRIOR_STEPS)
            total += run
        return total

    def __call__(self, stats) -> int:
        steps, verify_s, drafted, draft_s = stats.n_steps, stats.verify_s, stats.drafted, stats.draft_s
        last = self._last
        if not self.shared and steps > last[0]:  # alone: this sequence's own verify pass is the forward
            self.costs.record(1 + round((drafted - last[2]) / (steps - last[0])),
                              (verify_s - last[1]) / (steps - last[0]))
        self._last = (steps, verify_s, drafted)
        per_draft = draft_s / drafted if drafted else 0.0
        if steps == 0 or steps - self._steps >= EVERY:
            self._steps = steps
            self.n = self._choose(stats, per_draft)
            self.chosen.append(self.n)
        n = self.n
        self._since_draft = 0 if n > 0 else self._since_draft + 1
        if n == 0 and self.n_cap > 0 and self._since_draft >= PROBE_EVERY:
            self._since_draft, n = 0, 1
        self.costs.share(id(self), 1 + n, self.expected(stats, n), n * per_draft)
        return n

    def _choose(self, stats, per_draft: float) -> int:
        rows_o, tokens_o, draft_o = self.costs.others(id(self))
        best, best_rate = self.n, None
        for n in range(self.n_cap + 1):
            t = self.costs.time(rows_o + 1 + n)
            if t is None:
                return self.n                    # nothing measured yet: keep the start value
            rate = (self.expected(stats, n) + tokens_o) / (t + n * per_draft + draft_o)
            if best_rate is None or rate > best_rate * (1 + 1e-9):
                best, best_rate = n, rate
        return best

    def close(self) -> None:
        self.costs.leave(id(self))

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
