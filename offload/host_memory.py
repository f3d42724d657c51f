"""Freed activation memory goes back to the system, so the process's RSS is what the plan counts.

The runtime allocates no compute buffer up front: torch, numpy and the Numba kernels
allocate each activation through the C allocator when it is computed and free it when done
(``placement.compute`` models the bytes live at each step). glibc's default *dynamic* mmap
threshold breaks the link between live bytes and RSS: after the first large block (≥ 128 KiB)
is freed, the threshold rises to that block's size (up to 32 MiB), later blocks of that size
come from the heap or a per-thread arena, and what is freed there stays resident. Measured on
the shipped model (``bench/runtime_plans.py``): 3–12 MiB above the live peak, more than the
whole compute estimate, and it depends on the order of allocations, not on the plan.

A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also switches the dynamic adjustment
off) serves every block of ``MMAP_THRESHOLD`` bytes or more with its own mapping, returned to
the system on free: RSS then follows the live bytes, and the planner's host estimate
describes it (within 3–6 % on the shipped model, vs 13–44 % above it with the default).

The cost is page faults: every large activation is a fresh mapping, touched page by page.
It shows where a token is cheap and its blocks are large — the 21 MiB shipped model, and
above all GPUs backed by host RAM (``--virtual-gpus``), whose weights are dequantized into
fresh host blocks on every call. On the (loaded, 2-core) development box: all-CPU decode
5–25 % slower and prompt 10–45 % slower; decode with virtual GPUs about 2x slower
(``bench/runtime_plans.py`` prints both allocators side by side). On CUDA those blocks live in
torch's caching allocator on the GPU, and blocks over 32 MiB (a long context's attention)
get their own mapping under glibc's default as well.

``offload run`` / ``offload bench`` call ``return_freed_memory()`` first thing; it yields to
the user's own setting: with
``MALLOC_MMAP_THRESHOLD_`` in the environment (glibc applied it at start-up) it does nothing.
Embedders call it themselves. Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

MMAP_THRESHOLD = 64 << 10    # bytes: blocks this large get their own mapping (glibc's default: 128 KiB, dynamic)
_M_MMAP_THRESHOLD = -3       # glibc <malloc.h>


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes. True when set here; False under
    the user's own ``MALLOC_MMAP_THRESHOLD_`` or without glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return mallopt(_M_MMAP_THRESHOLD, threshold) == 1
