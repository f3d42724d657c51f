"""The plan's ``speculative:`` section: the cost model (``placement.cost``) applied to a plan.

``offload plan`` fills it with a prediction; ``offload tune`` replaces the profile with a
measured one and adds what it measured. The section's keys:

    type: mtp | ngram    the drafter; n_max / p_min: what ``offload run`` drafts with by default
    source: predicted | tune
    predicted_plain_tps, break_even_n_max, best_n_max, predicted_speedup, draft_ms, routing, rows
    profile: {hardware, acceptance, routing}     (``SpecProfile``)
    hop_latency_us, hop_gbps     a plan across hosts: the link between hosts its forecast assumed

and, written by ``offload tune`` (kept by later refreshes): measured_speedup (of the chosen
n_max), measured_best_n_max, choice (the rule that picked n_max), runner_up (the best other
drafter: type, n_max, measured speedup, margin), measured_rows (per drafter and n_max:
tokens/s and speedup mean ± std over repeats, tokens per step, step / draft / verify ms),
tune (date, budget, seconds, prompts, tokens per run, repeats, load average).

``SpecSection`` (placement.spec_section) is that section typed; ``plan_profile`` is the profile a plan predicts with.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from placement.acceptance import DEFAULT_DSPARK, DEFAULT_MTP
from placement.concurrency import ConcurrencyRow, concurrency_table
from placement.cost import HopLink, SpecProfile, SpecTable, pipeline_table, predicted_decode_tps, speculation_table
from placement.devices import CPU
from placement.draft import DRAFTER_KIND
from placement.footprint import DecodeFootprint, FootprintError, ForwardFootprint, LayerFootprint, footprint_from_tensors
from placement.hardware import HardwareProfile
from placement.multihost import MultiHostPlan
from placement.plan import Plan, PlannedModel
from placement.routing import RoutingCounts
from placement.spec_section import SpecSection
from placement.tensors import ModelSpec, TensorInfo

DEFAULT_MAX_N = 6




# drafter architectures whose GGUF is a block drafter of its own (DSpark), not a NextN block
BLOCK_DRAFTERS = ("dflash",)
# a block drafter's tensors run per step on the tokens it takes in (the injection), not per draft pass
_INJECT = re.compile(r"^(fc|enc\.output_norm)\.|^blk\.\d+\.(attn_kv|attn_kv_a_norm)\.")


def drafter_kind(plan: Plan, draft: PlannedModel | None) -> str:
    """How the plan's drafter spends its passes (``placement.cost.DRAFT_KINDS``)."""
    return "block" if draft is not None and draft.spec.arch in BLOCK_DRAFTERS else "chain"


def plan_footprint(plan: Plan, model: PlannedModel, draft: PlannedModel | None) -> DecodeFootprint:
    """What one target pass and one draft pass read, and on which device, under ``plan``.

    With a separate ``--draft`` GGUF its NextN block replaces any in-model one. A block
    drafter (DSpark) draft pass runs all its stages, its heads and the target's output head
    (its stages and glue are renumbered after the trunk's blocks, out of their names' way).
    """
    if draft is not None and draft.spec.arch in BLOCK_DRAFTERS:
        return _block_drafter_footprint(plan, model, draft)[0]
    tensors: list[TensorInfo] = list(model.tensors)
    tmap: dict[str, str] = dict(plan.tensors)
    draft_layers: Sequence[int] | None = None
    if draft is not None:
        tensors = [t for t in tensors if not t.nextn]
        d_tensors = [t for t in draft.tensors if t.layer is not None]   # globals are shared
        tensors += d_tensors
        tmap.update(plan.draft_tensors)
        draft_layers = sorted({t.layer for t in d_tensors if t.nextn})[:1]
    return footprint_from_tensors(tensors, tmap, n_expert_used=max(model.spec.n_expert_used, 1),
                                  draft_layers=draft_layers, n_embd=model.spec.n_embd,
                                  hot_experts=plan.hot_experts)


