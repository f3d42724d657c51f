"""Routing statistics: how the tokens of a batch spread over the routed experts of each MoE layer.

Two measurements of it:

- ``RoutingCounts``: how often each routed expert of each MoE layer is chosen (``offload profile``,
  the file below); ``uniform_counts`` is every expert equally likely.
- ``RoutingProfile``: mean distinct experts per MoE layer for B = 1, 2, … tokens (``offload tune``,
  a plan's ``speculative.profile.routing``); ``distinct_experts_uniform`` is the uniform curve it
  extends beyond the measured B.

The file ``offload profile`` writes (``routing.yaml``)::

    version: 1
    kind: routing
    model: models/tiny-glm4moe-mtp.gguf
    n_expert: 32                 # routed experts per MoE layer
    n_expert_used: 4             # k: experts per token
    source: "bench tasks: code, extract, story"
    tokens: 612                  # tokens routed (each counted once per layer)
    distinct: [4.0, 7.18, ...]   # measured mean distinct experts for B = 1, 2, ... consecutive tokens
    layers: {blk.1: [17, 3, ...], ...}           # per layer, assignments per expert (sum = k·tokens)
    prompts: [{name: code, tokens: 220, layers: {blk.1: [...], ...}}, ...]   # the same, per prompt

``hit_rates(layer)`` turns a layer's counts into p_e, the expected number of times a token
routes to expert e (Σ p_e = k): what the planner ranks hot experts by (hits per byte) and what
the cost model turns into distinct experts for a batch of B tokens,
``U(B) = Σ_e (1 − (1 − p_e)^B)`` (tokens independent; uniform p_e = k/E gives
``E·(1−(1−k/E)^B)``). ``held_out_shares`` and ``mapped_onto`` carry a profile measured on one
model onto another one's expert count and depth (``bench/hot_experts.py`` says why that is
honest).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import yaml

from placement.errors import PlacementError
from placement.hardware import ProfileError

VERSION = 1
HEADER = """\
# offload routing profile (written by `offload profile`): per MoE layer, how many times each
# routed expert was chosen over the prompts below. `offload plan --routing FILE` places the
# hottest single experts of CPU-resident blocks in the VRAM left above each GPU's target.
"""
_TOP_KEYS = ("version", "kind", "model", "n_expert", "n_expert_used", "source", "tokens", "distinct",
             "layers", "prompts")


def layer_key(layer: int) -> str:
    return f"blk.{layer}"


def _layer_of(key: object, where: str) -> int:
    text = str(key)
    if not text.startswith("blk.") or not text[4:].isdigit():
        raise PlacementError(f"{where}: layer key {text!r} is not blk.N")
    return int(text[4:])


@dataclass(frozen=True)
class PromptCounts:
    """One prompt's routing: its tokens and assignments per expert per layer."""

    name: str
    tokens: int
    layers: Mapping[int, tuple[float, ...]]


