"""Draft settings: the one check of ``n_max`` / ``p_min`` and the one "no draft head" error.

Every place that takes these values — the ``run`` / ``bench`` / ``tune`` flags, a plan file's
``speculative:`` section, ``offload.speculative.SpecOptions``, an acceptance profile — calls
``check_n_max`` / ``check_p_min`` with the name the user wrote (``--spec-n-max``,
``speculative.n_max``, ...), so the message names what to fix and reads the same everywhere.
Speculation asked of a model without a NextN (MTP) block raises ``NoDraftHead``.
"""
from __future__ import annotations

from placement.errors import PlacementError


def check_n_max(value: object, name: str = "n_max") -> int:
    """A draft length: an integer >= 0 (0 = plain decoding)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlacementError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def check_p_min(value: object, name: str = "p_min") -> float:
    """A draft-confidence floor: a number in [0, 1)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise PlacementError(f"{name} must be a number in [0, 1), got {value!r}")
    return float(value)


class NoDraftHead(PlacementError):
    """Speculative decoding asked (``asked``: the flag or call that asked) of ``model``,
    which has no draft head."""

    def __init__(self, model: str, asked: str):
        super().__init__(f"{asked}: {model} has no NextN (MTP) block to draft with; "
                         "give --draft MTP.gguf (a GGUF holding one) or do not draft")
