"""Device specs and discovery."""
from __future__ import annotations

import pytest

from placement.devices import GIB, MIB, discover_devices, parse_devices, parse_size, resolve_devices
from placement.errors import PlacementError


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * GIB), ("1.5 gib", int(1.5 * GIB)), ("1024", 1024 * MIB), ("512MiB", 512 * MIB),
    ("2TiB", 2 << 40), ("100B", 100), ("3KiB", 3072), ("0.5", MIB // 2),
])
def test_parse_size(text, expected):
    assert parse_size(text, what="x") == expected


@pytest.mark.parametrize("text", ["", "GiB", "24GB", "-1GiB", "24 GiBs", "1e3"])
def test_parse_size_rejects(text):
    with pytest.raises(PlacementError, match="cannot read size"):
        parse_size(text, what="--devices CUDA0")


def test_parse_devices_orders_gpus_then_cpu():
    devs = parse_devices("cpu=256GiB,CUDA1=24GiB,cuda0=12GiB")
    assert [(d.name, d.budget_bytes) for d in devs] == [("CUDA0", 12 * GIB), ("CUDA1", 24 * GIB), ("CPU", 256 * GIB)]
    assert [d.is_gpu for d in devs] == [True, True, False]


@pytest.mark.parametrize("spec,match", [
    ("CUDA0=24GiB", "needs a CPU"),
    ("GPU0=24GiB,CPU=1GiB", "unknown device 'GPU0'"),
    ("CUDA0=24GiB,CUDA0=12GiB,CPU=1GiB", "CUDA0 is given twice"),
    ("CUDA0,CPU=1GiB", "is not NAME=SIZE"),
    ("CUDA0=lots,CPU=1GiB", "cannot read size 'lots'"),
])
def test_parse_devices_rejects(spec, match):
    with pytest.raises(PlacementError, match=match):
        parse_devices(spec)


def test_discover_devices_on_this_box():
    """This box has no NVML: an all-CPU device list, not an error; RAM from psutil."""
    import psutil

    devs = discover_devices()
    assert devs[-1].name == "CPU" and 0 < devs[-1].budget_bytes <= psutil.virtual_memory().total
    assert all(d.name.startswith("CUDA") for d in devs[:-1])
    assert [d.name for d in resolve_devices("auto")] == [d.name for d in devs]
