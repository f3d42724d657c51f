"""Acceptance profile of a draft head: how many drafted tokens the target keeps.

``accept[j-1]`` is the conditional acceptance ``a_j`` = P(draft position j is accepted |
positions 1..j-1 were accepted). Under ``p_min > 0`` the drafter may stop before ``n_max``;
then ``a_j`` counts "not drafted" as "not accepted" (so ``E(n) = 1 + Σ_i Π_{j≤i} a_j`` still
holds), and ``cont[j-1]`` = P(a j-th token is drafted | a (j-1)-th was) gives the number of
draft forwards and the verify batch size. Positions past the end of a list reuse its last value.

Default profile (``DEFAULT_MTP``), from users' DeepSeek-V4-Flash MTP runs posted on
ggml-org/llama.cpp PR 25784 and ikawrakow/ik_llama.cpp PR 2216, all with p_min = 0:

- n_max = 1, 4x R9700 (PR 25784): acceptance 76.3%  ->  a_1 ~ 0.76.
- n_max = 2, accepted/drafted = (a_1 + a_1 a_2) / 2, eight runs: 79.5, 73.7, 65.0% (PR 2216,
  code/extract/story), 80.0, 72.3, 61.7% (PR 2216, second box), 65.1% (DGX Spark, PR 25784),
  56.5% (4x R9700, PR 25784). Median 68.7%: a + a^2 = 1.374 gives a = 0.774, so
  a_1 = a_2 = 0.77 agrees with both the n = 1 and the n = 2 figures.
- positions >= 3: no MTP per-position figures in those threads (llama.cpp PR 25642 reports
  93%/78% overall at n_max 2/3 but also 100% at n_max 1, from one short run; not used).
  A DSpark drafter on the same model (PR 25784, n_max 5) reported per-position rates whose
  successive ratios (the conditional a_j) at positions 3-5 are 0.541 0.519 0.372
  (translation) and 0.644 0.668 0.650 (code review), mean 0.57. That a chained MTP head
  (trained to look one token ahead) degrades the same way is an assumption; measure it
  with ``offload tune``.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from placement.draft import check_p_min
from placement.errors import PlacementError
from placement.hardware import ProfileError

_FIELDS = ("accept", "cont", "p_min", "source")


@dataclass(frozen=True)
class AcceptanceProfile:
    accept: tuple[float, ...]
    cont: tuple[float, ...] = (1.0,)   # 1.0 everywhere: p_min = 0, always draft n_max tokens
    p_min: float = 0.0
    source: str = "user"

    def __post_init__(self) -> None:
        object.__setattr__(self, "accept", _probabilities("accept", self.accept))
        object.__setattr__(self, "cont", _probabilities("cont", self.cont))
        try:
            check_p_min(self.p_min, "acceptance profile: p_min")
        except PlacementError as exc:
            raise ProfileError(str(exc)) from None

    def a(self, j: int) -> float:
        """Conditional acceptance at draft position j (1-based)."""
        return self.accept[min(j, len(self.accept)) - 1]

    def c(self, j: int) -> float:
        """P(position j is drafted | position j-1 was drafted), j >= 1 (1-based)."""
        return self.cont[min(j, len(self.cont)) - 1]

    def expected_tokens(self, n: int) -> float:
        """E(n) = 1 + Σ_{i≤n} Π_{j≤i} a_j: tokens produced per step with draft length n."""
        total, run = 1.0, 1.0
        for j in range(1, n + 1):
            run *= self.a(j)
            total += run
        return total

    def accepted_distribution(self, n: int) -> list[float]:
        """P(A = m) for m = 0..n: drafts a step with cap n accepts (so it yields m + 1 tokens)."""
        reach = [1.0]                         # P(A >= m)
        for j in range(1, n + 1):
            reach.append(reach[-1] * self.a(j))
        return [reach[m] - (reach[m + 1] if m < n else 0.0) for m in range(n + 1)]

    def drafted_distribution(self, n: int) -> list[float]:
        """P(D = d) for d = 0..n: tokens actually drafted when the cap is n."""
        at_least = [1.0]                      # P(D >= d)
        for j in range(1, n + 1):
            at_least.append(at_least[-1] * self.c(j))
        return [at_least[d] - (at_least[d + 1] if d < n else 0.0) for d in range(n + 1)]

    def to_dict(self) -> dict:
        return {"source": self.source, "p_min": self.p_min,
                "accept": list(self.accept), "cont": list(self.cont)}

    @classmethod
    def from_dict(cls, d: object) -> AcceptanceProfile:
        if not isinstance(d, Mapping):
            raise ProfileError("acceptance profile: expected a mapping")
        unknown = sorted(str(k) for k in d if k not in _FIELDS)
        if unknown:
            raise ProfileError(f"acceptance profile: unknown key(s) {', '.join(unknown)}")
        if "accept" not in d:
            raise ProfileError("acceptance profile: missing 'accept' (per-position acceptance list)")
        kw = {"accept": d["accept"]}
        if "cont" in d:
            kw["cont"] = d["cont"]
        if "p_min" in d:
            kw["p_min"] = d["p_min"]
        if "source" in d:
            kw["source"] = str(d["source"])
        return cls(**kw)


def _probabilities(what: str, values: object) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or len(values) == 0:
        raise ProfileError(f"acceptance profile: {what} must be a non-empty list of probabilities")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 <= v <= 1:
            raise ProfileError(f"acceptance profile: {what} values must be in [0, 1], got {v!r}")
        out.append(float(v))
    return tuple(out)


DEFAULT_MTP = AcceptanceProfile(
    accept=(0.77, 0.77, 0.57),
    source="default: DeepSeek-V4-Flash MTP user runs, see placement/acceptance.py",
)

# DSpark (a block drafter, DeepSeek-V4-Flash-0731), from ggml-org/llama.cpp PR 25784's bench
# with --spec-type draft-dspark --spec-draft-n-max 5 (DGX Spark, 7 tasks): 1,038 of 2,236
# drafted tokens accepted over 447 steps, so 2.32 accepted per step at n = 5. Positions 3-5
# keep the conditional 0.57 quoted above (the same thread's per-position rates); a_1 = a_2 =
# x then solves x + 2.08 x^2 = 2.32: x = 0.84, and E(5) = 3.32 as measured there.
DEFAULT_DSPARK = AcceptanceProfile(
    accept=(0.84, 0.84, 0.57),
    source="default: DeepSeek-V4-Flash DSpark run in llama.cpp PR 25784, see placement/acceptance.py",
)
