"""The plan's ``speculative:`` section typed (``SpecSection``; its keys are described in
``placement.speculative``). A module of its own so that ``placement.plan`` can name it
without importing the cost model's plan-level code, which imports ``placement.plan``."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from placement.cost import SpecProfile
from placement.errors import PlacementError


@dataclass(frozen=True)
class SpecSection:
    """The plan's ``speculative:`` section (keys as in this module's docstring), typed.

    ``keys``: the keys it was written with, in that order (``predict``, ``offload tune`` or a
    hand edit decide it), so that a plan file read and written back is the same file; a field
    set later (``replace``) follows them. ``placement.plan_file`` checks each key's value."""

    type: str | None = None                         # the drafter: "mtp", "ngram" (tune may choose it), "dspark"
    n_max: int | None = None                        # what ``offload run`` drafts with by default
    p_min: float | None = None
    source: str | None = None                       # "predicted" or "tune"
    predicted_plain_tps: float | None = None
    break_even_n_max: int | None = None
    best_n_max: int | None = None
    predicted_speedup: float | None = None
    draft_ms: float | None = None
    routing: str | None = None
    rows: list[dict[str, Any]] | None = None         # SpecTable.to_dict's rows
    measured_speedup: float | None = None
    measured_best_n_max: int | None = None
    choice: str | None = None
    runner_up: dict[str, Any] | None = None         # tune: the best other drafter (type, n_max, speedup, margin)
    measured_rows: list[dict[str, Any]] | None = None
    tune: dict[str, Any] | None = None
    profile: SpecProfile | None = None
    # a plan across hosts: the link its forecast assumed (``offload plan --hop-latency-us / --hop-gbps``)
    hop_latency_us: float | None = None
    hop_gbps: float | None = None
    keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, entries: Mapping[str, Any]) -> SpecSection:
        """From typed entries (the profile a ``SpecProfile``), keys in their order."""
        unknown = [k for k in entries if k not in SECTION_KEYS]
        if unknown:
            raise PlacementError(f"speculative: unknown key {unknown[0]!r}")
        return cls(**entries, keys=tuple(entries))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SpecSection:
        """The file form; the profile goes through ``SpecProfile.from_dict``."""
        entries = dict(d)
        if entries.get("profile") is not None:
            entries["profile"] = SpecProfile.from_dict(entries["profile"])
        return cls.of(entries)

    def entries(self) -> dict[str, Any]:
        """Key → typed value, in ``keys`` order, then any field set since."""
        names = list(self.keys) + [k for k in SECTION_KEYS if k not in self.keys and getattr(self, k) is not None]
        return {k: getattr(self, k) for k in names}

    def to_dict(self) -> dict[str, Any]:
        """The file form (``plan.yaml``'s ``speculative:``, ``offload plan --json``)."""
        out = self.entries()
        if self.profile is not None and "profile" in out:
            out["profile"] = self.profile.to_dict()
        return out


SECTION_KEYS = tuple(f.name for f in fields(SpecSection) if f.name != "keys")
