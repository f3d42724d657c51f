"""How far to trust the n_max table: the interval its inputs' uncertainty spans.

Every input of the forecast is either measured on the box (``HardwareProfile.measured``:
``offload probe`` or ``offload tune``; an acceptance profile that ``offload tune`` measured)
or a prior (the defaults in ``placement.hardware`` and ``placement.acceptance``). Each gets a
range: a factor on a cost term, plus or minus an amount on each conditional acceptance a_j.

Step time is linear in the cost terms (``placement.cost``): with the draft passes apart,
``T(n) = v_n·p + d·(g_n·p)`` for the parameter vector p and a factor d on the draft pass, so
``S(n) = E(n)·T(0)/T(n)`` is linear-fractional in p for fixed d and monotone in d and in the
a_j: its extremes over the box of ranges lie at the box's corners, which are enumerated (terms
of one kind on several GPUs move together, so there are at most 2^10 corners).
The interval leaves out what hot layers overlap (``overlap_credit``, not linear); the nominal
value is always inside it.
"""
from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from placement.acceptance import DEFAULT_MTP, AcceptanceProfile
from placement.cost import SpecTable, forward_features, predicted_decode_tps, step_weights
from placement.footprint import DecodeFootprint
from placement.hardware import HardwareProfile
from placement.routing import RoutingCounts, RoutingProfile

# Range of a term measured on this box: `offload tune`'s fitted model predicts its own runs
# within 7-11 % (issue 32), and the probe measures the same passes, so +-15 %.
MEASURED_SPREAD = (0.87, 1.15)
# The priors' known spread, from the plain-decode forecasts the priors gave against measured
# decoding (issue 32, shipped model): 14-17 % slow on a Xeon, 66-73 % fast on a Zen 3, ~50 %
# fast on a Zen 5 (whose fixed costs came out twice the prior); bandwidths: the default is a
# dual-channel DDR5 desktop, real boxes run from half that to a many-channel server's 4x.
PRIOR_SPREAD: dict[str, tuple[float, float]] = {
    "cpu_read": (0.5, 2.0), "cpu_compute": (0.5, 2.0), "gpu_read": (0.8, 1.5), "link": (0.8, 1.5),
    "link_latency": (0.5, 3.0), "cpu_layer": (0.75, 2.5), "gpu_layer": (0.5, 2.0), "forward": (0.75, 2.5),
    "draft_pass": (0.75, 2.5), "step": (0.75, 2.5), "spec_step": (0.75, 2.5),
}
# The draft pass apart from the terms it shares with verify passes: measured 0.42-0.46 ms on
# the Zen 5 against 0.23 ms assumed, while T(0) came out 1.5x the prior (issue 32).
DRAFT_PRIOR_SPREAD = (0.8, 2.0)
DRAFT_MEASURED_SPREAD = (0.9, 1.1)
# Conditional acceptance a_j: the defaults' own sources span 0.57-0.80 at positions 1-2
# (placement/acceptance.py), so +-0.15; measured by `offload tune` on the prompts: +-0.05.
ACCEPT_PRIOR_DELTA = 0.15
ACCEPT_MEASURED_DELTA = 0.05
# The draft pass counts as measured when these were fitted (probe and tune fit them on it).
_DRAFT_TERMS = ("cpu_layer", "forward")


def _kind(param: str) -> str:
    return param.split(":", 1)[0]


@dataclass(frozen=True)
class InputSpread:
    """The range of each input: factors per cost-term kind, the draft pass, acceptance."""

    terms: Mapping[str, tuple[float, float]]       # kind ("cpu_read", "gpu_read", ...) -> (lo, hi) factor
    draft: tuple[float, float]
    accept_delta: float
    measured: tuple[str, ...]                      # kinds measured on the box
    acceptance_measured: bool

    @classmethod
    def of(cls, hw: HardwareProfile, acceptance: AcceptanceProfile) -> InputSpread:
        measured = tuple(sorted({_kind(m) for m in hw.measured}))
        terms = {k: MEASURED_SPREAD if k in measured else spread for k, spread in PRIOR_SPREAD.items()}
        draft_measured = all(t in measured for t in _DRAFT_TERMS)
        acc_measured = acceptance.source != DEFAULT_MTP.source
        return cls(terms, DRAFT_MEASURED_SPREAD if draft_measured else DRAFT_PRIOR_SPREAD,
                   ACCEPT_MEASURED_DELTA if acc_measured else ACCEPT_PRIOR_DELTA, measured, acc_measured)


