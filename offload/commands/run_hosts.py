"""``offload run`` of a plan across hosts: one process per host, in pipeline order.

    offload run --placement multihost.yaml --rank R --world-size W -p TEXT -n N   (MASTER_ADDR, MASTER_PORT set)
    torchrun --nnodes W --node-rank R ... -m offload run --placement multihost.yaml -p TEXT

Every rank is given the same command line; the launch is checked against the plan (world
size = its hosts; the host, by ``--host`` or by this machine's hostname where the plan names
it) before any weight is read, then each rank loads its host's part and joins the
pipeline (``offload.pipeline``). Rank 0 prints the text; every rank prints its timings; the
last rank, which drafts, judges and samples, prints the run's statistics (and writes
``--stats-json``). Speculative decoding takes the flags and the plan's ``speculative``
section as ``offload run`` does, with the model's own MTP head (loaded on the last host) or
the n-gram drafter; ``--draft`` and DSpark are refused in one line.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from offload.commands.sampling_args import describe_sampling, sampling_options
from offload.commands.spec_args import spec_settings
from offload.errors import OffloadError, write_atomic
from offload.gguf_model import open_model
from offload.plans import read_plan_file
from placement.draft import NGRAM_SIZE
from placement.multihost import MultiHostPlan, build_multihost_plan

DEFAULT_TIMEOUT_S = 60.0
# run flags a pipeline does not take yet, as the user spells them
_NOT_BUILT = (("draft", "--draft (a draft head across hosts)"),
              ("spec_diagnose", "--spec-diagnose"), ("virtual_gpus", "--virtual-gpus"))


def add_rank_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("across hosts (a --placement plan with hosts:, one process per host)")
    g.add_argument("--rank", type=int, default=None, metavar="R",
                   help="this process's host, 0 = the plan's first (default: $RANK, as torchrun sets it)")
    g.add_argument("--world-size", type=int, default=None, metavar="W",
                   help="processes in the pipeline, one per host (default: $WORLD_SIZE)")
    g.add_argument("--host", default=None, metavar="NAME",
                   help="this process's host by its name in the plan (default: $OFFLOAD_HOST): gives the rank "
                        "when --rank is not given, must agree with it when it is. Without it, a plan host named "
                        "as this machine (its hostname) must be the launch's rank")
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
    names = [h.name for h in read_plan_file(args.placement).hosts]
    host = args.host if args.host is not None else os.environ.get("OFFLOAD_HOST")
    if host is not None:
        if host not in names:
            raise OffloadError(f"--host {host}: not a host of {args.placement} ({', '.join(names)})")
        if rank is None:
            rank = names.index(host)
    if rank is None or world is None:
        raise OffloadError(f"{args.placement} is a plan across hosts: run one process per host with --rank R "
                           "--world-size W (or launch with torchrun)")
    if 0 <= rank < len(names):
        if host is not None and names[rank] != host:
            raise OffloadError(f"--host {host} is rank {names.index(host)} of {args.placement}, but the launch "
                               f"gave rank {rank} (host {names[rank]})")
        machine = socket.gethostname().split(".")[0]
        if host is None and machine in names and names[rank] != machine:
            raise OffloadError(f"this machine ({machine}) is rank {names.index(machine)} of {args.placement}, but the "
                               f"launch gave it rank {rank} (host {names[rank]}); --host NAME says which host "
                               "a process is where the plan's names are not the machines'")
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
    mplan = build_multihost_plan(model, pf.hosts, pf.settings, speculative=pf.speculative)
    import torch

    from offload import pipeline
    from offload.sampling import Sampler, with_penalties
    from offload.speculative import SpecOptions
    from offload.stats import RunStats
    from offload.tokenizer import TextStream, Tokenizer

    pipeline.check_launch(mplan, model.spec.arch, rank, world, args.placement)   # before any weight is read
    spec, account = pipeline_spec(args, mplan)
    torch.set_num_threads(args.torch_threads)
    options = sampling_options(args)
    sampler = Sampler(temperature=options["temperature"], top_k=options["top_k"], top_p=options["top_p"],
                      min_p=options["min_p"], seed=options["seed"])
    tokenizer = Tokenizer.from_gguf(model.metadata)
    ids = tokenizer.encode(prompt)
    if len(ids) + args.n_predict > mplan.settings.ctx:
        raise OffloadError(f"{len(ids)} prompt tokens + {args.n_predict} to generate exceed the context of "
                           f"{mplan.settings.ctx}")
    host = mplan.hosts[rank]
    last = rank == world - 1
    if last:
        print(f"offload: {account}", file=sys.stderr)
        print(f"offload: {describe_sampling(options)}", file=sys.stderr)
    t0 = time.perf_counter()
    stage = pipeline.load_stage(model, mplan, rank, threads=args.threads)
    stage.warmup()
    load_s = time.perf_counter() - t0
    print(f"offload: rank {rank}/{world}: host {host.name}, blocks {host.blocks.start}-{host.blocks.stop - 1} "
          f"loaded in {load_s:.1f} s", file=sys.stderr)
    pipeline.init_group(rank, world, args.rank_timeout)
    try:
        run = pipeline.Pipeline(stage, rank, world)
        stream = TextStream(tokenizer.decode)
        stats = RunStats(n_prompt=len(ids), load_s=load_s)
        t1 = time.perf_counter()
        n = 0
        eos = frozenset() if args.ignore_eos else tokenizer.eos_ids
        for tok in run.generate(ids, max_tokens=args.n_predict, sampler=sampler, ubatch=mplan.settings.ubatch,
                                options=SpecOptions(n_max=spec["n_max"], p_min=spec.get("p_min", 0.0),
                                                    verify=spec.get("verify", "batched"),
                                                    type=spec.get("spec_type", "mtp"),
                                                    ngram_size=spec.get("ngram_size", NGRAM_SIZE)),
                                eos=eos, stats=stats, guide=with_penalties(None, options["penalties"], ids)):
            n += 1
            if rank == 0:
                sys.stdout.write(stream.push(tok))
                sys.stdout.flush()
        if rank == 0:
            sys.stdout.write(stream.close() + "\n")
        dt = time.perf_counter() - t1
        print(f"offload: rank {rank}: {len(ids)} prompt + {n} generated tokens in {dt * 1e3:.1f} ms "
              f"({n / dt:.2f} t/s overall)", file=sys.stderr)
        if last:
            for line in stats.lines():
                print(f"offload: {line}", file=sys.stderr)
            if args.stats_json:
                payload = stats.as_dict() | {"rank": rank, "world_size": world,
                                             "hosts": [h.name for h in mplan.hosts]}
                write_atomic(args.stats_json, json.dumps(payload, indent=2) + "\n")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return 0


def pipeline_spec(args: argparse.Namespace, mplan: MultiHostPlan) -> tuple[dict, str]:
    """``offload run``'s ``spec_settings`` for a plan across hosts: the n-gram drafter and the
    model's own MTP head (on the last host) draft across hosts; another drafter is refused."""
    spec, account = spec_settings(args, mplan)
    kind = spec.get("spec_type")
    if isinstance(spec["n_max"], str):
        raise OffloadError(f"--spec-n-max {spec['n_max']} across hosts is not built yet (give a number)")
    if spec["n_max"] and kind not in ("ngram", "mtp"):
        raise OffloadError(f"speculative decoding with {kind} across hosts is not built yet "
                           "(--spec-type mtp or ngram)")
    return spec, account
