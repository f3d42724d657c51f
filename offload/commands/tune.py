"""``offload tune``: measure this box, fit the speculative cost model, run it, choose n_max.

    offload tune [MODEL.gguf] --placement PLAN.yaml [--prompts FILE] [--max-n 6] [--budget 120s]
                 [-n 128] [--spec-p-min 0[,P...]] [-o OUT.yaml] [--json PATH] [placement flags]

Phases (progress on stderr; --budget is wall time from the start, load included):

  1. calibrate         greedy plain decoding of every prompt (-n tokens): the text the timed
                       passes feed (real tokens route like real decoding)
  2. passes (15 %)     T_verify(B), B = 1..max-n+1 (the target over B tokens after prompt +
                       half the text, all logits, KV rolled back), T_draft(B) (the head over
                       the B pairs a step's first draft pass runs; B = 1 is a chained step),
                       and short runs of the real decode loop, plain and drafting at max-n,
                       from the same position: interleaved rounds, medians. A DSpark drafter
                       (dflash --draft): T_draft(B) its draft call of B drafts (block pass,
                       Markov chain), T_inject(B) the injection of B kept tokens' taps
     routing           distinct routed experts per CPU-resident MoE layer in B-token windows,
                       and per-expert counts of every MoE layer (the NextN block's too, run
                       over the text as drafting feeds it): written into the plan's routing:
                       section (and to --routing-out, as `offload profile -o` writes it)
     op-offload rates  the CPU's batched MoE rate (one CPU-resident layer's experts over a
                       ubatch of tokens) and, on a real CUDA device only, pinned host->device
                       bandwidth; stored in the plan's profile, where --op-offload auto reads them
  3. acceptance        speculative decoding at n_max = max-n on every prompt, per p_min:
                       conditional acceptance a_j per draft position (and c_j under p_min)
     fit               placement.cost.fit_profile (cpu_read, cpu_compute, cpu_layer, forward)
                       on the pass medians; the loop's own time per step (what the run stats
                       book to neither drafting nor verifying: plain → step_us, drafting →
                       spec_step_us); the n_max table
  4. runs (the rest)   baseline and n_max = 1..min(4, max-n) plus the predicted best and its
                       neighbours, on every prompt, interleaved (round-robin over n, order
                       reversed every other repeat); repeats while the budget left holds one
                       more (at least one, so a tight budget can overrun by up to a repeat);
                       measured speedup = tokens/s(n) / tokens/s(0) of the same repeat
  5. hot experts (15 %, plans with a GPU) the plan without and with hot experts chosen from the
                       measured routing: predicted plain decode t/s and break-even n_max, and
                       measured plain decode t/s of both plans (a second session), paired

Phases 1 and 3 are one generation per prompt each, so their time follows -n and the
number of prompts; the pass timings take 15 % of the budget; the runs take what is left.

Choice: the predicted best n_max, unless a measured n_max beats it by more than twice the
standard error of the paired per-repeat difference (and by 1 %); then the best measured one.
With several --spec-p-min values the p_min whose predicted best is highest is run and chosen.

Output: predicted vs measured per n_max on stdout; the plan's ``speculative`` section
(n_max, p_min, source: tune, the predicted table, the measured rows, the fitted profile) is
written to -o, else back into --placement's file (atomic; other sections untouched). Without
--placement the plan is made on the fly from the placement flags (as ``offload run`` does)
and is written only with -o. ``offload run --placement`` then drafts with the chosen n_max.

Prompts: the bench tasks (code, extract, story) by default; --prompts FILE holds one prompt
per paragraph (blank-line separated), or, when the file has lines that are exactly ``---``,
the text between those lines (so prompts may contain blank lines). Decoding is greedy.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

from offload.bench_tasks import TASKS
from offload.commands.plan import add_placement_arguments, plan_from_args
from offload.commands.run import add_session_arguments, runtime_process_settings, session_options
from offload.errors import ArgumentParser, OffloadError, write_atomic
from offload.plans import read_plan_file
from offload.tune_result import HotComparison, MeasuredRow, RunRecord, StepTerms, TuneResult
from placement.concurrency import format_concurrency
from placement.draft import DRAFTER_KIND, check_p_min, spec_type
from placement.errors import PlacementError

DEFAULT_MAX_N = 6
DEFAULT_BUDGET_S = 120.0
DEFAULT_TOKENS = 128
MIN_BUDGET_S = 8.0           # below this the pass timings get under a second (tune still runs one
                             # repeat of each mode, overrunning a tight budget by up to that)
MIN_TOKENS = 16
PASSES_SHARE = 0.15         # of --budget for the pass timings; the runs get what is left
FIT_FREE = ("cpu_read", "cpu_compute", "cpu_layer", "forward")
# without draft passes (a model with no head) T_verify alone cannot tell the per-layer from the
# per-pass fixed cost: one of them is fitted, the other keeps the profile's value
FIT_FREE_VERIFY_ONLY = ("cpu_read", "cpu_compute", "forward")
RUN_ALL_UP_TO = 4            # run every n_max 1..min(4, max-n) when the budget allows
HOT_SHARE = 0.15            # of --budget kept for the hot-expert comparison (plans with a GPU)


def _budget(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min)?\s*", text)
    if not m:
        raise OffloadError(f"--budget: {text!r} is not a duration (e.g. 120, 120s, 5m)")
    value = float(m.group(1)) * (60.0 if m.group(2) in ("m", "min") else 1.0)
    if value < MIN_BUDGET_S:
        raise OffloadError(f"--budget {text} is too small to measure anything: tune needs at least "
                           f"{MIN_BUDGET_S:g}s")
    return value


def _p_mins(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        raise OffloadError(f"--spec-p-min: {text!r} is not a comma list of numbers in [0, 1)")
    return sorted({check_p_min(v, "--spec-p-min") for v in values})


def read_prompts(path: str) -> list[str]:
    """One prompt per paragraph, or the text between ``---`` lines when the file has any."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise OffloadError(f"--prompts {path}: not UTF-8 text") from None
    except OSError as e:
        raise OffloadError(f"--prompts {path}: {e.strerror}") from None
    lines = text.splitlines()
    if any(line == "---" for line in lines):
        parts, cur = [], []
        for line in lines:
            if line == "---":
                parts.append("\n".join(cur))
                cur = []
            else:
                cur.append(line)
        parts.append("\n".join(cur))
    else:
        parts = re.split(r"\n\s*\n", text)
    prompts = [p.strip("\n") for p in parts if p.strip()]
    if not prompts:
        raise OffloadError(f"--prompts {path}: no prompt in the file")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="offload tune", description=__doc__.split("\n\n")[0].replace("``", ""),
                       epilog=__doc__.split("\n\n", 2)[2].replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file (default: the --placement plan's model, else the shipped tiny glm4moe model)")
    p.add_argument("--prompts", metavar="FILE",
                   help="calibration prompts: one per paragraph, or separated by '---' lines "
                        "(default: the bench tasks code, extract, story)")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, metavar="N",
                   help=f"largest draft length measured and predicted (default {DEFAULT_MAX_N})")
    p.add_argument("--budget", default=f"{DEFAULT_BUDGET_S:g}s", metavar="SECONDS",
                   help=f"wall time for the whole tune, load included: 120, 120s, 5m "
                        f"(default {DEFAULT_BUDGET_S:g}s; at least {MIN_BUDGET_S:g}s)")
    p.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens generated per prompt in calibration, acceptance and runs (default "
                        f"{DEFAULT_TOKENS}; acceptance depends on it, so all phases use the same)")
    p.add_argument("--spec-type", default=None, metavar="TYPES",
                   help="comma list of drafters to measure and choose among: mtp, dspark, ngram (llama.cpp's "
                        "spellings too; default: dspark with a dflash --draft, else mtp when the model has a "
                        "draft head, and ngram)")
    p.add_argument("--spec-p-min", default="0", metavar="P[,P...]",
                   help="MTP / DSpark draft p_min value(s) to measure acceptance for and choose among "
                        "(DSpark: the confidence head's cut; default 0)")
    p.add_argument("-o", "--output", metavar="OUT.yaml",
                   help="write the tuned plan here (default: back into --placement's file; without "
                        "--placement nothing is written unless -o is given)")
    p.add_argument("--json", metavar="PATH", help="write every measurement, the fit and both tables as JSON")
    p.add_argument("--routing-out", metavar="ROUTING.yaml",
                   help="also write the measured per-expert routing profile here (as `offload profile -o`); "
                        "it always goes into the plan's routing: section")
    add_session_arguments(p)
    add_placement_arguments(p)
    return p


