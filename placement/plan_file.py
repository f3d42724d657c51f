"""The plan file: a human-editable YAML form of a ``Plan``.

It stores what decides the placement — model and draft paths, context, cache type, ubatch,
devices with budgets and targets, the layer layout, the ordered rules — plus an empty
``speculative:`` section for the cost model, and the per-device totals for the reader
(informational: they are recomputed when the plan is loaded). Loading it back and resolving it
against the same model gives exactly the same tensor→device map.

A plan across hosts (``placement.multihost``) keeps the shared settings at the top and, under
``hosts:``, per host in pipeline order its ``name``, its trunk ``blocks: [first, last]`` and the
one-box keys above (devices, layout, rules, draft_placement, totals). A plan without ``hosts:``
reads as it always did. ``load_hosts_file`` reads a hosts YAML (``offload plan --hosts``): the
``hosts:`` list with each host's name and devices only.

``load_plan_file`` checks the whole file — the type and range of every key, including the
``speculative:`` section (``n_max`` and ``p_min`` through ``placement.draft``, the profile
through ``SpecProfile.from_dict``) — and refuses malformed or inconsistent input with
``<file>:<line>: <reason>``, the reason naming the key: YAML syntax, unknown keys, bad sizes,
unknown devices, bad regexes, a rule or the layout naming a device the plan does not have, a
``-ts`` with the wrong number of values or a value that is not a finite number >= 0.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import math

import yaml

from placement.devices import CPU, Device, format_bytes, normalize_device_name, parse_size, sort_devices
from placement.draft import SPEC_TYPES, check_n_max, check_p_min
from placement.errors import PlacementError
from placement.hosts import Host, check_host_name
from placement.hot_experts import HotExperts, from_json, to_json
from placement.layers import LayerLayout
from placement.memory import MemorySettings
from placement.multihost import HostPlacement, MultiHostPlan
from placement.plan import Placement, Plan
from placement.routing import RoutingCounts
from placement.rules import Rule
from placement.spec_section import SECTION_KEYS, SpecSection

VERSION = 1
HEADER = """\
# offload placement plan (written by `offload plan`).
# Edit it and load it back with `offload plan --placement FILE` or `offload run --placement FILE`.
# rules: first match wins (Python re.search on GGUF tensor names); a tensor no rule matches
# follows the layer layout (llama.cpp -ngl / -ts: the last n_gpu_layers of the block_count + 1
# slots, output layer last, split over the GPUs in proportion to tensor_split).
# origin (of a rule or the layout) says who chose it: your flags (-ot, --cpu-moe, --n-cpu-moe,
# -ngl/-ts: "flags"), the auto-fit ("fit"), or a hand edit ("plan", the default).
# Sizes are bytes (or strings such as 24GiB). `totals` is informational, recomputed on load.
# hot_experts (from `offload plan --routing`): single experts of CPU-resident blocks held on a
# GPU, as GPU -> blk.N -> [expert, ...]; llama.cpp cannot express them (whole tensors only).
# routing (from `offload tune`): the per-expert routing counts it measured, as `offload profile`
# writes them (`offload plan --routing` takes such a file).
"""
# The speculative section's keys (placement.speculative.predict and offload tune write them)
# and what each must be; n_max, p_min and profile have their own checks.
SPEC_NUMBERS = ("predicted_plain_tps", "predicted_speedup", "draft_ms", "measured_speedup", "hop_latency_us",
                "hop_gbps")
SPEC_COUNTS = ("break_even_n_max", "best_n_max", "measured_best_n_max")
SPEC_TEXT = ("type", "source", "routing", "choice")
SPEC_LISTS = ("rows", "measured_rows")
SPEC_KEYS = frozenset(SECTION_KEYS)
TOP_KEYS = {"version", "model", "draft", "context", "cache_type", "cache_type_v", "ubatch", "parallel",
            "devices", "layout", "rules", "draft_placement", "speculative", "totals", "notes", "hot_experts", "routing", "hosts"}
# one box's placement: at the top of a one-host plan, under each host of a plan with ``hosts:``
PLACEMENT_KEYS = ("devices", "layout", "rules", "draft_placement", "totals", "hot_experts")
HOST_KEYS = {"name", "blocks", "devices", "layout", "rules", "draft_placement", "totals"}


@dataclass(frozen=True)
class PlanFile:
    """A loaded plan file, before it is resolved against the model."""

    model_path: str
    draft_path: str | None
    settings: MemorySettings
    devices: tuple[Device, ...]             # () in a plan across hosts: each host has its own
    targets: Mapping[str, int]
    placement: Placement | None             # None in a plan across hosts
    n_layer: int
    speculative: SpecSection | None
    hot_experts: HotExperts | None = None   # GPU → block → experts (checked against the model when resolved)
    routing: RoutingCounts | None = None    # the routing profile ``offload tune`` measured (``routing:``)
    hosts: tuple[HostPlacement, ...] | None = None   # a plan across hosts (``hosts:``), in pipeline order


def _placement_doc(plan: Plan) -> dict[str, Any]:
    """One box's devices, layout, rules and draft placement, as the plan file spells them."""
    layout = plan.placement.layout
    return {
        "devices": [{"name": d.name, "budget": d.budget_bytes, "target": plan.targets.get(d.name, 0)}
                    for d in plan.devices],
        "layout": {"block_count": layout.n_layer, "n_gpu_layers": layout.n_gpu_layers,
                   "tensor_split": [int(x) if float(x).is_integer() else x for x in layout.tensor_split],
                   "origin": plan.placement.layout_origin},
        "rules": [r.as_dict() for r in plan.placement.rules],
        "draft_placement": {"device": plan.placement.draft_device,
                            "rules": [r.as_dict() for r in plan.placement.draft_rules]},
    }