def _block_drafter_footprint(plan: Plan, model: PlannedModel,
                             draft: PlannedModel) -> tuple[DecodeFootprint, ForwardFootprint]:
    """(footprint, injection pass) of a block drafter: the draft pass reads every stage
    (blk.0..S-1 as layers n_layer..n_layer+S-1) with the drafter's heads (Markov, confidence,
    hc head, norm) on its last stage; the injection reads ``fc`` and each stage's K projection
    (deepseek4.md §2.11: K = rope(rms(main_x · Wkv)) into each stage's window ring)."""
    base = model.spec.n_layer
    stages = sorted({t.layer for t in draft.tensors if t.layer is not None})
    last = base + stages[-1]
    renamed, inject = [], []
    for t in draft.tensors:
        name = f"draft:{t.name}"
        layer = last if t.layer is None else base + t.layer
        r = replace(t, name=name, layer=layer, nextn=True)
        (inject if _INJECT.match(t.name) else renamed).append(r)
    tmap = dict(plan.tensors) | {f"draft:{n}": d for n, d in plan.draft_tensors.items()}
    trunk = [t for t in model.tensors if not t.nextn]
    fp = footprint_from_tensors(trunk + renamed, tmap, n_expert_used=max(model.spec.n_expert_used, 1),
                                draft_layers=[base + s for s in stages], n_embd=model.spec.n_embd,
                                hot_experts=plan.hot_experts)
    home = fp.draft.head_home
    reads: dict[str, int] = {}
    for t in inject:
        reads[tmap[t.name]] = reads.get(tmap[t.name], 0) + t.n_bytes
    injection = ForwardFootprint(home, (LayerFootprint(base, home, tuple(reads.items())),), home, ())
    return fp, injection


def block_injection(plan: Plan, model: PlannedModel, draft: PlannedModel) -> ForwardFootprint:
    """A block drafter's injection pass (``_block_drafter_footprint``): what taking in the
    tokens a step keeps reads (``fc`` and each stage's K projection)."""
    return _block_drafter_footprint(plan, model, draft)[1]


def default_profile(plan: Plan) -> SpecProfile:
    """Bandwidth defaults by GPU product name (a written device spec has none: generic GPU)."""
    return SpecProfile(HardwareProfile.for_devices({d.name: d.gpu_name for d in plan.devices if d.is_gpu}))


def plan_profile(plan: Plan) -> SpecProfile:
    """What ``plan`` predicts with: its section's profile (``offload tune``'s measured one, or a
    ``--hw-profile``), else the defaults by GPU name."""
    section = plan.speculative
    if section is not None and section.profile is not None:
        return section.profile
    return default_profile(plan)


def forecast_hardware(plan: Plan, hw: HardwareProfile) -> HardwareProfile:
    """``hw`` as it applies to ``plan``: the in-cache read rate when the plan's CPU-resident
    weights fit in the last-level cache (``HardwareProfile.for_cpu_weights``)."""
    return hw.for_cpu_weights(sum(t.weights_bytes for t in plan.totals if t.name == CPU))


def complete_hardware(hw: HardwareProfile, plan: Plan) -> HardwareProfile:
    """A user's profile that leaves out some of the plan's GPUs gets their name defaults."""
    defaults = default_profile(plan).hardware.gpus
    return replace(hw, gpus={**defaults, **hw.gpus})


@dataclass(frozen=True)
class ForecastInputs:
    """What a plan's drafting forecasts are computed from: its footprint, the box, the
    acceptance profile, the drafter's kind (``placement.cost.DRAFT_KINDS``) and a block
    drafter's injection pass."""
    fp: DecodeFootprint
    hw: HardwareProfile
    profile: SpecProfile
    kind: str
    inject: ForwardFootprint | None


