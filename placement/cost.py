"""Speculative-decoding cost model: the time of a forward pass and the n_max table (is drafting
worth it on this placement, and how far?).

Per step with draft length n (DESIGN.md "Break-even model"):

    E(n) = 1 + Σ_{i≤n} Π_{j≤i} a_j                        expected tokens per step
    T(n) = n·T_draft + T_verify(n+1) + T_step(n)           step time (p_min = 0)

(With per-batch draft times the first draft pass of a step runs the previous step's 1 +
accepted tokens through the head, as the chained MTP loop does: ``step_time``.)
    S(n) = E(n)·T(0) / T(n)                                speedup over plain decode

``T_verify(B)`` and ``T_draft`` are the time of one forward pass of B tokens (resp. one token
through the draft head), built from the bytes a ``placement.footprint`` reads per device
over that device's bandwidth: dense weights once per pass; routed experts once per
*distinct* expert the B tokens touch (``placement.routing``: uniform ``U(B) = E·(1−(1−k/E)^B)``
per layer, a measured ``RoutingProfile``, or per-expert ``RoutingCounts``); hidden-state
copies host<->device wherever the pass changes device; fixed costs per layer and per pass.
Every term is linear in one ``HardwareProfile.linear_params`` entry, so one feature vector
(``forward_features``) serves prediction here and the least-squares fit that ``offload tune``
runs (``placement.cost_fit``).
``T_step(n)`` is the decode loop's own per-step work outside the passes (sampling,
acceptance, rollback, Python): ``step`` for every step plus ``spec_step`` when n > 0.

Across hosts (``pipeline_table``): a target pass runs each host's blocks in turn and adds its
hops (``hop_features``: one per boundary carrying B x the state a block hands on, one back
with the tokens; ``HopLink``'s latency and rate); the draft head runs on the last host, with
no hop. The hops are a fixed cost per pass, so a verify batch spreads them over E(n) tokens.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from placement.acceptance import DEFAULT_MTP, AcceptanceProfile
from placement.devices import CPU
from placement.footprint import DecodeFootprint, ExpertSlice, FootprintError, ForwardFootprint, LayerFootprint
from placement.hardware import HardwareProfile, ProfileError
from placement.routing import RoutingCounts, RoutingProfile, distinct_experts_uniform


# ---------------------------------------------------------------------------------------------
# Routing: which of a slice's experts a batch of B tokens touches.
# ---------------------------------------------------------------------------------------------

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
    if fp.draft_head:
        f["draft_pass"] += 1
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
                # each (token, expert) pair beyond an expert's first streams it through the dot
                # products again; the first pair's are in the read rate (a batch-1 mat-vec's)
                f["cpu_compute"] += (pairs - touched) * s.bytes_per_expert
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
             "draft_pass": "fixed", "step": "step", "spec_step": "step", "hop_latency": "hops", "hop_bytes": "hops"}


def _breakdown(features: Mapping[str, float], params: Mapping[str, float]) -> dict[str, float]:
    out = dict.fromkeys(("CPU", "GPU", "copies", "fixed", "step", "hops"), 0.0)
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
                cpu += s.bytes_per_expert * (touched * params["cpu_read"] + (pairs - touched) * params["cpu_compute"])
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

    def format(self, interval=None) -> str:
        """The table; with ``interval`` (``placement.uncertainty.ForecastInterval``) each
        figure carries its range, and break-even is a range where the speedup's interval
        crosses 1.0x."""
        b = self.verify_breakdown
        split = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in b.items() if v)
        accept = " ".join(f"{a:.2f}" for a in self.acceptance.accept)
        plain = "" if interval is None else \
            f" [{interval.plain_tps[0]:.0f}-{interval.plain_tps[1]:.0f}]"
        lines = [
            f"predicted plain decode: {self.plain_tps:.2f} t/s{plain} "
            f"(T(0) = {self.rows[0].step_s * 1e3:.1f} ms: {split} ms)",
            f"draft pass: {self.draft_s * 1e3:.2f} ms; routing: {self.routing}; "
            f"acceptance: {accept} (p_min {self.acceptance.p_min:g})",
            f"{'n_max':>5} {'E(n)':>6} {'step ms':>9} {'t/s':>8} {'speedup':>8}"
            + ("" if interval is None else f" {'range':>12}"),
        ]
        for r in self.rows:
            lines.append(f"{r.n:>5} {r.expected_tokens:>6.2f} {r.step_s * 1e3:>9.1f} "
                         f"{r.tokens_per_s:>8.2f} {r.speedup:>7.2f}x"
                         + ("" if interval is None else
                            f" {interval.speedup[r.n][0]:>5.2f}-{interval.speedup[r.n][1]:.2f}x"))
        best = self.best
        even = f"{self.break_even_n}"
        if interval is not None and interval.crosses_one:
            lo, hi = interval.break_even
            even = f"{lo}-{hi}" if lo != hi else even
        lines.append(f"break-even n_max: {even}    best n_max: {best.n} "
                     f"({(best.speedup - 1) * 100:+.0f}%)")
        if interval is not None and interval.crosses_one:
            lines.append("the speedup's interval crosses 1.0x: whether drafting pays here is not known "
                         "from the plan; run `offload tune` to measure it")
        return "\n".join(lines)


# How a drafter's passes are spent per step (``step_weights``):
#   chain  an MTP head: a first pass over the previous step's 1 + accepted tokens, then one
#          chained pass per further draft;
#   block  a block drafter (DSpark): one pass over the n tokens of the block, and the
#          previous step's 1 + accepted tokens injected into its context (``inject_s``);
#   free   no weights at all (n-gram lookup): the passes cost nothing.
DRAFT_KINDS = ("chain", "block", "free")


def step_time(n: int, *, draft_s: float | Sequence[float], verify_s: Sequence[float],
              acceptance: AcceptanceProfile, step_s: float = 0.0, spec_step_s: float = 0.0,
              kind: str = "chain", inject_s: Sequence[float] | None = None) -> float:
    """T(n) with ``verify_s[b-1]`` = T_verify(b); ``step_s`` / ``spec_step_s``: the loop's own
    work per step / extra per drafting step (``HardwareProfile.step_us`` / ``spec_step_us``).

    ``draft_s``: one draft pass, or ``draft_s[b-1]`` = a draft pass over b tokens. For a
    chain (``kind``, see DRAFT_KINDS) the first pass of a step runs the pairs the previous
    step produced (1 + its accepted drafts; their distribution follows from a_j), the chained
    ones one token each; a scalar is used for all. With p_min = 0 and a scalar this is
    n·T_draft + T_verify(n+1) + T_step. Under p_min the drafter stops after D < n tokens (the
    pass that fell below p_min still ran), so the expectation runs over D. A block drafter
    pays T_draft(n) and ``inject_s[b-1]`` for the b = 1 + accepted tokens it takes in.
    """
    if n == 0:
        return verify_s[0] + step_s
    per_b = [float(draft_s)] if isinstance(draft_s, (int, float)) else [float(x) for x in draft_s]
    w_draft, w_verify = step_weights(n, acceptance, len(per_b), kind)
    inject = 0.0
    if kind == "block" and inject_s is not None:
        inject = sum(q * inject_s[min(m, len(inject_s) - 1)] for m, q in enumerate(acceptance.accepted_distribution(n)))
    return (step_s + spec_step_s + inject + sum(w * t for w, t in zip(w_draft, per_b))
            + sum(w * verify_s[b] for b, w in enumerate(w_verify)))


def step_weights(n: int, acceptance: AcceptanceProfile, draft_sizes: int,
                 kind: str = "chain") -> tuple[list[float], list[float]]:
    """The expectation ``step_time`` takes for n >= 1, as weights: T(n) - loop terms =
    sum_b w_draft[b]·T_draft(b+1) + sum_b w_verify[b]·T_verify(b+1), with the draft passes over
    more than ``draft_sizes`` tokens costed as the largest given (one size: every pass alike).
    ``kind``: DRAFT_KINDS (a block's injection is ``step_time``'s own term). Linear in the
    pass times, so ``placement.uncertainty`` takes the same weights over their cost-term
    coefficients."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"draft kind {kind!r}: one of {', '.join(DRAFT_KINDS)}")
    accepted = acceptance.accepted_distribution(n)
    w_draft, w_verify = [0.0] * draft_sizes, [0.0] * (n + 1)
    for d, p in enumerate(acceptance.drafted_distribution(n)):
        if p > 0:
            if kind == "chain":
                for m, q in enumerate(accepted):       # the first pass: the previous step's tokens
                    w_draft[min(m, draft_sizes - 1)] += p * q
                w_draft[0] += p * (min(d + 1, n) - 1)  # the chained passes, one token each
            elif kind == "block":
                w_draft[min(n, draft_sizes) - 1] += p  # the whole block, whatever p_min keeps of it
            w_verify[d] += p
    return w_draft, w_verify