def _shifted(acceptance: AcceptanceProfile, delta: float) -> AcceptanceProfile:
    return AcceptanceProfile(tuple(min(max(a + delta, 0.0), 1.0) for a in acceptance.accept),
                             acceptance.cont, acceptance.p_min, acceptance.source)


def step_coefficients(fp: DecodeFootprint, n: int, acceptance: AcceptanceProfile, *,
                      routing: RoutingProfile | None = None, hits: RoutingCounts | None = None,
                      draft_kind: str = "chain") -> tuple[dict[str, float], dict[str, float]]:
    """T(n) as (verify and loop part, draft part): coefficients over ``linear_params``, with
    ``placement.cost.step_weights`` (the expectation ``step_time`` takes) over each pass's
    ``forward_features``. A block drafter's injection is left out of the range (its reads are
    a small share of the block pass)."""
    kw = dict(n_embd=fp.n_embd, act_bytes=fp.act_bytes, routing=routing, hits=hits)
    verify: dict[str, float] = defaultdict(float, {"step": 1.0})
    draft: dict[str, float] = defaultdict(float)

    def add(into: dict[str, float], feats: Mapping[str, float], w: float) -> None:
        for k, c in feats.items():
            into[k] += w * c

    if n == 0:
        add(verify, forward_features(fp.target, 1, **kw), 1.0)
        return dict(verify), {}
    verify["spec_step"] += 1.0
    w_draft, w_verify = step_weights(n, acceptance, n + 1, draft_kind)
    for b, w in enumerate(w_draft):
        if w:
            add(draft, forward_features(fp.draft, b + 1, **kw), w)
    for b, w in enumerate(w_verify):
        if w:
            add(verify, forward_features(fp.target, b + 1, **kw), w)
    return dict(verify), dict(draft)


@dataclass(frozen=True)
class ForecastInterval:
    """Low and high ends of the plain decode t/s and of each n's speedup."""

    plain_tps: tuple[float, float]
    speedup: tuple[tuple[float, float], ...]     # by n
    spread: InputSpread

    @property
    def break_even(self) -> tuple[int, int]:
        """(largest n whose low speedup is >= 1, largest n whose high speedup is)."""
        return (max(n for n, (lo, _) in enumerate(self.speedup) if lo >= 1.0),
                max(n for n, (_, hi) in enumerate(self.speedup) if hi >= 1.0))

    @property
    def crosses_one(self) -> bool:
        return any(lo < 1.0 <= hi for lo, hi in self.speedup[1:])

    def to_dict(self) -> dict:
        return {"plain_tps": [round(v, 4) for v in self.plain_tps],
                "speedup": [[round(lo, 4), round(hi, 4)] for lo, hi in self.speedup],
                "break_even_n_max": list(self.break_even), "crosses_1x": self.crosses_one,
                "measured": list(self.spread.measured), "acceptance_measured": self.spread.acceptance_measured}


