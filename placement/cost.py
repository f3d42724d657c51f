"""Speculative-decoding cost model: is drafting worth it on this placement, and how far?

Per step with draft length n (DESIGN.md "Break-even model"):

    E(n) = 1 + Σ_{i≤n} Π_{j≤i} a_j                        expected tokens per step
    T(n) = n·T_draft + T_verify(n+1) + T_step(n)           step time (p_min = 0)

(With per-batch draft times the first draft pass of a step runs the previous step's 1 +
accepted tokens through the head, as the chained MTP loop does: ``step_time``.)
    S(n) = E(n)·T(0) / T(n)                                speedup over plain decode

``T_verify(B)`` and ``T_draft`` are the time of one forward pass of B tokens (resp. one token
through the draft head), built from bytes read per device over that device's bandwidth:
dense weights once per pass; routed experts once per *distinct* expert the B tokens touch
(uniform routing: ``U(B) = E·(1−(1−k/E)^B)`` per layer, or a measured ``RoutingProfile``);
hidden-state copies host<->device wherever the pass changes device; fixed costs per layer
and per pass. Every term is linear in one ``HardwareProfile.linear_params`` entry, so one
feature vector serves prediction and the least-squares fit that ``offload tune`` runs.
``T_step(n)`` is the decode loop's own per-step work outside the passes (sampling,
acceptance, rollback, Python): ``step`` for every step plus ``spec_step`` when n > 0.
"""
from __future__ import annotations

from placement.errors import PlacementError

import itertools
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

from placement.acceptance import DEFAULT_MTP, AcceptanceProfile
from placement.hardware import HardwareProfile, ProfileError
from placement.routing import RoutingCounts
from placement.tensors import Role, TensorInfo

CPU = "CPU"
_DEVICE = re.compile(r"CPU|CUDA\d+")


class FootprintError(PlacementError):
    """A tensor list / tensor map the cost model cannot turn into a footprint (one line)."""


# ---------------------------------------------------------------------------------------------
# What one forward pass reads, and where: the planner fills this from a plan.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertSlice:
    """A layer's routed-expert weights held on one device.

    ``-ot`` places whole tensors, so a slice usually holds all ``n_experts`` experts but only
    the matrices (gate/up/down) that were sent there; ``bytes_per_expert`` counts those.
    Hot experts (``placement.hot_experts``) split a CPU block by expert instead: ``experts``
    names which ones the slice holds (None: any ``n_experts`` of them, in proportion).
    """

    device: str
    bytes_per_expert: float
    n_experts: int
    experts: tuple[int, ...] | None = None


@dataclass(frozen=True)
class LayerFootprint:
    layer: int
    home: str                                # device the hidden state lives on (attention's)
    reads: tuple[tuple[str, int], ...]       # (device, bytes) read once per pass, any batch
    experts: tuple[ExpertSlice, ...] = ()
    n_expert: int = 0                        # routed experts in the layer (0: dense layer)
    n_expert_used: int = 0                   # k


@dataclass(frozen=True)
class ForwardFootprint:
    """One forward pass: token input, layers in order, output head."""

    input_device: str
    layers: tuple[LayerFootprint, ...]
    head_home: str
    head_reads: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class DecodeFootprint:
    target: ForwardFootprint
    draft: ForwardFootprint | None           # the NextN head; None when the model has none
    n_embd: int
    act_bytes: int = 4                       # bytes per hidden-state element copied between devices


def _nextn_name(tensor: MODEL_TENSOR, layer: int) -> str:
    return TENSOR_NAMES[tensor].format(bid=layer) + "."