class Clock:
    """Wall time since the start of the command, and each phase's deadline."""

    def __init__(self, budget: float):
        self.t0, self.budget = time.perf_counter(), budget

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget - self.elapsed()


def say(msg: str) -> None:
    print(f"offload tune: {msg}", file=sys.stderr, flush=True)


def _check_plan_model(args) -> None:
    """A positional model and a plan made for another model: refuse (tune writes the plan)."""
    if not (args.model and args.placement):
        return
    pf = read_plan_file(args.placement)
    if Path(pf.model_path).resolve() != Path(args.model).resolve():
        raise OffloadError(f"{args.placement} is a plan for {pf.model_path}, not {args.model}")


def _file_notes(path: str | None, plan) -> tuple[str, ...]:
    """The plan file's own notes (loading a plan file does not carry them; writing it back
    must not drop them)."""
    if not path:
        return tuple(plan.notes)
    import yaml
    try:
        notes = (yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}).get("notes") or []
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return tuple(plan.notes)
    return tuple(str(n) for n in notes) if isinstance(notes, list) else tuple(plan.notes)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    clock = Clock(_budget(args.budget))
    if args.max_n < 1:
        raise OffloadError(f"--max-n must be >= 1, got {args.max_n}")
    if args.n_predict < MIN_TOKENS:
        raise OffloadError(f"-n must be >= {MIN_TOKENS} (acceptance needs a few steps), got {args.n_predict}")
    if args.torch_threads < 1:
        raise OffloadError(f"--torch-threads must be >= 1, got {args.torch_threads}")
    p_mins = _p_mins(args.spec_p_min)
    texts = read_prompts(args.prompts) if args.prompts else list(TASKS.values())
    names = [f"prompt {i + 1}" for i in range(len(texts))] if args.prompts else list(TASKS)
    _check_plan_model(args)
    runtime_process_settings()     # the same process settings as offload run: measure what run does
    import torch

    from offload import runtime
    from offload.commands.run import open_cli_model

    torch.set_num_threads(args.torch_threads)
    model = open_cli_model(args)
    plan, model, draft = plan_from_args(args, model)
    kinds = tune_drafters(args.spec_type, plan)
    out_path = args.output or args.placement
    session = runtime.load_plan(model, plan, progress=True, **session_options(args))
    with session:
        prompts = [session.tokenize(t) for t in texts]
        for name, ids in zip(names, prompts):
            if len(ids) + args.n_predict > plan.settings.ctx:
                raise OffloadError(f"{name}: {len(ids)} tokens + -n {args.n_predict} exceed the plan's "
                                   f"context of {plan.settings.ctx} (shorten it or lower -n)")
            if len(ids) < 2:
                raise OffloadError(f"{name}: a prompt needs at least 2 tokens")
        session.warmup()
        try:
            result = tune(session, plan, model, draft, prompts, names, args, p_mins, clock, kinds)
        except ValueError as e:          # a measurement that got no sample (too short a text)
            raise OffloadError(f"tune: {e}") from None
    from placement.plan_file import plan_to_yaml

    tuned = dataclasses.replace(plan, speculative=result.section, notes=_file_notes(args.placement, plan))
    print(format_report(result))
    if args.routing_out:
        write_atomic(args.routing_out, result.routing_counts.to_yaml())
        say(f"wrote the measured routing profile to {args.routing_out}")
    if out_path:
        write_atomic(out_path, plan_to_yaml(tuned, routing=result.routing_counts))
        say(f"wrote drafter {result.section.type}, n_max {result.section.n_max}, p_min {result.section.p_min:g} "
            f"into {out_path}")
    else:
        say("no plan written (give -o PLAN.yaml, or tune a --placement file)")
    if args.json:
        write_atomic(args.json, json.dumps(result.to_json(), indent=1, default=float) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------
# The phases.
# ---------------------------------------------------------------------------------------------

def tune_drafters(text: str | None, plan) -> list[str]:
    """The drafters ``--spec-type`` names (``offload.commands.spec_args.plan_drafters``; here
    ``none`` is refused: plain decoding is always measured)."""
    from offload.commands.spec_args import plan_drafters

    if text is not None and any(spec_type(part.strip()) == "none" for part in text.split(",")):
        raise OffloadError("offload tune --spec-type: plain decoding is always measured; name drafters")
    return plan_drafters(text, plan, "offload tune")


def tune(session, plan, model, draft, prompts, names, args, p_mins, clock: Clock,
         kinds: list[str] | None = None) -> TuneResult:
    from offload import tune as measure
    from placement.concurrency import concurrency_table
    from placement.cost import SpecProfile, best_over_p_min, speculation_table
    from placement.cost_fit import fit_profile
    from placement.routing import distinct_experts_uniform
    from placement.spec_section import SpecSection
    from placement.speculative import block_injection, plan_footprint, plan_profile, predict

    kinds = kinds if kinds is not None else tune_drafters(None, plan)
    # the drafter with weights (mtp or dspark: a dflash --draft replaces any MTP head), measured per p_min
    head_kind = next((k for k in kinds if k != "ngram"), None)
    max_n, n_tok = args.max_n, args.n_predict
    dspark = getattr(session.model, "dspark", None)
    # n_max past what one DSpark block drafts is the block (llama.cpp clamps n_max the same way)
    n_cap = {k: min(max_n, dspark.header.max_drafts) if k == "dspark" else max_n for k in kinds}
    budget = clock.budget
    load0 = os.getloadavg()[0]
    say(f"{Path(plan.model_path).name}, {session.devices.describe()}; budget {budget:g}s, "
        f"{len(prompts)} prompts x {n_tok} tokens, max-n {max_n}, drafters {', '.join(kinds)}; "
        f"load average {load0:.2f} on {os.cpu_count()} cores (loaded in {clock.elapsed():.1f}s)")

    # 1. calibration: plain greedy decoding (the text and the plain loop's step time)
    t_phase = clock.elapsed()
    calib = [measure.decode(session, p, n_tokens=n_tok) for p in prompts]
    plain_step = sum(c.eval_s for c in calib) / sum(c.steps for c in calib)
    say(f"calibrate: plain decoding {sum(c.produced for c in calib)} tokens, {plain_step * 1e3:.2f} ms/step "
        f"({clock.elapsed() - t_phase:.1f}s)")

    # 2. pass timings and routing
    t_phase = clock.elapsed()
    longest = max(calib, key=lambda c: len(c.tokens))
    if len(longest.tokens) < 2 * (max_n + 1):
        raise OffloadError(f"-n {n_tok} is too short for --max-n {max_n}: needs at least {2 * (max_n + 1)} tokens")
    seconds = max(budget * PASSES_SHARE - 0.5, 0.5)
    passes = measure.time_passes(session, longest, max_batch=max_n + 1, seconds=seconds,
                                 loop_tokens=2 * (max_n + 1) + 1)
    verify_s, draft_s, inject_s = passes.verify_s(), passes.draft_s(), passes.inject_s()
    say("passes: T_verify(B) " + " ".join(f"{b}:{t * 1e3:.2f}" for b, t in verify_s.items())
        + " ms, T_draft(B) " + (" ".join(f"{b}:{t * 1e3:.2f}" for b, t in draft_s.items()) or "- (no head)")
        + (" ms, T_inject(B) " + " ".join(f"{b}:{t * 1e3:.2f}" for b, t in inject_s.items()) if inject_s else "")
        + f" ms, decode loop {statistics.median(r.step_s for r in passes.plain) * 1e3:.2f}"
        f" ms/step ({passes.rounds} rounds, {clock.elapsed() - t_phase:.1f}s)")
    routing, layers = measure.measure_routing(session, [c.prompt + c.tokens for c in calib], max_n + 1)
    cfg = session.config
    uniform = [distinct_experts_uniform(cfg.n_expert, cfg.n_expert_used, b) for b in range(1, max_n + 2)]
    say("routing: distinct experts per layer (blk " + ",".join(map(str, layers)) + ") B=1.. "
        + " ".join(f"{d:.2f}" for d in routing.distinct) + "; uniform " + " ".join(f"{u:.2f}" for u in uniform))
    counts = measure.routing_counts(session, [c.prompt + c.tokens for c in calib], names,
                                    source=f"offload tune calibration ({args.prompts or 'bench tasks'}, "
                                           f"{n_tok} generated per prompt)",
                                    model=plan.model_path, max_batch=max_n + 1)
    say(f"routing: per-expert counts over {counts.tokens} tokens, blocks "
        + ",".join(map(str, sorted(counts.layers))) + " (NextN included when the model has one)")

    # the two rates --op-offload auto weighs: the CPU's batched MoE rate, host->device bandwidth
    rates = measure.measure_prefill_rates(session, model.tensors, batch=plan.settings.ubatch)
    say("op-offload rates: " + _rates_summary(rates))

    # 3. acceptance per drafter (MTP, DSpark: per p_min), same prompts and length as the runs
    t_phase = clock.elapsed()
    accept = {}
    for p_min in p_mins if head_kind else ():
        accept[p_min], _ = measure.measure_acceptance(session, prompts, n_max=n_cap[head_kind], p_min=p_min,
                                                      n_tokens=n_tok, spec_type=head_kind)
        say(f"acceptance {head_kind} p_min {p_min:g}: a_j " + " ".join(f"{a:.3f}" for a in accept[p_min].accept)
            + ("" if p_min == 0 else "; c_j " + " ".join(f"{c:.3f}" for c in accept[p_min].cont)))
    ngram_accept = None
    if "ngram" in kinds:
        ngram_accept, _ = measure.measure_acceptance(session, prompts, n_max=max_n, p_min=0.0, n_tokens=n_tok,
                                                     spec_type="ngram")
        say("acceptance ngram: a_j " + " ".join(f"{a:.3f}" for a in ngram_accept.accept)
            + "; c_j (drafts made) " + " ".join(f"{c:.3f}" for c in ngram_accept.cont))
    say(f"acceptance: {clock.elapsed() - t_phase:.1f}s")

    # fit: pass times → hardware profile; loop overheads from the decode runs
    fp = plan_footprint(plan, model, draft)
    base_hw = plan_profile(plan).hardware
    free = [p for p in (FIT_FREE if draft_s else FIT_FREE_VERIFY_ONLY) if p in base_hw.linear_params()]
    fit = fit_profile(fp, base_hw, verify_s=verify_s, draft_s=draft_s or None, free=free, routing=routing)
    step_s, spec_step_s = passes.loop_overheads()
    step_us, spec_step_us = step_s * 1e6, spec_step_s * 1e6
    hw = fit.profile.with_linear_params({"step": step_us * 1e-6, "spec_step": spec_step_us * 1e-6},
                                        source=f"measured by offload tune ({time.strftime('%Y-%m-%d')})")
    hw = with_prefill_rates(hw, rates)
    say(f"fit: {_fit_summary(fit)}; per step: loop {step_us / 1e3:.2f} ms, +{spec_step_us / 1e3:.2f} ms drafting")
    try:
        batched = measure.decode_several(session, prompts, n_tokens=n_tok)
        batch_us = measure.batch_step(batched, fp, hw, routing=routing)
        hw = dataclasses.replace(hw, batch_step_us=batch_us)
        say("several sequences: plain decoding " + ", ".join(f"{b.sequences} at once {b.tokens_per_s:.1f} t/s"
                                                           for b in batched)
            + f"; each adds {batch_us / 1e3:.2f} ms to a batched step beyond the pass")
    except OffloadError as e:           # a session that cannot batch sequences, prompts too short
        batched = []
        say(f"several sequences: not measured ({e})")
    # a block drafter (DSpark) also pays the injection of each step's kept tokens
    inject = block_injection(plan, model, draft) if head_kind == "dspark" else None
    tables = {p: speculation_table(fp, hw, acceptance=accept[p], max_n=n_cap[head_kind], routing=routing,
                                   draft_kind=DRAFTER_KIND[head_kind], inject=inject) for p in accept}
    by_kind = {}
    if head_kind:
        by_kind[head_kind] = best_over_p_min(tables.values())
    if ngram_accept is not None:
        by_kind["ngram"] = speculation_table(fp, hw, acceptance=ngram_accept, max_n=max_n, routing=routing,
                                             draft_kind="free")
    p_min = by_kind[head_kind].acceptance.p_min if head_kind else 0.0

    # 4. runs: the baseline and each drafter's n_max values, interleaved
    def wanted(best: int, every: bool, top: int) -> list[int]:
        ns = {best, best - 1, best + 1, 1} | (set(range(1, min(RUN_ALL_UP_TO, top) + 1)) if every else set())
        return sorted(n for n in ns if 1 <= n <= top)

    def stage_list(every: bool) -> list[tuple[str, int]]:
        return [("none", 0)] + [(k, n) for k in kinds for n in wanted(by_kind[k].best.n, every, n_cap[k])]

    per_rep = {("none", 0): len(prompts) * (n_tok - 1) / next(iter(by_kind.values())).rows[0].tokens_per_s}
    per_rep |= {(k, n): len(prompts) * (n_tok - 1) / by_kind[k].rows[n].tokens_per_s
                for k in kinds for n in range(1, n_cap[k] + 1)}
    stages = stage_list(True)
    if sum(per_rep[st] for st in stages) > clock.left():
        stages = stage_list(False)
    say(f"runs: {', '.join(f'{k} {n}' if n else 'plain' for k, n in stages)}; about "
        f"{sum(per_rep[st] for st in stages):.1f}s per repeat, {clock.left():.1f}s left")
    records: list[RunRecord] = []
    rep_times: list[float] = []
    rep = 0
    # one repeat always; another while the budget left holds one more of the repeats so far
    reserve = budget * HOT_SHARE if any(d.is_gpu for d in plan.devices) else 0.0   # for the hot comparison
    while rep == 0 or clock.left() - reserve > max(rep_times):
        t_rep = clock.elapsed()
        order = stages if rep % 2 == 0 else stages[::-1]
        for i, ids in enumerate(prompts):
            for kind, n in order:
                r = measure.decode(session, ids, n_tokens=n_tok, n_max=n,
                                   p_min=p_min if kind == head_kind else 0.0, spec_type=kind if n else "mtp")
                records.append(RunRecord(rep, names[i], r))
        rep_times.append(clock.elapsed() - t_rep)
        rep += 1
        row = _measured_rows(records, stages)
        say(f"runs: repeat {rep} ({rep_times[-1]:.1f}s): speedup "
            + " ".join(f"{m.drafter} n{m.n_max} {m.speedups[-1]:.3f}" for m in row if m.n_max))
    measured = _measured_rows(records, stages)
    choices = {k: choose(by_kind[k].best.n, [m for m in measured if m.drafter in (k, "none")]) for k in kinds}
    chosen_kind, runner_up = choose_drafter(choices, measured)
    chosen, rule = choices[chosen_kind]
    table = by_kind[chosen_kind]
    hot, hot_note = compare_hot(session, plan, model, draft, prompts, counts,
                                SpecProfile(hw, table.acceptance, routing), args, clock, max_n=max_n)
    say(f"hot experts: {hot_note}" if hot is None else "hot experts: compared (see the report)")
    load1 = os.getloadavg()[0]

    # the plan section: the chosen drafter's table with the measured profile, then tune's choice
    profile = SpecProfile(hw, table.acceptance, routing)
    if chosen_kind == head_kind:
        old = plan.speculative.entries() if plan.speculative is not None else {}
        kept = {k: v for k, v in old.items() if k not in ("type", "n_max", "p_min", "source", "runner_up")}
        plan_in = dataclasses.replace(plan, speculative=SpecSection.of(kept) if kept else None)
        entries = predict(plan_in, model, draft, profile=profile, max_n=n_cap[head_kind])[1].entries()
    else:
        entries = {"type": chosen_kind, "n_max": chosen, "p_min": 0.0, "source": "tune", **table.to_dict(),
                   "profile": profile}
    mine = {m.n_max: m for m in measured if m.drafter in (chosen_kind, "none")}
    entries.update({
        "type": chosen_kind, "n_max": chosen, "p_min": p_min if chosen_kind == head_kind else 0.0, "source": "tune",
        "measured_speedup": round(mine[chosen].speedup_mean, 4) if chosen in mine else None,
        "measured_best_n_max": max(mine.values(), key=lambda m: m.speedup_mean).n_max,
        "choice": rule,
        "runner_up": runner_up,
        "measured_rows": [m.section_dict() for m in measured],
        "tune": {"date": time.strftime("%Y-%m-%d %H:%M"), "budget_s": budget, "seconds": round(clock.elapsed(), 1),
                 "prompts": len(prompts), "tokens_per_run": n_tok, "repeats": rep,
                 "load_average": [round(load0, 2), round(load1, 2)], "cores": os.cpu_count()},
    })
    # the profile last, where predict() puts it
    entries["profile"] = entries.pop("profile")
    section = SpecSection.of(entries)
    # the baseline's row goes with the first drafter's (its prediction is T(0) for every drafter)
    terms = [t for k in kinds for t in _terms(fp, hw, routing, by_kind[k].acceptance,
                                              [m for m in measured if m.drafter == k or
                                               (m.drafter == "none" and k == kinds[0])],
                                              draft_kind=DRAFTER_KIND[k], inject=inject)]
    # -np N: aggregate t/s and break-even n_max per number of sequences, from what was measured
    conc_kind = chosen_kind if chosen_kind in by_kind else next(iter(by_kind), None)
    concurrency = () if conc_kind is None else concurrency_table(
        fp, hw, acceptance=by_kind[conc_kind].acceptance, max_n=n_cap.get(conc_kind, max_n), routing=routing,
        draft_kind=DRAFTER_KIND[conc_kind], inject=inject if conc_kind == "dspark" else None)
    return TuneResult(
        model=plan.model_path, devices=session.devices.describe(), budget_s=budget, seconds=clock.elapsed(),
        load_average=(load0, load1), tokens_per_run=n_tok, calibration_step_ms=plain_step * 1e3,
        plain_step_ms=statistics.median(r.step_s for r in passes.plain) * 1e3,
        loop_step_ms=step_us / 1e3, loop_spec_step_ms=spec_step_us / 1e3,
        verify_ms={b: t * 1e3 for b, t in verify_s.items()}, draft_ms={b: t * 1e3 for b, t in draft_s.items()},
        inject_ms={b: t * 1e3 for b, t in inject_s.items()},
        terms=tuple(terms),
        pass_spread=passes.spread(), pass_rounds=passes.rounds,
        routing=routing, routing_layers=tuple(layers), routing_uniform=tuple(uniform),
        acceptance=accept, fit=fit, fit_free=tuple(free), hardware=hw, predicted=tables,
        p_min=p_min, stages=tuple(stages), repeats=rep, runs=tuple(records), measured=tuple(measured),
        chosen_n_max=chosen, choice=rule, section=section, prefill=rates, routing_counts=counts,
        hot=hot, hot_note=hot_note, tables=by_kind, chosen_drafter=chosen_kind, drafter_choices=choices,
        runner_up=runner_up, head_drafter=head_kind, concurrency=concurrency, batched=tuple(batched))



def choose_drafter(choices: dict[str, tuple[int, str]], measured: list[MeasuredRow]) -> tuple[str, dict | None]:
    """The drafter whose chosen n_max measured the highest speedup, and the runner-up (the
    best of the others: type, n_max, its measured speedup, and the margin between them)."""
    by_key = {(m.drafter, m.n_max): m for m in measured}

    def speedup(kind: str) -> float:
        n = choices[kind][0]
        row = by_key.get((kind, n)) if n else by_key.get(("none", 0))
        return row.speedup_mean if row is not None else 0.0

    ranked = sorted(choices, key=lambda k: (-speedup(k), list(choices).index(k)))
    if len(ranked) < 2:
        return ranked[0], None
    best, second = ranked[0], ranked[1]
    return best, {"type": second, "n_max": choices[second][0], "measured_speedup": round(speedup(second), 4),
                  "margin": round(speedup(best) - speedup(second), 4)}


def compare_hot(session, plan, model, draft, prompts, counts, profile, args, clock: Clock, *,
                max_n: int) -> tuple[HotComparison | None, str]:
    """The plan without and with hot experts chosen from ``counts``: predicted (``hot_gain``
    with the fitted ``profile`` and the counts' per-expert rates) and measured plain decode
    t/s, the two sessions alternating per prompt (order reversed every other repeat) while
    the budget lasts (at least one repeat). (None, why) when there is nothing to compare."""
    from offload import runtime
    from offload import tune as measure
    from placement.hot_experts import describe
    from placement.plan import build_plan
    from placement.planner import add_hot_experts
    from placement.speculative import hot_gain

    if not any(d.is_gpu for d in plan.devices):
        return None, "not compared: the plan has no GPU to hold any"
    base = plan if not plan.hot_experts else dataclasses.replace(
        build_plan(model, plan.placement, plan.settings, plan.devices, plan.targets, mode=plan.mode, draft=draft,
                   notes=plan.notes), speculative=plan.speculative)
    try:
        hot_plan = plan if plan.hot_experts else add_hot_experts(plan, model, counts, draft)
    except PlacementError as exc:
        return None, f"not compared: {exc}"
    if not hot_plan.hot_experts:
        return None, "not compared: no GPU has room above its target for a single expert of a CPU-resident block"
    try:
        gain = hot_gain(hot_plan, model, draft, hits=counts, profile=profile, max_n=max_n)
    except PlacementError as exc:
        return None, f"not compared: {exc}"
    other = runtime.load_plan(model, base if plan.hot_experts else hot_plan, virtual_gpus=args.virtual_gpus,
                              gpu_dtype=args.gpu_dtype, op_offload=args.op_offload, threads=args.threads, quiet=True)
    sessions = (other, session) if plan.hot_experts else (session, other)     # (without, with)
    tps: tuple[list[float], list[float]] = ([], [])
    with other:
        other.warmup()
        rep_s = 0.0
        while not tps[0] or clock.left() > rep_s:
            t0 = clock.elapsed()
            order = (0, 1) if len(tps[0]) % 2 == 0 else (1, 0)
            runs: dict[int, list] = {0: [], 1: []}
            for ids in prompts:
                for side in order:
                    runs[side].append(measure.decode(sessions[side], ids, n_tokens=args.n_predict))
            for side in (0, 1):
                tps[side].append(sum(r.produced for r in runs[side]) / sum(r.eval_s for r in runs[side]))
            rep_s = clock.elapsed() - t0
    virtual = any(d.is_gpu for d in plan.devices) and bool(session.devices.virtual)
    return HotComparison(describe(hot_plan.hot_experts, model.tensors), (gain.tps_without, gain.tps_with),
                         (gain.break_even_without, gain.break_even_with), (tuple(tps[0]), tuple(tps[1])),
                         virtual), ""


def _terms(fp, hw, routing, acceptance, measured: list[MeasuredRow], *, draft_kind: str = "chain",
           inject=None) -> list[StepTerms]:
    """Per run n_max: the predicted step split into draft passes, verify pass and the loop's
    own time, beside what the runs' stats booked to each — which term a misprediction is in.
    ``draft_kind``: ``free`` for a drafter that runs no weights (its predicted draft term is 0),
    ``block`` for one block pass over n tokens plus the injection (``inject``: its footprint)
    of the 1 + accepted tokens each step keeps (the loop books that to drafting too)."""
    from placement.cost import forward_time

    kw = dict(n_embd=fp.n_embd, act_bytes=fp.act_bytes, routing=routing)
    params = hw.linear_params()
    out = []
    for m in measured:
        n = m.n_max
        verify = [forward_time(fp.target, b, hw, **kw) for b in range(1, n + 2)]
        draft = [0.0 if draft_kind == "free" else forward_time(fp.draft, b, hw, **kw) for b in range(1, n + 2)]
        dist = acceptance.drafted_distribution(n)
        if draft_kind == "block" and n:
            kept = acceptance.accepted_distribution(n)
            injected = sum(q * forward_time(inject, a + 1, hw, **kw) for a, q in enumerate(kept)) if inject else 0.0
            d_pred = draft[n - 1] + injected
        else:
            first = sum(p * draft[k] for k, p in enumerate(acceptance.accepted_distribution(n)))
            d_pred = sum(p * (first + (min(d + 1, n) - 1) * draft[0]) for d, p in enumerate(dist) if p and n)
        v_pred = sum(p * verify[d] for d, p in enumerate(dist))
        loop = params["step"] + (params["spec_step"] if n else 0.0)
        out.append(StepTerms(n, d_pred * 1e3, m.draft_ms, v_pred * 1e3, m.verify_ms,
                             loop * 1e3, m.step_ms - m.draft_ms - m.verify_ms, m.drafter))
    return out


def with_prefill_rates(hw, rates):
    """``hw`` with the measured op-offload rates in place of the profile's (what was not
    measured keeps the profile's value); the plan's profile carries them to ``offload run``."""
    gpus = {dev: (dataclasses.replace(g, link_gbps=rates.link_gbps[dev], source="measured by offload tune")
                  if dev in rates.link_gbps else g) for dev, g in hw.gpus.items()}
    cpu = rates.cpu_batched_gflops
    return dataclasses.replace(hw, gpus=gpus, cpu_batched_gflops=hw.cpu_batched_gflops if cpu is None else cpu)


def _rates_summary(rates) -> str:
    parts = []
    if rates.cpu_batched_gflops is not None:
        parts.append(f"CPU batched MoE {rates.cpu_batched_gflops:.1f} GFLOP/s (blk.{rates.cpu_layer}, "
                     f"{rates.cpu_batch} tokens, {rates.cpu_seconds * 1e3:.1f} ms)")
    parts += [f"{dev} host->device {gbps:.1f} GB/s (pinned)" for dev, gbps in rates.link_gbps.items()]
    return "; ".join(parts + list(rates.notes))


def _fit_summary(fit) -> str:
    parts = []
    for k, v in fit.fitted.items():
        if k in ("cpu_read", "cpu_compute") or k.startswith(("gpu_read", "link:")):
            parts.append(f"{k} {1 / v / 1e9:.2f} GB/s" if v > 0 else f"{k} free (0)")
        else:
            parts.append(f"{k} {v * 1e6:.0f} us")
    return ", ".join(parts) + f"; largest pass error {100 * fit.max_rel_error:.1f}%"


def _measured_rows(records: list[RunRecord], stages: list[tuple[str, int]]) -> list[MeasuredRow]:
    """Per (drafter, n_max): tokens/s over all prompts per repeat; speedup = that / the
    baseline's (("none", 0)) of the same repeat; mean ± std over repeats; measured tokens per
    step and step time."""
    reps = sorted({r.repeat for r in records})
    tps: dict[tuple[str, int], list[float]] = {st: [] for st in stages}
    for rep in reps:
        for st in stages:
            rs = [r.run for r in records if r.repeat == rep and (r.run.drafter, r.run.n_max) == st]
            if rs:
                tps[st].append(sum(r.produced for r in rs) / sum(r.eval_s for r in rs))
    base = tps[("none", 0)]
    out = []
    for st in stages:
        rs = [r.run for r in records if (r.run.drafter, r.run.n_max) == st]
        k = min(len(tps[st]), len(base))
        sp = tuple(tps[st][i] / base[i] for i in range(k))
        steps = sum(r.steps for r in rs)
        out.append(MeasuredRow(
            n_max=st[1], repeats=k,
            tokens_per_s_mean=statistics.fmean(tps[st]),
            tokens_per_s_std=statistics.stdev(tps[st]) if len(tps[st]) > 1 else 0.0,
            speedup_mean=statistics.fmean(sp), speedup_std=statistics.stdev(sp) if k > 1 else 0.0,
            speedups=sp,
            expected_tokens=sum(r.produced for r in rs) / steps,
            step_ms=1e3 * sum(r.eval_s for r in rs) / steps,
            draft_ms=1e3 * sum(r.draft_s for r in rs) / steps,
            # the target pass alone: choosing the tokens is the loop's (as the probe and the fit count it)
            verify_ms=1e3 * sum(r.verify_s - r.sample_s for r in rs) / steps,
            drafter=st[0]))
    return out


def choose(predicted_best: int, measured: list[MeasuredRow]) -> tuple[int, str]:
    """The predicted best, unless a measured n_max is clearly better: its paired per-repeat
    speedup difference exceeds twice its standard error and 0.01. Then the best measured."""
    by_n = {m.n_max: m for m in measured}
    base = by_n.get(predicted_best)
    if base is None:
        return predicted_best, "predicted best (not run)"
    better = []
    for m in measured:
        d = [a - b for a, b in zip(m.speedups, base.speedups)]
        if len(d) < 2 or m.n_max == predicted_best:
            continue
        mean = statistics.fmean(d)
        se = statistics.stdev(d) / math.sqrt(len(d))
        if mean > max(2 * se, 0.01):
            better.append(m)
    if not better:
        return predicted_best, ("predicted best; no measured n_max beats it by more than 2 standard "
                                "errors of the paired difference")
    pick = max(better, key=lambda m: m.speedup_mean)
    return pick.n_max, (f"measured: n_max {pick.n_max} beats the predicted best {predicted_best} by "
                           "more than 2 standard errors of the paired difference")


# ---------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------

def format_report(r: TuneResult) -> str:
    tables = r.tables or {"mtp": r.table}
    meas = {(m.drafter, m.n_max): m for m in r.measured}
    hw = r.hardware.to_dict()
    drafts = (", ".join(f"B={b} {t:.2f}" for b, t in r.draft_ms.items()) or "- (no draft head)")
    if r.inject_ms:          # a block drafter: T_draft(B) is a block of B, plus the injection of B kept tokens
        drafts += " ms; T_inject(B) " + ", ".join(f"B={b} {t:.2f}" for b, t in r.inject_ms.items())
    lines = [
        f"offload tune: {r.model} on {r.devices}; {r.seconds:.0f}s of a {r.budget_s:g}s budget, "
        f"load average {r.load_average[0]:.2f} -> {r.load_average[1]:.2f}",
        "measured passes: T_verify(B) " + ", ".join(f"B={b} {t:.2f}" for b, t in r.verify_ms.items())
        + " ms; T_draft(B) " + drafts
        + f" ms; plain loop step {r.plain_step_ms:.2f} ms (loop's own "
        f"{r.loop_step_ms:.2f} ms, +{r.loop_spec_step_ms:.2f} ms when drafting)",
        "routing (distinct experts/layer, B=1..): measured " + " ".join(f"{d:.2f}" for d in r.routing.distinct)
        + ", uniform " + " ".join(f"{u:.2f}" for u in r.routing_uniform),
        "op-offload rates (stored in the plan's profile for --op-offload auto): " + _rates_summary(r.prefill),
        "fitted profile: " + ", ".join(f"{k} {v:.4g}" for k, v in hw.items()
                                       if isinstance(v, (int, float)))
        + f" (largest pass error {100 * r.fit.max_rel_error:.1f}%)",
    ]
    base = meas.get(("none", 0))
    for kind, table in tables.items():
        rows = {row.n: row for row in table.rows}
        p_min = r.p_min if kind == r.head_drafter else 0.0
        lines += ["", f"drafter {kind}" + (" (no weights: draft passes cost nothing)" if kind == "ngram" else "")
                  + ":", table.format(), "",
                  f"predicted vs measured ({kind}, p_min {p_min:g}, {r.repeats} repeats x {r.tokens_per_run} "
                  "tokens per prompt; measured E = tokens/step, T = ms/step):",
                  f"{'n_max':>5} {'E pred':>7} {'E meas':>7} {'T pred':>7} {'T meas':>7} {'S pred':>7} "
                  f"{'S measured':>15} {'diff':>7}"]
        mine = ([base] if base is not None else []) + sorted(
            (m for m in r.measured if m.drafter == kind), key=lambda m: m.n_max)
        for m in mine:
            p = rows[m.n_max]
            diff = (p.speedup / m.speedup_mean - 1) * 100
            lines.append(f"{m.n_max:>5} {p.expected_tokens:>7.2f} {m.expected_tokens:>7.2f} {p.step_s * 1e3:>7.2f} "
                         f"{m.step_ms:>7.2f} {p.speedup:>7.3f} {m.speedup_mean:>7.3f} ± {m.speedup_std:.3f} "
                         f"{diff:>+6.1f}%")
        theirs = [m for m in r.measured if m.drafter == kind]
        best_meas = max(theirs, key=lambda m: m.speedup_mean) if theirs else None
        n, why = (r.drafter_choices or {kind: (r.chosen_n_max, r.choice)})[kind]
        lines += [f"break-even n_max (predicted): {table.break_even_n}"
                  f"{' (or more: the table ends at --max-n)' if table.break_even_n == max(rows) else ''}; "
                  f"best n_max: predicted {table.best.n}"
                  + (f", measured {best_meas.n_max} ({best_meas.speedup_mean:.3f}x)" if best_meas else ""),
                  f"{kind}'s n_max: {n}: {why}"]
    lines += ["", "per-step terms, predicted / measured in the runs (ms; draft: draft passes or lookups and "
              "draft sampling, verify: the target pass, loop: the rest, choosing the tokens included):",
              f"{'drafter':>7} {'n_max':>5} {'draft':>15} {'verify':>15} {'loop':>13}"]
    for t in r.terms:
        lines.append(f"{t.drafter:>7} {t.n_max:>5} {t.draft_pred:>7.2f}/{t.draft_meas:<7.2f} "
                     f"{t.verify_pred:>7.2f}/{t.verify_meas:<7.2f} {t.loop_pred:>6.2f}/{t.loop_meas:<6.2f}")
    lines += ["", r.hot.format() if r.hot is not None else f"hot experts: {r.hot_note}", ""]
    if r.concurrency:
        lines += [format_concurrency(r.concurrency).replace(
            "(forecast;", "(forecast from the fitted costs and this drafter's measured acceptance;")]
        if r.batched:
            lines.append("measured, plain decoding: " + ", ".join(
                f"{b.sequences} sequences {b.tokens_per_s:.2f} t/s" for b in r.batched)
                + f" (each sequence adds {r.hardware.batch_step_us / 1e3:.2f} ms to a batched step beyond "
                  f"the pass; alone its loop takes {r.loop_step_ms:.2f} ms)")
        lines.append("")
    p_min = r.p_min if r.chosen_drafter == r.head_drafter else 0.0
    lines.append(f"chosen: drafter {r.chosen_drafter}, n_max {r.chosen_n_max} (p_min {p_min:g}): {r.choice}")
    if r.runner_up is not None:
        u = r.runner_up
        lines.append(f"runner-up: drafter {u['type']}, n_max {u['n_max']} ({u['measured_speedup']:.3f}x measured); "
                     f"margin {u['margin']:+.3f}x of the plain speed")
    return "\n".join(lines)
