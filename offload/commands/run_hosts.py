"""``offload run`` of a plan across hosts: one process per host, in pipeline order.

    offload run --placement multihost.yaml --rank R --world-size W -p TEXT -n N   (MASTER_ADDR, MASTER_PORT set)
    torchrun --nnodes W --node-rank R ... -m offload run --placement multihost.yaml -p TEXT

Every rank is given the same command line; the launch is checked against the plan (world
size = its hosts) before any weight is read, then each rank loads its host's part and joins the
pipeline (``offload.pipeline``). Rank 0 prints the text; every rank prints its timings.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from offload.commands.sampling_args import sampling_options
from offload.errors import OffloadError
from offload.gguf_model import open_model
from offload.plans import read_plan_file
from placement.multihost import build_multihost_plan

DEFAULT_TIMEOUT_S = 60.0
# run flags a pipeline does not take yet, as the user spells them
_NOT_BUILT = (("spec_n_max", "--spec-n-max (speculative decoding across hosts)"),
              ("spec_type", "--spec-type (speculative decoding across hosts)"),
              ("draft", "--draft (speculative decoding across hosts)"),
              ("spec_diagnose", "--spec-diagnose"), ("virtual_gpus", "--virtual-gpus"),
              ("stats_json", "--stats-json"))


def add_rank_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("across hosts (a --placement plan with hosts:, one process per host)")
    g.add_argument("--rank", type=int, default=None, metavar="R",
                   help="this process's host, 0 = the plan's first (default: $RANK, as torchrun sets it)")
    g.add_argument("--world-size", type=int, default=None, metavar="W",
                   help="processes in the pipeline, one per host (default: $WORLD_SIZE)")
    g.add_argument("--rank-timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"a rank silent this long ends the run with an error (default {DEFAULT_TIMEOUT_S:g})")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise OffloadError(f"${name} must be an integer, got {value!r}") from None


def launch(args: argparse.Namespace) -> tuple[int, int] | None:
    """(rank, world size) when this run is one rank of a plan across hosts, else None
    (refusing ranks without such a plan, and such a plan without ranks)."""
    rank = args.rank if args.rank is not None else _env_int("RANK")
    world = args.world_size if args.world_size is not None else _env_int("WORLD_SIZE")
    across = bool(args.placement) and read_plan_file(args.placement).hosts is not None
    if not across:
        if args.rank is not None or args.world_size is not None:
            raise OffloadError("--rank / --world-size run a plan across hosts (--placement PLAN.yaml with hosts:)")
        return None
    if rank is None or world is None:
        raise OffloadError(f"{args.placement} is a plan across hosts: run one process per host with --rank R "
                           "--world-size W (or launch with torchrun)")
    return rank, world


def main(args: argparse.Namespace, prompt: str, rank: int, world: int) -> int:
    for name, what in _NOT_BUILT:
        if getattr(args, name, None):
            raise OffloadError(f"{what} is not built yet for a plan across hosts")
    if args.rank_timeout <= 0:
        raise OffloadError(f"--rank-timeout must be > 0, got {args.rank_timeout}")
    pf = read_plan_file(args.placement)
    model = open_model(args.model or pf.model_path)
    if pf.n_layer != model.spec.n_layer:
        raise OffloadError(f"{args.placement}: the plan's layout is for {pf.n_layer} blocks but {model.path} "
                           f"has {model.spec.n_layer}")
    mplan = build_multihost_plan(model, pf.hosts, pf.settings)
    import torch

    from offload import pipeline
    from offload.sampling import Sampler
    from offload.tokenizer import TextStream, Tokenizer

    pipeline.check_launch(mplan, model.spec.arch, rank, world, args.placement)   # before any weight is read
    torch.set_num_threads(args.torch_threads)
    options = sampling_options(args)
    if options["penalties"] is not None:
        raise OffloadError("repetition penalties across hosts are not built yet (the last rank samples "
                           "without the history): leave --repeat-penalty/--presence-penalty/--frequency-penalty off")
    sampler = Sampler(temperature=options["temperature"], top_k=options["top_k"], top_p=options["top_p"],
                      min_p=options["min_p"], seed=options["seed"])
    tokenizer = Tokenizer.from_gguf(model.metadata)
    ids = tokenizer.encode(prompt)
    if len(ids) + args.n_predict > mplan.settings.ctx:
        raise OffloadError(f"{len(ids)} prompt tokens + {args.n_predict} to generate exceed the context of "
                           f"{mplan.settings.ctx}")
    host = mplan.hosts[rank]
    n_max = pf.speculative.n_max if pf.speculative is not None else None
    if rank == 0 and n_max:
        print(f"offload: note: the plan's speculative n_max {n_max} is not used: speculative decoding across "
              "hosts is not built yet (plain decoding)", file=sys.stderr)
    t0 = time.perf_counter()
    stage = pipeline.load_stage(model, mplan, rank)
    load_s = time.perf_counter() - t0
    print(f"offload: rank {rank}/{world}: host {host.name}, blocks {host.blocks.start}-{host.blocks.stop - 1} "
          f"loaded in {load_s:.1f} s", file=sys.stderr)
    pipeline.init_group(rank, world, args.rank_timeout)
    try:
        run = pipeline.Pipeline(stage, rank, world)
        stream = TextStream(tokenizer.decode)
        t1 = time.perf_counter()
        n = 0
        eos = frozenset() if args.ignore_eos else tokenizer.eos_ids
        for tok in run.generate(ids, max_tokens=args.n_predict, sampler=sampler, ubatch=mplan.settings.ubatch,
                                eos=eos):
            n += 1
            if rank == 0:
                sys.stdout.write(stream.push(tok))
                sys.stdout.flush()
        if rank == 0:
            sys.stdout.write(stream.close() + "\n")
        dt = time.perf_counter() - t1
        print(f"offload: rank {rank}: {len(ids)} prompt + {n} generated tokens in {dt * 1e3:.1f} ms "
              f"({n / dt:.2f} t/s overall)", file=sys.stderr)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0
