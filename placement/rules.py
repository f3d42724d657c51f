"""Override rules with llama.cpp's ``-ot`` semantics.

A rule is ``regex → device``. Every tensor name is tried against the rules in order with
``re.search``; the **first** rule that matches decides the device. Tensors no rule matches
fall back to the layer layout (``-ngl`` / ``-ts``, see ``placement.layers``).

* ``-ot "pat=DEV,pat2=DEV2"`` — repeatable; each value is a comma list, split at commas and
  then at the first ``=`` (so, as in llama.cpp, a pattern cannot contain a comma).
* ``--cpu-moe`` — ``\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` → CPU (every routed expert).
* ``--n-cpu-moe N`` — ``blk\\.i\\.ffn_(up|down|gate|gate_up)_(ch|)exps`` → CPU for i < N
  (written as one rule whose block number matches 0..N-1).

User ``-ot`` rules come first, so they win over the generated ones. The NextN layer's experts
are named like any other layer's, so the same expert regexes match them, as in llama.cpp.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from placement.devices import normalize_device_name
from placement.errors import PlacementError
from placement.tensors import TensorInfo

# llama.cpp common.h LLM_FFN_EXPS_REGEX: every routed-expert tensor (incl. fused gate_up, chunked).
EXPERTS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def _range_pieces(lo: int, hi: int) -> list[str]:
    """Regexes that together match exactly the decimal integers lo..hi (no leading zeros)."""
    if len(str(lo)) < len(str(hi)):        # split at a change of digit count: 7..42 → 7..9, 10..42
        edge = 10 ** len(str(lo))
        return _range_pieces(lo, edge - 1) + _range_pieces(edge, hi)
    a, b = str(lo), str(hi)
    # same length: the shared prefix, then one digit range, then free digits — if that is exact
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    if i == len(a):
        return [a]
    tail = len(a) - i - 1
    if a[i + 1:] == "0" * tail and b[i + 1:] == "9" * tail:
        digit = a[i] if a[i] == b[i] else f"[{a[i]}-{b[i]}]"
        return [a[:i] + digit + "[0-9]" * tail]
    # otherwise peel off the ragged ends: lo..(round up), middle, (round down)..hi
    step = 10 ** tail
    first_end = (lo // step + 1) * step - 1
    last_start = (hi // step) * step
    pieces = _range_pieces(lo, first_end) if lo % step else []
    mid_lo, mid_hi = (lo if lo % step == 0 else first_end + 1), (hi if hi % step == step - 1 else last_start - 1)
    if mid_lo <= mid_hi:
        pieces += _range_pieces(mid_lo, mid_hi)
    if hi % step != step - 1:
        pieces += _range_pieces(last_start, hi)
    return pieces


def layers_regex(layers: Iterable[int]) -> str:
    """A regex group matching exactly these block numbers: [3..58, 60] → ``([3-9]|[1-4][0-9]|5[0-8]|60)``."""
    nums = sorted(set(layers))
    pieces, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        pieces += _range_pieces(nums[i], nums[j])
        i = j + 1
    return pieces[0] if len(pieces) == 1 else "(" + "|".join(pieces) + ")"


@dataclass(frozen=True)
class Rule:
    """``pattern`` (re.search on tensor names) → ``device``; ``origin`` says who made it."""

    pattern: str
    device: str
    origin: str = "-ot"
    _regex: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            regex = re.compile(self.pattern)
        except re.error as exc:
            raise PlacementError(f"bad regex '{self.pattern}' in {self.origin}: {exc}") from None
        object.__setattr__(self, "_regex", regex)

    def matches(self, name: str) -> bool:
        return self._regex.search(name) is not None

    def as_dict(self) -> dict[str, str]:
        """The plan file's / JSON form."""
        return {"pattern": self.pattern, "device": self.device, "origin": self.origin}

    @property
    def text(self) -> str:
        """The ``pattern=DEVICE`` form llama.cpp's ``-ot`` takes."""
        return f"{self.pattern}={self.device}"


def parse_override(value: str, origin: str = "-ot") -> list[Rule]:
    """One ``-ot`` value (a comma list of ``pattern=DEVICE``) → rules, in order."""
    rules = []
    for item in value.split(","):
        if not item:
            continue
        pattern, sep, device = item.partition("=")
        if not sep or not pattern:
            raise PlacementError(f"{origin}: '{item}' is not PATTERN=DEVICE (e.g. 'exps=CPU')")
        rules.append(Rule(pattern, normalize_device_name(device), origin))
    return rules


def cpu_moe_rules() -> list[Rule]:
    return [Rule(EXPERTS_REGEX, "CPU", "--cpu-moe")]


def n_cpu_moe_rules(n: int) -> list[Rule]:
    """llama.cpp pushes one ``blk\\.i`` rule per block; adjacent rules with one device act as
    one, so we write them as a single rule over blocks 0..n-1."""
    if n < 0:
        raise PlacementError(f"--n-cpu-moe must be >= 0, got {n}")
    return [Rule(rf"blk\.{layers_regex(range(n))}{EXPERTS_REGEX}", "CPU", "--n-cpu-moe")] if n else []


def first_match(rules: Iterable[Rule], name: str) -> Rule | None:
    for rule in rules:
        if rule.matches(name):
            return rule
    return None


def assign(tensors: Iterable[TensorInfo], rules: Iterable[Rule],
           fallback: Callable[[TensorInfo], str]) -> dict[str, str]:
    """Tensor name → device: the first matching rule, else ``fallback(tensor)``."""
    rules = tuple(rules)
    out = {}
    for t in tensors:
        rule = first_match(rules, t.name)
        out[t.name] = rule.device if rule else fallback(t)
    return out


def check_devices(rules: Iterable[Rule], device_names: Iterable[str]) -> None:
    """Refuse a rule that sends tensors to a device the plan does not have."""
    names = list(device_names)
    for rule in rules:
        if rule.device not in names:
            raise PlacementError(
                f"rule '{rule.text}' ({rule.origin}) names device {rule.device}, "
                f"which is not among the devices ({', '.join(names)})")
