"""Devices a plan can place tensors on, and how much memory each offers.

Two sources:

* ``discover_devices()`` — this box: GPUs through NVML (free memory now, named ``CUDA0``,
  ``CUDA1``, … in NVML order, restricted to ``CUDA_VISIBLE_DEVICES`` when it lists indices)
  and system RAM through psutil (``available``). No NVML / no GPU → CPU only, not an error.
* ``parse_devices("CUDA0=24GiB,CUDA1=24GiB,CPU=256GiB")`` — a box you are not on.
  Sizes take ``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB`` (case-insensitive, decimals allowed);
  a plain number means MiB, as in llama.cpp's ``--fit-target``.

Device names are llama.cpp's buffer-type names: ``CPU`` and ``CUDA<n>``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from placement.errors import PlacementError

CPU = "CPU"
_GPU_NAME = re.compile(r"^CUDA(\d+)$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_UNITS = {"": 1 << 20, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class Device:
    """One device and the bytes a plan may use on it (free memory, or what the spec says)."""

    name: str
    budget_bytes: int
    description: str = ""
    gpu_name: str = ""      # NVML's product name (discovered GPUs only): picks the bandwidth defaults

    @property
    def is_gpu(self) -> bool:
        return self.name != CPU

    @property
    def gpu_index(self) -> int | None:
        m = _GPU_NAME.match(self.name)
        return int(m.group(1)) if m else None


def parse_size(text: str, *, what: str) -> int:
    """``"24GiB"`` → bytes. A plain number is MiB. ``what`` names the value in errors."""
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise PlacementError(
            f"{what}: cannot read size {text.strip()!r} (use a number of MiB or B/KiB/MiB/GiB/TiB, e.g. 24GiB)")
    return int(round(float(m.group(1)) * _UNITS[m.group(2).lower()]))


def normalize_device_name(name: str) -> str:
    """``cuda0`` → ``CUDA0``, ``cpu`` → ``CPU``; anything else is refused with the valid forms."""
    upper = name.strip().upper()
    if upper == CPU or _GPU_NAME.match(upper):
        return upper
    raise PlacementError(f"unknown device {name.strip()!r} (devices are named CPU, CUDA0, CUDA1, ...)")


def sort_devices(devices: list[Device]) -> list[Device]:
    """GPUs by index, then the CPU (the order of ``-ts`` and of ``--fit-target`` values)."""
    return sorted(devices, key=lambda d: (not d.is_gpu, d.gpu_index or 0))


def parse_devices(spec: str, *, what: str = "--devices") -> list[Device]:
    """``"CUDA0=24GiB,CPU=256GiB"`` → devices (GPUs by index, CPU last). CPU is required.
    ``what`` names the spec in errors (``--hosts a`` for one host's devices)."""
    devices: dict[str, Device] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        name, sep, size = item.partition("=")
        if not sep:
            raise PlacementError(f"{what}: {item.strip()!r} is not NAME=SIZE (e.g. CUDA0=24GiB)")
        dev = normalize_device_name(name)
        if dev in devices:
            raise PlacementError(f"{what}: {dev} is given twice")
        devices[dev] = Device(dev, parse_size(size, what=f"{what} {dev}"), f"from {what}")
    if CPU not in devices:
        raise PlacementError(f"{what}: the spec needs a CPU=<size> entry for system RAM")
    return sort_devices(list(devices.values()))


def _visible_gpu_indices(n_gpus: int) -> list[int]:
    """NVML indices to use, honouring a CUDA_VISIBLE_DEVICES list of integers."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(n_gpus))
    picked = []
    for part in env.split(","):
        part = part.strip()
        if not part.isdigit():      # UUIDs / MIG names: give up filtering, as documented
            return list(range(n_gpus))
        if int(part) < n_gpus:
            picked.append(int(part))
    return picked


def discover_devices() -> list[Device]:
    """This box's GPUs (NVML free memory) and RAM (psutil available)."""
    import psutil

    devices = [Device(CPU, int(psutil.virtual_memory().available), "system RAM (available)")]
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, no GPU: an all-CPU box
        return devices
    try:
        n = pynvml.nvmlDeviceGetCount()
        for cuda_idx, nvml_idx in enumerate(_visible_gpu_indices(n)):
            handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_idx)
            free = int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            devices.append(Device(f"CUDA{cuda_idx}", free, f"{name} (free)", gpu_name=name))
    finally:
        pynvml.nvmlShutdown()
    return sort_devices(devices)


def resolve_devices(spec: str) -> list[Device]:
    """``auto`` → ``discover_devices()``; anything else → ``parse_devices(spec)``."""
    return discover_devices() if spec.strip().lower() == "auto" else parse_devices(spec)


def format_bytes(n: int) -> str:
    """Human-readable GiB/MiB for tables (two decimals)."""
    if abs(n) >= GIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.1f} MiB"