def footprint_from_tensors(tensors: Sequence[TensorInfo], tensor_map: Mapping[str, str], *,
                           n_expert_used: int, draft_layers: Sequence[int] | None = None,
                           n_embd: int | None = None, act_bytes: int = 4,
                           kv_bytes: Mapping[int, int] | None = None,
                           hot_experts: Mapping[str, Mapping[int, Sequence[int]]] | None = None) -> DecodeFootprint:
    """Build the footprint of a placed model.

    ``tensor_map`` is the plan's tensor name -> device. NextN layers (``TensorInfo.nextn``)
    are left out of the target pass; ``draft_layers`` are the layers one draft forward runs
    (default: the first NextN layer, the one chained MTP drafting reuses). Embedding tables
    are looked up one row per token, so they count only as the pass's input device (a tied
    output head still reads ``token_embd`` whole). ``kv_bytes`` (layer -> bytes) is the KV
    cache attention reads per pass at the context the prediction is for, on that layer's
    home device; without it the prediction is for a short context. ``hot_experts`` (GPU →
    layer → expert ids, a plan's ``hot_experts``) takes those experts out of their CPU block.
    """
    if n_expert_used <= 0:
        raise FootprintError(f"n_expert_used must be positive, got {n_expert_used}")
    for t in tensors:
        dev = tensor_map.get(t.name)
        if dev is None:
            raise FootprintError(f"tensor {t.name} has no device in the tensor map")
        if not _DEVICE.fullmatch(dev):
            raise FootprintError(f"tensor {t.name}: unknown device {dev!r}")

    by_layer: dict[int, list[TensorInfo]] = defaultdict(list)
    globals_: list[TensorInfo] = []
    for t in tensors:
        (globals_ if t.layer is None else by_layer[t.layer]).append(t)
    nextn_layers = sorted(i for i, ts in by_layer.items()
                          if any(t.nextn or t.role is Role.NEXTN for t in ts))

    embd = next((t for t in globals_ if t.role is Role.EMBEDDING), None)
    out = next((t for t in globals_ if t.role is Role.OUTPUT), None) or embd  # tied output
    norm_prefix = TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM] + "."
    out_norm = next((t for t in globals_ if t.name.startswith(norm_prefix)), None)
    if out is None:
        raise FootprintError("model has neither an output nor a token_embd tensor")
    if n_embd is None:
        if embd is None:
            raise FootprintError("no token_embd tensor: pass n_embd")
        n_embd = embd.shape[-1]                       # numpy order: (n_vocab, n_embd)
    head = (tensor_map[out.name], _reads([out, out_norm], tensor_map))
    input_device = tensor_map[embd.name] if embd is not None else head[0]

    hot: dict[int, dict[str, tuple[int, ...]]] = defaultdict(dict)
    for dev, layers in (hot_experts or {}).items():
        for layer, ids in layers.items():
            hot[layer][dev] = tuple(ids)
    kv = dict(kv_bytes or {})
    unknown = sorted(set(kv) - set(by_layer))
    if unknown:
        raise FootprintError(f"kv_bytes given for layer(s) {unknown} not in the model")
    target_layers = tuple(_layer_footprint(i, by_layer[i], tensor_map, n_expert_used, kv.get(i, 0), hot.get(i))
                          for i in sorted(by_layer) if i not in nextn_layers)
    if not target_layers:
        raise FootprintError("model has no target layers")
    target = ForwardFootprint(input_device, target_layers, *head)

    if draft_layers is None:
        draft_layers = nextn_layers[:1]
    draft = None
    if draft_layers:
        missing = [i for i in draft_layers if i not in by_layer]
        if missing:
            raise FootprintError(f"draft layer(s) {missing} not in the model")
        d_layers = tuple(_layer_footprint(i, by_layer[i], tensor_map, n_expert_used, kv.get(i, 0), hot.get(i))
                         for i in draft_layers)
        d_ts = [t for i in draft_layers for t in by_layer[i]]
        d_out = _first_named(d_ts, MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD) or out
        d_norm = _first_named(d_ts, MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM) or out_norm
        # The draft pass starts from the target's last hidden state.
        draft = ForwardFootprint(target_layers[-1].home, d_layers,
                                 tensor_map[d_out.name], _reads([d_out, d_norm], tensor_map))
    return DecodeFootprint(target, draft, int(n_embd), act_bytes)


def _first_named(ts: Iterable[TensorInfo], kind: MODEL_TENSOR) -> TensorInfo | None:
    return next((t for t in ts if t.layer is not None
                 and t.name.startswith(_nextn_name(kind, t.layer))), None)


