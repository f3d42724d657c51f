"""Fitting the hardware profile to measured pass times (``offload tune``).

``fit_profile`` solves for the free ``HardwareProfile.linear_params`` entries by non-negative
least squares on relative error over measured T_verify(B) (and draft-pass) times, using the
cost model's feature vectors (``placement.cost.forward_features``): every term of a pass's
time is linear in one parameter, so the measurements form a linear system.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from placement.cost import forward_features, overlap_credit, pass_time
from placement.footprint import DecodeFootprint, FootprintError
from placement.hardware import HardwareProfile, ProfileError
from placement.routing import RoutingProfile

DEFAULT_FREE = ("cpu_read", "forward")
_BANDWIDTHS = ("cpu_read", "gpu_read", "link")        # inverse bandwidths: must stay > 0


@dataclass(frozen=True)
class FitResult:
    profile: HardwareProfile
    fitted: dict[str, float]                          # free linear params (s, s/byte)
    rows: tuple[tuple[str, float, float], ...]        # (what, measured s, predicted s)

    @property
    def max_rel_error(self) -> float:
        return max(abs(p - m) / m for _, m, p in self.rows)


def fit_profile(fp: DecodeFootprint, base: HardwareProfile, *, verify_s: Mapping[int, float],
                draft_s: float | Mapping[int, float] | None = None, free: Sequence[str] = DEFAULT_FREE,
                routing: RoutingProfile | None = None) -> FitResult:
    """Least squares (non-negative, on relative error) for the ``free`` linear parameters.

    ``verify_s`` maps batch B -> measured T_verify(B); ``draft_s`` is a measured draft pass
    (one token), or a mapping batch B -> a measured head pass over B tokens.
    The other parameters stay at ``base``. Terms that are constant in B (per-layer and
    per-pass costs, dense reads) cannot be told apart by T_verify alone: free at most one of
    them unless the draft pass, with its different mix, is measured too.
    """
    params = base.linear_params()
    free = list(dict.fromkeys(free))
    unknown = [p for p in free if p not in params]
    if unknown:
        raise ProfileError(f"fit: unknown parameter(s) {', '.join(unknown)} "
                           f"(known: {', '.join(sorted(params))})")
    kw = dict(n_embd=fp.n_embd, act_bytes=fp.act_bytes, routing=routing)
    passes = [(f"verify B={b}", fp.target, b, t) for b, t in sorted(verify_s.items())]
    if draft_s is not None:
        if fp.draft is None:
            raise FootprintError("fit: draft time given but the footprint has no draft head")
        drafts = {1: draft_s} if isinstance(draft_s, (int, float)) else dict(draft_s)
        passes += [(f"draft B={b}", fp.draft, b, t) for b, t in sorted(drafts.items())]
    samples: list[tuple[str, dict[str, float], float]] = [
        (what, forward_features(part, b, **kw), float(t)) for what, part, b, t in passes]
    # Hot layers overlap their two expert parts (``overlap_credit``), which is not linear in
    # the parameters: the fit adds back what ``base`` says they hide and fits the sum.
    hidden = [overlap_credit(part, b, params, routing=routing) for _, part, b, _ in passes]
    if any(not (math.isfinite(t) and t > 0) for _, _, t in samples):
        raise ProfileError("fit: measured times must be positive")
    if len(samples) < len(free):
        raise ProfileError(f"fit: {len(samples)} measurements cannot determine {len(free)} parameters")

    # Rows weighted by 1/measured: timing noise is roughly proportional to the time.
    a = np.array([[feats.get(p, 0.0) / t for p in free] for _, feats, t in samples])      # (rows, free)
    y = np.array([(t + h - sum(c * params[k] for k, c in feats.items() if k not in free)) / t
                  for (_, feats, t), h in zip(samples, hidden)])                              # (rows,)
    for j, p in enumerate(free):
        if not a[:, j].any():
            raise ProfileError(f"fit: parameter {p} has no effect on this footprint")
    scale = np.linalg.norm(a, axis=0)
    a_n = a / scale
    if np.linalg.matrix_rank(a_n, tol=1e-9) < len(free):
        raise ProfileError(f"fit: parameters {', '.join(free)} cannot be separated by these "
                           "measurements; fix some of them")
    x = _nnls(a_n, y) / scale
    fitted = dict(zip(free, (float(v) for v in x)))
    # A bandwidth cannot be infinite: one fitted to no cost at all stays at ``base`` and the
    # others are fitted again without it (cpu_compute = 0 is allowed: "free next to reads").
    stuck = [p for p, v in fitted.items() if v == 0.0 and p.split(":", 1)[0] in _BANDWIDTHS]
    if stuck:
        rest = [p for p in free if p not in stuck]
        if not rest:
            raise ProfileError(f"fit: {', '.join(stuck)} fitted to no cost at all; the measurements "
                               "do not show it")
        return fit_profile(fp, base, verify_s=verify_s, draft_s=draft_s, free=rest, routing=routing)
    try:
        profile = base.with_linear_params(fitted, source="measured")
    except ProfileError as e:
        raise ProfileError(f"fit: {e}") from None
    new = profile.linear_params()
    rows = tuple((what, t, pass_time(part, b, new, **kw))
                 for (what, _, t), (_, part, b, _) in zip(samples, passes))
    return FitResult(profile, fitted, rows)


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||a x - y|| s.t. x >= 0, exactly, by trying every support set (few parameters)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y * y))
    for size in range(1, n + 1):
        for support in itertools.combinations(range(n), size):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(n)
            x[cols] = sol
            res = float(np.sum((a @ x - y) ** 2))
            if res < best_res - 1e-18:
                best, best_res = x, res
    return best
