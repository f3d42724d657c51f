"""Process-wide kernel settings: thread count and the int8-activation mode.

Numba's thread count is per calling thread, so the drivers re-apply ours on every call
(the runtime may call from a worker thread).
"""
from __future__ import annotations

import threading

import numba

_threads: int | None = None
_applied = threading.local()      # what this thread last gave numba.set_num_threads
_int8 = False
_decode_int8_types = None       # "auto"'s weight types; None: placement.limits.DECODE_INT8_TYPES


def set_num_threads(n: int | None) -> None:
    """Threads the kernels use; None restores Numba's default (NUMBA_NUM_THREADS)."""
    global _threads
    if n is not None:
        n = int(n)
        if not 1 <= n <= max_threads():
            raise ValueError(f"thread count {n} outside 1..{max_threads()}")
    _threads = n


def max_threads() -> int:
    """The most threads ``set_num_threads`` accepts (what per-thread scratch is sized for)."""
    return numba.config.NUMBA_NUM_THREADS


def apply_threads() -> int:
    """Make the calling thread use the configured count; returns it. Numba's setter is
    called only when this thread's count changes (it costs microseconds, and the compiled
    block asks twice per layer and token)."""
    n = _threads if _threads is not None else numba.config.NUMBA_NUM_THREADS
    if getattr(_applied, "n", None) != n:
        numba.set_num_threads(n)
        _applied.n = n
    return n


def set_int8_activations(on: bool) -> None:
    """Quantize activations to int8 per 32 values (llama.cpp's Q8_0 activations) and use
    integer dot products for quantized weights. Only takes effect where the CPU has a
    u8 x s8 dot product (AVX512-VNNI / AVX-VNNI / AVX2: ``simd8.has_int8_dot``);
    elsewhere the float path runs.
    Error: |y - y_float| <= sum_c |w_c| * dx_c / 2, dx = max |x| over the 32 / 127."""
    global _int8
    _int8 = bool(on)


def int8_activations() -> bool:
    return _int8


def set_decode_int8_types(types) -> None:
    """The weight types "auto" requests (``placement.limits.AUTO``: the routed experts'
    decode batches) take int8 activations for: the set chosen for this CPU at load
    (``offload.decode_int8``); None restores ``placement.limits.DECODE_INT8_TYPES``."""
    global _decode_int8_types
    _decode_int8_types = None if types is None else frozenset(types)


def decode_int8_types():
    return _decode_int8_types