def _reads(ts: Iterable[TensorInfo | None], tensor_map: Mapping[str, str]) -> tuple[tuple[str, int], ...]:
    acc: dict[str, int] = defaultdict(int)
    for t in ts:
        if t is not None:
            acc[tensor_map[t.name]] += t.n_bytes
    return tuple(sorted(acc.items()))


# Per-layer tensors that are not read whole each pass: looked up (embeddings) or belonging
# to the draft head's output (counted in ForwardFootprint.head_reads).
_NOT_LAYER_READS = (MODEL_TENSOR.NEXTN_EMBED_TOKENS, MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD,
                    MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM)


def _layer_footprint(layer: int, ts: list[TensorInfo], tensor_map: Mapping[str, str],
                     k: int, kv_bytes: int, hot: Mapping[str, tuple[int, ...]] | None = None) -> LayerFootprint:
    skip = tuple(_nextn_name(kind, layer) for kind in _NOT_LAYER_READS)
    dense = [t for t in ts if t.role is not Role.ROUTED_EXPERTS and not t.name.startswith(skip)]
    exps = [t for t in ts if t.role is Role.ROUTED_EXPERTS]

    # Home: where the layer's attention runs (the NextN input projection for a draft layer).
    anchor = ([t for t in ts if t.name.startswith(_nextn_name(MODEL_TENSOR.NEXTN_EH_PROJ, layer))]
              or [t for t in ts if t.role is Role.ATTENTION] or dense or exps)
    home = tensor_map[max(anchor, key=lambda t: t.n_bytes).name]

    n_expert = 0
    per_dev: dict[str, float] = defaultdict(float)
    for t in exps:
        if t.n_experts == 0:
            raise FootprintError(f"{t.name}: routed-expert tensor is not 3-D (shape {t.shape})")
        if n_expert and t.n_experts != n_expert:
            raise FootprintError(f"blk.{layer}: expert tensors disagree on the expert count "
                                 f"({n_expert} vs {t.n_experts} in {t.name})")
        n_expert = t.n_experts
        per_dev[tensor_map[t.name]] += t.n_bytes / t.n_experts
    if n_expert and k > n_expert:
        raise FootprintError(f"blk.{layer}: n_expert_used {k} exceeds the {n_expert} experts")
    slices = tuple(ExpertSlice(dev, b, n_expert) for dev, b in sorted(per_dev.items()))
    if hot:
        if set(per_dev) != {CPU}:
            raise FootprintError(f"blk.{layer}: hot experts need the block's expert tensors on the CPU")
        held = sorted(e for ids in hot.values() for e in ids)
        rest = tuple(sorted(set(range(n_expert)) - set(held)))
        slices = (ExpertSlice(CPU, per_dev[CPU], len(rest), rest),) + tuple(
            ExpertSlice(dev, per_dev[CPU], len(ids), tuple(ids)) for dev, ids in sorted(hot.items()))
    reads = dict(_reads(dense, tensor_map))
    if kv_bytes:
        reads[home] = reads.get(home, 0) + kv_bytes
    return LayerFootprint(layer, home, tuple(sorted(reads.items())), slices, n_expert, k if n_expert else 0)


# ---------------------------------------------------------------------------------------------
# Routing: how many distinct experts a batch of B tokens touches in one layer.
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


def _distinct(routing: RoutingProfile | None, n_expert: int, k: int, batch: int) -> float:
    if routing is None:
        return distinct_experts_uniform(n_expert, k, batch)
    return routing.distinct_for(n_expert, k, batch)


def expert_slice_use(s: ExpertSlice, lay: LayerFootprint, batch: int, routing: RoutingProfile | None,
               hits: RoutingCounts | None) -> tuple[float, float]:
    """(distinct experts of the slice that a pass of ``batch`` tokens touches, expected
    (token, expert) pairs in it). With measured per-expert hit rates p_e for the layer:
    Σ_slice 1−(1−p_e)^B and B·Σ_slice p_e (tokens independent); else the layer's distinct
    count and B·k, in proportion to the slice's share of the experts."""
    if hits is not None and lay.layer in hits.layers:
        p = hits.hit_rates(lay.layer)
        ids = list(range(lay.n_expert)) if s.experts is None else list(s.experts)
        return hits.distinct_for_batch(lay.layer, batch, ids), batch * float(p[ids].sum())
    share = s.n_experts / lay.n_expert
    return (_distinct(routing, lay.n_expert, lay.n_expert_used, batch) * share,
            batch * lay.n_expert_used * share)