def _totals_doc(plan: Plan) -> dict[str, Any]:
    return {t.name: {"weights": format_bytes(t.weights_bytes), "kv_cache": format_bytes(t.kv_bytes),
                     "compute": format_bytes(t.compute_bytes), "free_after": format_bytes(t.free_after_bytes)}
            for t in plan.totals}


def _settings_doc(path: str, draft: str | None, s: MemorySettings) -> dict[str, Any]:
    return {"version": VERSION, "model": path, "draft": draft, "context": s.ctx, "cache_type": s.cache_type,
            **({"cache_type_v": s.cache_type_v} if s.cache_type_v else {}), "ubatch": s.ubatch,
            **({"parallel": s.parallel} if s.parallel > 1 else {})}


def _dump(doc: dict[str, Any]) -> str:
    return HEADER + yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=200, allow_unicode=True)


def plan_to_yaml(plan: Plan, *, routing: RoutingCounts | None = None) -> str:
    """The plan as YAML; ``routing`` (``offload tune``'s measured profile) goes in as ``routing:``."""
    return _dump({
        **_settings_doc(plan.model_path, plan.draft_path, plan.settings),
        **_placement_doc(plan),
        "speculative": (plan.speculative.to_dict() or None) if plan.speculative is not None else None,
        **({"hot_experts": to_json(plan.hot_experts)} if plan.hot_experts else {}),
        **({"routing": routing.to_dict()} if routing is not None else {}),
        "notes": list(plan.notes),
        "totals": _totals_doc(plan),
    })


def multihost_plan_to_yaml(mplan: MultiHostPlan) -> str:
    """A plan across hosts as YAML: the shared settings, then per host (pipeline order) its
    blocks and its placement in the one-box form."""
    return _dump({
        **_settings_doc(mplan.model_path, mplan.draft_path, mplan.settings),
        "hosts": [{"name": h.name, "blocks": [h.blocks.start, h.blocks.stop - 1], **_placement_doc(h.plan),
                   "totals": _totals_doc(h.plan)} for h in mplan.hosts],
        "speculative": (mplan.speculative.to_dict() or None) if mplan.speculative is not None else None,
        "notes": list(mplan.notes),
    })