def forecast_inputs(plan: Plan, model: PlannedModel, draft: PlannedModel | None,
                    profile: SpecProfile | None = None) -> ForecastInputs:
    """``ForecastInputs`` of ``plan`` (``profile``: default the plan's own)."""
    old = plan.speculative.entries() if plan.speculative is not None else {}
    if profile is None:
        profile = plan_profile(plan)
    kind, inject = drafter_kind(plan, draft), None
    # a section ``offload tune`` gave to the n-gram drafter keeps predicting for it (no weights)
    if old.get("type") == "ngram":
        kind = DRAFTER_KIND["ngram"]
    if kind == "block":
        fp, inject = _block_drafter_footprint(plan, model, draft)
        if profile.acceptance is DEFAULT_MTP:          # nothing measured or given: DSpark's own prior
            profile = replace(profile, acceptance=DEFAULT_DSPARK)
    else:
        fp = plan_footprint(plan, model, draft)
    return ForecastInputs(fp, forecast_hardware(plan, profile.hardware), profile, kind, inject)


def predict_concurrency(plan: Plan, model: PlannedModel, draft: PlannedModel | None, *,
                        profile: SpecProfile | None = None, max_n: int = DEFAULT_MAX_N,
                        hits: RoutingCounts | None = None) -> tuple[ConcurrencyRow, ...]:
    """Aggregate t/s and break-even n_max per number of active sequences
    (``placement.concurrency``) for the plan's drafter."""
    fc = forecast_inputs(plan, model, draft, profile)
    return concurrency_table(fc.fp, fc.hw, acceptance=fc.profile.acceptance, max_n=max_n,
                             routing=fc.profile.routing, hits=hits, draft_kind=fc.kind, inject=fc.inject)


def predict(plan: Plan, model: PlannedModel, draft: PlannedModel | None, *,
            profile: SpecProfile | None = None, max_n: int = DEFAULT_MAX_N,
            hits: RoutingCounts | None = None) -> tuple[SpecTable, SpecSection]:
    """The n_max table for ``plan`` and the ``speculative`` section that goes with it.

    A section the plan already has (e.g. written by ``offload tune``) keeps its chosen
    ``n_max``/``p_min``, its measurements and its profile; only the prediction is refreshed.
    """
    old = plan.speculative.entries() if plan.speculative is not None else {}
    fc = forecast_inputs(plan, model, draft, profile)
    profile, kind = fc.profile, fc.kind
    table = speculation_table(fc.fp, fc.hw, acceptance=profile.acceptance, max_n=max_n, routing=profile.routing,
                              hits=hits, draft_kind=kind, inject=fc.inject)
    section: dict[str, Any] = {"type": "dspark" if kind == "block" else "mtp", "n_max": table.best.n,
                               "p_min": profile.acceptance.p_min, "source": "predicted"}
    section.update({k: v for k, v in old.items() if k not in ("rows", "profile")})
    section.update(table.to_dict())
    section["profile"] = profile
    return table, SpecSection.of(section)


@dataclass(frozen=True)
class HotGain:
    """What a plan's hot experts buy, predicted: plain decode t/s and break-even n_max
    (None without a draft head) for the same whole-tensor placement without and with them."""

    tps_without: float
    tps_with: float
    break_even_without: int | None
    break_even_with: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"predicted_plain_tps": {"without": round(self.tps_without, 4), "with": round(self.tps_with, 4)},
                "break_even_n_max": {"without": self.break_even_without, "with": self.break_even_with}}

    def format(self) -> str:
        line = (f"hot experts: predicted plain decode {self.tps_with:.2f} t/s "
                f"(without them {self.tps_without:.2f} t/s, {self.tps_with / self.tps_without - 1:+.1%})")
        if self.break_even_with is not None:
            line += f"; break-even n_max {self.break_even_with} (without them {self.break_even_without})"
        return line