# ---------------------------------------------------------------------------------------------
# One forward pass as a feature vector over HardwareProfile.linear_params().
# ---------------------------------------------------------------------------------------------

def forward_features(fp: ForwardFootprint, batch: int, *, n_embd: int, act_bytes: int = 4,
                     routing: RoutingProfile | None = None, hits: RoutingCounts | None = None) -> dict[str, float]:
    """Coefficients c_p with time = Σ_p c_p·param_p for one pass of ``batch`` tokens.
    ``hits``: measured per-expert hit rates (``offload profile``) for the layers they cover."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    f: dict[str, float] = defaultdict(float)
    hidden = batch * n_embd * act_bytes          # (B, n_embd) activations

    def read(dev: str, n_bytes: float) -> None:
        f["cpu_read" if dev == CPU else f"gpu_read:{dev}"] += n_bytes

    def copy(src: str, dst: str) -> None:
        # CPU<->GPU goes over that GPU's link; GPU<->GPU is staged through host memory.
        if src == dst:
            return
        for dev in (src, dst):
            if dev != CPU:
                f[f"link:{dev}"] += hidden
                f["link_latency"] += 1

    f["forward"] += 1
    here = fp.input_device
    for lay in fp.layers:
        copy(here, lay.home)
        here = lay.home
        used = {dev for dev, _ in lay.reads} | {s.device for s in lay.experts}
        for dev, n_bytes in lay.reads:
            read(dev, n_bytes)
        for s in lay.experts:
            touched, pairs = expert_slice_use(s, lay, batch, routing, hits)
            read(s.device, touched * s.bytes_per_expert)
            if s.device == CPU:
                # every (token, expert) pair streams the expert through the dot products
                f["cpu_compute"] += pairs * s.bytes_per_expert
        for dev in sorted(used - {lay.home}):    # out to another device and back
            copy(lay.home, dev)
            copy(dev, lay.home)
        if lay.home != CPU:
            f["gpu_layer"] += 1
        if CPU in used or lay.home == CPU:
            f["cpu_layer"] += 1
    copy(here, fp.head_home)
    for dev, n_bytes in fp.head_reads:
        read(dev, n_bytes)
    for dev in sorted({dev for dev, _ in fp.head_reads} - {fp.head_home}):
        copy(fp.head_home, dev)
        copy(dev, fp.head_home)
    return dict(f)


def _dot(features: Mapping[str, float], params: Mapping[str, float]) -> float:
    missing = sorted(k for k in features if k not in params)
    if missing:
        devs = sorted({k.split(":", 1)[1] for k in missing if ":" in k})
        raise ProfileError(f"hardware profile has no entry for {', '.join(devs or missing)}")
    return sum(c * params[k] for k, c in features.items())


# How T(0) is split when printed: parameter name (before any ":device") -> category.
_CATEGORY = {"cpu_read": "CPU", "cpu_compute": "CPU", "gpu_read": "GPU", "link": "copies",
             "link_latency": "copies", "cpu_layer": "fixed", "gpu_layer": "fixed", "forward": "fixed",
             "step": "step", "spec_step": "step"}


def _breakdown(features: Mapping[str, float], params: Mapping[str, float]) -> dict[str, float]:
    out = dict.fromkeys(("CPU", "GPU", "copies", "fixed", "step"), 0.0)
    for k, c in features.items():
        out[_CATEGORY[k.split(":", 1)[0]]] += c * params[k]
    return out


def overlap_credit(fp: ForwardFootprint, batch: int, params: Mapping[str, float], *,
                   routing: RoutingProfile | None = None, hits: RoutingCounts | None = None) -> float:
    """Seconds a pass hides by running a hot layer's two expert parts at once.

    In a layer whose routed experts are split by expert between the CPU and GPUs (hot
    experts), ``offload.moe.MoE`` runs the CPU experts in its worker thread while the GPU
    computes the hot ones, so the layer's expert time is max(CPU part, GPU part), not the sum
    ``forward_features`` counts: the credit is Σ min(CPU part, GPU part) over such layers.
    What stays serial — the hand-off — is counted apart by ``forward_features``: the hidden
    state's copies to the host and back (link, link_latency) and the CPU layer's fixed cost
    (cpu_layer). Whole-tensor splits (``-ot`` moving one projection) run stage after stage
    (``offload.moe.StagedExperts``): no credit."""
    total = 0.0
    for lay in fp.layers:
        if not any(s.device != CPU and s.experts is not None for s in lay.experts) or \
                not any(s.device == CPU for s in lay.experts):
            continue
        cpu = gpu = 0.0
        for s in lay.experts:
            touched, pairs = expert_slice_use(s, lay, batch, routing, hits)
            if s.device == CPU:
                cpu += touched * s.bytes_per_expert * params["cpu_read"] + pairs * s.bytes_per_expert * params["cpu_compute"]
            else:
                gpu += touched * s.bytes_per_expert * params[f"gpu_read:{s.device}"]
        total += min(cpu, gpu)
    return total


def pass_time(fp: ForwardFootprint, batch: int, params: Mapping[str, float], *, n_embd: int,
              act_bytes: int = 4, routing: RoutingProfile | None = None,
              hits: RoutingCounts | None = None) -> float:
    """Seconds for one pass of ``batch`` tokens under ``params`` (``linear_params``): the
    features' sum less what hot layers overlap (``overlap_credit``)."""
    feats = forward_features(fp, batch, n_embd=n_embd, act_bytes=act_bytes, routing=routing, hits=hits)
    return _dot(feats, params) - overlap_credit(fp, batch, params, routing=routing, hits=hits)