class YamlDoc:
    """The parsed document and its node tree, to report ``file:line`` for any path."""

    def __init__(self, text: str, source: str):
        self.source = source
        try:
            loader = yaml.SafeLoader(text)
            try:
                self.node = loader.get_single_node()
                self.data = loader.construct_document(self.node) if self.node is not None else None
            finally:
                loader.dispose()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark else 1
            raise PlacementError(f"{source}:{line}: malformed YAML: {exc.problem or exc.context}") from None
        except yaml.YAMLError as exc:
            raise PlacementError(f"{source}: malformed YAML: {exc}") from None

    def line(self, *path: str | int) -> int:
        node = self.node
        for step in path:
            if isinstance(node, yaml.MappingNode):
                node = next((v for k, v in node.value if k.value == step), node)
            elif isinstance(node, yaml.SequenceNode) and isinstance(step, int) and step < len(node.value):
                node = node.value[step]
        return node.start_mark.line + 1 if node is not None else 1

    def fail(self, path: tuple, reason: str):
        raise PlacementError(f"{self.source}:{self.line(*path)}: {reason}")


def _where(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _get(doc: YamlDoc, mapping: Any, path: tuple, key: str, kinds: tuple[type, ...], *, required=True, default=None):
    if not isinstance(mapping, dict):
        doc.fail(path, f"{_where(path) or 'the plan'} must be a mapping")
    if key not in mapping:
        if required:
            doc.fail(path, f"{_where(path + (key,))} is missing")
        return default
    value = mapping[key]
    if value is None and not required:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(k.__name__ for k in kinds)
        doc.fail(path + (key,), f"{_where(path + (key,))} must be {names}, got {value!r}")
    return value


def _size(doc: YamlDoc, mapping: dict, path: tuple, key: str, *, default: int | None = None) -> int:
    value = _get(doc, mapping, path, key, (int, str), required=default is None, default=default)
    try:
        n = parse_size(value, what=_where(path + (key,))) if isinstance(value, str) else value
    except PlacementError as exc:
        doc.fail(path + (key,), str(exc))
    if n < 0:
        doc.fail(path + (key,), f"{_where(path + (key,))} must be >= 0")
    return n


def _positive(doc: YamlDoc, mapping: Any, key: str, path: tuple = (), *, default: int | None = None) -> int:
    value = _get(doc, mapping, path, key, (int,), required=default is None, default=default)
    if value < 1:
        doc.fail(path + (key,), f"{_where(path + (key,))} must be >= 1, got {value}")
    return value


def _speculative(doc: YamlDoc, spec: dict | None) -> SpecSection | None:
    """The ``speculative:`` section, every key checked (see SPEC_KEYS)."""
    if spec is None:
        return None
    at = ("speculative",)
    for key in spec:
        if key not in SPEC_KEYS:
            doc.fail(at + (key,), f"speculative: unknown key {key!r} (expected {', '.join(sorted(SPEC_KEYS))})")
    for key, check in (("n_max", check_n_max), ("p_min", check_p_min)):
        if key in spec:
            try:
                check(spec[key], f"speculative.{key}")
            except PlacementError as exc:
                doc.fail(at + (key,), str(exc))
    for key in SPEC_COUNTS:
        if spec.get(key) is not None:
            try:
                check_n_max(spec[key], f"speculative.{key}")
            except PlacementError as exc:
                doc.fail(at + (key,), str(exc))
    for key in SPEC_NUMBERS:
        v = spec.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v < 0):
            doc.fail(at + (key,), f"speculative.{key} must be a finite number >= 0, got {v!r}")
    if spec.get("hop_gbps") == 0:
        doc.fail(at + ("hop_gbps",), "speculative.hop_gbps must be a number > 0, got 0")
    for key, kind in ((k, str) for k in SPEC_TEXT):
        if spec.get(key) is not None and not isinstance(spec[key], kind):
            doc.fail(at + (key,), f"speculative.{key} must be a string, got {spec[key]!r}")
    if spec.get("type", "mtp") not in SPEC_TYPES:
        doc.fail(at + ("type",), f"speculative.type must be one of {', '.join(SPEC_TYPES)}, got {spec['type']!r}")
    if spec.get("runner_up") is not None and not isinstance(spec["runner_up"], dict):
        doc.fail(at + ("runner_up",), f"speculative.runner_up must be a mapping, got {spec['runner_up']!r}")
    for key in SPEC_LISTS:
        v = spec.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(r, dict) for r in v)):
            doc.fail(at + (key,), f"speculative.{key} must be a list of mappings")
    if spec.get("tune") is not None and not isinstance(spec["tune"], dict):
        doc.fail(at + ("tune",), f"speculative.tune must be a mapping, got {spec['tune']!r}")
    try:
        return SpecSection.from_dict(spec)      # the keys are checked: only the profile can fail here
    except (ValueError, TypeError, KeyError, AttributeError) as exc:   # ProfileError, or a wrong type inside
        doc.fail(at + ("profile",), f"speculative.profile: {exc}")


