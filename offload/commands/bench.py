"""``offload bench``: speculative-decoding benchmark in the spirit of llama.cpp's spec-bench.

    offload bench [MODEL.gguf] [placement flags] [--tasks code,extract,story] [--n-max 1,2,3,4]
                  [--spec-type mtp|dspark,ngram] [--draft FILE] [--repeat 3] [-n 128] [--temp 0] [--spec-p-min P]
                  [--spec-ngram-size-n N] [--spec-verify batched|exact] [--jsonl PATH]

One load, one placement: for each repeat, each task prompt (``offload.bench_tasks``) and each
stage — the baseline (plain decoding) and each drafter (``--spec-type``: the DSpark drafter of a
dflash ``--draft``, else the MTP head when the model has one; n-gram self-drafting always) with
every n_max — generates ``-n``
tokens (end-of-sequence ignored, so every stage produces the same count). Stages are
interleaved so that a change in the machine's load hits them alike. A warm-up run
(compilation, allocator) is excluded. Prints decode t/s mean ± std over the repeats, the
change against the baseline, accepted/drafted, mean accepted length and acceptance per draft
position per task and drafter; ``--jsonl`` writes one record per run and one summary per (task, stage).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from offload.bench_tasks import TASKS
from offload.commands.plan import add_placement_arguments, plan_from_args
from offload.commands.run import add_session_arguments, open_cli_model, runtime_process_settings, session_options
from offload.commands.spec_args import plan_drafters
from offload.errors import ArgumentParser, OffloadError, write_atomic
from offload.stats import conditional, per_position
from placement.draft import NGRAM_SIZE, check_ngram_size, check_p_min

WARMUP_TOKENS = 16


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise OffloadError(f"{what}: {text!r} is not a comma list of integers >= 1")
    return sorted(set(values))


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="offload bench", description=__doc__.split("\n\n")[0].replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file (default: the --placement plan's model, else the shipped tiny glm4moe model)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of tasks (default {','.join(TASKS)})")
    p.add_argument("--n-max", default="1,2,3,4", help="draft lengths to run beside the baseline (default 1,2,3,4)")
    p.add_argument("--repeat", type=int, default=3, help="runs per task and stage (default 3)")
    p.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=128,
                   help="tokens to generate per run (default 128)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p (1 = off)")
    p.add_argument("--seed", type=int, default=42,
                   help="sampling seed of the first repeat; repeat r uses seed + r (default 42)")
    p.add_argument("--spec-type", default=None, metavar="TYPES",
                   help="comma list of drafters to run (mtp, ngram, dspark; llama.cpp's spellings too; "
                        "default: dspark with a dflash --draft, else mtp when the model has a draft head; "
                        "and ngram)")
    p.add_argument("--spec-p-min", type=float, default=0.0, metavar="P", help="draft p_min (default 0)")
    p.add_argument("--spec-ngram-size-n", type=int, default=NGRAM_SIZE, metavar="N",
                   help=f"ngram: the longest n-gram looked up (default {NGRAM_SIZE})")
    p.add_argument("--spec-verify", choices=("batched", "exact"), default="batched",
                   help="verify mode of the drafting stages (default batched)")
    p.add_argument("--jsonl", metavar="PATH", help="write one JSON record per run and per summary here")
    add_session_arguments(p)
    add_placement_arguments(p)
    return p


def _stages(n_maxes: list[int], drafters: list[str]) -> list[tuple[str, str | None, int]]:
    """(stage name, drafter, n_max): the baseline, then every drafter at every n_max."""
    return [("baseline", None, 0)] + [(f"{d} n={n}", d, n) for d in drafters for n in n_maxes]


def run_once(session, prompt_ids: list[int], n_max: int, args, rep: int = 0,
             drafter: str | None = None) -> tuple[dict, list[int]]:
    """One generation; repeat ``rep`` samples with seed ``--seed + rep`` (independent repeats)."""
    out = list(session.generate(prompt_ids, max_tokens=args.n_predict, temperature=args.temp,
                                top_k=args.top_k, top_p=args.top_p, seed=args.seed + rep, stop_at_eos=False,
                                n_max=n_max, p_min=args.spec_p_min, verify=args.spec_verify,
                                spec_type=drafter or "mtp", ngram_size=args.spec_ngram_size_n))
    s = session.stats
    return {"tokens": s.n_gen, "tokens_per_second": s.eval_tps, "eval_s": s.eval_s,
            "target_passes": s.n_eval, "steps": s.n_steps, "drafted": s.drafted, "accepted": s.accepted,
            "drafted_per_position": list(s.drafted_per_position),
            "accepted_per_position": list(s.accepted_per_position),
            "reached_per_position": list(s.reached_per_position),
            "draft_s": s.draft_s, "verify_s": s.verify_s}, out


def summarize(task: str, stage: str, n_max: int, runs: list[dict], base_mean: float | None,
              drafter: str | None = None) -> dict:
    tps = [r["tokens_per_second"] for r in runs]
    mean = statistics.fmean(tps)
    std = statistics.stdev(tps) if len(tps) > 1 else 0.0
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    steps = sum(r["steps"] for r in runs)
    width = max((len(r["drafted_per_position"]) for r in runs), default=0)
    total = lambda key: [sum(r[key][j] for r in runs if j < len(r[key])) for j in range(width)]  # noqa: E731
    dpp, app, rpp = total("drafted_per_position"), total("accepted_per_position"), total("reached_per_position")
    return {"kind": "summary", "task": task, "stage": stage, "drafter": drafter, "n_max": n_max, "runs": len(runs),
            "tokens_per_second_mean": mean, "tokens_per_second_std": std,
            "change": (mean / base_mean - 1.0) if base_mean and n_max else None,
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "mean_accepted_length": 1.0 + accepted / steps if steps else None,
            "acceptance_per_position": per_position(app, dpp),
            "acceptance_conditional": conditional(app, rpp),
            "same_text_as_baseline": (sum(r["same_as_baseline"] for r in runs)
                                      if all(r["same_as_baseline"] is not None for r in runs) else None),
            "draft_s": sum(r["draft_s"] for r in runs), "verify_s": sum(r["verify_s"] for r in runs),
            "eval_s": sum(r["eval_s"] for r in runs)}


def format_table(rows: list[dict]) -> str:
    head = (f"{'task':<8} {'stage':<10} {'runs':>4}  {'tok/s mean ± std':>17}  {'change':>7}  "
            f"{'accepted/drafted — rate':>26}  {'a.len':>5}  {'= base':>6}  acceptance per position")
    lines = [head, "-" * len(head)]
    for r in rows:
        tps = f"{r['tokens_per_second_mean']:8.2f} ± {r['tokens_per_second_std']:6.2f}"
        change = f"{100 * r['change']:+6.1f}%" if r["change"] is not None else "      -"
        if r["n_max"]:
            acc = f"{r['accepted']:,}/{r['drafted']:,} — {100 * (r['acceptance'] or 0):6.2f}%"
            alen = f"{r['mean_accepted_length']:.2f}"
            pos = " ".join(f"{a:.3f}" for a in r["acceptance_per_position"])
        else:
            acc, alen, pos = "-", "-", "-"
        same = "-" if r["same_text_as_baseline"] is None else f"{r['same_text_as_baseline']}/{r['runs']}"
        lines.append(f"{r['task']:<8} {r['stage']:<10} {r['runs']:>4}  {tps:>17}  {change:>7}  {acc:>26}  "
                     f"{alen:>5}  {same:>6}  {pos}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    runtime_process_settings()
    import torch

    from offload import runtime

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise OffloadError(f"--tasks: unknown task {unknown[0] if unknown else args.tasks!r} "
                           f"(tasks: {', '.join(TASKS)})")
    n_maxes = _int_list(args.n_max, "--n-max")
    for flag, value in (("--repeat", args.repeat), ("-n", args.n_predict), ("--torch-threads", args.torch_threads)):
        if value < 1:
            raise OffloadError(f"{flag} must be >= 1, got {value}")
    check_p_min(args.spec_p_min, "--spec-p-min")
    check_ngram_size(args.spec_ngram_size_n)
    torch.set_num_threads(args.torch_threads)
    model = open_cli_model(args)
    plan, model, _ = plan_from_args(args, model)
    drafters = plan_drafters(args.spec_type, plan, "offload bench")
    if plan.drafting == "none" and args.spec_type is None:      # gpt-oss, qwen3moe: n-gram drafts still run
        print(f"offload bench: {Path(plan.model_path).name} has no draft head (no NextN block, no --draft): "
              f"the baseline and n-gram drafting only", file=sys.stderr)
    session = runtime.load_plan(model, plan, progress=True, **session_options(args))
    stages = _stages(n_maxes, drafters)
    records: list[dict] = []
    with session:
        prompts = {t: session.tokenize(TASKS[t]) for t in tasks}
        need = max(len(p) for p in prompts.values()) + args.n_predict
        if need > plan.settings.ctx:
            raise OffloadError(f"a task prompt + -n {args.n_predict} need {need} tokens of context, "
                               f"the plan has {plan.settings.ctx} (raise --ctx or lower -n)")
        session.warmup()
        warm = argparse.Namespace(**{**vars(args), "n_predict": min(WARMUP_TOKENS, args.n_predict)})
        for _, drafter, n_max in (stages[0], stages[-1]):        # plain and the longest verify batch
            run_once(session, prompts[tasks[0]], n_max, warm, drafter=drafter)
        load0 = os.getloadavg()[0]
        print(f"offload bench: {Path(plan.model_path).name}, {session.devices.describe()}; "
              f"{args.n_predict} tokens per run, {args.repeat} repeats, temp {args.temp:g}, "
              f"p_min {args.spec_p_min:g}, verify {args.spec_verify}; load average {load0:.2f} on "
              f"{os.cpu_count()} cores", file=sys.stderr)
        baseline_out: dict[str, list[int]] = {}
        for rep in range(args.repeat):
            for task in tasks:
                for stage, drafter, n_max in stages:
                    rec, out = run_once(session, prompts[task], n_max, args, rep, drafter)
                    if n_max == 0:
                        baseline_out.setdefault(task, out)
                    rec |= {"kind": "run", "task": task, "stage": stage, "drafter": drafter, "n_max": n_max,
                            "repeat": rep,
                            "same_as_baseline": out == baseline_out.get(task) if args.temp == 0 else None,
                            "load_average": os.getloadavg()[0]}
                    records.append(rec)
                    print(f"offload bench: {task:<8} {stage:<10} run {rep + 1}/{args.repeat}: "
                          f"{rec['tokens_per_second']:8.2f} t/s", file=sys.stderr)
        load1 = os.getloadavg()[0]
    summaries = []
    for task in tasks:
        base = None
        for stage, drafter, n_max in stages:
            runs = [r for r in records if r["task"] == task and r["stage"] == stage]
            row = summarize(task, stage, n_max, runs, base, drafter)
            if n_max == 0:
                base = row["tokens_per_second_mean"]
            summaries.append(row)
    for drafter in drafters or [None]:          # one table per drafter, each beside the baseline
        if drafter is not None:
            print(f"drafter {drafter}:")
        print(format_table([r for r in summaries if r["drafter"] in (None, drafter)]) + "\n")
    print(f"load average {load0:.2f} before, {load1:.2f} after the timed runs ({os.cpu_count()} cores); "
          f"'= base': runs whose text equals the baseline's (greedy only)")
    if args.jsonl:
        write_atomic(args.jsonl, "".join(json.dumps(r) + "\n" for r in records + summaries))
    return 0
