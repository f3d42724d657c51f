"""The planning API: model inventory + devices + options → ``Plan``.

``offload plan`` / ``run`` / ``tune`` / ``bench`` turn their flags into ``PlanOptions``
(``PlanOptions.from_flags``) and ``offload.load`` its keywords the same way; both call
``make_plan``. Nothing below the command line sees argparse.

``fit`` decides what the placement flags (``-ot``, ``--cpu-moe``, ``--n-cpu-moe``, ``-ngl``,
``-ts``) mean:

* ``auto`` — auto-fit when none is given, else the flags alone (llama.cpp's ``--fit``);
* ``on``   — the flags are hard constraints, applied first with their first-match semantics;
  the auto-fit places every tensor they leave open (``placement.fit.Pins``);
* ``off``  — the flags alone (none given: llama.cpp's defaults, every slot on the GPUs split
  by free memory); the plan is refused if it does not fit.

``routing`` (a ``placement.routing.RoutingCounts``, ``--routing routing.yaml``): after the
whole-tensor placement, the room left above each GPU's target is filled with the hottest
single experts of CPU-resident blocks (``placement.hot_experts``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from placement.devices import Device, parse_size
from placement.errors import PlacementError
from placement.fit import Pins, fit
from placement.hot_experts import choose_hot_experts, describe
from placement.layers import layout_from_flags
from placement.memory import MemorySettings
from placement.plan import Placement, Plan, PlannedModel, build_plan
from placement.routing import RoutingCounts
from placement.rules import Rule, cpu_moe_rules, n_cpu_moe_rules, parse_override

DEFAULT_FIT_TARGET_MIB = 1024
DEFAULT_FIT_CTX = 4096
DEFAULT_UBATCH = 512
FIT_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class PlanOptions:
    """Everything besides the model and the devices that decides a plan (the planner's flags)."""

    rules: tuple[Rule, ...] = ()                    # -ot, in order
    cpu_moe: bool = False                           # --cpu-moe
    n_cpu_moe: int | None = None                    # --n-cpu-moe N
    n_gpu_layers: int | None = None                 # -ngl N; -1 = all
    tensor_split: tuple[float, ...] | None = None   # -ts
    fit: str = "auto"                               # --fit auto|on|off (module docstring)
    fit_target: tuple[int, ...] = (DEFAULT_FIT_TARGET_MIB << 20,)   # bytes kept free: one for all GPUs or one each
    fit_ctx: int = DEFAULT_FIT_CTX                  # the fit may shrink the context to this when ctx is None
    ctx: int | None = None                          # None: the model's training context
    cache_type: str | None = None                   # --cache-type: K and V (default f16)
    cache_type_k: str | None = None                 # -ctk / --cache-type-k (llama.cpp's): K, over --cache-type
    cache_type_v: str | None = None                 # -ctv / --cache-type-v: V, over --cache-type
    ubatch: int = DEFAULT_UBATCH
    routing: RoutingCounts | None = None            # --routing: fill the GPUs' room with hot experts
    parallel: int = 1                               # -np: sequences at once, a KV cache each

    def __post_init__(self) -> None:
        if self.fit not in FIT_MODES:
            raise PlacementError(f"--fit must be one of {', '.join(FIT_MODES)}, got {self.fit!r}")
        if self.n_gpu_layers is not None and self.n_gpu_layers < -1:
            raise PlacementError(f"-ngl must be >= 0 or -1 (all), got {self.n_gpu_layers}")
        if self.tensor_split is not None and not all(math.isfinite(x) for x in self.tensor_split):
            raise PlacementError(f"-ts: {list(self.tensor_split)} are not all finite numbers")
        if self.fit_ctx < 1:
            raise PlacementError(f"--fit-ctx must be >= 1, got {self.fit_ctx}")
        if any(t < 0 for t in self.fit_target):
            raise PlacementError(f"--fit-target must be >= 0, got {list(self.fit_target)}")

    @classmethod
    def from_flags(cls, **flags) -> PlanOptions:
        """The planner's flags as the command line spells them, by argparse ``dest`` name (None or
        False = not given): ``override_tensor`` a list of ``-ot`` values (or one), ``tensor_split``
        "3,1" or numbers, ``fit_target`` "1024,2048" or 1024 or [1024, 2048] (MiB, or sizes like "2GiB");
        ``cpu_moe``, ``n_cpu_moe``, ``n_gpu_layers``, ``fit``, ``fit_ctx``, ``ctx``,
        ``cache_type`` (``cache_type_k``, ``cache_type_v``), ``ubatch``, ``parallel`` as typed values;
        ``routing`` a routing profile's path (or a ``RoutingCounts``)."""
        unknown = sorted(set(flags) - set(FLAG_NAMES))
        if unknown:
            raise PlacementError(f"unknown planning option {unknown[0]!r} (options: {', '.join(FLAG_NAMES)})")
        given = {k: v for k, v in flags.items() if v is not None and v is not False}
        ot = given.pop("override_tensor", [])
        given["rules"] = tuple(r for value in ([ot] if isinstance(ot, str) else ot) for r in parse_override(value))
        if "tensor_split" in given:
            given["tensor_split"] = _numbers(given["tensor_split"])
        if "fit_target" in given:
            given["fit_target"] = _sizes(given["fit_target"])
        if isinstance(given.get("routing"), str):
            given["routing"] = RoutingCounts.from_file(given["routing"])
        return cls(**given)

    def flags_given(self) -> list[str]:
        """The placement flags set, as the command line names them."""
        return [flag for flag, on in (("-ot", bool(self.rules)), ("--cpu-moe", self.cpu_moe),
                                      ("--n-cpu-moe", self.n_cpu_moe is not None),
                                      ("-ngl", self.n_gpu_layers is not None),
                                      ("-ts", self.tensor_split is not None)) if on]

    def cache_types(self) -> tuple[str, str | None]:
        """(K type, V type or None when it is K's), as llama.cpp reads -ctk / -ctv: each
        defaults to f16 on its own; ``--cache-type`` sets both."""
        k = (self.cache_type_k or self.cache_type or "f16").lower()
        v = (self.cache_type_v or self.cache_type or "f16").lower()
        return k, (None if v == k else v)

    def user_rules(self) -> tuple[Rule, ...]:
        """-ot first (so it wins), then --cpu-moe, then --n-cpu-moe, as llama.cpp orders them."""
        return (self.rules + (tuple(cpu_moe_rules()) if self.cpu_moe else ())
                + (tuple(n_cpu_moe_rules(self.n_cpu_moe)) if self.n_cpu_moe is not None else ()))


FLAG_NAMES = ("override_tensor", "cpu_moe", "n_cpu_moe", "n_gpu_layers", "tensor_split", "fit", "fit_target",
              "fit_ctx", "ctx", "cache_type", "cache_type_k", "cache_type_v", "ubatch", "routing", "parallel")


def _numbers(value) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in (value.split(",") if isinstance(value, str) else value))
    except (TypeError, ValueError):
        out = ()
    if not out or not all(math.isfinite(x) for x in out):
        raise PlacementError(f"-ts: {value!r} is not a comma list of numbers")
    return out


