"""Does the plan's forecast hold on the box it is printed on? (issue 32)

    python -m bench.forecast [MODEL.gguf] [--rounds 3] [-n 480] [--tune-budget 60] [--no-tune] [--json PATH]
                             [--cpu-target avx2|avx-vnni|avx512]

For the model (default: the shipped one), each in a fresh process as a user runs them:

* prior: ``offload plan MODEL --no-probe --json``: plain decode t/s and best n_max from the priors;
* calibrated: ``offload plan MODEL --refresh-probe --json`` (``--devices auto``, the probe run
  afresh each round into a temporary cache): the same with this box's measured terms, the
  forecast's interval, and the probe's timed seconds;
* measured: ``offload run MODEL -n N --ignore-eos`` (plain decoding, the default prompt): the
  eval tokens per second it prints;
* tuned: ``offload tune MODEL --budget B --json`` once: the n_max it chooses for the model's
  draft head (the drafter the plan's table is for), and its overall choice.

Calibrated and measured alternate in ``--rounds`` rounds (order reversed every other round),
so a load change on a shared box hits both; medians are printed with the load average before
and after. The environment is passed through as it is (e.g. ``OMP_WAIT_POLICY``: set it the
same for every command, as here). ``--cpu-target`` compiles offload's kernels for another x86
class in every one of those processes (``bench.llama_build.target_envs``: ``NUMBA_CPU_NAME`` and
``NUMBA_CPU_FEATURES``); the probe's cache is keyed by that target, so each class is probed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from offload.probe import SHIPPED_MODEL

ROOT = Path(__file__).resolve().parents[1]
_EVAL = re.compile(r"eval time\s*=.*?([\d.]+) tokens per second")


def _offload(*args: str, env: dict) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "offload", *args], cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"offload {' '.join(args)} failed: {r.stderr.strip().splitlines()[-1:]}")
    return r


def plan_forecast(model: str, *flags: str, env: dict) -> dict:
    doc = json.loads(_offload("plan", model, "--json", *flags, env=env).stdout)
    spec = doc["speculative"] or {}
    iv = doc.get("forecast_interval") or {}
    return {"plain_tps": spec.get("predicted_plain_tps", doc.get("predicted_plain_tps")),
            "best_n_max": spec.get("best_n_max"),
            "break_even": iv.get("break_even_n_max", [spec.get("break_even_n_max")] * 2),
            "plain_range": iv.get("plain_tps")}


def measured_tps(model: str, n: int, env: dict) -> float:
    r = _offload("run", model, "-n", str(n), "--ignore-eos", env=env)
    m = [line for line in r.stderr.splitlines() if " eval time" in line and "prompt" not in line]
    return float(_EVAL.search(m[-1]).group(1))


def probe_seconds(cache: Path) -> float:
    import yaml
    files = sorted(cache.glob("probe-*.yaml"))
    return float(yaml.safe_load(files[-1].read_text())["seconds"]) if files else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=str(SHIPPED_MODEL))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", type=int, default=480, help="tokens per offload run (default 480)")
    ap.add_argument("--tune-budget", default="60", help="offload tune --budget (default 60)")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--cpu-target", default="native",
                    help="compile offload's kernels for another x86 class this CPU can run, for every command: "
                         "avx2 (haswell), avx-vnni (alderlake), avx512 (cascadelake), or native (default)")
    a = ap.parse_args(argv)
    from bench.llama_build import target_envs
    try:
        target = target_envs(a.cpu_target, with_llama=False)
    except ValueError as e:
        print(f"bench.forecast: --cpu-target: {e}", file=sys.stderr)
        return 2
    print(target.header, flush=True)
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, **target.offload, "OFFLOAD_CACHE_DIR": str(Path(tmp) / "cache")}
        # --no-probe prints no plain forecast for a model without a draft head: the priors'
        # forecast is then the uncalibrated one (a written device spec, no probe)
        prior = plan_forecast(a.model, "--no-probe", env=env)
        if prior["plain_tps"] is None:
            prior = plan_forecast(a.model, "--devices", "CPU=16GiB", env=env)
        head = prior["best_n_max"] is not None
        calibrated, measured, probe_s = [], [], []
        for r in range(a.rounds):
            for step in (("plan", "run") if r % 2 == 0 else ("run", "plan")):
                if step == "plan":
                    calibrated.append(plan_forecast(a.model, "--refresh-probe", env=env))
                    probe_s.append(probe_seconds(Path(tmp) / "cache"))
                else:
                    measured.append(measured_tps(a.model, a.n, env))
            c = calibrated[-1]
            spec = f", best n_max {c['best_n_max']} (break-even {c['break_even']})" if head else ""
            print(f"round {r + 1}: calibrated {c['plain_tps']:.1f} t/s [{c['plain_range'][0]:.0f}-"
                  f"{c['plain_range'][1]:.0f}]{spec}; measured {measured[-1]:.1f} t/s "
                  f"(ratio {c['plain_tps'] / measured[-1]:.2f}); probe {probe_s[-1]:.2f}s; "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
        tuned = None
        if head and not a.no_tune:
            out = Path(tmp) / "tune.json"
            _offload("tune", a.model, "--budget", a.tune_budget, "--json", str(out), env=env)
            tuned = json.loads(out.read_text())
    load1 = os.getloadavg()
    cal = statistics.median(c["plain_tps"] for c in calibrated)
    meas = statistics.median(measured)
    paired = statistics.median(c["plain_tps"] / m for c, m in zip(calibrated, measured))
    print(f"\n{Path(a.model).name}, {os.cpu_count()} cores, load average {load0[0]:.2f} -> {load1[0]:.2f}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; medians of {a.rounds} rounds")
    print(f"plain decode t/s: prior {prior['plain_tps']:.1f} ({prior['plain_tps'] / meas - 1:+.0%}), "
          f"calibrated {cal:.1f} ({cal / meas - 1:+.0%}), measured {meas:.1f} (offload run -n {a.n}); "
          f"per-round calibrated/measured median {paired:.2f}")
    print(f"probe: {statistics.median(probe_s):.2f}s timed (median)")
    if head:
        best = statistics.median_low(c["best_n_max"] for c in calibrated)
        line = f"best n_max: prior {prior['best_n_max']}, calibrated {best}"
        if tuned is not None:
            # the plan's table is the model's draft head's: compare tune's choice for that drafter
            # (tune also weighs n-gram drafting, whose acceptance no plan can know)
            head_kind = tuned["head_drafter"]
            mine = (tuned.get("drafters") or {}).get(head_kind, {"n_max": tuned["chosen_n_max"],
                                                                 "choice": tuned["choice"]})
            theirs = [m for m in tuned["measured"] if m.get("drafter", head_kind) in (head_kind, "none")]
            line += (f", offload tune chose {mine['n_max']} for {head_kind} (measured best "
                     f"{max(theirs, key=lambda m: m['speedup_mean'])['n_max']}; {mine['choice']}); "
                     f"its overall choice: {tuned['chosen_drafter']} n_max {tuned['chosen_n_max']}")
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu_target": target.name, "prior": prior, "calibrated": calibrated,
                                            "measured": measured,
                                            "probe_s": probe_s, "load": [load0[0], load1[0]],
                                            "tuned_n_max": None if tuned is None else mine["n_max"],
                                            "tuned_overall": None if tuned is None else
                                            [tuned["chosen_drafter"], tuned["chosen_n_max"]]},
                                           indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
