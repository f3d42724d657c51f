"""Draft settings: the one check of ``n_max`` / ``p_min`` and the one "no draft head" error.

Every place that takes these values — the ``run`` / ``bench`` / ``tune`` flags, a plan file's
``speculative:`` section, ``offload.speculative.SpecOptions``, an acceptance profile — calls
``check_n_max`` / ``check_p_min`` with the name the user wrote (``--spec-n-max``,
``speculative.n_max``, ...), so the message names what to fix and reads the same everywhere.
Speculation asked of a model without a NextN (MTP) block raises ``NoDraftHead``.

``spec_type`` reads a drafter's name as ``--spec-type`` takes it: offload's ``mtp``, ``dspark``,
``ngram``, ``none``, and llama.cpp's spellings (``draft-mtp``, ``draft-dspark``, ``ngram-simple``,
``ngram-map-k``, ... — every ``ngram-*`` kind is offload's one n-gram drafter).
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


SPEC_TYPES = ("mtp", "dspark", "ngram")      # the drafters; "none" = plain decoding
# how each drafter spends its passes, as the cost model counts them (placement.cost.DRAFT_KINDS)
DRAFTER_KIND = {"mtp": "chain", "dspark": "block", "ngram": "free"}
_LLAMA_SPELLINGS = {"draft-mtp": "mtp", "draft-dspark": "dspark", "suffix": "ngram"}
NGRAM_SIZE = 12        # longest n-gram looked up (llama.cpp's ngram-simple default size_n)


def spec_type(value: object, name: str = "--spec-type") -> str:
    """A drafter's name → ``mtp`` | ``dspark`` | ``ngram`` | ``none``."""
    text = str(value).strip().lower()
    kind = _LLAMA_SPELLINGS.get(text, "ngram" if text.startswith("ngram") else text)
    if kind not in SPEC_TYPES + ("none",):
        raise PlacementError(f"{name} {value!r}: expected one of {', '.join(SPEC_TYPES + ('none',))} "
                             "(or llama.cpp's draft-mtp, draft-dspark, ngram-*)")
    return kind


def check_ngram_size(value: object, name: str = "--spec-ngram-size-n") -> int:
    """The longest n-gram the n-gram drafter looks up: an integer in 2..1024."""
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 1024:
        raise PlacementError(f"{name} must be an integer in 2..1024, got {value!r}")
    return value


class NoDraftHead(PlacementError):
    """Speculative decoding asked (``asked``: the flag or call that asked) of ``model``,
    which has no draft head."""

    def __init__(self, model: str, asked: str):
        super().__init__(f"{asked}: {model} has no NextN (MTP) block to draft with; "
                         "give --draft MTP.gguf (a GGUF holding one) or do not draft")