def forward_time(fp: ForwardFootprint, batch: int, hw: HardwareProfile, *, n_embd: int,
                 act_bytes: int = 4, routing: RoutingProfile | None = None,
                 hits: RoutingCounts | None = None) -> float:
    """Seconds for one pass of ``batch`` tokens."""
    return pass_time(fp, batch, hw.linear_params(), n_embd=n_embd, act_bytes=act_bytes, routing=routing, hits=hits)


def predicted_decode_tps(fp: DecodeFootprint, hw: HardwareProfile, *,
                         routing: RoutingProfile | None = None, hits: RoutingCounts | None = None) -> float:
    """Plain decode tokens/s (no drafting): 1 / (T_verify(1) + T_step(0)). Needs no draft head."""
    verify = forward_time(fp.target, 1, hw, n_embd=fp.n_embd, act_bytes=fp.act_bytes, routing=routing, hits=hits)
    return 1.0 / (verify + hw.linear_params()["step"])


# ---------------------------------------------------------------------------------------------
# The n_max table.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SpecRow:
    n: int
    expected_tokens: float     # E(n)
    step_s: float              # T(n)
    tokens_per_s: float        # E(n) / T(n)
    speedup: float             # S(n)

    def to_dict(self) -> dict:
        return {"n_max": self.n, "expected_tokens": round(self.expected_tokens, 4),
                "step_ms": round(self.step_s * 1e3, 4), "tokens_per_s": round(self.tokens_per_s, 4),
                "speedup": round(self.speedup, 4)}


