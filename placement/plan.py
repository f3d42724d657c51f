"""The Plan: ordered rules + layer layout → a resolved tensor→device map and per-device totals.

``Placement`` is the editable part (what a plan file stores): the ordered override rules,
the ``-ngl``/``-ts`` layout that places every tensor no rule matches, and the same two for a
separate ``--draft`` model (its rules, and one fallback device, like llama.cpp's ``-otd`` /
``-devd``). ``build_plan`` resolves it against the model's tensors — first match wins — and
adds up weights, KV cache and compute buffers per device (``placement.memory``).

The YAML form is in ``placement.plan_file``; the llama.cpp flags in ``placement.llama_args``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from placement.devices import CPU, Device, format_bytes
from placement.errors import PlacementError
from placement.hot_experts import HotExperts, check_hot, hot_footprint, to_json
from placement.layers import LayerLayout, input_layer
from placement.compute import peak_of_group
from placement.memory import (DeviceTotals, Footprint, MemorySettings, add_footprints, device_totals,
                              footprint, forward_steps)
from placement.rules import Rule, assign, check_devices, first_match
from placement.spec_section import SpecSection
from placement.tensors import ModelSpec, TensorInfo



class PlannedModel(Protocol):
    """What the planner needs of a model (``offload.gguf_model.ModelFile`` provides it)."""

    path: str
    spec: ModelSpec
    tensors: Sequence[TensorInfo]


@dataclass(frozen=True)
class Placement:
    rules: tuple[Rule, ...]
    layout: LayerLayout
    draft_rules: tuple[Rule, ...] = ()
    draft_device: str = CPU
    layout_origin: str = "flags"     # who chose the layout: "flags" (-ngl/-ts), "fit", "-ngl 30, the rest by the fit"

    def resolve(self, tensors: Sequence[TensorInfo]) -> dict[str, str]:
        return assign(tensors, self.rules, self.layout.device_of)

    def resolve_draft(self, tensors: Sequence[TensorInfo]) -> dict[str, str]:
        """A draft's tensors no rule matches go to the draft device, but for its input layer
        (``token_embd``, which a sidecar such as deepseek4's MTP GGUF carries): on the CPU, as
        llama.cpp keeps every model's input layer (with ``-devd``/``-ngld`` too)."""
        return assign(tensors, self.draft_rules, lambda t: CPU if input_layer(t) else self.draft_device)

    def placed_by(self, names: Iterable[str], draft: bool = False) -> dict[str, str]:
        """Tensor name → who decided its device: the first matching rule's origin (``-ot``,
        ``--cpu-moe``, ``--n-cpu-moe``, ``fit``, ``plan``), else ``layout_origin`` (a draft
        tensor no rule matches goes to the draft device, which follows the output layer)."""
        rules = self.draft_rules if draft else self.rules
        out = {}
        for name in names:
            rule = first_match(rules, name)
            out[name] = rule.origin if rule is not None else self.layout_origin
        return out

    def check_devices(self, names: Sequence[str]) -> None:
        check_devices(self.rules, names)
        check_devices(self.draft_rules, names)
        for gpu in self.layout.gpus:
            if gpu not in names:
                raise PlacementError(f"the layer layout names {gpu}, which is not among the devices")
        if self.draft_device not in names:
            raise PlacementError(f"the draft device {self.draft_device} is not among the devices")


def kv_blocks(model: PlannedModel, drafting_in_model: bool) -> list[int]:
    """Blocks that keep a KV cache: the trunk, plus the NextN blocks when they draft — of
    those the model holds (one host's part of a model split across hosts holds a range)."""
    spec = model.spec
    n = spec.n_layer if drafting_in_model else spec.n_layer_trunk
    held = {t.layer for t in model.tensors if t.layer is not None}
    return [i for i in range(n) if i in held]


@dataclass(frozen=True)
class Plan:
    model_path: str
    settings: MemorySettings
    devices: tuple[Device, ...]
    targets: Mapping[str, int]          # free-memory target per device (bytes; CPU 0)
    placement: Placement
    tensors: Mapping[str, str]          # model tensor name → device
    totals: tuple[DeviceTotals, ...]
    mode: str                           # "auto-fit", "flags" or "plan file"
    draft_path: str | None = None
    draft_tensors: Mapping[str, str] = field(default_factory=dict)
    drafting: str = "none"              # "in-model NextN", "--draft", or "none"
    notes: tuple[str, ...] = ()
    speculative: SpecSection | None = None  # filled by the cost model (offload plan, offload tune)
    hot_experts: HotExperts = field(default_factory=dict)   # GPU → block → single experts held there

    @property
    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    def overflow(self) -> list[DeviceTotals]:
        return [t for t in self.totals if t.free_after_bytes < 0]

    def check_fits(self) -> None:
        """Refuse a plan that needs more than a device has, with the numbers."""
        for t in self.overflow():
            raise PlacementError(
                f"the plan does not fit: {t.name} needs {format_bytes(t.used_bytes)} "
                f"(weights {format_bytes(t.weights_bytes)} + KV {format_bytes(t.kv_bytes)} + "
                f"compute {format_bytes(t.compute_bytes)}) but has {format_bytes(t.budget_bytes)}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``offload plan --json`` adds ``llama_cpp_args``)."""
        return {
            "model": self.model_path,
            "draft": self.draft_path,
            "drafting": self.drafting,
            "mode": self.mode,
            "context": self.settings.ctx,
            "cache_type": self.settings.cache_type,
            "cache_type_v": self.settings.v_type,
            "ubatch": self.settings.ubatch,
            "parallel": self.settings.parallel,
            "devices": [{
                "name": t.name, "budget_bytes": t.budget_bytes, "target_bytes": t.target_bytes,
                "weights_bytes": t.weights_bytes, "kv_bytes": t.kv_bytes,
                "compute_bytes": t.compute_bytes, "free_after_bytes": t.free_after_bytes,
            } for t in self.totals],
            "layout": {"n_gpu_layers": self.placement.layout.n_gpu_layers,
                       "gpus": list(self.placement.layout.gpus),
                       "tensor_split": list(self.placement.layout.tensor_split)},
            "rules": [r.as_dict() for r in self.placement.rules],
            "draft_placement": {"device": self.placement.draft_device,
                                "rules": [r.as_dict() for r in self.placement.draft_rules]},
            "tensors": dict(self.tensors),
            "draft_tensors": dict(self.draft_tensors),
            "layout_origin": self.placement.layout_origin,
            "placed_by": self.placement.placed_by(self.tensors),
            "draft_placed_by": self.placement.placed_by(self.draft_tensors, draft=True),
            "notes": list(self.notes),
            "speculative": self.speculative.to_dict() if self.speculative is not None else None,
            "hot_experts": to_json(self.hot_experts),
        }


def build_plan(model: PlannedModel, placement: Placement, settings: MemorySettings,
               devices: Sequence[Device], targets: Mapping[str, int], *, mode: str,
               draft: PlannedModel | None = None, notes: Sequence[str] = (),
               hot_experts: HotExperts | None = None) -> Plan:
    """Resolve ``placement`` on the model (and draft) and total the memory per device;
    ``hot_experts`` (``placement.hot_experts``) move single experts of CPU blocks to GPUs."""
    names = [d.name for d in devices]
    placement.check_devices(names)
    in_model = draft is None and model.spec.n_nextn > 0
    tensors = placement.resolve(model.tensors)
    use = footprint(model.spec, list(model.tensors), tensors, settings,
                    kv_blocks=kv_blocks(model, in_model))
    draft_tensors: dict[str, str] = {}
    if draft is not None:
        draft_tensors = placement.resolve_draft(draft.tensors)
        use = add_footprints(use, footprint(draft.spec, list(draft.tensors), draft_tensors, settings,
                                            kv_blocks=sorted({t.layer for t in draft.tensors
                                                              if t.layer is not None})))
    hot = {dev: dict(layers) for dev, layers in (hot_experts or {}).items() if layers}
    if hot:
        check_hot(hot, model.tensors, tensors, names)
        use = hot_footprint(use, hot, model.spec, model.tensors, tensors, settings)
    drafting = "--draft" if draft is not None else ("in-model NextN" if in_model else "none")
    return Plan(model.path, settings, tuple(devices), dict(targets), placement, tensors,
                tuple(device_totals(devices, targets, use)), mode,
                draft_path=draft.path if draft is not None else None,
                draft_tensors=draft_tensors, drafting=drafting, notes=tuple(notes), hot_experts=hot)


def replan(plan: Plan, model: PlannedModel, settings: MemorySettings,
           draft: PlannedModel | None = None) -> Plan:
    """The same placement totalled under other settings (e.g. GPUs backed by host RAM)."""
    return build_plan(model, plan.placement, settings, plan.devices, plan.targets, mode=plan.mode,
                      draft=draft, notes=plan.notes, hot_experts=plan.hot_experts)


def host_footprint(plan: Plan, model: PlannedModel, draft: PlannedModel | None = None) -> Footprint:
    """What the plan puts in host RAM: weights and KV of the CPU and of the GPUs backed by
    host RAM (``settings.host_backed``), and their joint compute — the largest step of one
    forward pass summed over those devices (they peak together, not one after another)."""
    host = {CPU, *plan.settings.host_backed}
    rows = [t for t in plan.totals if t.name in host]
    steps = forward_steps(model.spec, list(model.tensors), plan.tensors, plan.settings,
                          kv_blocks=kv_blocks(model, plan.drafting == "in-model NextN"))
    if draft is not None:
        steps += forward_steps(draft.spec, list(draft.tensors), plan.draft_tensors, plan.settings,
                               kv_blocks=sorted({t.layer for t in draft.tensors if t.layer is not None}))
    return Footprint(sum(t.weights_bytes for t in rows), sum(t.kv_bytes for t in rows),
                     peak_of_group(steps, host))
