"""The environment of a measuring subprocess: nearly bare (no inherited allocator, thread or
library settings skew what it measures), but the Numba compile target and cache folder
(``NUMBA_*``) carry over, so a suite run for another CPU class (``cpu_kernels.targets``)
compiles and measures its subprocesses for that class too, and so does the suite's pin of
"auto" decode activations to the built-in list (``OFFLOAD_DECODE_INT8``, tests/conftest.py)."""
from __future__ import annotations

import os


def bare_env(**extra: str) -> dict[str, str]:
    numba = {k: v for k, v in os.environ.items() if k.startswith("NUMBA_") or k == "OFFLOAD_DECODE_INT8"}
    return {"PATH": "/usr/bin:/bin", **numba, **extra}