def _rules(doc: YamlDoc, seq: Any, path: tuple, devices: list[str]) -> tuple[Rule, ...]:
    if seq is None:
        return ()
    if not isinstance(seq, list):
        doc.fail(path, f"{_where(path)} must be a list of {{pattern, device}}")
    rules = []
    for i, item in enumerate(seq):
        p = path + (i,)
        pattern = _get(doc, item, p, "pattern", (str,))
        try:
            device = normalize_device_name(_get(doc, item, p, "device", (str,)))
            rule = Rule(pattern, device, _get(doc, item, p, "origin", (str,), required=False, default="plan"))
        except PlacementError as exc:
            doc.fail(p, f"{_where(p)}: {exc}")
        if rule.device not in devices:
            doc.fail(p + ("device",), f"{_where(p)}: device {rule.device} is not among the plan's "
                                      f"devices ({', '.join(devices)})")
        unknown = set(item) - {"pattern", "device", "origin"}
        if unknown:
            doc.fail(p, f"{_where(p)}: unknown key {sorted(unknown)[0]!r}")
        rules.append(rule)
    return tuple(rules)


def _devices(doc: YamlDoc, seq: list, path: tuple) -> tuple[list[Device], dict[str, int]]:
    """A ``devices:`` list of {name, budget, target} → devices (GPUs by index, CPU last) and targets."""
    devices, targets = [], {}
    for i, item in enumerate(seq):
        p = path + (i,)
        try:
            name = normalize_device_name(_get(doc, item, p, "name", (str,)))
        except PlacementError as exc:
            doc.fail(p + ("name",), f"{_where(p)}: {exc}")
        if name in targets:
            doc.fail(p, f"{_where(p)}: device {name} is listed twice")
        devices.append(Device(name, _size(doc, item, p, "budget"), "from the plan file"))
        targets[name] = _size(doc, item, p, "target", default=0)
        unknown = set(item) - {"name", "budget", "target"}
        if unknown:
            doc.fail(p, f"{_where(p)}: unknown key {sorted(unknown)[0]!r}")
    if CPU not in targets:
        doc.fail(path, f"{_where(path)}: the {'host' if len(path) > 1 else 'plan'} needs a CPU entry")
    return sort_devices(devices), targets


