"""A model split across hosts, on loopback (issue 26): what a hop costs, and decode speed of
1 vs 2 vs 3 ranks beside the planner's forecast.

    python -m bench.pipeline [MODEL.gguf] [--rounds 3] [-n 64] [--iters 300] [--spec-n-max 3]

MODEL: the shipped model by default (its 4 blocks split 1 / 2+2 / 1+1+2 by hand-picked hosts),
or any other file, planned over 1, 2 and 3 equal hosts (``host_specs``): e.g. the depth
bench's 48-block narrow model (``python -m bench.depth --keep DIR`` writes it). MTP runs only
where the model has a head.

* hops: two processes over gloo on 127.0.0.1 bounce a (T, n_embd) float32 tensor (T = 1, 4,
  16: a decode pass and verify batches) and the pipeline's command (``offload.pipeline``'s
  int64 broadcast); the median round trip over ``--iters``, its half as one hop, bytes per
  token per hop, and the link's rate from the slope between T = 1 and 16 at DeepSeek-V3's
  width (7168: at the model's width the bytes are lost in the latency);
* decode: ``offload run --placement`` of a plan with one, two and three hosts (one process
  per rank, CPU devices, gloo, ``--torch-threads 1 -t 1``) and ``offload run`` of the model
  in one process, greedy, ``-n`` tokens, each plain and speculating with the n-gram drafter
  and the model's MTP head (``--spec-n-max``, batched verify; 0 leaves them out); the
  configurations alternate within a round (order reversed every other round) and the medians
  are printed; eval t/s is the last rank's ``--stats-json`` (the prompt and loading excluded);
* forecast: ``offload plan --hosts ... --hop-latency-us H --hop-gbps G`` with the hop measured
  above and this box's probe (``offload probe -t 1 --write``: the ranks' one thread) as every
  host's hardware: the plain decode t/s and the MTP t/s at ``--spec-n-max`` it predicts (the MTP one with the planner's
  prior acceptance, not the measured one), and measured / predicted; beside it what a hop
  cost inside decoding (the time per token over one rank's, divided by the forecast's hops
  per pass: one per boundary and one back).

Every process gets ``OMP_WAIT_POLICY=PASSIVE`` (three ranks share this box's cores); the load
average is printed before and after.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from offload.probe import SHIPPED_MODEL

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time"
RANK_THREADS = "1"              # each process's kernel threads: ranks share this box's cores
WIDE = 7168                     # DeepSeek-V3's n_embd: where the bytes of a hop show
BATCHES = (1, 4, 16)
# host specs whose proportional split gives the shipped model's 4 blocks 1, 2 and 3 ranges
HOSTS = {1: "a:CPU=1GiB", 2: "a:CPU=1GiB;b:CPU=1GiB", 3: "a:CPU=1GiB;b:CPU=1GiB;c:CPU=2GiB"}
ROOM = 1.5          # another model's hosts: each holds its share of the file this many times over


def host_specs(model: str, file_bytes: int) -> dict[int, str]:
    """World size → the ``--hosts`` spec to plan ``model`` with: the shipped model's above, else
    1, 2 or 3 equal hosts, each with room for its share of the file (``ROOM``; at least 1 GiB),
    which the planner's proportional split gives equal ranges of blocks."""
    if Path(model).resolve() == Path(SHIPPED_MODEL).resolve():
        return HOSTS
    out = {}
    for w in (1, 2, 3):
        gib = max(1, math.ceil(file_bytes * ROOM / w / 2 ** 30))
        out[w] = ";".join(f"{h}:CPU={gib}GiB" for h in "abc"[:w])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# hops: a gloo round trip between two processes
# ---------------------------------------------------------------------------------------------

