"""Fixtures of the kernel tests."""
from __future__ import annotations

import pytest

import cpu_kernels as ck


@pytest.fixture
def int8_mode():
    """The int8 activation path switched on for one test (skipped where the CPU has no integer dot product: VNNI or AVX2)."""
    from cpu_kernels.simd8 import has_int8_dot
    if not has_int8_dot():
        pytest.skip("int8 path needs AVX512-VNNI, AVX-VNNI or AVX2; the float path runs instead")
    ck.set_int8_activations(True)
    yield
    ck.set_int8_activations(False)