def speculation_table(fp: DecodeFootprint, hw: HardwareProfile, *,
                      acceptance: AcceptanceProfile = DEFAULT_MTP, max_n: int = 6,
                      routing: RoutingProfile | None = None, hits: RoutingCounts | None = None,
                      draft_kind: str = "chain", inject: ForwardFootprint | None = None) -> SpecTable:
    """Predicted E(n), T(n), t/s and S(n) for n = 0..max_n (``hits``: ``forward_features``).
    ``draft_kind`` (DRAFT_KINDS): how the draft passes are spent; ``free`` (n-gram lookup)
    costs nothing beyond the loop's own per-step time and needs no draft head. ``inject``: a
    block drafter's pass over the tokens it takes in each step (fc and its stages' keys)."""
    if fp.draft is None and draft_kind != "free":
        raise FootprintError("model has no draft head (no NextN layer): nothing to speculate with")
    if max_n < 0:
        raise ValueError(f"max_n must be >= 0, got {max_n}")
    params = hw.linear_params()
    kw = dict(n_embd=fp.n_embd, act_bytes=fp.act_bytes, routing=routing, hits=hits)
    feats = [forward_features(fp.target, b, **kw) for b in range(1, max_n + 2)]
    verify = [pass_time(fp.target, b, params, **kw) for b in range(1, max_n + 2)]
    drafts = ([0.0] * (max_n + 1) if draft_kind == "free" else
              [pass_time(fp.draft, b, params, **kw) for b in range(1, max_n + 2)])
    injects = (None if inject is None else [pass_time(inject, b, params, **kw) for b in range(1, max_n + 2)])
    rows = spec_rows(verify, drafts, acceptance, params, draft_kind=draft_kind, inject_s=injects)
    breakdown = _breakdown({**feats[0], "step": 1.0}, params)
    breakdown["overlap"] = -overlap_credit(fp.target, 1, params, routing=routing, hits=hits)
    return SpecTable(rows, drafts[0], breakdown, acceptance, routing_label(routing, hits))