def hot_gain(plan: Plan, model: PlannedModel, draft: PlannedModel | None, *, hits: RoutingCounts,
             profile: SpecProfile | None = None, max_n: int = DEFAULT_MAX_N) -> HotGain:
    """``HotGain`` of ``plan`` with per-expert ``hits`` in both predictions (the skew lowers the
    distinct experts a batch touches with or without hot experts)."""
    if profile is None:
        profile = plan_profile(plan)
    out = []
    for hot in ({}, plan.hot_experts):
        fp = plan_footprint(replace(plan, hot_experts=hot), model, draft)
        hw = forecast_hardware(plan, profile.hardware)
        tps = predicted_decode_tps(fp, hw, routing=profile.routing, hits=hits)
        even = None
        if fp.draft is not None:
            even = speculation_table(fp, hw, acceptance=profile.acceptance, max_n=max_n,
                                     routing=profile.routing, hits=hits).break_even_n
        out.append((tps, even))
    return HotGain(out[0][0], out[1][0], out[0][1], out[1][1])


# ---------------------------------------------------------------------------------------------
# A plan across hosts (placement.multihost): the pipeline's forecast.
# ---------------------------------------------------------------------------------------------

def carried_bytes(spec: ModelSpec, act_bytes: int = 4) -> int:
    """Bytes per token one block hands the next, so one host the next: the hidden state
    (n_embd floats), times the residual streams deepseek4 carries between blocks (hc_mult)."""
    return spec.n_embd * act_bytes * max(1, spec.hc_mult)


def host_footprints(mplan: MultiHostPlan, model: PlannedModel,
                    draft: PlannedModel | None) -> tuple[list[ForwardFootprint], DecodeFootprint]:
    """Per host (pipeline order) the footprint of its part of one target pass, and the whole
    model's footprint (its draft pass runs on the last host). A host past the first takes the
    hidden state in host memory (gloo sends CPU tensors); a host before the last hands it
    back there with no output head."""
    if draft is not None and draft.spec.arch in BLOCK_DRAFTERS:
        raise FootprintError("a block drafter (DSpark) across hosts is not forecast: its taps of the trunk's "
                             "hidden states would cross hosts")
    merged: dict[str, str] = {}
    for h in mplan.hosts:
        merged.update(h.plan.tensors)
    fp = plan_footprint(replace(mplan.last, tensors=merged), model, draft)
    parts = []
    for i, h in enumerate(mplan.hosts):
        first, last = i == 0, i == len(mplan.hosts) - 1
        layers = tuple(lay for lay in fp.target.layers if lay.layer in h.blocks)
        parts.append(ForwardFootprint(fp.target.input_device if first else CPU, layers,
                                      fp.target.head_home if last else CPU, fp.target.head_reads if last else ()))
    return parts, fp


def predict_multihost(mplan: MultiHostPlan, model: PlannedModel, draft: PlannedModel | None, *,
                      link: HopLink | None, hardware: HardwareProfile | None = None, max_n: int = DEFAULT_MAX_N,
                      hits: RoutingCounts | None = None) -> tuple[SpecTable, SpecSection | None]:
    """The pipeline's n_max table (``placement.cost.pipeline_table``; ``link`` None: the hops
    cost nothing, the same blocks as if on one box) and, with a draft head, the plan's
    ``speculative`` section, with the link it assumed (``hop_latency_us``, ``hop_gbps``).
    ``hardware``: one profile for every host (each completed with its GPUs' defaults), else
    each host's defaults by GPU name."""
    parts, fp = host_footprints(mplan, model, draft)
    hws = [forecast_hardware(h.plan, complete_hardware(hardware, h.plan) if hardware is not None
                             else default_profile(h.plan).hardware) for h in mplan.hosts]
    acceptance = DEFAULT_MTP
    table = pipeline_table(list(zip(parts, hws)), fp.draft, link, n_embd=fp.n_embd,
                           carried_bytes=carried_bytes(model.spec, fp.act_bytes), act_bytes=fp.act_bytes,
                           acceptance=acceptance, max_n=max_n, hits=hits)
    if fp.draft is None:
        return table, None
    hops = {} if link is None else {"hop_latency_us": link.latency_us, "hop_gbps": link.gbps}
    section: dict[str, Any] = {"type": "mtp", "n_max": table.best.n, "p_min": acceptance.p_min,
                               "source": "predicted", **hops, **table.to_dict(),
                               "profile": SpecProfile(hws[-1], acceptance)}
    return table, SpecSection.of(section)