def _sizes(value) -> tuple[int, ...]:
    """--fit-target as written: "1024,2048" or 1024 or [1024, 2048] (MiB, as llama.cpp), or sizes like "2GiB"."""
    items = value.split(",") if isinstance(value, str) else ([value] if isinstance(value, int) else list(value))
    return tuple(parse_size(str(v), what="--fit-target") for v in items)


def gpu_targets(fit_target: Sequence[int], devices: Sequence[Device]) -> dict[str, int]:
    """GPU name → bytes to keep free: one value for every GPU, or one per GPU."""
    gpus = [d.name for d in devices if d.is_gpu]
    values = list(fit_target) * len(gpus) if len(fit_target) == 1 else list(fit_target)
    if len(values) != len(gpus):
        raise PlacementError(f"--fit-target has {len(fit_target)} values for {len(gpus)} GPUs "
                             f"({', '.join(gpus) or 'none'})")
    return dict(zip(gpus, values))


def make_plan(model: PlannedModel, devices: Sequence[Device], options: PlanOptions = PlanOptions(), *,
              draft: PlannedModel | None = None) -> Plan:
    """The plan for ``model`` (and a separate ``draft`` head) on ``devices`` (module docstring)."""
    plan = _whole_tensor_plan(model, devices, options, draft)
    if options.routing is None:
        return plan
    return add_hot_experts(plan, model, options.routing, draft)


def add_hot_experts(plan: Plan, model: PlannedModel, routing: RoutingCounts, draft: PlannedModel | None = None) -> Plan:
    """``plan`` with the room above each GPU's target filled by hot experts (``placement.hot_experts``)."""
    spec = model.spec
    routing.check_model(spec.n_expert, spec.n_expert_used,
                        [i for i in range(spec.n_layer) if spec.is_moe_layer(i)], model.path)
    rooms = {t.name: t.above_target_bytes for t in plan.totals if t.name != "CPU"}
    hot = choose_hot_experts(spec=spec, tensors=model.tensors, tensor_map=plan.tensors, settings=plan.settings,
                             rooms=rooms, computes={t.name: t.compute_bytes for t in plan.totals}, counts=routing)
    note = (f"hot experts ({routing.source or 'routing profile'}): {describe(hot, model.tensors)}" if hot else
            "routing profile given, but no GPU has room for a single expert of a CPU-resident block")
    out = build_plan(model, plan.placement, plan.settings, plan.devices, plan.targets, mode=plan.mode,
                     draft=draft, notes=plan.notes + (note,), hot_experts=hot)
    out.check_fits()
    return replace(out, speculative=plan.speculative)


def _whole_tensor_plan(model: PlannedModel, devices: Sequence[Device], options: PlanOptions,
                       draft: PlannedModel | None) -> Plan:
    n_layer = model.spec.n_layer
    targets = gpu_targets(options.fit_target, devices)
    settings = MemorySettings(model.spec.n_ctx_train if options.ctx is None else options.ctx,
                              options.cache_types()[0], options.ubatch, cache_type_v=options.cache_types()[1],
                              parallel=options.parallel)
    rules = options.user_rules()
    gpus = [d for d in devices if d.is_gpu]
    layout = layout_from_flags(n_layer, [g.name for g in gpus], options.n_gpu_layers, options.tensor_split,
                               [float(g.budget_bytes) for g in gpus])     # llama.cpp: split by free memory
    if options.fit == "off" or (options.fit == "auto" and options.flags_given()):
        draft_device = layout.slot_device(n_layer)     # the draft head sits with the output layer
        placement = Placement(rules, layout, rules if draft is not None else (), draft_device)
        plan = build_plan(model, placement, settings, devices, targets, mode="flags", draft=draft)
        plan.check_fits()
        return plan
    pins = Pins(rules, options.n_gpu_layers,
                layout.tensor_split if options.tensor_split is not None else None)
    floor = None if options.ctx is not None else options.fit_ctx
    return fit(model, devices, targets, settings, ctx_floor=floor, draft=draft, pins=pins)

