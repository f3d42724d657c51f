"""Auto-fit: the placement ``offload plan`` makes when no placement flag is given (or, with
``--fit on``, around the flags given).

MoE-aware and tight, in four steps:

1. **Context.** If ``--ctx`` was not given, start from the model's training context and, when
   the non-expert part does not fit, shrink it in steps of 256 down to ``--fit-ctx`` (binary
   search; the non-expert part only grows with the context). Experts spill before the
   context shrinks: a long context is worth more than a few GPU-resident experts.
2. **Non-expert part → GPUs.** The model's slots (blocks ``0 … n_layer-1``, then the output
   layer, which also carries a ``--draft`` head) are cut into one contiguous range per GPU,
   in proportion to each GPU's room above its target. A slot costs its non-expert weights
   (attention, router, norms, shared experts, dense FFN, NextN glue) plus its KV cache; each
   GPU also pays its compute buffer. If the proportional cut overflows a GPU, the slots are
   packed greedily in order instead; if that fails too, the plan is refused with numbers.
   ``token_embd`` stays on the CPU (llama.cpp's input layer).
3. **Experts → their own GPU.** Expert blocks (``blk.N.ffn_{gate,up,down,gate_up}_exps`` with
   their biases) are tried from the last slot backwards — the draft head's and NextN's first,
   then the trunk from its last block down — each on the GPU that holds its block, first fit.
   So each GPU keeps the experts of its last blocks and the first blocks' experts spill, the
   ``--n-cpu-moe`` shape.
4. **Top-up.** The expert blocks still on the CPU are offered, in the same order, to any GPU
   with room (most room first). Afterwards no CPU expert block fits on any GPU: what is left
   above each GPU's target is smaller than the smallest expert block on the CPU (tight).

**Around the user's flags** (``--fit on``, ``Pins``): the rules (``-ot``, ``--cpu-moe``,
``--n-cpu-moe``) decide first, with first-match semantics, and ``-ngl`` keeps its first slots on
the CPU; what they place is fixed and counted on its device before anything else (weights,
the KV of a block whose largest attention tensor they place, and compute). The four steps
then place only the open tensors, over the GPU slots; a user ``-ts`` replaces step 2's cut.
When the pinned part alone overflows a device, the refusal names the device, the bytes and
each rule's share.

The result is expressed as a ``Placement``: ``-ngl`` = every slot, ``-ts`` = slots per GPU
(integers, so llama.cpp's float split points land exactly), and one ``-ot`` rule per group
of expert blocks that leaves its block's GPU, after the user's rules (which win where both
match).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from placement.compute import block_anchors, streamable_expert_blocks, tensor_staging_bytes
from placement.devices import CPU, Device, format_bytes
from placement.errors import PlacementError
from placement.layers import LayerLayout, input_layer
from placement.memory import MemorySettings, forward_model, kv_bytes, tied_output
from placement.plan import Placement, Plan, PlannedModel, build_plan, kv_blocks
from placement.rules import EXPERTS_REGEX, Rule, check_devices, first_match, layers_regex
from placement.tensors import Role, TensorInfo

CTX_STEP = 256


@dataclass(eq=False)  # identity-hashed: used as a dict key
class _ExpertBlock:
    """``blk.N.ffn_up_exps`` (weight and bias) of the model or of the draft."""

    key: str
    layer: int
    slot: int
    draft: bool
    tensors: list[TensorInfo]

    @property
    def kind(self) -> str:  # "ffn_up_exps"
        return self.key.split(".", 2)[2]


def expert_block_key(t: TensorInfo) -> str:
    stem, _, suffix = t.name.rpartition(".")
    return stem if suffix in ("weight", "bias", "scale") else t.name


class _Forward:
    """memory.py's compute model of the model (and draft) at one setting, asked what one GPU
    holding some of the tensors would need. Per-block answers are cached by what the GPU
    holds of the block: the fit asks the same questions many times."""

    def __init__(self, model: PlannedModel, draft: PlannedModel | None, s: MemorySettings,
                 first_gpu: str | None = None):
        self.parts = [(False, forward_model(model.spec, model.tensors, s),
                       kv_blocks(model, draft is None and model.spec.n_nextn > 0))]
        if draft is not None:
            self.parts.append((True, forward_model(draft.spec, draft.tensors, s),
                               sorted({t.layer for t in draft.tensors if t.layer is not None})))
        self.parts = [(d, fm, fm.run_order(order)) for d, fm, order in self.parts]
        self._cache: dict[tuple, int] = {}
        # op offload's staging buffers (placement.compute.op_offload_staging_bytes), on real GPUs
        self.first_gpu, self.host_backed = first_gpu, set(s.host_backed)
        anchors = block_anchors(model.tensors)
        self.streamable = {i: (anchors[i].name if i in anchors else None, frozenset(t.name for t in mats),
                               max(tensor_staging_bytes(t) for t in mats))
                           for i, mats in streamable_expert_blocks(model.tensors).items()}

    def peak_on(self, gpu: str, placed: Mapping[tuple[bool, int | None], frozenset[str]]) -> int:
        """Compute bytes on ``gpu`` when it holds ``placed`` (names per (is_draft, block),
        block None for global tensors) and everything else is elsewhere (which device does
        not change what ``gpu`` holds)."""
        best = 0
        none: frozenset[str] = frozenset()
        for is_draft, fm, order in self.parts:
            def dev_of(t: TensorInfo, d=is_draft) -> str:
                return gpu if t.name in placed.get((d, t.layer), none) else CPU
            prevs, trunk_home = fm.homes(dev_of, order)
            key = (gpu, is_draft, None, placed.get((is_draft, None), none), trunk_home == gpu)
            if key not in self._cache:
                self._cache[key] = max((m.get(gpu, 0) for m in fm.global_steps(dev_of, trunk_home)), default=0)
            best = max(best, self._cache[key])
            for i, prev in prevs.items():
                mine = placed.get((is_draft, i), none)
                if not mine and prev != gpu:
                    continue
                key = (gpu, is_draft, i, mine, prev == gpu, trunk_home == gpu)
                if key not in self._cache:
                    self._cache[key] = max((m.get(gpu, 0) for m in fm.block_steps(i, dev_of, prev, trunk_home)),
                                           default=0)
                best = max(best, self._cache[key])
        return best + self.staging_on(gpu, placed)

    def staging_on(self, gpu: str, placed: Mapping[tuple[bool, int | None], frozenset[str]]) -> int:
        """Op offload's staging on ``gpu`` (none on a GPU that holds nothing): two chunks of
        the largest expert tensor of the blocks whose experts it does not hold and that compute
        here, or (the first GPU) anywhere but here: exact with one GPU, an upper bound with
        more (the experts may sit on another GPU, the block may compute on one)."""
        if gpu in self.host_backed or not self.streamable or not any(placed.values()):
            return 0
        none: frozenset[str] = frozenset()
        largest = 0
        for i, (anchor, mats, n_bytes) in self.streamable.items():
            mine = placed.get((False, i), none)
            if not mats & mine and (anchor in mine or gpu == self.first_gpu):
                largest = max(largest, n_bytes)
        return 2 * largest


class _Ledger:
    """Exact running memory of one GPU: weights + KV + compute (memory.py's formula)."""

    def __init__(self, device: Device, target: int, forward: _Forward):
        self.name = device.name
        self.room = device.budget_bytes - target
        self.forward = forward
        self.weights = 0
        self.kv = 0
        self.compute = 0
        self.placed: dict[tuple[bool, int | None], frozenset[str]] = {}   # (is_draft, block) → names

    @property
    def used(self) -> int:
        return self.weights + self.kv + self.compute

    def try_add(self, items: Sequence[tuple[TensorInfo, bool]], kv: int = 0, *,
                force: bool = False) -> bool:
        """Add (tensor, is_draft) items and KV bytes if they fit above the target (or ``force``)."""
        placed = dict(self.placed)
        for t, is_draft in items:
            placed[is_draft, t.layer] = placed.get((is_draft, t.layer), frozenset()) | {t.name}
        weights = self.weights + sum(t.n_bytes for t, _ in items)
        compute = self.forward.peak_on(self.name, placed)
        if not force and weights + self.kv + kv + compute > self.room:
            return False
        self.weights, self.kv, self.compute, self.placed = weights, self.kv + kv, compute, placed
        return True


@dataclass(frozen=True)
class Pins:
    """What ``--fit on`` keeps of the user's placement flags: the rules (``-ot`` first, then
    ``--cpu-moe`` / ``--n-cpu-moe``; first match wins, for the model and a ``--draft`` alike) and
    ``-ngl`` / ``-ts`` when given. The fit places every tensor they leave open."""

    rules: tuple[Rule, ...] = ()
    n_gpu_layers: int | None = None                 # None: the fit may use every slot
    tensor_split: tuple[float, ...] | None = None   # None: the fit cuts the GPU slots

    def __bool__(self) -> bool:
        return bool(self.rules) or self.n_gpu_layers is not None or self.tensor_split is not None

    def gpu_slots(self, n_layer: int) -> int:
        n = self.n_gpu_layers
        return n_layer + 1 if n is None or n == -1 else min(n, n_layer + 1)


@dataclass
class _Slots:
    """The open (unpinned) non-expert tensors and KV of each GPU slot; every open expert block,
    in priority order; and what the pins put on each device, with the reason (rule or -ngl)."""

    dense: list[list[tuple[TensorInfo, bool]]]   # per slot: (tensor, is_draft)
    kv: list[int]
    experts: list[_ExpertBlock]
    first_gpu: int                               # slots below it are on the CPU (-ngl)
    pinned: dict[str, list[tuple[TensorInfo, bool, str]]]   # device → (tensor, is_draft, why)
    pinned_kv: dict[str, list[tuple[int, str]]]             # device → (KV bytes, why)

    def cost(self, slot: int) -> int:
        return sum(t.n_bytes for t, _ in self.dense[slot]) + self.kv[slot]

    @property
    def gpu_slots(self) -> range:
        return range(self.first_gpu, len(self.dense))


def _slots(model: PlannedModel, draft: PlannedModel | None, s: MemorySettings, pins: Pins) -> _Slots:
    n = model.spec.n_layer
    first_gpu = n + 1 - pins.gpu_slots(n)
    below = f"-ngl {pins.n_gpu_layers}"
    dense: list[list[tuple[TensorInfo, bool]]] = [[] for _ in range(n + 1)]
    kv = [0] * (n + 1)
    experts: dict[str, _ExpertBlock] = {}
    pinned: dict[str, list[tuple[TensorInfo, bool, str]]] = defaultdict(list)
    pinned_kv: dict[str, list[tuple[int, str]]] = defaultdict(list)
    pin_of: dict[tuple[bool, str], tuple[str, str]] = {}     # (is_draft, name) → (device, why)
    sources = [(model, False)] + ([(draft, True)] if draft is not None else [])
    tied = tied_output(model.tensors)
    for m, is_draft in sources:
        extra = [tied] if tied is not None and not is_draft else []   # logits from token_embd: a copy
        for t in list(m.tensors) + extra:                               # on the output layer's GPU
            if input_layer(t):
                slot = None     # input layer (token_embd, a draft's too): on the CPU, as in llama.cpp
            elif is_draft or t.layer is None:
                slot = n        # the output layer, which also carries a --draft head
            else:
                slot = t.layer
            rule = first_match(pins.rules, t.name)
            if rule is not None:
                pin_of[is_draft, t.name] = (rule.device, f"rule '{rule.text}' ({rule.origin})")
            elif slot is not None and slot < first_gpu:
                pin_of[is_draft, t.name] = (CPU, below)
            if (is_draft, t.name) in pin_of:
                dev, why = pin_of[is_draft, t.name]
                pinned[dev].append((t, is_draft, why))
            elif slot is None:
                continue
            elif t.role is Role.ROUTED_EXPERTS and t.layer is not None:
                key = ("draft:" if is_draft else "") + expert_block_key(t)
                blk = experts.setdefault(key, _ExpertBlock(expert_block_key(t), t.layer, slot, is_draft, []))
                blk.tensors.append(t)
            else:
                dense[slot].append((t, is_draft))
    # KV: with the block's largest attention tensor (memory.py), so a pinned attention takes it along
    kv_sources = [(model, False, kv_blocks(model, draft is None and model.spec.n_nextn > 0))]
    if draft is not None:
        kv_sources.append((draft, True, sorted({t.layer for t in draft.tensors if t.layer is not None})))
    for m, is_draft, layers in kv_sources:
        attn: dict[int, TensorInfo] = {}
        for t in m.tensors:
            if t.role is Role.ATTENTION and t.layer is not None and (
                    t.layer not in attn or t.n_bytes > attn[t.layer].n_bytes):
                attn[t.layer] = t
        for layer in layers:
            size = kv_bytes(m.spec, layer, s)
            where = pin_of.get((is_draft, attn[layer].name)) if layer in attn else None
            if where is not None:
                pinned_kv[where[0]].append((size, where[1]))
            else:
                kv[n if is_draft else layer] += size
    # priority: last slot first (draft, NextN, then the trunk backwards); stable within a block
    order = sorted(experts.values(), key=lambda b: (-b.slot, not b.draft, -b.layer, b.key))
    return _Slots(dense, kv, order, first_gpu, dict(pinned), dict(pinned_kv))


def _base_ledgers(gpus, targets, forward: _Forward, slots: _Slots) -> list[_Ledger]:
    """One ledger per GPU holding what the pins put there."""
    ledgers = [_Ledger(g, targets.get(g.name, 0), forward) for g in gpus]
    for lg in ledgers:
        lg.try_add([(t, d) for t, d, _ in slots.pinned.get(lg.name, ())],
                   sum(b for b, _ in slots.pinned_kv.get(lg.name, ())), force=True)
    return ledgers


def _partition(gpus, targets, forward: _Forward, slots: _Slots, split: tuple[float, ...] | None):
    """Contiguous GPU-slot ranges per GPU and their ledgers: the user's ``-ts`` when given, else
    proportional to the GPUs' room beside what is pinned there, else greedy. None when the
    non-expert part cannot fit."""
    def ledgers_for(groups):
        ledgers = _base_ledgers(gpus, targets, forward, slots)
        for ledger, group in zip(ledgers, groups):
            for slot in group:
                ledger.try_add(slots.dense[slot], slots.kv[slot], force=True)
        return ledgers if all(lg.used <= lg.room for lg in ledgers) else None

    names = tuple(g.name for g in gpus)
    n_layer = len(slots.dense) - 1
    if split is not None:           # the user's -ts decides which GPU holds each slot
        layout = LayerLayout(n_layer, names, len(slots.gpu_slots), split)
        groups = list(layout.slots_per_gpu().values())
        ledgers = ledgers_for(groups)
        return None if ledgers is None else (groups, ledgers)
    base = _base_ledgers(gpus, targets, forward, slots)
    rooms = [max(lg.room - lg.used, 0) for lg in base]
    cum, acc = [], 0
    for r in rooms:
        acc += r
        cum.append(acc / (sum(rooms) or 1))
    total = sum(slots.cost(i) for i in slots.gpu_slots) or 1
    groups = [[] for _ in gpus]
    before = 0
    for slot in slots.gpu_slots:    # proportional: a slot goes where its midpoint falls
        mid = (before + slots.cost(slot) / 2) / total
        groups[next((i for i, x in enumerate(cum) if x > mid), len(gpus) - 1)].append(slot)
        before += slots.cost(slot)
    ledgers = ledgers_for(groups)
    if ledgers is not None:
        return groups, ledgers
    ledgers = base
    groups = [[] for _ in gpus]
    g = 0
    for slot in slots.gpu_slots:    # greedy: fill GPU 0, then GPU 1, ...
        while g < len(gpus) and not ledgers[g].try_add(slots.dense[slot], slots.kv[slot]):
            g += 1
        if g == len(gpus):
            return None
        groups[g].append(slot)
    return groups, ledgers


def _pinned_overflow(devices, targets, forward: _Forward, slots: _Slots) -> str | None:
    """The refusal when what the pins alone put on a device does not fit: the device, its
    bytes and each rule's share (largest first). None when every device holds its pins."""
    for d in devices:
        if d.is_gpu:
            lg = _base_ledgers([d], targets, forward, slots)[0]
            used, room = lg.used, lg.room
            split = (f" (weights {format_bytes(lg.weights)} + KV {format_bytes(lg.kv)} + "
                     f"compute {format_bytes(lg.compute)})")
        else:
            used = (sum(t.n_bytes for t, _, _ in slots.pinned.get(d.name, ()))
                    + sum(b for b, _ in slots.pinned_kv.get(d.name, ())))
            room, split = d.budget_bytes, ""
        if used <= room:
            continue
        share: dict[str, int] = defaultdict(int)
        for t, _, why in slots.pinned.get(d.name, ()):
            share[why] += t.n_bytes
        for b, why in slots.pinned_kv.get(d.name, ()):
            share[why] += b
        whys = "; ".join(f"{why} {format_bytes(b)}" for why, b in sorted(share.items(), key=lambda kv: -kv[1]))
        target = targets.get(d.name, 0)
        kept = f" with {format_bytes(target)} kept free" if target else ""
        return (f"cannot fit: your flags alone put {format_bytes(used)} on {d.name}{split} but it has "
                f"{format_bytes(room)}{kept} — {whys}")
    return None


def _dense_need(slots: _Slots, forward: _Forward, gpus, targets) -> str:
    """The refusal's numbers: what the non-expert part (and the pins on GPUs) needs vs the GPUs' room."""
    lg = _Ledger(Device("all GPUs", 1 << 62), 0, forward)
    for g in gpus:
        lg.try_add([(t, d) for t, d, _ in slots.pinned.get(g.name, ())],
                   sum(b for b, _ in slots.pinned_kv.get(g.name, ())), force=True)
    for slot in slots.gpu_slots:
        lg.try_add(slots.dense[slot], slots.kv[slot], force=True)
    room = ", ".join(f"{g.name} {format_bytes(g.budget_bytes - targets.get(g.name, 0))}" for g in gpus)
    return (f"needs {format_bytes(lg.used)} (weights {format_bytes(lg.weights)} + KV "
            f"{format_bytes(lg.kv)} + compute {format_bytes(lg.used - lg.weights - lg.kv)}) "
            f"but the GPUs have {room} above their targets")


def _rules_for_moves(moves: Mapping[_ExpertBlock, str], all_blocks: Sequence[_ExpertBlock],
                     draft: bool) -> list[Rule]:
    """Rules for expert blocks that leave their slot's device, grouped per destination:
    whole blocks use llama.cpp's expert regex; the rest name their kinds. (Only open blocks
    count: a pinned kind the regex also matches is caught by its user rule, which comes first.)"""
    kinds_of_layer: dict[int, set[str]] = defaultdict(set)
    for b in all_blocks:
        if b.draft is draft:
            kinds_of_layer[b.layer].add(b.kind)
    by_layer: dict[int, dict[str, str]] = defaultdict(dict)
    for b, dev in moves.items():
        if b.draft is draft:
            by_layer[b.layer][b.kind] = dev
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = defaultdict(list)   # (device, kinds) → layers
    for layer, kinds in sorted(by_layer.items()):
        for dev in sorted(set(kinds.values())):
            moved = tuple(sorted(k for k, d in kinds.items() if d == dev))
            groups[(dev, () if set(moved) == kinds_of_layer[layer] else moved)].append(layer)
    rules = []
    for (dev, kinds), layers in sorted(groups.items(), key=lambda kv: (kv[0][1] != (), kv[0][0], kv[1])):
        what = EXPERTS_REGEX if not kinds else r"\." + (kinds[0] if len(kinds) == 1 else "(" + "|".join(kinds) + ")")
        rules.append(Rule(rf"blk\.{layers_regex(layers)}{what}", dev, "fit"))
    return rules


def _checked(plan: Plan) -> Plan:
    """The GPUs were packed above their targets; the CPU must hold what is left. (Checked on
    the plan's own totals, so the fit's running accounts and memory.py cannot drift apart.)"""
    for t in plan.totals:
        if t.above_target_bytes < 0:
            what = "for what does not fit on the GPUs " if t.name == CPU else ""
            raise PlacementError(
                f"cannot fit: {t.name} needs {format_bytes(t.used_bytes)} (weights "
                f"{format_bytes(t.weights_bytes)} + KV {format_bytes(t.kv_bytes)} + compute "
                f"{format_bytes(t.compute_bytes)}) {what}but has {format_bytes(t.budget_bytes)}"
                + (f" with {format_bytes(t.target_bytes)} kept free" if t.target_bytes else ""))
    return plan


def fit(model: PlannedModel, devices: Sequence[Device], targets: Mapping[str, int],
        settings: MemorySettings, *, ctx_floor: int | None = None,
        draft: PlannedModel | None = None, pins: Pins = Pins()) -> Plan:
    """Auto-fit (module docstring) around ``pins``. ``ctx_floor`` None: keep ``settings.ctx``.

    The plan's settings carry the context actually used; its notes say what the fit did.
    """
    spec = model.spec
    gpus = [d for d in devices if d.is_gpu]
    notes: list[str] = []
    mode = "auto-fit" + (" around your flags" if pins else "")
    user_draft_rules = pins.rules if draft is not None else ()
    if not gpus:
        placement = Placement(pins.rules, LayerLayout(spec.n_layer, (), 0, ()), user_draft_rules, CPU,
                              layout_origin="fit")
        return _checked(build_plan(model, placement, settings, devices, targets, mode=mode,
                                   draft=draft, notes=["no GPU: everything on the CPU"]))
    check_devices(pins.rules, [d.name for d in devices])

    def attempt(ctx: int):
        s = replace(settings, ctx=ctx)
        slots = _slots(model, draft, s, pins)
        forward = _Forward(model, draft, s, gpus[0].name)
        if _pinned_overflow(devices, targets, forward, slots) is not None:
            return s, slots, None
        return s, slots, _partition(gpus, targets, forward, slots, pins.tensor_split)

    s, slots, part = attempt(settings.ctx)
    if part is None and ctx_floor is not None and ctx_floor < settings.ctx:
        candidates = list(range(settings.ctx - CTX_STEP, ctx_floor - 1, -CTX_STEP))
        lo, hi, best = 0, len(candidates) - 1, None
        while lo <= hi:             # candidates descend; feasibility is monotone in the context
            mid = (lo + hi) // 2
            trial = attempt(candidates[mid])
            if trial[2] is not None:
                best, hi = trial, mid - 1
            else:
                lo = mid + 1
        if best is not None:
            notes.append(f"context reduced from {settings.ctx} to {best[0].ctx} "
                         f"so that the non-expert part fits on the GPUs")
            s, slots, part = best
    if part is None:
        at = f" even at context {ctx_floor}" if ctx_floor is not None and ctx_floor < settings.ctx else ""
        s_min = replace(settings, ctx=min(settings.ctx, ctx_floor or settings.ctx))
        slots_min, forward_min = _slots(model, draft, s_min, pins), _Forward(model, draft, s_min, gpus[0].name)
        pinned = _pinned_overflow(devices, targets, forward_min, slots_min)
        if pinned is not None:
            raise PlacementError(pinned + at)
        raise PlacementError(
            f"cannot fit the non-expert part on the GPUs{at}: "
            f"{_dense_need(slots_min, forward_min, gpus, targets)}; "
            f"lower --ctx, use a smaller --cache-type, or keep layers on the CPU with -ngl")
    groups, ledgers = part
    slot_gpu = {slot: i for i, group in enumerate(groups) for slot in group}

    cpu_blocks: list[_ExpertBlock] = []
    for blk in slots.experts:                      # step 3: own GPU
        if not ledgers[slot_gpu[blk.slot]].try_add([(t, blk.draft) for t in blk.tensors]):
            cpu_blocks.append(blk)
    moves: dict[_ExpertBlock, str] = {}
    for blk in cpu_blocks:                         # step 4: top-up, most room first
        for g in sorted(range(len(ledgers)), key=lambda i: ledgers[i].used - ledgers[i].room):
            if ledgers[g].try_add([(t, blk.draft) for t in blk.tensors]):
                moves[blk] = ledgers[g].name
                break
        else:
            moves[blk] = CPU

    counts = tuple(float(len(group)) for group in groups)
    layout = LayerLayout(spec.n_layer, tuple(g.name for g in gpus), len(slots.gpu_slots),
                         counts if sum(counts) else (1.0,) * len(gpus))
    draft_device = ledgers[slot_gpu[spec.n_layer]].name if spec.n_layer in slot_gpu else CPU
    placement = Placement(pins.rules + tuple(_rules_for_moves(moves, slots.experts, draft=False)), layout,
                          user_draft_rules + tuple(_rules_for_moves(moves, slots.experts, draft=True)),
                          draft_device, layout_origin=_layout_origin(pins))
    n_cpu = sum(1 for d in moves.values() if d == CPU)
    if n_cpu:
        notes.append(f"{n_cpu} of {len(slots.experts)} expert blocks the fit placed are on the CPU"
                     if pins else f"{n_cpu} of {len(slots.experts)} expert blocks on the CPU")
    if pins:
        n_pinned = sum(len(v) for v in slots.pinned.values())
        notes.append(f"{n_pinned} tensors pinned by your flags "
                     f"({format_bytes(sum(t.n_bytes for v in slots.pinned.values() for t, _, _ in v))}); "
                     "the fit placed the rest")
    return _checked(build_plan(model, placement, s, devices, targets, mode=mode, draft=draft, notes=notes))


def _layout_origin(pins: Pins) -> str:
    """Who chose -ngl / -ts: what ``Plan.placed_by`` says of the tensors no rule matches."""
    given = ([f"-ngl {pins.n_gpu_layers}"] if pins.n_gpu_layers is not None else []) + \
        (["-ts"] if pins.tensor_split is not None else [])
    if len(given) == 2:
        return " ".join(given)
    return f"{given[0]}, the rest by the fit" if given else "fit"