def _bounce(rank: int, port: int, shapes: list[tuple[tuple[int, ...], str]], iters: int, out) -> None:
    """Rank 0 sends each tensor to rank 1 and waits for it back; ``out`` gets the median and
    the fastest round trip per shape (seconds)."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    medians = []
    for shape, dtype in shapes:
        x = torch.zeros(shape, dtype=getattr(torch, dtype))
        times = []
        for i in range(iters + 20):                  # 20 warm-up trips
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(x, dst=1)
                dist.recv(x, src=1)
            else:
                dist.recv(x, src=0)
                dist.send(x, dst=0)
            if i >= 20:
                times.append(time.perf_counter() - t0)
        medians.append((statistics.median(times), min(times)))
    dist.destroy_process_group()
    if rank == 0:
        out.put(medians)


@dataclass
class Hop:
    what: str
    nbytes: int
    rtt_s: float               # median round trip
    best_s: float              # fastest round trip: the link without the scheduler's waits

    @property
    def one_way_us(self) -> float:
        return self.rtt_s / 2 * 1e6


def measure_hops(n_embd: int, n_max: int, iters: int) -> list[Hop]:
    from offload.pipeline import HEADER
    shapes = [((t, w), "float32") for w in (n_embd, WIDE) for t in BATCHES]
    shapes.append(((HEADER + 2 * (n_max + 1),), "int64"))
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_bounce, args=(r, port, shapes, iters, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    medians = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    hops = []
    for (shape, dtype), (rtt, best) in zip(shapes, medians):
        size = 8 if dtype == "int64" else 4
        nbytes = size * shape[0] * (shape[1] if len(shape) > 1 else 1)
        what = (f"hidden state T={shape[0]}, n_embd {shape[1]}" if len(shape) > 1 else
                f"pipeline command ({shape[0]} int64)")
        hops.append(Hop(what, nbytes, rtt, best))
    return hops


def link_gbps(hops: list[Hop]) -> float | None:
    """The rate from the slope of one-way time against bytes at the wide width (None when the
    slope is not positive: the bytes are lost in the noise)."""
    wide = [h for h in hops if h.what.endswith(f"n_embd {WIDE}")]
    lo, hi = wide[0], wide[-1]
    dt = (hi.rtt_s - lo.rtt_s) / 2
    return (hi.nbytes - lo.nbytes) / dt / 1e9 if dt > 0 else None


# ---------------------------------------------------------------------------------------------
# decode: offload run, one process per rank
# ---------------------------------------------------------------------------------------------

def _env(port: int | None = None) -> dict:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    if port is not None:
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return env


def _offload(*args: str, env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "offload", *args], cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"offload {' '.join(args)} failed: {r.stderr.strip().splitlines()[-1:]}")
    return r


def run_flags(n: int, kind: str, n_max: int, stats: Path) -> list[str]:
    spec = ["--spec-type", kind, "--spec-n-max", str(n_max)] if kind != "none" else ["--spec-type", "none"]
    return ["-p", PROMPT, "-n", str(n), "--ignore-eos", "--temp", "0", "--torch-threads", "1", "-t", RANK_THREADS,
            "--stats-json", str(stats), *spec]


def decode(plan: Path | None, model: str, world: int, n: int, kind: str, n_max: int, tmp: Path) -> dict:
    """One ``offload run``: ``world`` ranks of ``plan`` (None: the model in one process, no
    pipeline) → the last rank's stats."""
    stats = tmp / "stats.json"
    stats.unlink(missing_ok=True)
    flags = run_flags(n, kind, n_max, stats)
    if plan is None:
        _offload("run", model, *flags, env=_env())
    else:
        env = _env(free_port())
        procs = [subprocess.Popen([sys.executable, "-m", "offload", "run", "--placement", str(plan), "--rank",
                                   str(r), "--world-size", str(world), *flags], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        for r, p in enumerate(procs):
            _, err = p.communicate(timeout=900)
            if p.returncode != 0:
                raise SystemExit(f"rank {r}/{world} failed: {err.strip().splitlines()[-1:]}")
    return json.loads(stats.read_text())


def read_at_types_rate(model_path: str, profile: Path) -> float:
    """Rewrite the probe's profile with the rate one decode token reads this model's weights at
    on their types' decode path with the ranks' threads (``probe.at_weights_rate``, as
    ``offload plan --devices auto`` does for a plan on this box; the probe's own rate is the
    Q8_0 mat-vec's: 14 GB/s against the narrow model's 7 at one thread) → that rate."""
    import yaml

    from offload.gguf_model import open_model
    from offload.probe import at_weights_rate
    from placement.hardware import HardwareProfile

    model = open_model(model_path)
    # (a model within the probe's measured cache is still read at its in-cache rate, as in a
    # plan for one box)
    hw, rate = at_weights_rate(HardwareProfile.from_yaml(profile), model.tensors,
                               {t.name: "CPU" for t in model.tensors}, model.spec.n_expert_used,
                               threads=int(RANK_THREADS))
    if rate is not None:
        profile.write_text(yaml.safe_dump(hw.to_dict(), sort_keys=False))
    return hw.cpu_read_gbps


def forecast(model: str, hosts: str, hop_us: float, gbps: float | None, profile: Path, out: Path,
             n_max: int) -> tuple[float, float | None]:
    """Plan ``hosts`` with the measured hop → the plain decode t/s the plan predicts, and its
    MTP t/s at ``n_max`` (None beyond the table or without an MTP head)."""
    flags = ["--hop-latency-us", f"{hop_us:.2f}"] + (["--hop-gbps", f"{gbps:.3f}"] if gbps else [])
    doc = json.loads(_offload("plan", model, "--hosts", hosts, "--hw-profile", str(profile), *flags,
                              "--spec-max-n", str(max(n_max, 1)), "-o", str(out), "--json", env=_env()).stdout)
    rows = {r["n_max"]: r["tokens_per_s"] for r in (doc["speculative"] or {}).get("rows", [])}
    return float(doc["forecast"]["predicted_plain_tps"]), rows.get(n_max)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=str(SHIPPED_MODEL))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=64, help="tokens per run (default 64)")
    ap.add_argument("--iters", type=int, default=300, help="round trips per hop shape (default 300)")
    ap.add_argument("--spec-n-max", type=int, default=3,
                    help="drafts per step (n-gram and MTP; default 3); 0: plain decoding only")
    a = ap.parse_args(argv)
    if not Path(a.model).is_file():
        raise SystemExit(f"{a.model}: no such file")
    from offload.gguf_model import open_model
    spec = open_model(a.model).spec
    n_embd = spec.n_embd
    hosts = host_specs(a.model, Path(a.model).stat().st_size)
    drafters = ("ngram", "mtp") if spec.n_nextn else ("ngram",)     # MTP only where the model has a head
    load0 = os.getloadavg()

    hops = measure_hops(n_embd, a.spec_n_max, a.iters)
    gbps = link_gbps(hops)
    hop_us = hops[0].one_way_us              # T=1 at the model's width: a decode pass's hop
    print(f"hops on loopback (gloo send+recv, median of {a.iters} round trips; one hop = half the median):")
    print(f"  {'what':<36} {'bytes':>8} {'round trip us':>14} {'fastest us':>11} {'one hop us':>11} "
          f"{'bytes/token':>12}")
    for h in hops:
        per_tok = h.nbytes // int(h.what.split("T=")[1].split(",")[0]) if "T=" in h.what else h.nbytes
        print(f"  {h.what:<36} {h.nbytes:>8} {h.rtt_s * 1e6:>14.1f} {h.best_s * 1e6:>11.1f} {h.one_way_us:>11.1f} "
              f"{per_tok:>12}")
    print(f"  link rate from T=1..16 at n_embd {WIDE}: " + (f"{gbps:.2f} GB/s" if gbps else "not measurable"))

    configs = [(None, 1)] + [("plan", w) for w in (1, 2, 3)]
    kinds = [("none", 0)] + ([(d, a.spec_n_max) for d in drafters] if a.spec_n_max else [])
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        profile = tmp / "box.yaml"
        # the ranks' own thread count: a 2-thread probe under OMP_WAIT_POLICY=PASSIVE measured
        # 379 us per block against 35 at one thread, and forecast a third of the speed
        _offload("probe", "--refresh", "-t", RANK_THREADS, "--write", str(profile), env=_env())
        rate = read_at_types_rate(a.model, profile)
        print(f"forecast's profile: offload probe -t {RANK_THREADS}, the model's CPU weights read at "
              f"{rate:.1f} GB/s (their types' decode path at {RANK_THREADS} thread)")
        plans, predicted = {}, {}
        for w in (1, 2, 3):
            plans[w] = tmp / f"hosts{w}.yaml"
            predicted[w] = forecast(a.model, hosts[w], hop_us, gbps, profile, plans[w], a.spec_n_max)
        results: dict[tuple, list[dict]] = {}
        jobs = [(c, k) for c in configs for k in kinds]
        for r in range(a.rounds):
            for (plan, w), (kind, n_max) in (jobs if r % 2 == 0 else jobs[::-1]):
                stats = decode(plans[w] if plan else None, a.model, w, a.n, kind, n_max, tmp)
                results.setdefault((plan, w, kind), []).append(stats)
            print(f"round {r + 1}/{a.rounds} done, load {os.getloadavg()[0]:.2f}", flush=True)
    load1 = os.getloadavg()

    def tps(plan, w, kind) -> float:
        return statistics.median(s["eval_tokens_per_second"] for s in results[(plan, w, kind)])

    def name(plan, w) -> str:
        return "offload run, one process" if plan is None else f"{w} rank{'s' if w > 1 else ''} ({hosts[w]})"

    print(f"\nplain decode, {Path(a.model).name}, -n {a.n} greedy, median of {a.rounds} rounds; forecast: offload "
          f"plan --hosts with hop {hop_us:.1f} us" + (f", {gbps:.2f} GB/s" if gbps else "") + " and this box's probe")
    print(f"  {'configuration':<44} {'t/s':>8} {'forecast':>9} {'meas/fc':>8} {'vs 1 rank':>10} "
          f"{'hop us in decode':>17}")
    one_rank = tps("plan", 1, "none")
    for plan, w in configs:
        plain = tps(plan, w, "none")
        fc = f" {predicted[w][0]:>9.1f} {plain / predicted[w][0]:>8.2f}" if plan else f" {'':>9} {'':>8}"
        # what a hop cost inside decoding: the time per token over 1 rank's, per hop (w per pass)
        implied = f" {(1 / plain - 1 / one_rank) / w * 1e6:>17.0f}" if plan and w > 1 else f" {'':>17}"
        print(f"  {name(plan, w):<44} {plain:>8.1f}{fc} {plain / one_rank:>10.2f}{implied}")
    if a.spec_n_max:
        print(f"\nspeculation, n_max {a.spec_n_max}, batched verify (acceptance and target passes of the last "
              f"round; x plain: over the same configuration's plain t/s)")
        mtp_cols = f" {'mtp t/s':>8} {'acc':>5} {'x plain':>8} {'mtp fc':>8} {'meas/fc':>8}" if "mtp" in drafters else ""
        print(f"  {'configuration':<44} {'ngram t/s':>9} {'acc':>5} {'x plain':>8}{mtp_cols}")
        for plan, w in configs:
            plain = tps(plan, w, "none")
            line = f"  {name(plan, w):<44}"
            for kind in drafters:
                last = results[(plan, w, kind)][-1]
                v = tps(plan, w, kind)
                line += f" {v:>{9 if kind == 'ngram' else 8}.1f} {last['accepted'] / max(last['drafted'], 1):>5.0%}"
                line += f" {v / plain:>8.2f}"
            fc = predicted[w][1] if plan and "mtp" in drafters else None
            if "mtp" in drafters:
                line += f" {fc:>8.1f} {tps(plan, w, 'mtp') / fc:>8.2f}" if fc else f" {'':>8} {'':>8}"
            print(line)
    print(f"\n{os.cpu_count()} cores, load average {load0[0]:.2f} -> {load1[0]:.2f}, OMP_WAIT_POLICY=PASSIVE, "
          "--torch-threads 1 -t 1 per process")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
