"""Plan device names (``CPU``, ``CUDA0``, …) → torch devices.

``CPU`` means "raw GGUF bytes in system RAM, used in place by cpu_kernels"; a ``CUDAn``
device is a torch device holding dequantized copies. Where no CUDA exists, ``virtual_gpus``
backs every CUDA device of a plan with torch's CPU device (for tests and CI) — still the
torch path with uploaded copies, so a virtual-GPU plan exercises exactly the code a real
GPU runs. Without that flag such a plan is refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from offload.errors import OffloadError

CPU = "CPU"
_CUDA = re.compile(r"CUDA(\d+)\Z")


@dataclass(frozen=True)
class DeviceMap:
    torch_devices: dict[str, torch.device]   # plan device name → torch device
    virtual: tuple[str, ...]                 # names backed by torch's CPU device

    def __getitem__(self, name: str) -> torch.device:
        if name not in self.torch_devices:
            raise OffloadError(f"no device {name!r} among the plan's devices ({', '.join(self.torch_devices)})")
        return self.torch_devices[name]

    def describe(self) -> str:
        parts = []
        for name, dev in self.torch_devices.items():
            if name == CPU:
                parts.append("CPU = system RAM (raw GGUF blocks, cpu_kernels)")
            elif name in self.virtual:
                parts.append(f"{name} = virtual (torch CPU device, no CUDA here)")
            else:
                parts.append(f"{name} = {dev} ({torch.cuda.get_device_name(dev)})")
        return "; ".join(parts)


def resolve(names, *, virtual_gpus: bool = False) -> DeviceMap:
    """Map every device name a plan uses onto a torch device, or refuse with one line."""
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out: dict[str, torch.device] = {}
    virtual = []
    for name in sorted(set(names), key=lambda s: (s != CPU, s)):
        if name == CPU:
            out[name] = torch.device("cpu")
            continue
        m = _CUDA.match(name)
        if m is None:
            raise OffloadError(f"unknown device {name!r} in the plan (expected CPU or CUDA0, CUDA1, ...)")
        idx = int(m.group(1))
        if virtual_gpus:
            out[name] = torch.device("cpu")
            virtual.append(name)
        elif idx < n_cuda:
            out[name] = torch.device("cuda", idx)
        else:
            have = f"{n_cuda} CUDA device(s)" if n_cuda else "no CUDA device"
            raise OffloadError(f"the plan places tensors on {name} but this machine has {have}; "
                               "pass --virtual-gpus to back GPU devices with the CPU for testing")
    return DeviceMap(out, tuple(virtual))
