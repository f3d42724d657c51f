"""A model split across hosts, run as separate processes on loopback over gloo
(offload.pipeline): greedy tokens and logits identical to one process of the same placement;
a rank that dies or stops answering ends the others in one line within the timeout; a launch
that disagrees with the plan is refused before any weight is read."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from offload import runtime
from offload.gguf_model import open_model
from offload.probe import SHIPPED_MODEL
from placement.devices import parse_devices
from placement.hosts import parse_hosts
from placement.multihost import make_multihost_plan
from placement.plan_file import multihost_plan_to_yaml
from placement.planner import PlanOptions, make_plan
from tests.pipeline_rank import SEED
from tests.tiny_models import TinySpec, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [1, 17, 42, 5, 99, 3, 64, 8]
N = 24


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(port: int) -> dict[str, str]:
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_WAIT_POLICY": "PASSIVE",
            "PYTHONPATH": str(ROOT)}


def _plan_file(tmp: Path, model_path: str, hosts: str, ctx: int | None = None) -> Path:
    model = open_model(model_path)
    mplan = make_multihost_plan(model, parse_hosts(hosts), PlanOptions(ctx=ctx))
    path = tmp / "multihost.yaml"
    path.write_text(multihost_plan_to_yaml(mplan))
    return path


PLAIN = (("ngram", 0, "batched", 0.0),)


def _one_process(model_path: str, prompt=PROMPT, runs=PLAIN) -> list[tuple[list[int], np.ndarray]]:
    """Decoding of the same (all-CPU) placement in one process: per (drafter, n_max, verify,
    temperature) of ``runs`` (sampled with the ranks' seed) the tokens and the logits row of each."""
    model = open_model(model_path)
    plan = make_plan(model, parse_devices("CPU=4GiB"), PlanOptions())
    out = []
    with runtime.load_plan(model, plan, quiet=True) as session:
        for kind, n_max, verify, temp in runs:
            rows = []
            tokens = list(session.generate(prompt, max_tokens=N, n_max=n_max, spec_type=kind, verify=verify,
                                           temperature=temp, seed=SEED,
                                           stop_at_eos=False,
                                           on_token=lambda t, row: rows.append(np.array(row, copy=True))))
            out.append((tokens, np.array(rows)))
    return out


def _ranks(tmp: Path, plan: Path, world: int, prompt=PROMPT, runs=PLAIN) -> list[dict]:
    port = _port()
    spec = ",".join(":".join(map(str, run)) for run in runs)
    procs = [subprocess.Popen([sys.executable, "-m", "tests.pipeline_rank", str(plan), str(r), str(world),
                               ",".join(map(str, prompt)), str(N), str(tmp / f"rank{r}.npz"), spec],
                              cwd=ROOT, env=_env(port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
    return [dict(np.load(tmp / f"rank{r}.npz")) for r in range(world)]


@pytest.mark.parametrize("which,hosts", [
    ("shipped", "a:CPU=1GiB;b:CPU=1GiB"),                          # glm4moe, 4 trunk blocks: 0-2 | 3
    ("deepseek2", "a:CPU=1GiB;b:CPU=1GiB;c:CPU=1GiB"),             # tiny MLA model, 6 blocks over three ranks
])
def test_ranks_match_one_process(tmp_path, which, hosts):
    if which == "shipped":
        path = str(SHIPPED_MODEL)
    else:
        path = str(write_tiny_model(tmp_path / "ds2.gguf", TinySpec(arch="deepseek2", n_layer=6, seed=7)).path)
    plan = _plan_file(tmp_path, path, hosts)
    world = hosts.count(";") + 1
    ranks = _ranks(tmp_path, plan, world)
    [(tokens, rows)] = _one_process(path)
    assert len(tokens) == N
    for r in ranks:                          # every rank saw the same tokens
        assert r["tokens_0"].tolist() == tokens
    # the last rank's logits, pass by pass, are the single process's bit for bit (they once
    # differed in the last bit: the compiled block's numbers depended on whether Numba compiled
    # it in the process or loaded it from its cache; cpu_kernels.block's _glue_kw)
    assert np.array_equal(ranks[-1]["rows_0"], rows)


# "Once upon a time": the shipped model soon repeats itself, so the n-gram drafter drafts, and
# some drafts are rejected (each rejection in a batched verify is a rollback on every rank)
SPEC_PROMPT = [0, 47, 78, 309, 1002, 267, 268, 734]
SPEC_RUNS = PLAIN + tuple((kind, n, verify, 0.0) for kind in ("ngram", "mtp") for verify in ("exact", "batched")
                          for n in (1, 2, 3)) + (("mtp", 3, "batched", 0.8),)


def test_deepseek4_across_ranks_is_one_process(tmp_path):
    """deepseek4 over two ranks (its (T, 4, n_embd) streams between them, the hash-routed first
    blocks reading the pass's tokens on every rank, the hc head and the bundled MTP head on the
    last): plain decoding and MTP drafting (exact and batched) give the single process's
    tokens, and its logits within 1e-5 of the largest; exact verify gives plain decoding's
    tokens. Not bit for bit: the compiled V4 FFN half's last bits depend on whether Numba
    compiled ``v4_ffn_half`` together with ``_clamped_moe`` in the process or loaded them from
    its cache (3.6e-7 on a logit of 0.91; bisected by deleting cache entries; both compile
    without fastmath, the cause below them is not found), and on a cold cache the ranks compile
    where the single process loads. Warm, the rows are equal bit for bit."""
    from tests.archs.test_deepseek4 import MTP_SPEC
    path = str(write_tiny_model(tmp_path / "ds4.gguf", MTP_SPEC).path)
    plan = _plan_file(tmp_path, path, "a:CPU=1GiB;b:CPU=1GiB")
    assert "blocks: [0, 2]" in plan.read_text() and "blocks: [3, 3]" in plan.read_text()   # both ranks hold blocks
    runs = PLAIN + (("mtp", 2, "exact", 0.0), ("mtp", 3, "batched", 0.0))
    ranks = _ranks(tmp_path, plan, 2, PROMPT, runs)
    one = _one_process(path, PROMPT, runs)
    for i, run in enumerate(runs):
        tokens, rows = one[i]
        for r in ranks:
            assert r[f"tokens_{i}"].tolist() == tokens, run
        assert np.abs(ranks[-1][f"rows_{i}"] - rows).max() <= 1e-5 * np.abs(rows).max(), run
    assert one[1][0] == one[0][0] and int(ranks[-1]["drafted_1"]) > 0


def test_speculation_across_ranks_is_lossless(tmp_path):
    """Speculation over two ranks (the last drafts with the n-gram drafter or the model's MTP
    head, judges, and broadcasts the rollback): exact verification yields plain decoding's
    tokens and rows; batched verification the single process's tokens and rows with the same
    drafter and n_max, bit for bit; sampled (temperature 0.8, the same seed), the single
    process's tokens too: the last rank draws exactly as one process does."""
    plan = _plan_file(tmp_path, str(SHIPPED_MODEL), "a:CPU=1GiB;b:CPU=1GiB")
    ranks = _ranks(tmp_path, plan, 2, SPEC_PROMPT, SPEC_RUNS)
    one = _one_process(str(SHIPPED_MODEL), SPEC_PROMPT, SPEC_RUNS)
    plain_tokens = one[0][0]
    for i, run in enumerate(SPEC_RUNS):
        tokens, rows = one[i] if run[2] == "batched" else one[0]
        for r in ranks:
            assert r[f"tokens_{i}"].tolist() == tokens, run
        assert np.array_equal(ranks[-1][f"rows_{i}"], rows), run
        if run[2] == "exact":
            assert tokens == plain_tokens
        if run[3]:
            assert tokens != plain_tokens           # it did sample
        if run[1]:
            drafted, accepted = int(ranks[-1][f"drafted_{i}"]), int(ranks[-1][f"accepted_{i}"])
            assert 0 < accepted < drafted, (run, drafted, accepted)   # kept some, rolled back some


def _run(plan: Path, rank: int, world: int, port: int, *extra: str, err=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "offload", "run", "--placement", str(plan), "--rank", str(rank),
                             "--world-size", str(world), "-p", "Once upon a time", "--ignore-eos", *extra],
                            cwd=ROOT, env=_env(port), stdout=subprocess.PIPE, stderr=err, text=True)


def _wait_for(path: Path, text: str, deadline: float) -> None:
    while text not in (path.read_text() if path.exists() else ""):
        assert time.monotonic() < deadline, path.read_text() if path.exists() else "no output"
        time.sleep(0.2)


def test_offload_run_speculates_across_ranks(tmp_path):
    """``offload run --spec-type mtp --spec-verify exact`` over two ranks (the MTP head on the
    last) prints the text of plain greedy decoding in one process; the last rank's
    --stats-json shows the drafts."""
    plan = _plan_file(tmp_path, str(SHIPPED_MODEL), "a:CPU=1GiB;b:CPU=1GiB")
    port = _port()
    flags = ("-n", "24", "--temp", "0", "--spec-type", "mtp", "--spec-n-max", "3", "--spec-verify", "exact",
             "--stats-json", str(tmp_path / "stats.json"))
    ranks = [_run(plan, r, 2, port, *flags) for r in range(2)]
    outs = [p.communicate(timeout=600) for p in ranks]
    for p, (_, err) in zip(ranks, outs):
        assert p.returncode == 0, err
    one = subprocess.run([sys.executable, "-m", "offload", "run", str(SHIPPED_MODEL), "-p", "Once upon a time",
                          "--ignore-eos", "-n", "24", "--temp", "0"], cwd=ROOT, env=_env(port),
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr
    assert outs[0][0] == one.stdout
    assert "speculative decoding: mtp with the model's NextN head" in outs[1][1]
    split = next(line for line in outs[1][1].splitlines() if "eval split" in line)   # the last rank's own timers
    assert "compiled CPU blocks 0.0 ms" not in split and "transfers 0.0 ms" not in split, split
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["n_gen"] == 24 and stats["accepted"] > 0, stats


# a context and a run long enough that both ranks are still generating when one fails
@pytest.mark.parametrize("fault,sig,spec", [
    ("dies", signal.SIGKILL, ("-n", "4000", "--spec-type", "ngram", "--temp", "0")),
    ("stops answering", signal.SIGSTOP, ("-n", "4000"))])
def test_a_rank_that_fails_ends_the_other_in_one_line(tmp_path, fault, sig, spec):
    plan = _plan_file(tmp_path, str(SHIPPED_MODEL), "a:CPU=1GiB;b:CPU=1GiB", ctx=4096)
    port, timeout = _port(), 8
    logs = [tmp_path / "rank0.err", tmp_path / "rank1.err"]
    with open(logs[0], "w") as e0, open(logs[1], "w") as e1:
        r0 = _run(plan, 0, 2, port, "--rank-timeout", str(timeout), *spec, err=e0)
        r1 = _run(plan, 1, 2, port, "--rank-timeout", str(timeout), *spec, err=e1)
        try:
            deadline = time.monotonic() + 300
            for log in logs:
                _wait_for(log, "loaded in", deadline)
            time.sleep(3)                    # both ranks are generating (the runs take far longer)
            assert r0.poll() is None and r1.poll() is None
            os.kill(r1.pid, sig)
            t0 = time.monotonic()
            r0.wait(timeout=timeout + 30)
            took = time.monotonic() - t0
        finally:
            for p in (r0, r1):
                if p.poll() is None:
                    p.kill()
                    p.wait()
    err = logs[0].read_text().splitlines()
    assert r0.returncode == 2, err
    assert err[-1].startswith("offload: error: rank 0: step ") and "rank 1 stopped answering" in err[-1], err
    assert not any("Traceback" in line for line in err)
    assert took < timeout + 15, took          # the timeout, plus a loaded box's slack


def _refused(tmp: Path, plan: Path, *argv: str) -> str:
    r = subprocess.run([sys.executable, "-m", "offload", "run", *argv], cwd=ROOT, env=_env(_port()),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "loaded in" not in r.stderr
    return r.stderr


def test_launch_that_disagrees_with_the_plan_is_refused_before_loading(tmp_path):
    plan = _plan_file(tmp_path, str(SHIPPED_MODEL), "a:CPU=1GiB;b:CPU=1GiB")
    p = str(plan)
    assert "the plan has 2 hosts (a, b) but the launch has world size 3" in \
        _refused(tmp_path, plan, "--placement", p, "--rank", "0", "--world-size", "3")
    assert "--rank must be 0..1, got 2" in _refused(tmp_path, plan, "--placement", p, "--rank", "2", "--world-size", "2")
    assert "is a plan across hosts: run one process per host with --rank R --world-size W" in \
        _refused(tmp_path, plan, "--placement", p)
    assert "--rank / --world-size run a plan across hosts" in \
        _refused(tmp_path, plan, str(SHIPPED_MODEL), "--rank", "0", "--world-size", "2")
    assert "--spec-type dspark needs a DSpark drafter" in \
        _refused(tmp_path, plan, "--placement", p, "--rank", "1", "--world-size", "2", "--spec-type", "dspark")
    assert "--draft (a draft head across hosts) is not built yet" in \
        _refused(tmp_path, plan, "--placement", p, "--rank", "0", "--world-size", "2", "--draft", str(SHIPPED_MODEL))


def test_torchrun_launch_gives_one_processes_text(tmp_path):
    """``torchrun --standalone --nproc_per_node 2 -m offload run --placement PLAN`` (ranks and
    the rendezvous from torchrun's environment, no --rank flags) prints plain greedy decoding's
    text of one process."""
    plan = _plan_file(tmp_path, str(SHIPPED_MODEL), "a:CPU=1GiB;b:CPU=1GiB")
    env = {k: v for k, v in _env(_port()).items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    flags = ("-p", "Once upon a time", "--ignore-eos", "-n", "24", "--temp", "0")
    ranks = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                            "-m", "offload", "run", "--placement", str(plan), *flags],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert "rank 1/2: host b" in ranks.stderr
    one = subprocess.run([sys.executable, "-m", "offload", "run", str(SHIPPED_MODEL), *flags], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr
    assert ranks.stdout == one.stdout


def test_host_names_give_or_check_the_rank(tmp_path, monkeypatch):
    """``--host NAME`` (or $OFFLOAD_HOST) picks this process's rank from the plan or must agree
    with --rank; a plan host named as this machine must get that host's rank. The refusals are
    OffloadErrors raised before any weight is read (the CLI prints them as one line, as the
    subprocess cases above show for the others)."""
    from offload.commands.run import build_parser
    from offload.commands.run_hosts import launch
    from offload.errors import OffloadError
    plan = str(_plan_file(tmp_path, str(SHIPPED_MODEL), "a:CPU=1GiB;b:CPU=1GiB"))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("OFFLOAD_HOST", raising=False)
    parse = build_parser().parse_args
    assert launch(parse(["--placement", plan, "--host", "b", "--world-size", "2"])) == (1, 2)
    with pytest.raises(OffloadError, match="--host c: not a host of .* \\(a, b\\)"):
        launch(parse(["--placement", plan, "--host", "c", "--world-size", "2"]))
    with pytest.raises(OffloadError, match="--host b is rank 1 of .*, but the launch gave rank 0 \\(host a\\)"):
        launch(parse(["--placement", plan, "--host", "b", "--rank", "0", "--world-size", "2"]))
    monkeypatch.setenv("OFFLOAD_HOST", "a")
    assert launch(parse(["--placement", plan, "--world-size", "2"])) == (0, 2)
    monkeypatch.delenv("OFFLOAD_HOST")
    machine = socket.gethostname().split(".")[0]
    (tmp_path / "named").mkdir()
    named = str(_plan_file(tmp_path / "named", str(SHIPPED_MODEL), f"b:CPU=1GiB;{machine}:CPU=1GiB"))
    assert launch(parse(["--placement", named, "--rank", "1", "--world-size", "2"])) == (1, 2)
    with pytest.raises(OffloadError, match=f"this machine \\({machine}\\) is rank 1 of .*gave it rank 0 \\(host b\\)"):
        launch(parse(["--placement", named, "--rank", "0", "--world-size", "2"]))
    assert launch(parse(["--placement", named, "--rank", "0", "--world-size", "2", "--host", "b"])) == (0, 2)
