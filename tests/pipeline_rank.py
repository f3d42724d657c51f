"""One rank of a pipeline across hosts, for the tests (``python -m tests.pipeline_rank``):
runs ``offload.pipeline`` as ``offload run`` does and saves the tokens it saw (and, on the
last rank, each token's logits row) to an .npz, so the test can hold them to one process."""
from __future__ import annotations

import sys

import numpy as np
import torch

from offload.gguf_model import open_model
from offload.pipeline import Pipeline, check_launch, init_group, load_stage
from offload.plans import read_plan_file
from offload.sampling import Sampler
from placement.multihost import build_multihost_plan


def main(plan_path: str, rank: int, world: int, prompt: list[int], n: int, out: str) -> None:
    torch.set_num_threads(1)
    pf = read_plan_file(plan_path)
    model = open_model(pf.model_path)
    mplan = build_multihost_plan(model, pf.hosts, pf.settings)
    check_launch(mplan, model.spec.arch, rank, world, plan_path)
    stage = load_stage(model, mplan, rank)
    init_group(rank, world, 600.0)        # generous: a cold kernel cache compiles for minutes on a busy box
    rows: list[np.ndarray] = []
    run = Pipeline(stage, rank, world)
    tokens = list(run.generate(prompt, max_tokens=n, sampler=Sampler(), ubatch=mplan.settings.ubatch,
                               on_token=lambda t, row: rows.append(row.copy())))
    torch.distributed.destroy_process_group()
    np.savez(out, tokens=np.array(tokens), rows=np.array(rows))


if __name__ == "__main__":
    plan, rank, world, prompt, n, out = sys.argv[1:7]
    main(plan, int(rank), int(world), [int(x) for x in prompt.split(",")], int(n), out)