def routing_label(routing: RoutingProfile | None, hits: RoutingCounts | None) -> str:
    """What a table says it assumed of the routing."""
    if hits is not None:
        return f"per-expert hit rates ({hits.source or 'profile'})"
    return "uniform" if routing is None else routing.source


def spec_rows(verify: Sequence[float], drafts: Sequence[float], acceptance: AcceptanceProfile,
              params: Mapping[str, float], *, draft_kind: str = "chain",
              inject_s: Sequence[float] | None = None) -> tuple[SpecRow, ...]:
    """The rows n = 0..len(verify)-1 from the pass times (``verify[b-1]`` = T_verify(b),
    ``drafts[b-1]`` = a draft pass over b tokens) and the loop's own ``step`` / ``spec_step``."""
    rows: list[SpecRow] = []
    for n in range(len(verify)):
        e = acceptance.expected_tokens(n)
        t = step_time(n, draft_s=drafts, verify_s=verify, acceptance=acceptance,
                      step_s=params["step"], spec_step_s=params["spec_step"], kind=draft_kind, inject_s=inject_s)
        rows.append(SpecRow(n, e, t, e / t, e * rows[0].step_s / t if rows else 1.0))
    return tuple(rows)


def break_even_acceptance(fp: DecodeFootprint, hw: HardwareProfile, *, max_n: int = 6,
                          routing: RoutingProfile | None = None, hits: RoutingCounts | None = None,
                          draft_kind: str = "free") -> list[float | None]:
    """Per n = 1..max_n: the least acceptance a (the same a_j at every position, a draft of n
    tokens every step) at which drafting n tokens pays (S(n) >= 1); None where even a = 1 does
    not. For a drafter whose acceptance is the text's (n-gram), this is the forecast a plan can
    make before measuring: S(n) rises with a, so bisection finds it (to 1e-3)."""
    def speedup(a: float, n: int) -> float:
        table = speculation_table(fp, hw, acceptance=AcceptanceProfile(accept=(a,), source="break-even"),
                                  max_n=n, routing=routing, hits=hits, draft_kind=draft_kind)
        return table.rows[n].speedup

    out: list[float | None] = []
    for n in range(1, max_n + 1):
        if speedup(1.0, n) < 1.0:
            out.append(None)
            continue
        lo, hi = 0.0, 1.0
        while hi - lo > 1e-3:
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if speedup(mid, n) >= 1.0 else (mid, hi)
        out.append(round(hi, 3))
    return out


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
# A model split across hosts (placement.multihost): a pipeline of passes and hops.
# ---------------------------------------------------------------------------------------------

