"""The human-readable plan: per-device table and what went where."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from placement.devices import MIB, format_bytes
from placement.plan import Plan, PlannedModel
from placement.tensors import Role, TensorInfo


def ranges(numbers: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] → "0-2,5,7-8"."""
    out, nums = [], sorted(set(numbers))
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


def _where_things_went(tensors: Sequence[TensorInfo], placement: dict[str, str], device: str,
                       label: str = "") -> list[str]:
    blocks_attn = sorted({t.layer for t in tensors if t.layer is not None and t.role is Role.ATTENTION
                          and placement[t.name] == device})
    experts_by_layer: dict[int, list[TensorInfo]] = defaultdict(list)
    for t in tensors:
        if t.role is Role.ROUTED_EXPERTS and t.layer is not None:
            experts_by_layer[t.layer].append(t)
    full, partial = [], []
    for layer, ts in sorted(experts_by_layer.items()):
        here = [t for t in ts if placement[t.name] == device]
        if len(here) == len(ts):
            full.append(layer)
        elif here:
            partial += sorted({t.name.rsplit(".", 1)[0] for t in here})
    nextn = sorted({t.layer for t in tensors if t.nextn and t.role is Role.NEXTN and placement[t.name] == device})
    globals_ = [t.name.rsplit(".", 1)[0] for t in tensors if t.layer is None and placement[t.name] == device]
    parts = []
    if blocks_attn:
        parts.append(f"{label}blocks {ranges(blocks_attn)}")
    if nextn:
        parts.append(f"{label}NextN head blk.{ranges(nextn)}")
    if full:
        parts.append(f"{label}experts of blocks {ranges(full)}")
    if partial:
        shown = ", ".join(partial[:4]) + (f" (+{len(partial) - 4} more)" if len(partial) > 4 else "")
        parts.append(f"{label}{shown}")
    if globals_:
        parts.append(label + ", ".join(sorted(set(globals_))))
    return parts


def _placed_by_line(plan: Plan, model: PlannedModel, draft: PlannedModel | None) -> str:
    """Who placed what, when the user's flags and the fit share the plan (``--fit on``)."""
    count: dict[str, int] = defaultdict(int)
    size: dict[str, int] = defaultdict(int)
    for tensors, is_draft in ((model.tensors, False), (draft.tensors if draft is not None else (), True)):
        origin = plan.placement.placed_by([t.name for t in tensors], draft=is_draft)
        for t in tensors:
            count[origin[t.name]] += 1
            size[origin[t.name]] += t.n_bytes
    if len(count) < 2 or not any("fit" in o for o in count):
        return ""
    return "placed by: " + "; ".join(f"{o}: {count[o]} tensors ({format_bytes(size[o])})"
                                     for o in sorted(count, key=lambda o: ("fit" in o, o)))


def format_plan(plan: Plan, model: PlannedModel, draft: PlannedModel | None = None) -> str:
    spec = model.spec
    lines = []
    nextn = f", {spec.n_nextn} NextN" if spec.n_nextn else ""
    experts = (f", {spec.n_expert} experts ({spec.n_expert_used} used"
               + (f", {spec.n_expert_shared} shared" if spec.n_expert_shared else "") + ")") if spec.n_expert else ""
    lines.append(f"model    {plan.model_path}")
    lines.append(f"         {spec.arch}: {len(model.tensors)} tensors, {spec.n_layer} blocks{nextn}{experts}"
                 + (", MLA" if spec.is_mla else ""))
    if draft is not None:
        lines.append(f"draft    {plan.draft_path} ({len(draft.tensors)} tensors)")
    slots = f" × {plan.settings.parallel} sequences (-np)" if plan.settings.parallel > 1 else ""
    lines.append(f"context  {plan.settings.ctx}{slots} ({plan.settings.type_label} KV cache), ubatch "
                 f"{plan.settings.ubatch}; placement: {plan.mode}; drafting: {plan.drafting}")
    lines.append("")
    head = ["device", "budget", "weights", "KV cache", "compute", "target", "free after", "above target"]
    rows = [[t.name, format_bytes(t.budget_bytes), format_bytes(t.weights_bytes), format_bytes(t.kv_bytes),
             format_bytes(t.compute_bytes), format_bytes(t.target_bytes), format_bytes(t.free_after_bytes),
             format_bytes(t.above_target_bytes)] for t in plan.totals]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines += [fmt(head)] + [fmt(r) for r in rows]
    lines.append("")
    lines.append("placement")
    for d in plan.devices:
        parts = _where_things_went(model.tensors, dict(plan.tensors), d.name)
        if draft is not None:
            parts += _where_things_went(draft.tensors, dict(plan.draft_tensors), d.name, label="draft ")
        hot = plan.hot_experts.get(d.name, {})
        if hot:
            parts.append(f"hot experts of blocks {ranges(list(hot))} "
                         f"({sum(len(es) for es in hot.values())} single experts)")
        lines.append(f"  {d.name:<7} " + ("; ".join(parts) if parts else "(nothing)"))
    if plan.placement.rules or plan.placement.draft_rules:
        lines.append("")
        lines.append("rules (first match wins)")
        for i, r in enumerate(plan.placement.rules, 1):
            lines.append(f"  {i:>2}. {r.pattern} -> {r.device}  [{r.origin}]")
        for i, r in enumerate(plan.placement.draft_rules, 1):
            lines.append(f"  d{i:>1}. {r.pattern} -> {r.device}  [draft, {r.origin}]")
    by = _placed_by_line(plan, model, draft)
    if by:
        lines.append(by)
    for note in plan.notes:
        lines.append(f"note: {note}")
    below = [t for t in plan.totals if t.budget_bytes and t.above_target_bytes < -MIB and t.free_after_bytes >= 0]
    for t in below:
        lines.append(f"note: {t.name} is {format_bytes(-t.above_target_bytes)} below its free-memory target")
    return "\n".join(lines) + "\n"
