"""Calling a compiled kernel without Numba's per-call dispatch.

A Numba dispatcher types every argument on every call (~30 µs for a 50-argument call on a
2-core box); a bound caller (the compiled block, the hybrid hand-off) always passes the same
types, so after one call through the dispatcher it can call the compiled entry point itself
(~1 µs).
"""
from __future__ import annotations


def first_call(fn, args):
    """Run ``fn`` through Numba's dispatcher (compiling it, or loading it from the cache, for
    these argument types); returns (the compiled entry point, which later calls use directly
    — they must pass the same types: bound arguments fixed, per-call arrays of the same
    dtype, layout and rank — and this call's result)."""
    result = fn(*args)
    sig = tuple(fn.typeof_pyval(a) for a in args)
    return (fn.overloads[sig].entry_point if sig in fn.overloads else (lambda *a: fn(*a))), result
