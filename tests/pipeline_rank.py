"""One rank of a pipeline across hosts, for the tests (``python -m tests.pipeline_rank``):
runs ``offload.pipeline`` as ``offload run`` does and saves the tokens it saw (and, on the
last rank, each token's logits row) to an .npz, so the test can hold them to one process.

    python -m tests.pipeline_rank PLAN RANK WORLD PROMPT_IDS N OUT.npz [RUNS]

RUNS: generations one after the other in the same pipeline, ``DRAFTER:N_MAX:VERIFY[:TEMP]``
comma-separated (default ``ngram:0:batched``, plain decoding); DRAFTER ngram or mtp; greedy,
or sampled at TEMP with seed ``SEED``.
Run i's tokens and rows are saved as ``tokens_i``, ``rows_i``, its drafts as ``drafted_i``,
``accepted_i``."""
from __future__ import annotations

import sys

import numpy as np
import torch

from offload.gguf_model import open_model
from offload.pipeline import Pipeline, check_launch, init_group, load_stage
from offload.plans import read_plan_file
from offload.sampling import Sampler
from offload.speculative import SpecOptions
from offload.stats import RunStats
from placement.multihost import build_multihost_plan

SEED = 7


def main(plan_path: str, rank: int, world: int, prompt: list[int], n: int, out: str,
         runs: list[tuple[str, int, str, float]]) -> None:
    torch.set_num_threads(1)
    pf = read_plan_file(plan_path)
    model = open_model(pf.model_path)
    mplan = build_multihost_plan(model, pf.hosts, pf.settings)
    check_launch(mplan, model.spec.arch, rank, world, plan_path)
    stage = load_stage(model, mplan, rank)
    init_group(rank, world, 600.0)        # generous: a cold kernel cache compiles for minutes on a busy box
    run = Pipeline(stage, rank, world)
    saved = {}
    for i, (kind, n_max, verify, temp) in enumerate(runs):
        rows: list[np.ndarray] = []
        options = SpecOptions(n_max=n_max, verify=verify, type=kind)
        stats = RunStats(n_prompt=len(prompt))
        sampler = Sampler(temperature=temp, seed=SEED)
        tokens = list(run.generate(prompt, max_tokens=n, sampler=sampler, ubatch=mplan.settings.ubatch,
                                   options=options, stats=stats, on_token=lambda t, row: rows.append(row.copy())))
        saved |= {f"tokens_{i}": np.array(tokens), f"rows_{i}": np.array(rows), f"drafted_{i}": stats.drafted,
                  f"accepted_{i}": stats.accepted}
    torch.distributed.destroy_process_group()
    np.savez(out, **saved)


if __name__ == "__main__":
    plan, rank, world, prompt, n, out = sys.argv[1:7]
    spec = sys.argv[7] if len(sys.argv) > 7 else "ngram:0:batched"
    runs = [(kind, int(n_max), verify, float(temp[0]) if temp else 0.0)
            for kind, n_max, verify, *temp in (r.split(":") for r in spec.split(","))]
    main(plan, int(rank), int(world), [int(x) for x in prompt.split(",")], int(n), out, runs)
