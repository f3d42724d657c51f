"""``offload plan`` — where each tensor goes.

    offload plan MODEL.gguf [--devices auto|SPEC] [placement flags] [-o plan.yaml] [--json | --emit llama.cpp]

With no placement flag it auto-fits (``placement.fit``); with ``-ot`` / ``--cpu-moe`` /
``--n-cpu-moe`` / ``-ngl`` / ``-ts`` it applies them with llama.cpp's semantics and checks the
result fits, or, with ``--fit on``, keeps them and auto-fits everything they leave open; with
``--placement plan.yaml`` it loads a plan file. The table (or JSON, or flags) goes to stdout,
notices to stderr.

``add_placement_arguments`` and ``plan_from_args`` are shared with ``offload run``, so it takes
every planner flag for free; the flags become ``placement.planner.PlanOptions`` and the plan
comes from ``placement.planner.make_plan``, the API ``offload.load`` calls too.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from offload.commands import plan_hosts
from offload.errors import ArgumentParser, OffloadError, write_atomic
from offload.gguf_model import ModelFile, check_shapes, open_model
from offload.plans import open_draft, plan_from_file, read_plan_file
from offload.probe import CACHE_ENV, hw_profile_path
from placement.devices import resolve_devices
from placement.draft import NoDraftHead, check_n_max, spec_type
from placement.llama_args import format_args, llama_cpp_args
from placement.memory import CACHE_TYPES
from placement.plan import Plan
from placement.plan_file import plan_to_yaml
from placement.planner import (DEFAULT_FIT_CTX, DEFAULT_FIT_TARGET_MIB, DEFAULT_UBATCH, FIT_MODES, FLAG_NAMES,
                               PlanOptions, make_plan)
from placement.concurrency import format_concurrency
from placement.report import format_plan
from placement.cost import SpecProfile, break_even_acceptance, predicted_decode_tps
from placement.footprint import FootprintError
from placement.hardware import HardwareProfile
from placement.hot_experts import describe
from placement.routing import RoutingCounts
from placement.speculative import (DEFAULT_MAX_N, complete_hardware, drafter_kind, forecast_hardware, hot_gain, predict_concurrency,
                                   plan_footprint, plan_profile, predict)
from placement.uncertainty import forecast_interval, format_inputs

# what a plan file fixes, so it cannot be combined with --placement
PLAN_FILE_FIXES = FLAG_NAMES + ("devices",)


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if getattr(args, n) is not None and getattr(args, n) is not False]


def add_placement_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag that decides a placement (shared by ``offload plan`` and ``offload run``)."""
    g = parser.add_argument_group("placement (llama.cpp semantics)")
    g.add_argument("--devices", metavar="auto|SPEC",
                   help="'auto' (NVML free memory + available RAM) or e.g. "
                        "'CUDA0=24GiB,CUDA1=24GiB,CPU=256GiB' (B/KiB/MiB/GiB/TiB; plain numbers are MiB); "
                        "default auto")
    g.add_argument("-ot", "--override-tensor", action="append", metavar="PATTERN=DEVICE[,...]",
                   help="override rule(s), repeatable; re.search on tensor names, first match wins")
    g.add_argument("--cpu-moe", action="store_true", help="all routed experts on the CPU")
    g.add_argument("--n-cpu-moe", type=int, metavar="N", help="routed experts of blocks 0..N-1 on the CPU")
    g.add_argument("-ngl", "--n-gpu-layers", type=int, metavar="N",
                   help="the last N of the block_count+1 slots (output counts) on GPUs; -1 = all (default)")
    g.add_argument("-ts", "--tensor-split", metavar="A,B,...",
                   help="split of the GPU slots across GPUs (default: in proportion to free memory)")
    g.add_argument("--fit", choices=FIT_MODES,
                   help="auto (default): auto-fit unless a placement flag (-ot, --cpu-moe, --n-cpu-moe, -ngl, "
                        "-ts) is given; on: keep those flags as hard constraints and auto-fit the rest; "
                        "off: the flags alone")
    g.add_argument("--fit-target", metavar="MiB[,MiB...]",
                   help=f"memory to leave free on each GPU (default {DEFAULT_FIT_TARGET_MIB}); one value "
                        "for all GPUs or one per GPU")
    g.add_argument("--fit-ctx", type=int, metavar="N",
                   help="auto-fit may shrink the context down to N (steps of 256) when --ctx is not given "
                        f"(default {DEFAULT_FIT_CTX})")
    g.add_argument("-c", "--ctx", type=int, metavar="N", help="context length (default: the model's)")
    g.add_argument("-np", "--parallel", type=int, metavar="N",
                   help="sequences at once (llama-server's -np; offload serve's slots): each gets a KV cache "
                        "of the whole --ctx (llama-server divides -c among them), and the plan counts N (default 1)")
    g.add_argument("--cache-type", metavar="TYPE",
                   help=f"KV cache type of K and V: {', '.join(CACHE_TYPES)} (default f16)")
    g.add_argument("-ctk", "--cache-type-k", metavar="TYPE", help="K's cache type (as llama.cpp; over --cache-type)")
    g.add_argument("-ctv", "--cache-type-v", metavar="TYPE",
                   help="V's cache type (as llama.cpp; over --cache-type); K-only caches (MLA, deepseek4) take K's")
    g.add_argument("-ub", "--ubatch", type=int, metavar="N",
                   help=f"tokens per compute batch; sizes the compute buffers (default {DEFAULT_UBATCH})")
    g.add_argument("--draft", metavar="GGUF", help="a separate draft model holding only a NextN (MTP) block")
    g.add_argument("--placement", metavar="PLAN.yaml", help="load a plan file instead of planning")
    g.add_argument("--routing", metavar="ROUTING.yaml",
                   help="a routing profile (`offload profile`): fill the VRAM left above each GPU's target "
                        "with the hottest single experts of CPU-resident blocks")