def _placement(doc: YamlDoc, top: dict, at: tuple) -> tuple[tuple[Device, ...], dict[str, int], Placement, int]:
    """One box's devices, layout, rules and draft placement (the plan's, or a host's under
    ``hosts:``; ``at`` is where they sit) → (devices, targets, placement, block_count)."""
    devices, targets = _devices(doc, _get(doc, top, at, "devices", (list,)), at + ("devices",))
    names = [d.name for d in devices]
    gpus = tuple(d.name for d in devices if d.is_gpu)
    lat = at + ("layout",)
    lay = _get(doc, top, at, "layout", (dict,))
    n_layer = _positive(doc, lay, "block_count", lat)
    ngl = _get(doc, lay, lat, "n_gpu_layers", (int,))
    if not 0 <= ngl <= n_layer + 1:
        doc.fail(lat + ("n_gpu_layers",), f"{_where(lat + ('n_gpu_layers',))} must be 0 .. block_count + 1 "
                                          f"({n_layer + 1}), got {ngl}")
    ts = _get(doc, lay, lat, "tensor_split", (list,))
    layout_origin = _get(doc, lay, lat, "origin", (str,), required=False, default="plan")
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
               for x in ts):
        doc.fail(lat + ("tensor_split",), f"{_where(lat + ('tensor_split',))} must be a list of finite numbers "
                                          f">= 0, got {ts!r}")
    unknown = set(lay) - {"block_count", "n_gpu_layers", "tensor_split", "origin"}
    if unknown:
        doc.fail(lat, f"{_where(lat)}: unknown key {sorted(map(str, unknown))[0]!r}")
    try:
        layout = LayerLayout(n_layer, gpus, ngl, tuple(float(x) for x in ts))
    except PlacementError as exc:
        doc.fail(lat, f"{_where(lat)}: {exc} ({', '.join(gpus) or 'no GPUs'})")

    rules = _rules(doc, top.get("rules"), at + ("rules",), names)
    dat = at + ("draft_placement",)
    dp = _get(doc, top, at, "draft_placement", (dict,), required=False, default={})
    try:
        draft_device = normalize_device_name(_get(doc, dp, dat, "device", (str,), required=False, default=CPU))
    except PlacementError as exc:
        doc.fail(dat + ("device",), f"{_where(dat + ('device',))}: {exc}")
    if draft_device not in names:
        doc.fail(dat + ("device",), f"{_where(dat + ('device',))} {draft_device} is not among "
                                    f"the plan's devices ({', '.join(names)})")
    draft_rules = _rules(doc, dp.get("rules"), dat + ("rules",), names)
    unknown = set(dp) - {"device", "rules"}
    if unknown:
        doc.fail(dat, f"{_where(dat)}: unknown key {sorted(map(str, unknown))[0]!r}")
    return (tuple(devices), targets, Placement(rules, layout, draft_rules, draft_device, layout_origin), n_layer)


def _blocks(doc: YamlDoc, item: dict, path: tuple) -> range:
    """A host's ``blocks: [first, last]`` (trunk blocks, both included)."""
    value = _get(doc, item, path, "blocks", (list,))
    if len(value) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in value) \
            or value[0] > value[1]:
        doc.fail(path + ("blocks",), f"{_where(path + ('blocks',))} must be [first, last] block numbers, "
                                     f"first <= last, got {value!r}")
    return range(value[0], value[1] + 1)


def _host_name(doc: YamlDoc, item: Any, p: tuple, seen: set[str]) -> str:
    try:
        name = check_host_name(_get(doc, item, p, "name", (str,)), _where(p + ("name",)))
    except PlacementError as exc:
        doc.fail(p + ("name",), str(exc))
    if name in seen:
        doc.fail(p + ("name",), f"{_where(p)}: host {name} is given twice")
    seen.add(name)
    return name


def _hosts(doc: YamlDoc, seq: list, path: tuple) -> list[tuple[HostPlacement, int]]:
    """A plan's ``hosts:`` → (each host's placement, its layout's block_count), in pipeline order."""
    if not seq:
        doc.fail(path, f"{_where(path)} must list at least one host")
    out, seen = [], set()
    for i, item in enumerate(seq):
        p = path + (i,)
        name = _host_name(doc, item, p, seen)
        blocks = _blocks(doc, item, p)
        devices, targets, placement, n_layer = _placement(doc, item, p)
        if out and n_layer != out[0][1]:
            doc.fail(p + ("layout", "block_count"), f"{_where(p + ('layout', 'block_count'))} {n_layer} is not "
                                                    f"the first host's {out[0][1]}")
        unknown = set(item) - HOST_KEYS
        if unknown:
            doc.fail(p, f"{_where(p)}: unknown key {sorted(map(str, unknown))[0]!r}")
        out.append((HostPlacement(name, blocks, devices, targets, placement), n_layer))
    return out