@dataclass(frozen=True)
class RoutingCounts:
    """Assignments per expert per MoE layer over ``tokens`` tokens (module docstring)."""

    n_expert: int
    n_expert_used: int
    tokens: int
    layers: Mapping[int, tuple[float, ...]]        # layer -> count per expert (len n_expert)
    source: str = ""
    model: str = ""
    distinct: tuple[float, ...] = ()               # measured distinct experts for B = 1.. tokens
    prompts: tuple[PromptCounts, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.n_expert <= 0 or not 0 < self.n_expert_used <= self.n_expert:
            raise PlacementError(f"routing profile: n_expert {self.n_expert} / n_expert_used "
                                 f"{self.n_expert_used} are not a valid MoE shape")
        if self.tokens <= 0 or not self.layers:
            raise PlacementError("routing profile: no tokens or no layers")
        for layer, counts in self.layers.items():
            c = np.asarray(counts, dtype=float)
            if c.shape != (self.n_expert,) or not np.all(np.isfinite(c)) or np.any(c < 0):
                raise PlacementError(f"routing profile: {layer_key(layer)} needs {self.n_expert} "
                                     "non-negative counts")
            # each token picks k distinct experts: a count above the token count is impossible
            if c.max() > self.tokens * (1 + 1e-9):
                raise PlacementError(f"routing profile: {layer_key(layer)} has an expert chosen {c.max():g} "
                                     f"times in {self.tokens} tokens (at most once per token)")
            if abs(c.sum() - self.n_expert_used * self.tokens) > 1e-6 * c.sum() + 1e-6:
                raise PlacementError(f"routing profile: {layer_key(layer)} counts sum to {c.sum():g}, expected "
                                     f"n_expert_used × tokens = {self.n_expert_used * self.tokens}")

    # -- what the planner and the cost model read --------------------------------------------
    def hit_rates(self, layer: int) -> np.ndarray:
        """p_e: expected assignments of one token to expert e (Σ p_e = k), shape (n_expert,)."""
        return np.asarray(self.layers[layer], dtype=float) / self.tokens

    def distinct_for_batch(self, layer: int, batch: int, experts: Sequence[int] | None = None) -> float:
        """Expected distinct experts (of ``experts``, default all) that B independent tokens touch."""
        p = np.minimum(self.hit_rates(layer), 1.0)
        if experts is not None:
            p = p[np.asarray(experts, dtype=int)]
        return float(np.sum(1.0 - (1.0 - p) ** batch))

    def check_model(self, n_expert: int, n_expert_used: int, moe_layers: Sequence[int], model: str) -> None:
        """Refuse a profile measured on a model of another shape, naming the difference."""
        if (self.n_expert, self.n_expert_used) != (n_expert, n_expert_used):
            raise PlacementError(f"routing profile {self.model or ''} is for {self.n_expert} experts (top-"
                                 f"{self.n_expert_used}) but {model} has {n_expert} (top-{n_expert_used})")
        extra = sorted(set(self.layers) - set(moe_layers))
        if extra:
            raise PlacementError(f"routing profile names {layer_key(extra[0])}, which is not an MoE "
                                 f"layer of {model}")

    # -- carrying a profile onto another model ------------------------------------------------
    def held_out_shares(self, layer: int, *, in_sample: bool = False) -> np.ndarray:
        """The share of a layer's assignments that goes to its r-th hottest expert, r = 1..E,
        ranked on the *other* prompts and scored on each prompt in turn (leave one prompt out),
        so that noise which made an expert look hot in the ranking does not count as a hit.
        Needs at least two prompts; falls back to in-sample ranking with one (or ``in_sample``:
        ranked and scored on the same counts, an optimistic bound)."""
        if len(self.prompts) < 2 or in_sample:
            c = np.sort(np.asarray(self.layers[layer], dtype=float))[::-1]
            return c / c.sum()
        shares = np.zeros(self.n_expert)
        total = np.asarray(self.layers[layer], dtype=float)
        weight = 0.0
        for p in self.prompts:
            mine = np.asarray(p.layers[layer], dtype=float)
            rest = total - mine
            order = np.lexsort((np.arange(self.n_expert), -rest))     # hottest first, ties by id
            shares += mine[order]
            weight += mine.sum()
        return shares / weight

    def mapped_onto(self, n_expert: int, n_expert_used: int, moe_layers: Sequence[int], *,
                    model: str = "", in_sample: bool = False,
                    nextn: tuple[int, int | None] | None = None) -> RoutingCounts:
        """This profile's skew on another model: its MoE layers by relative depth take the
        held-out hit-share curve of the source layer at the same depth, stretched over the
        target's expert count (cumulative share as a function of the *fraction* of experts,
        linear in between, so 1/E of the experts keeps the same share of the hits; experts
        that fall into one source expert's slot share its hits evenly: the mapping can only
        flatten the measured skew, never sharpen it). Expert r (0-based) is the r-th hottest.
        ``nextn`` = (this profile's NextN block, the target's or None): the NextN block takes the
        NextN block's curve and the trunk layers map by depth among the trunk layers."""
        src = sorted(set(self.layers) - ({nextn[0]} if nextn else set()))
        dst = sorted(set(moe_layers) - ({nextn[1]} if nextn else set()))
        if not moe_layers:
            raise PlacementError("mapped_onto: the target has no MoE layer")
        if nextn and (nextn[0] not in self.layers or (nextn[1] is not None and nextn[1] not in moe_layers)):
            raise PlacementError(f"mapped_onto: NextN blocks {nextn} are not MoE layers of the profile / target")
        tokens = self.tokens
        out: dict[int, tuple[float, ...]] = {}
        pairs = [(layer, src[min(i * len(src) // len(dst), len(src) - 1)]) for i, layer in enumerate(dst)]
        for layer, j in pairs + ([(nextn[1], nextn[0])] if nextn and nextn[1] is not None else []):
            cum = np.concatenate([[0.0], np.cumsum(self.held_out_shares(j, in_sample=in_sample))])   # (E_src + 1,)
            at = np.interp(np.arange(n_expert + 1) / n_expert, np.arange(self.n_expert + 1) / self.n_expert, cum)
            share = np.diff(at)
            out[layer] = tuple(float(x) for x in share * n_expert_used * tokens)
        return RoutingCounts(n_expert, n_expert_used, tokens, out,
                             source=f"{self.source} (measured on {self.model or 'another model'}, "
                                    f"{self.n_expert} experts, {'in-sample' if in_sample else 'held-out'} "
                                    f"ranking; mapped onto {n_expert})",
                             model=model)

    # -- the file -----------------------------------------------------------------------------
    def to_yaml(self) -> str:
        return HEADER + yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=200)

    def to_dict(self) -> dict:
        """The file's mapping (``to_yaml`` without the header; a plan file's ``routing:``)."""
        def ints(c):
            return [int(x) if float(x).is_integer() else round(float(x), 6) for x in c]
        return {"version": VERSION, "kind": "routing", "model": self.model, "n_expert": self.n_expert,
               "n_expert_used": self.n_expert_used, "source": self.source, "tokens": self.tokens,
               "distinct": [round(x, 4) for x in self.distinct],
               "layers": {layer_key(i): ints(c) for i, c in sorted(self.layers.items())},
               "prompts": [{"name": p.name, "tokens": p.tokens,
                            "layers": {layer_key(i): ints(c) for i, c in sorted(p.layers.items())}}
                           for p in self.prompts]}

    @classmethod
    def from_yaml(cls, text: str, source: str) -> RoutingCounts:
        try:
            d = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            raise PlacementError(f"{source}:{mark.line + 1 if mark else 1}: malformed YAML") from None
        return cls.from_dict(d, source)

    @classmethod
    def from_dict(cls, d: object, source: str) -> RoutingCounts:
        """``to_dict``'s mapping, checked (``source`` names it in errors)."""
        if not isinstance(d, dict) or d.get("kind") != "routing":
            raise PlacementError(f"{source}: not a routing profile (expected 'kind: routing', "
                                 "as `offload profile` writes)")
        unknown = sorted(str(k) for k in d if k not in _TOP_KEYS)
        if unknown:
            raise PlacementError(f"{source}: unknown key {unknown[0]!r}")
        if d.get("version") != VERSION:
            raise PlacementError(f"{source}: unsupported routing profile version {d.get('version')!r}")

        def layers(m, where):
            if not isinstance(m, dict) or not m:
                raise PlacementError(f"{source}: {where} must be a mapping blk.N -> counts")
            out = {}
            for k, v in m.items():
                if not isinstance(v, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                      for x in v):
                    raise PlacementError(f"{source}: {where}.{k} must be a list of numbers")
                out[_layer_of(k, f"{source}: {where}")] = tuple(float(x) for x in v)
            return out

        try:
            n_expert, k, tokens = int(d["n_expert"]), int(d["n_expert_used"]), int(d["tokens"])
            prompts = []
            for i, p in enumerate(d.get("prompts") or []):
                if not isinstance(p, dict):
                    raise PlacementError(f"{source}: prompts[{i}] must be a mapping")
                prompts.append(PromptCounts(str(p.get("name", i)), int(p["tokens"]),
                                            layers(p.get("layers"), f"prompts[{i}].layers")))
            out = cls(n_expert, k, tokens, layers(d.get("layers"), "layers"), str(d.get("source", "")),
                      str(d.get("model", "")), tuple(float(x) for x in d.get("distinct") or ()), tuple(prompts))
        except KeyError as exc:
            raise PlacementError(f"{source}: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:        # PlacementError is a ValueError: named too
            raise PlacementError(f"{source}: {exc}") from None
        if prompts:
            if sum(p.tokens for p in prompts) != tokens:
                raise PlacementError(f"{source}: the prompts' tokens do not add up to tokens ({tokens})")
            for p in prompts:
                if set(p.layers) != set(out.layers):
                    raise PlacementError(f"{source}: prompt {p.name!r} does not count the same layers as 'layers'")
            for layer, total in out.layers.items():
                summed = np.sum([p.layers[layer] for p in prompts], axis=0)
                if not np.allclose(summed, total):
                    raise PlacementError(f"{source}: the prompts' counts of {layer_key(layer)} do not add "
                                         "up to its layers entry")
        return out

    @classmethod
    def from_file(cls, path: str) -> RoutingCounts:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise PlacementError(f"{path}: cannot read routing profile "
                                 f"({getattr(exc, 'strerror', None) or exc})") from None
        return cls.from_yaml(text, path)


def uniform_counts(n_expert: int, n_expert_used: int, moe_layers: Sequence[int], tokens: int = 1) -> RoutingCounts:
    """Every expert equally likely (the cost model's default routing) as a profile."""
    share = n_expert_used * tokens / n_expert
    return RoutingCounts(n_expert, n_expert_used, tokens, {i: (share,) * n_expert for i in moe_layers},
                         source="uniform")


# ---------------------------------------------------------------------------------------------
# Distinct experts per batch: the uniform curve and the measured one (``offload tune``).
# ---------------------------------------------------------------------------------------------

def distinct_experts_uniform(n_expert: int, k: int, batch: int) -> float:
    """U(B) = E·(1−(1−k/E)^B): expected distinct experts when each token picks k of E uniformly.

    Each expert is missed by one token with probability 1−k/E, independently across tokens.
    """
    return n_expert * (1.0 - (1.0 - k / n_expert) ** batch)


@dataclass(frozen=True)
class RoutingProfile:
    """Measured mean distinct experts per MoE layer for B = 1, 2, … tokens (``offload tune``).

    Beyond the measured B the uniform curve is scaled by the ratio seen at the last measured B.
    A model whose layers differ in E uses the measured *fraction* of experts touched.
    """

    distinct: tuple[float, ...]
    n_expert: int
    n_expert_used: int
    source: str = "measured"

    def __post_init__(self) -> None:
        d = tuple(float(x) for x in self.distinct)
        object.__setattr__(self, "distinct", d)
        if not d or self.n_expert <= 0 or not 0 < self.n_expert_used <= self.n_expert:
            raise ProfileError("routing profile: needs distinct counts, n_expert and n_expert_used")
        prev = 0.0
        for b, x in enumerate(d, start=1):
            cap = min(self.n_expert, b * self.n_expert_used)
            if not (math.isfinite(x) and prev <= x <= cap + 1e-9 and x > 0):
                raise ProfileError(f"routing profile: distinct experts at B={b} is {x}, "
                                   f"expected non-decreasing in (0, {cap}]")
            prev = x

    def distinct_for(self, n_expert: int, k: int, batch: int) -> float:
        m = len(self.distinct)
        if batch <= m:
            frac = self.distinct[batch - 1] / self.n_expert
        else:
            ratio = self.distinct[-1] / distinct_experts_uniform(self.n_expert, self.n_expert_used, m)
            frac = ratio * distinct_experts_uniform(self.n_expert, self.n_expert_used, batch) / self.n_expert
        return min(frac * n_expert, n_expert, batch * k)

    def to_dict(self) -> dict:
        return {"source": self.source, "n_expert": self.n_expert,
                "n_expert_used": self.n_expert_used, "distinct": list(self.distinct)}

    @classmethod
    def from_dict(cls, d: object) -> RoutingProfile:
        if not isinstance(d, Mapping) or not {"distinct", "n_expert", "n_expert_used"} <= set(d):
            raise ProfileError("routing profile: expected a mapping with distinct, n_expert, n_expert_used")
        unknown = sorted(str(x) for x in d if x not in ("distinct", "n_expert", "n_expert_used", "source"))
        if unknown:
            raise ProfileError(f"routing profile: unknown key(s) {', '.join(unknown)}")
        try:
            return cls(tuple(d["distinct"]), int(d["n_expert"]), int(d["n_expert_used"]),
                       str(d.get("source", "measured")))
        except (TypeError, ValueError) as e:
            if isinstance(e, ProfileError):
                raise
            raise ProfileError(f"routing profile: {e}") from None