@dataclass(frozen=True)
class SpecTable:
    rows: tuple[SpecRow, ...]
    draft_s: float                         # T_draft: one draft-head pass
    verify_breakdown: dict[str, float]     # T(0) = T_verify(1) + T_step(0) by category (CPU, GPU, copies, fixed,
                                           # step; overlap: minus what hot layers run at once)
    acceptance: AcceptanceProfile
    routing: str                           # "uniform" or the routing profile's source

    @property
    def plain_tps(self) -> float:
        return self.rows[0].tokens_per_s

    @property
    def break_even_n(self) -> int:
        """Largest n with S(n) >= 1 (S(0) = 1, so at least 0)."""
        return max(r.n for r in self.rows if r.speedup >= 1.0)

    @property
    def best(self) -> SpecRow:
        return max(self.rows, key=lambda r: (r.speedup, -r.n))   # ties -> shorter draft

    def to_dict(self) -> dict:
        """The plan's ``speculative`` block (minus the profile, see ``SpecProfile``)."""
        return {
            "predicted_plain_tps": round(self.plain_tps, 4),
            "break_even_n_max": self.break_even_n,
            "best_n_max": self.best.n,
            "predicted_speedup": round(self.best.speedup, 4),
            "p_min": self.acceptance.p_min,
            "draft_ms": round(self.draft_s * 1e3, 4),
            "routing": self.routing,
            "rows": [r.to_dict() for r in self.rows],
        }

    def format(self) -> str:
        b = self.verify_breakdown
        split = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in b.items() if v)
        accept = " ".join(f"{a:.2f}" for a in self.acceptance.accept)
        lines = [
            f"predicted plain decode: {self.plain_tps:.2f} t/s "
            f"(T(0) = {self.rows[0].step_s * 1e3:.1f} ms: {split} ms)",
            f"draft pass: {self.draft_s * 1e3:.2f} ms; routing: {self.routing}; "
            f"acceptance: {accept} (p_min {self.acceptance.p_min:g})",
            f"{'n_max':>5} {'E(n)':>6} {'step ms':>9} {'t/s':>8} {'speedup':>8}",
        ]
        for r in self.rows:
            lines.append(f"{r.n:>5} {r.expected_tokens:>6.2f} {r.step_s * 1e3:>9.1f} "
                         f"{r.tokens_per_s:>8.2f} {r.speedup:>7.2f}x")
        best = self.best
        lines.append(f"break-even n_max: {self.break_even_n}    best n_max: {best.n} "
                     f"({(best.speedup - 1) * 100:+.0f}%)")
        return "\n".join(lines)


def step_time(n: int, *, draft_s: float | Sequence[float], verify_s: Sequence[float],
              acceptance: AcceptanceProfile, step_s: float = 0.0, spec_step_s: float = 0.0) -> float:
    """T(n) with ``verify_s[b-1]`` = T_verify(b); ``step_s`` / ``spec_step_s``: the loop's own
    work per step / extra per drafting step (``HardwareProfile.step_us`` / ``spec_step_us``).

    ``draft_s``: one draft pass, or ``draft_s[b-1]`` = a head pass over b tokens. The first
    pass of a step runs the pairs the previous step produced (1 + its accepted drafts; their
    distribution follows from a_j), the chained ones one token each; a scalar is used for all.
    With p_min = 0 and a scalar this is n·T_draft + T_verify(n+1) + T_step. Under p_min the
    drafter stops after D < n tokens (the pass that fell below p_min still ran), so the
    expectation runs over D.
    """
    if n == 0:
        return verify_s[0] + step_s
    per_b = [float(draft_s)] if isinstance(draft_s, (int, float)) else [float(x) for x in draft_s]
    one = per_b[0]
    first = sum(p * per_b[min(m, len(per_b) - 1)] for m, p in enumerate(acceptance.accepted_distribution(n)))
    total = step_s + spec_step_s
    for d, p in enumerate(acceptance.drafted_distribution(n)):
        if p > 0:
            passes = min(d + 1, n)
            total += p * (first + (passes - 1) * one + verify_s[d])
    return total