def plan_from_args(args: argparse.Namespace, model: ModelFile | None) -> tuple[Plan, ModelFile, ModelFile | None]:
    """args (``add_placement_arguments``) + model → (Plan, model, draft).

    ``model`` may be None only with ``--placement`` (the plan file names the model).
    """
    if args.placement:
        clash = _given(args, PLAN_FILE_FIXES)
        if clash:
            raise OffloadError(f"--placement cannot be combined with --{clash[0].replace('_', '-')} "
                               f"(the plan file fixes it)")
        return plan_from_file(args.placement, model, args.draft)
    if model is None:
        raise OffloadError("give a model (or --placement PLAN.yaml)")
    draft = open_draft(args.draft, model) if args.draft else None
    for m in (model, draft):        # a header whose shapes the metadata contradicts is refused here
        if m is not None:
            check_shapes(m)
    options = PlanOptions.from_flags(**{name: getattr(args, name) for name in FLAG_NAMES})
    return make_plan(model, resolve_devices(args.devices or "auto"), options, draft=draft), model, draft


def spec_type_arg(text: str) -> str:
    """``--spec-type`` for argparse: a drafter's name, llama.cpp's spellings too."""
    try:
        return spec_type(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--spec-type ")) from None


def _head_max_n(max_n: int, model, draft) -> int:
    """The n_max table's length for the plan's drafter: a DSpark block drafts at most its block
    (``DSparkHeader.max_drafts``; llama.cpp clamps n_max the same way)."""
    from offload.dspark_header import dspark_header
    from offload.plans import DRAFTER_ARCHS

    if draft is not None and draft.spec.arch in DRAFTER_ARCHS:
        return min(max_n, dspark_header(draft, model.spec).max_drafts)
    return max_n


def ngram_forecast(plan: Plan, model, draft, hw: HardwareProfile, hits, max_n: int) -> dict | None:
    """What a plan can say of n-gram self-drafting before measuring (its acceptance is the
    text's): per n_max the least acceptance at which it pays (``break_even_acceptance``).
    None when the cost model cannot read the model."""
    try:
        fp = plan_footprint(plan, model, draft)
        need = break_even_acceptance(fp, hw, max_n=max_n, hits=hits)
    except FootprintError:
        return None
    return {"draft_ms": 0.0, "break_even_acceptance": {str(n): a for n, a in enumerate(need, 1)}}


def format_ngram_forecast(forecast: dict) -> str:
    need = forecast["break_even_acceptance"]
    cells = " ".join(f"{n:>5}" for n in need)
    values = " ".join(f"{'never':>5}" if a is None else f"{a:>5.2f}" for a in need.values())
    return ("\nn-gram self-drafting (--spec-type ngram; no weights, its acceptance is the text's: "
            "`offload tune` measures it):\n"
            f"n_max                          {cells}\n"
            f"pays when acceptance a_j >=    {values}")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="offload plan", description=__doc__.split("\n\n")[0].replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", help="GGUF model (any shard of a split model)")
    add_placement_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("-o", "--output", metavar="PLAN.yaml", help="also write the plan file")
    spec = p.add_argument_group("speculative decoding (prediction; `offload tune` measures it)")
    spec.add_argument("--spec-type", type=spec_type_arg, metavar="TYPE",
                      help="mtp: predict drafting with the model's NextN (MTP) head (default when the "
                           "model or --draft has one); ngram: only the n-gram forecast (the acceptance "
                           "at which self-drafting pays, per n_max; printed for every model); none: no "
                           "speculative forecast")
    spec.add_argument("--spec-max-n", type=int, default=DEFAULT_MAX_N, metavar="N",
                      help=f"largest draft length in the n_max table (default {DEFAULT_MAX_N})")
    spec.add_argument("--hw-profile", metavar="YAML|NAME",
                      help="hardware profile (cpu_read_gbps, gpus: {CUDA0: {name|read_gbps|link_gbps}}, "
                           "fixed costs), e.g. written by `offload probe --write NAME` on the box the plan is "
                           "for; a NAME is looked up in $OFFLOAD_PROFILES, ~/.config/offload/profiles and "
                           "bench/profiles; "
                           "default: the probe on this box, or the plan file's measured profile")
    probe = spec.add_mutually_exclusive_group()
    probe.add_argument("--no-probe", action="store_true",
                       help="forecast from the priors alone, as before the probe (no ranges)")
    probe.add_argument("--probe", action="store_true",
                       help="the plan is for this box although --devices is written out: calibrate the "
                            "forecast with the probe (default only with --devices auto)")
    spec.add_argument("--refresh-probe", action="store_true",
                      help=f"run the probe again, and measure the plan's weight types' read rates again, instead of "
                           f"reading their caches (${CACHE_ENV} relocates them)")
    fmt = out.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    fmt.add_argument("--emit", choices=["llama.cpp"], help="print llama.cpp flags for the same placement")
    plan_hosts.add_host_arguments(p)
    return p


LLAMA_CPP_HOT_NOTE = ("llama.cpp cannot express partial expert tensors (it places whole ones): these flags are "
                      "the nearest whole-tensor map, with the hot experts ({what}) left on the CPU")


def op_offload_forecast(plan: Plan, model, hits) -> dict | None:
    """``--op-offload auto``'s threshold for this plan and box, and predicted prefill t/s at the
    ubatch with the RAM-resident experts on the CPU and streamed (None: nothing to stream)."""
    from placement.op_offload import PrefillModel

    if not any(d.is_gpu for d in plan.devices):
        return None
    hw = plan_profile(plan).hardware
    try:
        m = PrefillModel(plan, model, hw, hits=hits)
    except FootprintError:          # a model the cost model cannot read (e.g. 2-D expert biases)
        return None
    if not m.layers:
        return None
    ub = plan.settings.ubatch
    return {"threshold": m.threshold(), "ubatch": ub,
            "prefill_tps": {"cpu": round(m.tokens_per_second(ub, streamed=False), 2),
                            "streamed": round(m.tokens_per_second(ub, streamed=True), 2)}}


def format_op_offload(op: dict) -> str:
    t = op["threshold"]
    when = f"passes of >= {t} tokens" if t is not None else "never (streaming does not pay on this box)"
    tps = op["prefill_tps"]
    return (f"op offload (--op-offload auto): {when} stream the RAM-resident experts to a GPU; predicted "
            f"prefill at ubatch {op['ubatch']}: {tps['cpu']:.1f} t/s on the CPU, {tps['streamed']:.1f} t/s streamed")


def for_this_box(args: argparse.Namespace, plan: Plan) -> bool:
    """Whether the forecast should be calibrated on this box: ``--probe``, or devices found
    here (``--devices auto``) with no measured profile in the plan already."""
    if args.no_probe or args.hw_profile:
        return False
    if args.probe:
        return True
    measured = plan.speculative is not None and plan.speculative.profile is not None
    return not args.placement and (args.devices or "auto").strip().lower() == "auto" and not measured


def forecast_profile(args: argparse.Namespace, plan: Plan, model) -> tuple[SpecProfile | None, str]:
    """The profile the forecast uses in place of the plan's (None: the plan's own), and the
    probe's line when it ran or was read from its cache: ``--hw-profile``, else the probe on
    this box (``for_this_box``)."""
    if args.hw_profile:
        base = plan.speculative.profile if plan.speculative is not None else None
        hw = complete_hardware(HardwareProfile.from_yaml(hw_profile_path(args.hw_profile)), plan)
        return (SpecProfile(hw) if base is None else dataclasses.replace(base, hardware=hw)), ""
    if for_this_box(args, plan):
        return probed_profile(plan, model, refresh=args.refresh_probe)
    return None, ""


def probed_profile(plan: Plan, model, *, refresh: bool) -> tuple[SpecProfile, str]:
    """The plan's profile with this box's CPU terms from the probe (``offload.probe``), the
    RAM read rate that of this plan's CPU weight types on the path this CPU decodes them with
    (``probe.weights_read_gbps``; the probe's own is Q8_0's); the GPU terms stay the plan's
    (defaults by GPU name)."""
    from offload import probe

    result, how = probe.calibrate(refresh=refresh)
    hw, rate = probe.at_weights_rate(result.hardware, model.tensors, plan.tensors, model.spec.n_expert_used,
                                     log=lambda m: print(f"offload: {m}", file=sys.stderr), refresh=refresh)
    note = "" if rate is None or abs(rate - result.hardware.cpu_read_gbps) <= 1e-3 else \
        f"; this plan's CPU weights read at {rate:.1f} GB/s (their types' decode path on this CPU)"
    profile = dataclasses.replace(plan_profile(plan), hardware=complete_hardware(hw, plan))
    return profile, f"{how}: {result.describe()}{note}"


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    model = open_model(args.model) if args.model else None
    if plan_hosts.wants_hosts(args):
        return plan_hosts.main(args, model)
    for flag in ("hop_latency_us", "hop_gbps"):
        if getattr(args, flag) is not None:
            raise OffloadError(f"--{flag.replace('_', '-')} is for a plan across hosts (--hosts)")
    plan, model, draft = plan_from_args(args, model)
    # a plan file's routing counts (``offload tune``) stay with it and feed its forecasts
    kept = read_plan_file(args.placement).routing if args.placement else None
    hits = RoutingCounts.from_file(args.routing) if args.routing else kept
    table = gain = interval = plain_hw = plain_tps = fp = concurrency = None
    probe_note = ""
    if args.spec_type in ("mtp", "dspark") and plan.drafting == "none":
        raise NoDraftHead(plan.model_path, f"--spec-type {args.spec_type}")
    check_n_max(args.spec_max_n, "--spec-max-n")
    ngram = None
    if args.spec_type == "none":
        plan = dataclasses.replace(plan, speculative=None)
    elif plan.drafting != "none" and args.spec_type != "ngram":
        profile, probe_note = forecast_profile(args, plan, model)
        max_n = _head_max_n(args.spec_max_n, model, draft)
        table, section = predict(plan, model, draft, profile=profile, max_n=max_n, hits=hits)
        plan = dataclasses.replace(plan, speculative=section)
        concurrency = predict_concurrency(plan, model, draft, profile=profile, max_n=max_n, hits=hits)
        if not args.no_probe:
            fp, used = plan_footprint(plan, model, draft), plan_profile(plan)
            interval = forecast_interval(fp, forecast_hardware(plan, used.hardware), table,
                                         routing=used.routing, hits=hits,
                                         draft_kind=drafter_kind(plan, draft))
    if plan.drafting == "none" and not args.no_probe:
        # no draft head: no n_max table, but the plain decode forecast and its range
        profile, probe_note = forecast_profile(args, plan, model)
        plain_hw = forecast_hardware(plan, (profile or plan_profile(plan)).hardware)
        try:
            fp = plan_footprint(plan, model, draft)
            interval = forecast_interval(fp, plain_hw, None, hits=hits)
            plain_tps = predicted_decode_tps(fp, plain_hw, hits=hits)
        except FootprintError as exc:      # a model the cost model cannot read (e.g. 2-D expert biases)
            print(f"offload: note: no plain decode forecast: {exc}", file=sys.stderr)
            plain_hw = None
    if args.spec_type != "none" and args.spec_max_n > 0:
        ngram_hw = plain_hw if plain_hw is not None else forecast_hardware(plan, plan_profile(plan).hardware)
        ngram = ngram_forecast(plan, model, draft, ngram_hw, hits, args.spec_max_n)
    if probe_note:
        print(f"offload: {probe_note}", file=sys.stderr)
    if hits is not None and plan.hot_experts:
        try:
            gain = hot_gain(plan, model, draft, hits=hits, max_n=args.spec_max_n)
        except FootprintError as exc:      # the plan stands; only the forecast is left out
            print(f"offload: note: no hot-expert forecast: {exc}", file=sys.stderr)
    op = op_offload_forecast(plan, model, hits)
    draft_arch = draft.spec.arch if draft is not None else None
    hot_note = LLAMA_CPP_HOT_NOTE.format(what=describe(plan.hot_experts, model.tensors)) if plan.hot_experts else ""
    if args.output:
        write_atomic(args.output, plan_to_yaml(plan, routing=hits))
        print(f"offload: wrote {args.output}", file=sys.stderr)
    if args.json:
        extra = {"llama_cpp_note": hot_note} if hot_note else {}
        if gain is not None:
            extra["hot_experts_forecast"] = gain.to_dict()
        if op is not None:
            extra["op_offload"] = op
        if interval is not None:
            extra["forecast_interval"] = interval.to_dict()
        if plain_tps is not None:
            extra["predicted_plain_tps"] = round(plain_tps, 4)
        if ngram is not None:
            extra["ngram_forecast"] = ngram
        if concurrency is not None:
            extra["concurrency_forecast"] = [r.to_dict() for r in concurrency]
        print(json.dumps({**plan.to_dict(), "llama_cpp_args": llama_cpp_args(plan, draft_arch), **extra}, indent=1))
    elif args.emit:
        if hot_note:
            print(f"offload: note: {hot_note}", file=sys.stderr)
        print(format_args(llama_cpp_args(plan, draft_arch)))
    else:
        sys.stdout.write(format_plan(plan, model, draft))
        if table is not None:
            head = ("DSpark block drafter (--draft)" if drafter_kind(plan, draft) == "block"
                    else f"{plan.drafting} draft head")
            print(f"\nspeculative decoding ({head}; predicted, "
                  f"profile: {plan_profile(plan).hardware.source}):")
            if interval is not None:
                print(format_inputs(forecast_hardware(plan, plan_profile(plan).hardware), interval.spread, fp))
            print(table.format(interval))
            if concurrency is not None:
                print(format_concurrency(concurrency))
        elif plain_tps is not None:
            print(f"\nplain decoding (no draft head; predicted, profile: {plain_hw.source}):")
            print(format_inputs(plain_hw, interval.spread, fp))
            print(f"predicted plain decode: {plain_tps:.2f} t/s [{interval.plain_tps[0]:.0f}-{interval.plain_tps[1]:.0f}]")
        if ngram is not None:
            print(format_ngram_forecast(ngram))
        if gain is not None:
            print(gain.format())
        if op is not None:
            print(format_op_offload(op))
        print(f"\nllama.cpp: {format_args(llama_cpp_args(plan, draft_arch))}")
        if hot_note:
            print(f"note: {hot_note}")
    return 0
