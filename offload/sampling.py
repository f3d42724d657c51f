"""Token sampling: greedy, temperature, top-k, top-p, seeded.

``probs`` gives the distribution a token is actually drawn from (after temperature,
top-k and top-p), which speculative sampling needs for its acceptance rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Sampler:
    temperature: float = 0.0     # 0 → greedy (argmax)
    top_k: int = 0               # 0 → off
    top_p: float = 1.0           # 1 → off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError("need temperature >= 0, top_k >= 0, 0 < top_p <= 1")
        self.rng = np.random.default_rng(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """logits (V,) → float64 probabilities (V,) of the distribution sampled from."""
        z = np.asarray(logits, dtype=np.float64)
        if self.greedy:
            p = np.zeros_like(z)
            p[int(np.argmax(z))] = 1.0
            return p
        z = z / self.temperature
        if 0 < self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z >= kth, z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            cum = np.cumsum(p[order])
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            cut = int(np.searchsorted(cum, self.top_p)) + 1
            keep = np.zeros_like(p, dtype=bool)
            keep[order[:cut]] = True
            p = np.where(keep, p, 0.0)
            p /= p.sum()
        return p

    def draw(self, p: np.ndarray) -> int:
        """One token from probabilities p (V,)."""
        if self.greedy:
            return int(np.argmax(p))
        return int(self.rng.choice(p.size, p=p))

    def __call__(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        return self.draw(self.probs(logits))