def speculation_table(fp: DecodeFootprint, hw: HardwareProfile, *,
                      acceptance: AcceptanceProfile = DEFAULT_MTP, max_n: int = 6,
                      routing: RoutingProfile | None = None, hits: RoutingCounts | None = None) -> SpecTable:
    """Predicted E(n), T(n), t/s and S(n) for n = 0..max_n (``hits``: ``forward_features``)."""
    if fp.draft is None:
        raise FootprintError("model has no draft head (no NextN layer): nothing to speculate with")
    if max_n < 0:
        raise ValueError(f"max_n must be >= 0, got {max_n}")
    params = hw.linear_params()
    kw = dict(n_embd=fp.n_embd, act_bytes=fp.act_bytes, routing=routing, hits=hits)
    feats = [forward_features(fp.target, b, **kw) for b in range(1, max_n + 2)]
    verify = [pass_time(fp.target, b, params, **kw) for b in range(1, max_n + 2)]
    drafts = [pass_time(fp.draft, b, params, **kw) for b in range(1, max_n + 2)]
    draft = drafts[0]
    rows = []
    for n in range(max_n + 1):
        e = acceptance.expected_tokens(n)
        t = step_time(n, draft_s=drafts, verify_s=verify, acceptance=acceptance,
                      step_s=params["step"], spec_step_s=params["spec_step"])
        rows.append(SpecRow(n, e, t, e / t, e * rows[0].step_s / t if rows else 1.0))
    source = "uniform" if routing is None else routing.source
    breakdown = _breakdown({**feats[0], "step": 1.0}, params)
    breakdown["overlap"] = -overlap_credit(fp.target, 1, params, routing=routing, hits=hits)
    return SpecTable(tuple(rows), draft, breakdown, acceptance,
                     source if hits is None else f"per-expert hit rates ({hits.source or 'profile'})")


def best_over_p_min(tables: Iterable[SpecTable]) -> SpecTable:
    """The table (one per measured p_min) whose best n gives the highest speedup."""
    tables = list(tables)
    if not tables:
        raise ValueError("no tables")
    return max(tables, key=lambda t: (t.best.speedup, -t.acceptance.p_min))


@dataclass(frozen=True)
class SpecProfile:
    """Everything the prediction depends on besides the footprint: plan's ``speculative.profile``."""

    hardware: HardwareProfile
    acceptance: AcceptanceProfile = DEFAULT_MTP
    routing: RoutingProfile | None = None

    def to_dict(self) -> dict:
        return {"hardware": self.hardware.to_dict(), "acceptance": self.acceptance.to_dict(),
                "routing": None if self.routing is None else self.routing.to_dict()}

    @classmethod
    def from_dict(cls, d: object) -> SpecProfile:
        if not isinstance(d, Mapping) or "hardware" not in d:
            raise ProfileError("speculative profile: expected a mapping with 'hardware'")
        unknown = sorted(str(k) for k in d if k not in ("hardware", "acceptance", "routing"))
        if unknown:
            raise ProfileError(f"speculative profile: unknown key(s) {', '.join(unknown)}")
        acc = d.get("acceptance")
        rout = d.get("routing")
        return cls(HardwareProfile.from_dict(d["hardware"]),
                   DEFAULT_MTP if acc is None else AcceptanceProfile.from_dict(acc),
                   None if rout is None else RoutingProfile.from_dict(rout))


# ---------------------------------------------------------------------------------------------
# Fitting the profile to measurements (offload tune).
# ---------------------------------------------------------------------------------------------

DEFAULT_FREE = ("cpu_read", "forward")
_BANDWIDTHS = ("cpu_read", "gpu_read", "link")        # inverse bandwidths: must stay > 0


@dataclass(frozen=True)
class FitResult:
    profile: HardwareProfile
    fitted: dict[str, float]                          # free linear params (s, s/byte)
    rows: tuple[tuple[str, float, float], ...]        # (what, measured s, predicted s)

    @property
    def max_rel_error(self) -> float:
        return max(abs(p - m) / m for _, m, p in self.rows)


