"""``offload profile`` — which routed experts the model picks, per MoE layer, over a prompt set.

    offload profile [MODEL.gguf] [placement flags] [-f PROMPTS.txt ...] [-n N] -o routing.yaml

Each prompt (the bench tasks by default; ``-f`` files hold one prompt per paragraph, or the text
between ``---`` lines) is continued greedily for ``-n`` tokens, and prompt + continuation go
through the model in ubatches with every MoE layer's router recorded; the counts per expert
go to ``routing.yaml`` (``placement.routing``), per prompt and summed, with the prompts' source
and token count. ``offload plan --routing routing.yaml`` then fills the VRAM left above each
GPU's target with the hottest single experts.

Routing is recorded at the router (``offload.tune.routed_ids``), so the placement the model
is loaded with does not change the counts. stdout: per layer, how concentrated the routing
is, and the distinct experts B consecutive tokens touch (measured) beside what independent
tokens with the measured per-expert rates would touch (the cost model's assumption) and
uniform routing.
"""
from __future__ import annotations

import argparse
import sys

from offload.bench_tasks import TASKS
from offload.commands.plan import add_placement_arguments, plan_from_args
from offload.commands.run import add_session_arguments, open_cli_model, runtime_process_settings, session_options
from offload.commands.tune import read_prompts
from offload.errors import ArgumentParser, OffloadError, write_atomic

DEFAULT_TOKENS = 64
MAX_BATCH = 8          # distinct experts are reported for B = 1..MAX_BATCH consecutive tokens


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="offload profile", description=__doc__.split("\n\n")[0].replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file (default: the --placement plan's model, else the shipped tiny glm4moe model)")
    p.add_argument("-f", "--prompts", nargs="+", metavar="FILE",
                   help="prompt files (one prompt per paragraph, or between '---' lines); "
                        "default: the bench tasks (code, extract, story)")
    p.add_argument("-n", "--n-predict", dest="n_predict", type=int, default=DEFAULT_TOKENS,
                   help=f"greedy tokens generated after each prompt and routed with it (default {DEFAULT_TOKENS})")
    p.add_argument("-o", "--output", required=True, metavar="ROUTING.yaml", help="where to write the profile")
    add_session_arguments(p)
    add_placement_arguments(p)
    return p


def prompt_set(files: list[str] | None) -> tuple[list[tuple[str, str]], str]:
    """(name, text) per prompt and a one-line description of where they came from."""
    if not files:
        return list(TASKS.items()), f"bench tasks: {', '.join(TASKS)}"
    out = []
    for path in files:
        texts = read_prompts(path)
        out += [(f"{path}#{i + 1}" if len(texts) > 1 else path, t) for i, t in enumerate(texts)]
    return out, "prompt files: " + ", ".join(files)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.n_predict < 0:
        raise OffloadError(f"-n must be >= 0, got {args.n_predict}")
    prompts, source = prompt_set(args.prompts)
    runtime_process_settings()
    import numpy as np
    import torch

    from offload import runtime
    from offload import tune as measure
    from placement.routing import layer_key

    torch.set_num_threads(args.torch_threads)
    model = open_cli_model(args)
    plan, model, _ = plan_from_args(args, model)
    spec = model.spec
    if not spec.n_expert:
        raise OffloadError(f"{plan.model_path} has no routed experts: nothing to profile")
    session = runtime.load_plan(model, plan, quiet=True, **session_options(args))
    with session:
        texts = []
        for name, text in prompts:
            ids = session.tokenize(text)
            if not ids:
                raise OffloadError(f"prompt {name!r} is empty")
            if args.n_predict:
                ids = ids + measure.decode(session, ids, n_tokens=args.n_predict).tokens
            texts.append(ids)
        counts = measure.routing_counts(session, texts, [n for n, _ in prompts], source=source,
                                        model=plan.model_path, max_batch=MAX_BATCH)
    E, k = spec.n_expert, spec.n_expert_used
    nextn = [i for i in counts.layers if spec.is_nextn_layer(i)]
    layers = [i for i in sorted(counts.layers) if i not in nextn]
    distinct, batch = list(counts.distinct), len(counts.distinct)
    write_atomic(args.output, counts.to_yaml())
    print(f"offload: wrote {args.output}", file=sys.stderr)

    print(f"{plan.model_path}: {len(prompts)} prompts ({source}), {counts.tokens} tokens "
          f"({args.n_predict} generated per prompt), {E} experts, top-{k}")
    print(f"{'layer':<7} {'hottest':>8} {'top 1/8':>8} {'top 1/4':>8} {'top 1/2':>8}   share of assignments "
          "(held out: ranked on the other prompts)")
    for i in sorted(counts.layers):
        share = counts.held_out_shares(i)
        cum = np.cumsum(share)
        print(f"{layer_key(i) + ('*' if i in nextn else ''):<7} {share[0]:>8.1%} {cum[max(E // 8, 1) - 1]:>8.1%} {cum[E // 4 - 1]:>8.1%} "
              f"{cum[E // 2 - 1]:>8.1%}")
    if nextn:
        print("* the NextN (MTP) block, routed over the text's (state, next token) pairs as drafting runs it")
    print(f"uniform {1 / E:>8.1%} {max(E // 8, 1) / E:>8.1%} {0.25:>8.1%} {0.5:>8.1%}")
    indep = [float(np.mean([counts.distinct_for_batch(i, b) for i in layers])) for b in range(1, batch + 1)]
    uniform = [E * (1 - (1 - k / E) ** b) for b in range(1, batch + 1)]
    print("distinct experts per layer for B consecutive tokens, B = 1.." + str(batch))
    for label, row in (("measured", distinct), ("independent tokens, measured rates", indep),
                       ("uniform routing", uniform)):
        print(f"  {label:<36}" + " ".join(f"{x:6.2f}" for x in row))
    return 0
