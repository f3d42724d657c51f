"""Where the time went: wall seconds accumulated per category during a run.

``cpu_experts`` is measured inside the worker thread that drives the Numba kernels (they
release the GIL, so it overlaps the torch part); ``cpu_wait`` is the part of it the main
thread had to wait for; ``transfer`` covers moves of activations between devices (on CUDA
a move to the host also waits for queued GPU work, so it includes that).
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class Profile:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def time(self, category: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[category] += time.perf_counter() - t0

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    def reset(self) -> None:
        self.seconds.clear()

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)
