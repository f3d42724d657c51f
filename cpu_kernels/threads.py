"""Thread count for the kernels. Numba's own setting is per calling thread, so the
drivers re-apply ours on every call (the runtime may call from a worker thread)."""
from __future__ import annotations

import numba

_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Threads the kernels use; None restores Numba's default (NUMBA_NUM_THREADS)."""
    global _threads
    if n is not None:
        n = int(n)
        if not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
            raise ValueError(f"thread count {n} outside 1..{numba.config.NUMBA_NUM_THREADS}")
    _threads = n


def apply() -> int:
    """Make the calling thread use the configured count; returns it."""
    n = _threads if _threads is not None else numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(n)
    return n
