"""Where the time went: wall seconds accumulated per category during a run.

``cpu_experts`` is measured inside the worker thread that drives the Numba kernels (they
release the GIL, so it overlaps the torch part); ``cpu_wait`` is the part of it the main
thread had to wait for; ``transfer`` covers moves of activations between devices (on CUDA
a move to the host also waits for queued GPU work, so it includes that).
"""
from __future__ import annotations

import time
from collections import defaultdict


class _Timer:
    """``with profile.time(cat):`` — a plain class, not a ``@contextmanager`` generator:
    it runs several times per layer and token, so its own cost shows at decode."""

    __slots__ = ("seconds", "category", "t0")

    def __init__(self, seconds: dict, category: str):
        self.seconds, self.category = seconds, category

    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds[self.category] += time.perf_counter() - self.t0
        return False


class Profile:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def time(self, category: str) -> _Timer:
        return _Timer(self.seconds, category)

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    def reset(self) -> None:
        self.seconds.clear()

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)