def forecast_interval(fp: DecodeFootprint, hw: HardwareProfile, table: SpecTable | None, *,
                      routing: RoutingProfile | None = None, hits: RoutingCounts | None = None,
                      spread: InputSpread | None = None, draft_kind: str = "chain") -> ForecastInterval:
    """The interval of ``table`` (``speculation_table`` of the same inputs) over the ranges of
    its inputs (``InputSpread.of(hw, table.acceptance)`` unless given). ``table`` None: plain
    decoding only (a model without a draft head), around ``predicted_decode_tps``."""
    acceptance = table.acceptance if table is not None else DEFAULT_MTP
    if spread is None:
        spread = InputSpread.of(hw, acceptance)
    params = hw.linear_params()
    max_n = len(table.rows) - 1 if table is not None else 0
    nominal_tps = table.plain_tps if table is not None else \
        predicted_decode_tps(fp, hw, routing=routing, hits=hits)
    accs = [_shifted(acceptance, -spread.accept_delta), _shifted(acceptance, spread.accept_delta)]
    coeffs = [[step_coefficients(fp, n, acc, routing=routing, hits=hits, draft_kind=draft_kind)
               for n in range(max_n + 1)] for acc in accs]
    used = sorted({k for per_acc in coeffs for v, g in per_acc for k in (*v, *g)})
    kinds = sorted({_kind(k) for k in used})
    # corners: one factor per kind (lo or hi), as rows of the parameter vector over `used`
    corners = np.array(list(itertools.product((0, 1), repeat=len(kinds))), dtype=float)    # (C, kinds)
    lo = np.array([spread.terms[k][0] for k in kinds])
    hi = np.array([spread.terms[k][1] for k in kinds])
    factor = lo + corners * (hi - lo)                                                       # (C, kinds)
    col = [kinds.index(_kind(k)) for k in used]
    p = factor[:, col] * np.array([params[k] for k in used])                                # (C, used)

    def vec(c: Mapping[str, float]) -> np.ndarray:
        return np.array([c.get(k, 0.0) for k in used])

    t0 = p @ vec(coeffs[0][0][0])                                                           # (C,)
    speed = [(1.0, 1.0)]
    for n in range(1, max_n + 1):
        vals = []
        for acc, per_acc in zip(accs, coeffs):
            v, g = per_acc[n]
            for d in spread.draft:
                vals.append(acc.expected_tokens(n) * t0 / (p @ vec(v) + d * (p @ vec(g))))
        nominal = table.rows[n].speedup
        speed.append((min(nominal, min(float(x.min()) for x in vals)),
                      max(nominal, max(float(x.max()) for x in vals))))
    plain = (min(nominal_tps, float(1.0 / t0.max())), max(nominal_tps, float(1.0 / t0.min())))
    return ForecastInterval(plain, tuple(speed), spread)


def format_inputs(hw: HardwareProfile, spread: InputSpread, fp: DecodeFootprint) -> str:
    """Which terms the forecast measured on this box and which are priors (with their range)."""
    feats = forward_features(fp.target, 1, n_embd=fp.n_embd, act_bytes=fp.act_bytes)
    if fp.draft is not None:
        feats = {**feats, **forward_features(fp.draft, 1, n_embd=fp.n_embd, act_bytes=fp.act_bytes)}
    params = hw.linear_params()
    kinds = sorted({_kind(k) for k, c in feats.items() if c} | {"step"} | ({"spec_step"} if fp.draft else set()))

    def value(kind: str) -> str:
        v = next(params[k] for k in params if _kind(k) == kind)
        if kind in ("cpu_read", "cpu_compute", "gpu_read", "link"):
            return f"{kind} {1 / v / 1e9:.1f} GB/s" if v else f"{kind} free"
        return f"{kind} {v * 1e6:.0f} us"

    measured = [value(k) for k in kinds if k in spread.measured]
    priors = [f"{value(k)} (x{spread.terms[k][0]:g}-{spread.terms[k][1]:g})" for k in kinds
              if k not in spread.measured]
    draft = "" if fp.draft is None else f"; draft pass x{spread.draft[0]:g}-{spread.draft[1]:g}"
    lines = []
    if measured:
        lines.append("measured on this box: " + ", ".join(measured) + draft)
    else:
        lines.append("uncalibrated: every cost term is a prior (plan on the box itself, or give "
                     "--hw-profile from `offload probe --write` run there)")
    if priors:
        lines.append("priors: " + ", ".join(priors) + ("" if measured else draft))
    if fp.draft is not None:
        lines.append("acceptance: " + ("measured" if spread.acceptance_measured else "defaults")
                     + f" (+-{spread.accept_delta:g})")
    return "\n".join(lines)