# Priors for one hop between hosts (a torch.distributed send of a small CPU tensor over gloo/TCP,
# and the link's rate); ``offload plan --hop-latency-us / --hop-gbps`` replace them. Not measured
# here: TCP round trips on a switched 10 GbE LAN are typically 50-100 us, one way about half, and
# gloo adds its own framing; 10 GbE moves at most 1.25 GB/s.
DEFAULT_HOP_LATENCY_US = 100.0
DEFAULT_HOP_GBPS = 1.25
TOKEN_BYTES = 8            # a sampled token id going back to the first host (int64)


@dataclass(frozen=True)
class HopLink:
    """The link between consecutive hosts: a fixed latency per hop and a rate for its bytes."""

    latency_us: float = DEFAULT_HOP_LATENCY_US
    gbps: float = DEFAULT_HOP_GBPS

    def __post_init__(self) -> None:
        if not (isinstance(self.latency_us, (int, float)) and math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ProfileError(f"--hop-latency-us must be a number >= 0, got {self.latency_us!r}")
        if not (isinstance(self.gbps, (int, float)) and math.isfinite(self.gbps) and self.gbps > 0):
            raise ProfileError(f"--hop-gbps must be a number > 0, got {self.gbps!r}")

    def params(self) -> dict[str, float]:
        return {"hop_latency": self.latency_us * 1e-6, "hop_bytes": 1.0 / (self.gbps * 1e9)}


def hops_per_pass(n_hosts: int) -> int:
    """Hops of one pass through ``n_hosts`` hosts: one per boundary and one back with the
    sampled tokens; one host: none."""
    return n_hosts if n_hosts > 1 else 0


def hop_features(n_hosts: int, batch: int, carried_bytes: int) -> dict[str, float]:
    """One pass of ``batch`` tokens through ``n_hosts`` hosts (``hops_per_pass``): each boundary
    sends the state the blocks carry (``carried_bytes`` per token: T x n_embd x 4, times
    deepseek4's hc_mult streams); the last host sends the sampled tokens back to the first."""
    if not hops_per_pass(n_hosts):
        return {}
    return {"hop_latency": float(hops_per_pass(n_hosts)),
            "hop_bytes": float((n_hosts - 1) * batch * carried_bytes + batch * TOKEN_BYTES)}


def pipeline_table(hosts: Sequence[tuple[ForwardFootprint, HardwareProfile]], draft: ForwardFootprint | None,
                   link: HopLink | None, *, n_embd: int, carried_bytes: int, act_bytes: int = 4,
                   acceptance: AcceptanceProfile = DEFAULT_MTP, max_n: int = 6,
                   routing: RoutingProfile | None = None, hits: RoutingCounts | None = None) -> SpecTable:
    """The n_max table of a model split across hosts: per host (pipeline order) the footprint
    of its blocks and its hardware. A verify pass runs every host's part in turn and pays the
    hops (``hop_features``) once, whatever its batch; the draft head runs on the last host
    with no hop, so drafting amortises the hops over the E(n) tokens of a step. Without a
    ``draft`` only n = 0 (plain decoding). The loop's own step costs are the last host's.
    ``link`` None: the hops cost nothing (the same passes as if the hosts were one box)."""
    if max_n < 0:
        raise ValueError(f"max_n must be >= 0, got {max_n}")
    kw = dict(n_embd=n_embd, act_bytes=act_bytes, routing=routing, hits=hits)

    def hops(b: int) -> float:
        return 0.0 if link is None else _dot(hop_features(len(hosts), b, carried_bytes), link.params())

    last = hosts[-1][1].linear_params()
    top = max_n if draft is not None else 0
    verify = [sum(pass_time(fp, b, hw.linear_params(), **kw) for fp, hw in hosts) + hops(b)
              for b in range(1, top + 2)]
    drafts = [pass_time(draft, b, last, **kw) for b in range(1, top + 2)] if draft is not None else [0.0]
    rows = spec_rows(verify, drafts, acceptance, last)
    breakdown = dict.fromkeys(("CPU", "GPU", "copies", "fixed", "step", "hops"), 0.0)
    for fp, hw in hosts:
        params = hw.linear_params()
        for k, v in _breakdown(forward_features(fp, 1, **kw), params).items():
            breakdown[k] += v
        breakdown["overlap"] = breakdown.get("overlap", 0.0) - overlap_credit(fp, 1, params, routing=routing,
                                                                              hits=hits)
    breakdown["step"] += last["step"]
    breakdown["hops"] += hops(1)
    return SpecTable(rows, drafts[0], breakdown, acceptance, routing_label(routing, hits))
