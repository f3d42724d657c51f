"""A plan across hosts: one contiguous range of blocks per host, each host planned by the
same planner as one box (``placement.planner.make_plan``: rules, ``--fit``, targets).

The split (``split_blocks``): the trunk's blocks are cut into one range per host, in pipeline
order, in proportion to what each host can hold (its devices' budgets less their targets). A
block costs its weights and its KV cache at the plan's context; the first host also carries
the input layer (``token_embd``), the last the output layer, the NextN blocks (with a second
``token_embd`` when the NextN head embeds with it) and a ``--draft`` head, so the cut counts
them where they sit. A block goes to the host its
midpoint falls in (as ``placement.fit`` cuts GPU slots). When the model's weights and KV
exceed all hosts together, the plan is refused before any host is planned.

Each host then plans its ``Shard`` — the model's tensors of its blocks (plus the input layer
on the first host, the output layer, NextN blocks and draft on the last) — on its own
devices. A shard keeps the model's ``ModelSpec``: the layer layout still has ``block_count +
1`` slots, of which those the host does not hold are empty (they cost nothing). Hosts must
agree on the context: when the fit shrinks it on one host, every host is planned again at
the smallest.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from placement.devices import Device, format_bytes
from placement.errors import PlacementError
from placement.layers import input_layer, output_slot_member
from placement.hosts import Host
from placement.memory import MemorySettings, kv_bytes, tied_output
from placement.plan import Placement, Plan, PlannedModel, build_plan
from placement.planner import PlanOptions, make_plan
from placement.spec_section import SpecSection
from placement.tensors import ModelSpec, TensorInfo


@dataclass(frozen=True)
class Shard:
    """The part of a model one host holds, as the planner sees a model (``PlannedModel``)."""

    path: str
    spec: ModelSpec
    tensors: tuple[TensorInfo, ...]


def nextn_embedding(model: PlannedModel) -> TensorInfo | None:
    """``token_embd`` when the model's NextN head embeds its tokens with it (no
    ``nextn.embed_tokens`` of its own, as GLM-4.5's files): the last host drafts, so it holds
    a second copy (the head embeds every drafted token; fetching rows from the first host
    would cost a round trip per draft)."""
    if not model.spec.n_nextn or any(t.name.endswith(".nextn.embed_tokens.weight") for t in model.tensors):
        return None
    return next((t for t in model.tensors if t.name == "token_embd.weight"), None)


def shard(model: PlannedModel, blocks: range, *, first: bool, last: bool) -> Shard:
    """``model``'s tensors of trunk ``blocks``; the first host adds the input layer, the last
    the output layer and the NextN blocks (and ``token_embd`` again when the output is tied
    to it — the head's matrix — or the NextN head embeds with it: ``nextn_embedding``)."""
    spec = model.spec
    tied = last and (tied_output(model.tensors) is not None or nextn_embedding(model) is not None)

    def held(t: TensorInfo) -> bool:
        if t.layer is not None:
            return t.layer in blocks or (last and spec.is_nextn_layer(t.layer))
        return (first and input_layer(t)) or (last and (output_slot_member(t) or
                                                        (tied and t.name == "token_embd.weight")))
    return Shard(model.path, spec, tuple(t for t in model.tensors if held(t)))


def _block_costs(model: PlannedModel, settings: MemorySettings, draft: PlannedModel | None) -> tuple[int, list[int], int]:
    """(input layer, each trunk block, output side) in bytes: weights + KV at ``settings``."""
    spec = model.spec
    trunk = [0] * spec.n_layer_trunk
    head = tail = 0
    for t in model.tensors:
        if t.layer is not None and not spec.is_nextn_layer(t.layer):
            trunk[t.layer] += t.n_bytes
        elif t.layer is None and input_layer(t):
            head += t.n_bytes
        else:
            tail += t.n_bytes
    for i in range(spec.n_layer_trunk):
        trunk[i] += kv_bytes(spec, i, settings)
    tail += sum(kv_bytes(spec, i, settings) for i in range(spec.n_layer_trunk, spec.n_layer))
    if draft is not None:
        tail += sum(t.n_bytes for t in draft.tensors)
    second = nextn_embedding(model)
    if second is not None and tied_output(model.tensors) is None:
        tail += second.n_bytes             # the last host's copy for the NextN head
    return head, trunk, tail


def split_blocks(model: PlannedModel, rooms: Sequence[int], names: Sequence[str], settings: MemorySettings,
                 draft: PlannedModel | None = None) -> tuple[range, ...]:
    """Contiguous trunk-block ranges, one per host (module docstring); ``rooms``: bytes each
    host can hold. Refused when the whole does not fit or a host's share is under one block."""
    head, trunk, tail = _block_costs(model, settings, draft)
    need = head + sum(trunk) + tail
    if need > sum(rooms):
        held = ", ".join(f"{n} {format_bytes(r)}" for n, r in zip(names, rooms))
        raise PlacementError(f"cannot fit across the hosts: the model needs {format_bytes(need)} (weights and KV "
                             f"at context {settings.ctx}) but the hosts hold {format_bytes(sum(rooms))} "
                             f"({held})")
    if len(rooms) > len(trunk):
        raise PlacementError(f"{len(rooms)} hosts for {len(trunk)} blocks: give at most one host per block")
    cum, acc = [], 0
    for r in rooms:
        acc += r
        cum.append(acc / sum(rooms))
    owner, before = [], head
    for cost in trunk:              # a block goes where its midpoint falls
        mid = (before + cost / 2) / need
        owner.append(next((i for i, x in enumerate(cum) if x > mid), len(rooms) - 1))
        before += cost
    out = []
    for i, name in enumerate(names):
        mine = [b for b, o in enumerate(owner) if o == i]
        if not mine:
            raise PlacementError(f"host {name}'s share ({format_bytes(rooms[i])} of "
                                 f"{format_bytes(sum(rooms))}) is less than one block; leave it out of --hosts")
        out.append(range(mine[0], mine[-1] + 1))
    return tuple(out)


@dataclass(frozen=True)
class HostPlan:
    """One host's part of a multi-host plan: its trunk blocks and its plan (the last host also
    holds the NextN blocks, the output layer and the draft head)."""

    name: str
    blocks: range
    plan: Plan


def host_label(name: str, blocks: range) -> str:
    """How errors name a host: ``host b (blocks 30-60)``."""
    return f"host {name} (blocks {blocks.start}-{blocks.stop - 1})"


@dataclass(frozen=True)
class MultiHostPlan:
    """Hosts in pipeline order, each with its plan; one settings (context, cache, ubatch) for all."""

    model_path: str
    hosts: tuple[HostPlan, ...]
    notes: tuple[str, ...] = ()
    speculative: SpecSection | None = None

    @property
    def settings(self) -> MemorySettings:
        return self.hosts[0].plan.settings

    @property
    def last(self) -> Plan:
        return self.hosts[-1].plan

    @property
    def draft_path(self) -> str | None:
        return self.last.draft_path

    @property
    def drafting(self) -> str:
        return self.last.drafting

    @property
    def host_names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: per host its blocks and its plan's JSON form."""
        return {"model": self.model_path, "draft": self.draft_path, "drafting": self.drafting,
                "context": self.settings.ctx, "cache_type": self.settings.cache_type,
                "cache_type_v": self.settings.v_type, "ubatch": self.settings.ubatch,
                "hosts": [{"name": h.name, "blocks": [h.blocks.start, h.blocks.stop - 1], **h.plan.to_dict()}
                          for h in self.hosts],
                "notes": list(self.notes),
                "speculative": self.speculative.to_dict() if self.speculative is not None else None}


@dataclass(frozen=True)
class HostPlacement:
    """What a plan file stores of one host: its blocks, devices, targets and placement."""

    name: str
    blocks: range
    devices: tuple[Device, ...]
    targets: Mapping[str, int]
    placement: Placement


def host_fit_targets(hosts: Sequence[Host], fit_target: Sequence[int]) -> list[dict[str, int]]:
    """Per host, GPU → bytes kept free: a host spec's own target, else ``--fit-target`` (one
    value for every GPU, or one per GPU across the hosts in order)."""
    gpus = [(h, d.name) for h in hosts for d in h.devices if d.is_gpu]
    values = list(fit_target) * len(gpus) if len(fit_target) == 1 else list(fit_target)
    if len(values) != len(gpus):
        raise PlacementError(f"--fit-target has {len(fit_target)} values for {len(gpus)} GPUs across the hosts "
                             f"({', '.join(f'{h.name}:{g}' for h, g in gpus) or 'none'})")
    out: list[dict[str, int]] = [{} for _ in hosts]
    index = {h.name: i for i, h in enumerate(hosts)}
    for (h, gpu), value in zip(gpus, values):
        out[index[h.name]][gpu] = h.targets.get(gpu, value)
    return out


# what places slots of one box, which a host's part of the model does not have as a whole
_ONE_BOX_FLAGS = (("n_gpu_layers", "-ngl"), ("tensor_split", "-ts"), ("routing", "--routing"))


def make_multihost_plan(model: PlannedModel, hosts: Sequence[Host], options: PlanOptions = PlanOptions(), *,
                        draft: PlannedModel | None = None) -> MultiHostPlan:
    """The plan of ``model`` (and a ``--draft`` head) across ``hosts`` (module docstring)."""
    for attr, flag in _ONE_BOX_FLAGS:
        if getattr(options, attr) is not None:
            raise PlacementError(f"--hosts cannot be combined with {flag} (it places the slots of one box); "
                                 "use -ot rules or let the fit place each host's blocks")
    if options.parallel > 1:   # the pipeline carries one sequence: a plan for more could not run
        raise PlacementError(f"--hosts cannot be combined with -np {options.parallel}: a pipeline across hosts "
                             "runs one sequence at a time")
    targets = host_fit_targets(hosts, options.fit_target)
    rooms = [h.room_with(t) for h, t in zip(hosts, targets)]
    k, v = options.cache_types()
    settings = MemorySettings(model.spec.n_ctx_train if options.ctx is None else options.ctx, k, options.ubatch,
                              cache_type_v=v)
    blocks = split_blocks(model, rooms, [h.name for h in hosts], settings, draft)

    def plan_all(opts: PlanOptions) -> list[HostPlan]:
        out = []
        for i, (host, rng) in enumerate(zip(hosts, blocks)):
            first, last = i == 0, i == len(hosts) - 1
            part = shard(model, rng, first=first, last=last)
            names = [t.name for t in part.tensors] + ([t.name for t in draft.tensors] if last and draft else [])
            # an -ot rule counts on the hosts whose tensors it matches (it may name a GPU only they have)
            rules = tuple(r for r in opts.rules if any(r.matches(n) for n in names))
            gpus = [d.name for d in host.devices if d.is_gpu]
            host_opts = replace(opts, rules=rules,
                                fit_target=tuple(targets[i][g] for g in gpus) or opts.fit_target[:1])
            label = host_label(host.name, rng)
            try:
                plan = make_plan(part, host.devices, host_opts, draft=draft if last else None)
            except PlacementError as exc:
                raise PlacementError(f"{label}: {exc}") from None
            if not last:        # the draft head is the last host's (the spec names NextN blocks for all)
                plan = replace(plan, drafting="none")
            out.append(HostPlan(host.name, rng, plan))
        return out

    plans = plan_all(options)
    ctx = min(h.plan.settings.ctx for h in plans)
    notes: list[str] = []
    if any(h.plan.settings.ctx != ctx for h in plans):
        notes.append(f"context {ctx} on every host: the fit shrank it to fit "
                     + ", ".join(h.name for h in plans if h.plan.settings.ctx == ctx))
        plans = plan_all(replace(options, ctx=ctx))
    return MultiHostPlan(model.path, tuple(plans), tuple(notes))


def build_multihost_plan(model: PlannedModel, hosts: Sequence[HostPlacement], settings: MemorySettings, *,
                         draft: PlannedModel | None = None, notes: Sequence[str] = (),
                         speculative: SpecSection | None = None) -> MultiHostPlan:
    """A plan file's hosts resolved against ``model``: the same tensor→device map per host as
    when it was planned. The ranges must cover the trunk's blocks in order, without gaps."""
    n = model.spec.n_layer_trunk
    at = 0
    for h in hosts:
        if h.blocks.start != at or h.blocks.stop <= h.blocks.start:
            raise PlacementError(f"host {h.name}: blocks {h.blocks.start}-{h.blocks.stop - 1} do not continue "
                                 f"from block {at} (the hosts' ranges must cover blocks 0-{n - 1} in order)")
        at = h.blocks.stop
    if at != n:
        raise PlacementError(f"the hosts' blocks end at {at - 1} but {model.path} has {n} trunk blocks (0-{n - 1})")
    out = []
    for i, h in enumerate(hosts):
        last = i == len(hosts) - 1
        part = shard(model, h.blocks, first=i == 0, last=last)
        label = host_label(h.name, h.blocks)
        try:
            plan = build_plan(part, h.placement, settings, h.devices, h.targets, mode="plan file",
                              draft=draft if last else None)
            plan.check_fits()
        except PlacementError as exc:
            raise PlacementError(f"{label}: {exc}") from None
        out.append(HostPlan(h.name, h.blocks, plan if last else replace(plan, drafting="none")))
    return MultiHostPlan(model.path, tuple(out), tuple(notes), speculative)

