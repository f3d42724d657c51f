"""Shared fixtures: real-shaped GGUF headers (sparse files) written once per test session.

Also, for the runtime tests: OpenMP threads that sleep when idle (set before torch or
Numba load OpenMP: the suite shares a loaded box, where spinning threads steal the cores;
see ``offload.commands.run.runtime_process_settings``), and torch on one intra-op
thread — the models are tiny, so extra threads only add barrier waits, which explode on a
loaded 2-core box (measured: 6 ms vs 300+ ms per decode step). And "auto" decode
activations on the built-in type list (``OFFLOAD_DECODE_INT8=prior``): a load would
otherwise measure each expert type's int8 and float paths on this CPU (offload.decode_int8),
and the tests' paths would depend on that measurement (tests/runtime/test_decode_int8.py
runs the measured choice).
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OFFLOAD_DECODE_INT8", "prior")

import pytest  # noqa: E402
import torch  # noqa: E402

from offload.gguf_model import open_model  # noqa: E402
from tests.fixtures.real_models import ALL, write_fixture  # noqa: E402

torch.set_num_threads(1)

# Qwen3 carries its (synthetic) 151936-token vocabulary so the lazy tokenizer-array path is
# exercised; the others skip the tokenizer to keep the session quick.
TOKENIZER = {"qwen3-30b-a3b": "vocab"}


@pytest.fixture(scope="session")
def fixture_paths(tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("real_models")
    return {name: str(write_fixture(make(), out, tokenizer=TOKENIZER.get(name, "none")))
            for name, make in ALL.items()}


@pytest.fixture(scope="session")
def models(fixture_paths):
    return {name: open_model(path) for name, path in fixture_paths.items()}


# ---------------------------------------------------------------- the full tier
# Tests marked ``full`` repeat a behaviour the default tier already holds for more quant types
# or modes (each further type is one more Numba specialisation, 5-30 s of compiling on a cold
# cache). The type itself stays covered where its code lives (tests/kernels: every type through
# matmul and the int8 path; tests/kernels/test_gpu_quant.py: every type's torch decoder).
# ``--full`` (or OFFLOAD_FULL_TESTS=1) runs them too.
FULL_REASON = "full tier (one more quant type or mode of a check the default tier holds): run with --full"


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the full tier (tests marked 'full'): every quant type and mode of the "
                          "integration checks, not only the representative ones")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full") or os.environ.get("OFFLOAD_FULL_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason=FULL_REASON)
    for item in items:
        if item.get_closest_marker("full") is not None:
            item.add_marker(skip)
