"""Hosts a model is split across (``offload plan --hosts``): each host's name and devices.

Two spellings, one result (a tuple of ``Host``):

* ``parse_hosts("a:CUDA0=24GiB,CPU=256GiB;b:CPU=512GiB")`` — hosts separated by ``;``, each
  ``NAME:DEVICES`` with DEVICES in ``--devices``'s form (``placement.devices.parse_devices``);
* a hosts YAML (``placement.plan_file.load_hosts_file``), the plan file's ``hosts:`` section
  without the placement, so a device may carry its own free-memory ``target``.

Host order is pipeline order: the first host holds the first blocks and the embedding, the
last host the last blocks, the output head and the draft head.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from placement.devices import Device, parse_devices
from placement.errors import PlacementError

# a host name as a hostname's label spells it (it names the rank's machine in logs and errors)
_HOST_NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Host:
    """One host: its devices (``--devices`` semantics) and the targets its spec fixed (a hosts
    YAML may give a device a ``target``; the others take ``--fit-target``)."""

    name: str
    devices: tuple[Device, ...]
    targets: Mapping[str, int] = field(default_factory=dict)

    @property
    def room_bytes(self) -> int:
        """What the host can hold: every device's budget less its fixed target."""
        return self.room_with(self.targets)

    def room_with(self, targets: Mapping[str, int]) -> int:
        """What the host can hold with ``targets`` (device → bytes kept free) on its devices."""
        return sum(max(d.budget_bytes - targets.get(d.name, 0), 0) for d in self.devices)


def check_host_name(name: object, what: str = "--hosts") -> str:
    """A host name: letters, digits, '.', '-', '_' (as a hostname), else refused in one line."""
    if not isinstance(name, str) or not _HOST_NAME.match(name):
        raise PlacementError(f"{what}: {name!r} is not a host name (letters, digits, '.', '-', '_'; "
                             "starting and ending with a letter or digit)")
    return name


def check_unique(hosts: Sequence[Host], what: str = "--hosts") -> tuple[Host, ...]:
    """At least one host, each named once."""
    if not hosts:
        raise PlacementError(f"{what}: no host given (e.g. a:CUDA0=24GiB,CPU=256GiB;b:CPU=512GiB)")
    seen: set[str] = set()
    for h in hosts:
        if h.name in seen:
            raise PlacementError(f"{what}: host {h.name} is given twice")
        seen.add(h.name)
    return tuple(hosts)


def parse_hosts(spec: str) -> tuple[Host, ...]:
    """``"a:CUDA0=24GiB,CPU=256GiB;b:CPU=512GiB"`` → hosts, in pipeline order."""
    hosts = []
    for item in spec.split(";"):
        if not item.strip():
            continue
        name, sep, devices = item.partition(":")
        if not sep:
            raise PlacementError(f"--hosts: {item.strip()!r} is not NAME:DEVICES (e.g. a:CUDA0=24GiB,CPU=256GiB)")
        name = check_host_name(name.strip())
        try:
            hosts.append(Host(name, tuple(parse_devices(devices, what=f"--hosts {name}"))))
        except PlacementError as exc:       # normalize_device_name's message names no spec: add it
            msg = str(exc)
            raise PlacementError(msg if msg.startswith("--hosts") else f"--hosts {name}: {msg}") from None
    return check_unique(hosts)
