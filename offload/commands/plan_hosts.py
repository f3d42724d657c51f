"""``offload plan --hosts`` — a plan across hosts, and its forecast.

    offload plan MODEL.gguf --hosts "a:CUDA0=24GiB,CPU=256GiB;b:CPU=512GiB" [placement flags] [-o plan.yaml]
    offload plan MODEL.gguf --hosts hosts.yaml ...
    offload plan --placement multihost.yaml

The blocks are split into one contiguous range per host (``placement.multihost``) and each
host is planned with the one-box planner; the table per host is ``offload plan``'s. The
forecast (``placement.speculative.predict_multihost``) adds the hops between hosts to every
target pass; it prints t/s and break-even n_max across the hosts beside the same passes with
the hops free, which shows how far a verify batch amortises them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from offload.errors import OffloadError, write_atomic
from offload.gguf_model import ModelFile, check_shapes, open_model
from offload.plans import open_draft, read_hosts, read_plan_file
from offload.probe import hw_profile_path
from placement.cost import HopLink, SpecTable, hops_per_pass
from placement.draft import NoDraftHead, check_n_max
from placement.footprint import FootprintError
from placement.hardware import HardwareProfile
from placement.multihost import MultiHostPlan, build_multihost_plan, make_multihost_plan, shard
from placement.plan_file import multihost_plan_to_yaml
from placement.planner import FLAG_NAMES, PlanOptions
from placement.report import format_plan
from placement.spec_section import SpecSection
from placement.speculative import carried_bytes, predict_multihost

# what the one-box command does that a plan across hosts does not (yet)
_REFUSED = (("devices", "--devices (each host names its devices in --hosts)"),
            ("emit", "--emit llama.cpp (llama.cpp flags describe one box)"),
            ("probe", "--probe (the probe measures this box, not the hosts)"),
            ("refresh_probe", "--refresh-probe (the probe measures this box, not the hosts)"))


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("hosts (a model split across machines)")
    g.add_argument("--hosts", metavar="SPEC|HOSTS.yaml",
                   help="plan across hosts, in pipeline order: 'a:CUDA0=24GiB,CPU=256GiB;b:CPU=512GiB' or a YAML "
                        "(hosts: [{name, devices: [{name, budget, target}]}]); the blocks are split in proportion "
                        "to what each host holds")
    g.add_argument("--hop-latency-us", type=float, metavar="US",
                   help=f"forecast: latency of one hop between hosts (default {HopLink().latency_us:g}, a LAN prior)")
    g.add_argument("--hop-gbps", type=float, metavar="GB/s",
                   help=f"forecast: rate of the link between hosts (default {HopLink().gbps:g}, 10 GbE)")


def wants_hosts(args: argparse.Namespace) -> bool:
    """Whether ``offload plan`` plans across hosts: ``--hosts``, or a plan file with ``hosts:``
    (read only when no flag the plan file fixes is given: that refusal comes first)."""
    if args.hosts:
        return True
    if not args.placement or _given_fixed(args):
        return False
    return read_plan_file(args.placement).hosts is not None


def _given_fixed(args: argparse.Namespace) -> list[str]:
    """Flags given that a plan file fixes (so ``--placement`` cannot take them)."""
    return [n for n in FLAG_NAMES + ("devices", "hosts") if getattr(args, n) not in (None, False)]


def _link(args: argparse.Namespace, recorded: SpecSection | None = None) -> HopLink:
    """The flags' link; a flag not given: the one the plan file's forecast recorded, else the prior."""
    base = HopLink()
    latency = recorded.hop_latency_us if recorded is not None and recorded.hop_latency_us is not None \
        else base.latency_us
    gbps = recorded.hop_gbps if recorded is not None and recorded.hop_gbps is not None else base.gbps
    return HopLink(latency if args.hop_latency_us is None else args.hop_latency_us,
                   gbps if args.hop_gbps is None else args.hop_gbps)


def _plan(args: argparse.Namespace, model: ModelFile | None) -> tuple[MultiHostPlan, ModelFile, ModelFile | None]:
    if args.placement:
        clash = _given_fixed(args)
        if clash:
            raise OffloadError(f"--placement cannot be combined with --{clash[0].replace('_', '-')} "
                               f"(the plan file fixes it)")
        pf = read_plan_file(args.placement)
        model = model or open_model(pf.model_path)
        if pf.n_layer != model.spec.n_layer:
            raise OffloadError(f"{args.placement}: the plan's layout is for {pf.n_layer} blocks but {model.path} "
                               f"has {model.spec.n_layer}")
        draft_path = args.draft or pf.draft_path
        draft = open_draft(draft_path, model) if draft_path else None
        return (build_multihost_plan(model, pf.hosts, pf.settings, draft=draft, speculative=pf.speculative), model, draft)
    if model is None:
        raise OffloadError("give a model (or --placement PLAN.yaml)")
    hosts = read_hosts(args.hosts)
    draft = open_draft(args.draft, model) if args.draft else None
    for m in (model, draft):
        if m is not None:
            check_shapes(m)
    options = PlanOptions.from_flags(**{name: getattr(args, name) for name in FLAG_NAMES})
    return make_multihost_plan(model, hosts, options, draft=draft), model, draft


def _hardware(args: argparse.Namespace) -> HardwareProfile | None:
    return HardwareProfile.from_yaml(hw_profile_path(args.hw_profile)) if args.hw_profile else None


def format_forecast(table: SpecTable, free: SpecTable, link: HopLink, n_hosts: int, carried: int,
                    drafting: bool) -> str:
    hops = (f"{hops_per_pass(n_hosts)} hops per pass: {n_hosts - 1} of {carried} bytes per token, one back with "
            f"the tokens; hop {link.latency_us:g} us, {link.gbps:g} GB/s" if hops_per_pass(n_hosts) else "no hops")
    head = f"\nacross {n_hosts} hosts (predicted; {hops}):"
    if drafting:
        body = table.format()
        free_line = (f"with the hops free (the same passes on one box): plain {free.plain_tps:.2f} t/s, "
                     f"break-even n_max {free.break_even_n}, best n_max {free.best.n} "
                     f"({(free.best.speedup - 1) * 100:+.0f}%)")
    else:
        split = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in table.verify_breakdown.items() if v)
        body = (f"predicted plain decode: {table.plain_tps:.2f} t/s (T(0) = {table.rows[0].step_s * 1e3:.1f} ms: "
                f"{split} ms)")
        free_line = f"with the hops free (the same passes on one box): {free.plain_tps:.2f} t/s"
    return "\n".join([head, body, free_line])


def main(args: argparse.Namespace, model: ModelFile | None) -> int:
    for name, what in _REFUSED:
        if getattr(args, name, None):
            raise OffloadError(f"--hosts: {what} is not taken with a plan across hosts")
    check_n_max(args.spec_max_n, "--spec-max-n")
    _link(args)                                   # bad hop flags: one line before the plan is made
    mplan, model, draft = _plan(args, model)
    link = _link(args, mplan.speculative)
    if args.spec_type in ("mtp", "dspark") and mplan.drafting == "none":
        raise NoDraftHead(mplan.model_path, f"--spec-type {args.spec_type}")
    table = free = None
    if args.spec_type not in ("none", "ngram"):
        hw = _hardware(args)
        max_n = args.spec_max_n if mplan.drafting != "none" else 0
        try:
            table, section = predict_multihost(mplan, model, draft, link=link, hardware=hw, max_n=max_n)
            free, _ = predict_multihost(mplan, model, draft, link=None, hardware=hw, max_n=max_n)
        except FootprintError as exc:         # the plan stands; only the forecast is left out
            print(f"offload: note: no forecast across hosts: {exc}", file=sys.stderr)
        else:
            mplan = dataclasses.replace(mplan, speculative=section)
    if args.output:
        write_atomic(args.output, multihost_plan_to_yaml(mplan))
        print(f"offload: wrote {args.output}", file=sys.stderr)
    carried = carried_bytes(model.spec)
    if args.json:
        extra = {}
        if table is not None:
            extra["forecast"] = {"hop_latency_us": link.latency_us, "hop_gbps": link.gbps,
                                 "hops_per_pass": hops_per_pass(len(mplan.hosts)), "carried_bytes_per_token": carried,
                                 "predicted_plain_tps": round(table.plain_tps, 4),
                                 "break_even_n_max": table.break_even_n, "best_n_max": table.best.n,
                                 "hops_free": {"predicted_plain_tps": round(free.plain_tps, 4),
                                               "break_even_n_max": free.break_even_n, "best_n_max": free.best.n}}
        print(json.dumps({**mplan.to_dict(), **extra}, indent=1))
        return 0
    print(f"plan across {len(mplan.hosts)} hosts: "
          + "; ".join(f"{h.name} blocks {h.blocks.start}-{h.blocks.stop - 1}" for h in mplan.hosts)
          + " (the first holds the input layer, the last the output layer"
          + (" and the draft head)" if mplan.drafting != "none" else ")"))
    for i, h in enumerate(mplan.hosts):
        last = i == len(mplan.hosts) - 1
        part = shard(model, h.blocks, first=i == 0, last=last)
        print(f"\n== host {h.name}: blocks {h.blocks.start}-{h.blocks.stop - 1} ==")
        sys.stdout.write(format_plan(h.plan, part, draft if last else None))
    for note in mplan.notes:
        print(f"note: {note}")
    if table is not None:
        print(format_forecast(table, free, link, len(mplan.hosts), carried, mplan.drafting != "none"))
    print("\nllama.cpp: no single command line for a plan across hosts (its RPC backend places tensors "
          "its own way); each host's table above is what offload loads there")
    return 0