def fit_profile(fp: DecodeFootprint, base: HardwareProfile, *, verify_s: Mapping[int, float],
                draft_s: float | Mapping[int, float] | None = None, free: Sequence[str] = DEFAULT_FREE,
                routing: RoutingProfile | None = None) -> FitResult:
    """Least squares (non-negative, on relative error) for the ``free`` linear parameters.

    ``verify_s`` maps batch B -> measured T_verify(B); ``draft_s`` is a measured draft pass
    (one token), or a mapping batch B -> a measured head pass over B tokens.
    The other parameters stay at ``base``. Terms that are constant in B (per-layer and
    per-pass costs, dense reads) cannot be told apart by T_verify alone: free at most one of
    them unless the draft pass, with its different mix, is measured too.
    """
    params = base.linear_params()
    free = list(dict.fromkeys(free))
    unknown = [p for p in free if p not in params]
    if unknown:
        raise ProfileError(f"fit: unknown parameter(s) {', '.join(unknown)} "
                           f"(known: {', '.join(sorted(params))})")
    kw = dict(n_embd=fp.n_embd, act_bytes=fp.act_bytes, routing=routing)
    passes = [(f"verify B={b}", fp.target, b, t) for b, t in sorted(verify_s.items())]
    if draft_s is not None:
        if fp.draft is None:
            raise FootprintError("fit: draft time given but the footprint has no draft head")
        drafts = {1: draft_s} if isinstance(draft_s, (int, float)) else dict(draft_s)
        passes += [(f"draft B={b}", fp.draft, b, t) for b, t in sorted(drafts.items())]
    samples: list[tuple[str, dict[str, float], float]] = [
        (what, forward_features(part, b, **kw), float(t)) for what, part, b, t in passes]
    # Hot layers overlap their two expert parts (``overlap_credit``), which is not linear in
    # the parameters: the fit adds back what ``base`` says they hide and fits the sum.
    hidden = [overlap_credit(part, b, params, routing=routing) for _, part, b, _ in passes]
    if any(not (math.isfinite(t) and t > 0) for _, _, t in samples):
        raise ProfileError("fit: measured times must be positive")
    if len(samples) < len(free):
        raise ProfileError(f"fit: {len(samples)} measurements cannot determine {len(free)} parameters")

    # Rows weighted by 1/measured: timing noise is roughly proportional to the time.
    a = np.array([[feats.get(p, 0.0) / t for p in free] for _, feats, t in samples])      # (rows, free)
    y = np.array([(t + h - sum(c * params[k] for k, c in feats.items() if k not in free)) / t
                  for (_, feats, t), h in zip(samples, hidden)])                              # (rows,)
    for j, p in enumerate(free):
        if not a[:, j].any():
            raise ProfileError(f"fit: parameter {p} has no effect on this footprint")
    scale = np.linalg.norm(a, axis=0)
    a_n = a / scale
    if np.linalg.matrix_rank(a_n, tol=1e-9) < len(free):
        raise ProfileError(f"fit: parameters {', '.join(free)} cannot be separated by these "
                           "measurements; fix some of them")
    x = _nnls(a_n, y) / scale
    fitted = dict(zip(free, (float(v) for v in x)))
    # A bandwidth cannot be infinite: one fitted to no cost at all stays at ``base`` and the
    # others are fitted again without it (cpu_compute = 0 is allowed: "free next to reads").
    stuck = [p for p, v in fitted.items() if v == 0.0 and p.split(":", 1)[0] in _BANDWIDTHS]
    if stuck:
        rest = [p for p in free if p not in stuck]
        if not rest:
            raise ProfileError(f"fit: {', '.join(stuck)} fitted to no cost at all; the measurements "
                               "do not show it")
        return fit_profile(fp, base, verify_s=verify_s, draft_s=draft_s, free=rest, routing=routing)
    try:
        profile = base.with_linear_params(fitted, source="measured")
    except ProfileError as e:
        raise ProfileError(f"fit: {e}") from None
    new = profile.linear_params()
    rows = tuple((what, t, _dot(feats, new) - overlap_credit(part, b, new, routing=routing))
                 for (what, feats, t), (_, part, b, _) in zip(samples, passes))
    return FitResult(profile, fitted, rows)


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||a x - y|| s.t. x >= 0, exactly, by trying every support set (few parameters)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(np.sum(y * y))
    for size in range(1, n + 1):
        for support in itertools.combinations(range(n), size):
            cols = list(support)
            sol, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(n)
            x[cols] = sol
            res = float(np.sum((a @ x - y) ** 2))
            if res < best_res - 1e-18:
                best, best_res = x, res
    return best