def load_hosts_file(text: str, source: str) -> tuple[Host, ...]:
    """A hosts YAML (``offload plan --hosts hosts.yaml``)::

        hosts:
        - name: a
          devices: [{name: CUDA0, budget: 24GiB, target: 1GiB}, {name: CPU, budget: 256GiB}]
        - name: b
          devices: [{name: CPU, budget: 512GiB}]

    the plan file's ``hosts:`` without the placement; a GPU's ``target`` is kept free there
    (over ``--fit-target``). Malformed → ``<file>:<line>: <reason>``."""
    doc = YamlDoc(text, source)
    top = doc.data
    if not isinstance(top, dict) or set(top) != {"hosts"}:
        raise PlacementError(f"{source}:1: a hosts file is a YAML mapping with one key, hosts: (a list of "
                             "{name, devices})")
    seq = _get(doc, top, (), "hosts", (list,))
    if not seq:
        doc.fail(("hosts",), "hosts must list at least one host")
    hosts, seen = [], set()
    for i, item in enumerate(seq):
        p = ("hosts", i)
        name = _host_name(doc, item, p, seen)
        devices, targets = _devices(doc, _get(doc, item, p, "devices", (list,)), p + ("devices",))
        if targets.get(CPU):
            doc.fail(p + ("devices",), f"{_where(p + ('devices',))}: a CPU target is not used; lower the CPU's "
                                       "budget to keep RAM free")
        unknown = set(item) - {"name", "devices"}
        if unknown:
            doc.fail(p, f"{_where(p)}: unknown key {sorted(map(str, unknown))[0]!r}")
        hosts.append(Host(name, tuple(devices), {g: t for g, t in targets.items() if g != CPU}))
    return tuple(hosts)


def load_plan_file(text: str, source: str) -> PlanFile:
    """Parse and check a plan file (see the module docstring)."""
    doc = YamlDoc(text, source)
    top = doc.data
    if not isinstance(top, dict):
        raise PlacementError(f"{source}:1: a plan file must be a YAML mapping")
    for key in top:
        if key not in TOP_KEYS:
            doc.fail((key,), f"unknown key {key!r} (expected {', '.join(sorted(TOP_KEYS))})")
    version = _get(doc, top, (), "version", (int,))
    if version != VERSION:
        doc.fail(("version",), f"unsupported plan version {version} (this offload reads {VERSION})")
    model = _get(doc, top, (), "model", (str,))
    draft = _get(doc, top, (), "draft", (str,), required=False)
    if not model:
        doc.fail(("model",), "model must name the GGUF file the plan is for")
    ctx = _positive(doc, top, "context")
    ubatch = _positive(doc, top, "ubatch", default=512)
    parallel = _positive(doc, top, "parallel", default=1)
    cache = _get(doc, top, (), "cache_type", (str,), required=False, default="f16")
    cache_v = _get(doc, top, (), "cache_type_v", (str,), required=False)
    try:
        settings = MemorySettings(ctx, cache, ubatch, cache_type_v=None if cache_v == cache else cache_v,
                                  parallel=parallel)
    except PlacementError as exc:
        doc.fail(("cache_type_v" if cache_v is not None else "cache_type",), f"cache_type: {exc}")

    hosts = None
    if "hosts" in top:
        clash = sorted(k for k in top if k in PLACEMENT_KEYS)
        if clash:
            doc.fail((clash[0],), f"{clash[0]}: a plan with hosts: keeps each host's {clash[0]} under that host")
        hosts = _hosts(doc, _get(doc, top, (), "hosts", (list,)), ("hosts",))
        devices, targets, placement, n_layer, hot = (), {}, None, hosts[0][1], None
        hosts = tuple(h for h, _ in hosts)
    else:
        devices, targets, placement, n_layer = _placement(doc, top, ())
        gpus = tuple(d.name for d in devices if d.is_gpu)
        try:
            hot = from_json(top.get("hot_experts"), "hot_experts")
        except PlacementError as exc:
            doc.fail(("hot_experts",), str(exc))
        for dev in hot:
            if dev not in gpus:
                doc.fail(("hot_experts", dev), f"hot_experts: {dev} is not one of the plan's GPUs "
                                               f"({', '.join(gpus) or 'none'})")
    notes = _get(doc, top, (), "notes", (list,), required=False, default=[])
    if not all(isinstance(n, str) for n in notes):
        doc.fail(("notes",), "notes must be a list of strings")
    _get(doc, top, (), "totals", (dict,), required=False)      # informational: recomputed on load
    spec = _speculative(doc, _get(doc, top, (), "speculative", (dict,), required=False))
    routing = None
    if top.get("routing") is not None:
        try:
            routing = RoutingCounts.from_dict(top["routing"], "routing")
        except PlacementError as exc:
            doc.fail(("routing",), str(exc))
    return PlanFile(model, draft, settings, tuple(devices), targets, placement, n_layer, spec, hot, routing, hosts)
