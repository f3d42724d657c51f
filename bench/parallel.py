"""Several clients at once against ``offload serve -np N`` (continuous batching), from the
clients' side, against a real server process.

    python -m bench.parallel [MODEL.gguf] [--levels 1,2,4,8] [--modes 0,1,2,3,auto,bandit]
                             [--tokens 64] [--rounds 3] [-- serve flags]

For each speculation mode (fixed n_max values; ``auto``, the online choice; ``bandit``, the
ε-greedy comparator) one server runs with ``-np`` = the largest level; at each concurrency level C, C streaming clients (distinct prompts, greedy,
``ignore_eos``) are released together, ``--rounds`` times. Printed per row: aggregate
tokens/s (every client's tokens over the wall time of the round; median and spread over the
rounds), its ratio to one client alone on the same server, time to first token and
inter-token latency percentiles (client clock, over every request of every round), the
draft acceptance, and requests that failed. A server with ``-np 1`` (no batcher) serving one
client is the baseline row of plain decoding. Then each online mode against the best fixed
n_max at each level, and the planner's forecast of aggregate tokens/s
per number of sequences (``offload plan --json --probe``'s ``concurrency_forecast``, from the plan's
hardware profile) beside the measured numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.serve import CLIENT, pct, together
from tests.serve_process import ServeProcess

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "tiny-glm4moe-mtp.gguf"
PROMPTS = ["import os\n", "def main(argv):\n    ", "class Config:\n    ", "Once upon a time",
           "SELECT * FROM", "#include <stdio.h>\n", "The quick brown fox", "for i in range(10):\n    "]


def stream(url: str, prompt: str, tokens: int, n_max: int) -> dict:
    """One streamed completion: arrival times of its content chunks and the final timings."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "n_max": n_max}
    t0 = time.perf_counter()
    arrivals, timings = [], {}
    with CLIENT.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter() - t0)
            timings = chunk.get("timings", timings)
    return {"arrivals": arrivals, "timings": timings}


def crowd(url: str, clients: int, tokens: int, n_max: int) -> tuple[float, list[dict], int]:
    """C clients released together → (wall s, their results, failures)."""
    def one(i):
        try:
            return stream(url, PROMPTS[i % len(PROMPTS)], tokens, n_max)
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            return exc

    wall, results = together(clients, one)
    ok = [r for r in results if isinstance(r, dict)]
    return wall, ok, clients - len(ok)


def level_row(url: str, clients: int, args, n_max: int) -> dict:
    rates, ttft, itl, failed, drafted, accepted = [], [], [], 0, 0, 0
    crowd(url, clients, 8, n_max)                     # warm: first requests of a level
    for _ in range(args.rounds):
        wall, ok, bad = crowd(url, clients, args.tokens, n_max)
        failed += bad
        rates.append(sum(r["timings"].get("predicted_n", 0) for r in ok) / wall)
        for r in ok:
            a = r["arrivals"]
            if a:
                ttft.append(a[0])
                itl.extend(b - c for b, c in zip(a[1:], a))
            drafted += r["timings"].get("draft_n", 0)
            accepted += r["timings"].get("draft_n_accepted", 0)
    return {"clients": clients, "tps": statistics.median(rates), "lo": min(rates), "hi": max(rates),
            "ttft50": pct(ttft, .5), "ttft99": pct(ttft, .99), "itl50": pct(itl, .5), "itl99": pct(itl, .99),
            "acceptance": accepted / drafted if drafted else None, "failed": failed}


def forecast(model: str, flags: list[str]) -> dict[int, dict]:
    """``offload plan --json``'s concurrency forecast, by number of sequences."""
    out = subprocess.run([sys.executable, "-m", "offload.cli", "plan", model, "--json", *flags],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        print(f"(no forecast: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode})")
        return {}
    doc = json.loads(out.stdout)
    rows = doc.get("concurrency_forecast") or []
    return {r["sequences"]: r for r in rows}


def serve(model: str, flags: list[str]) -> ServeProcess:
    """``offload serve`` started for a round; a server that does not come up is one line (its
    own last line of output), not a traceback."""
    with tempfile.TemporaryFile("w+") as log:
        try:
            return ServeProcess(model, flags, passive=False, log=log)
        except RuntimeError as e:
            log.seek(0)
            last = (log.read().strip().splitlines() or [""])[-1]
            raise SystemExit(f"bench.parallel: {e}: {last}") from None


def mode_name(n_max) -> str:
    return "off" if n_max == 0 else f"n_max {n_max}" if isinstance(n_max, int) else n_max


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=str(SHIPPED))
    p.add_argument("--levels", default="1,2,4,8", help="client counts (default 1,2,4,8)")
    p.add_argument("--modes", default="0,1,2,3,auto,bandit",
                   help="speculation modes: fixed n_max values, auto, bandit (default 0,1,2,3,auto,bandit)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--devices", default="CPU=16GiB")
    p.epilog = "flags after -- go to offload serve"
    # split at "--" by hand: a REMAINDER positional after the optional model swallowed every
    # option written after the model (`bench.parallel MODEL --levels 1,8` served with --levels)
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    levels = [int(x) for x in args.levels.split(",")]
    modes = [m if m in ("auto", "bandit") else int(m) for m in args.modes.split(",")]
    np_max = max(levels)
    print(f"model {args.model}; -np {np_max}; {args.tokens} tokens per request, greedy; {args.rounds} rounds; "
          f"devices {args.devices}")
    table = []
    for n_max in modes:
        mode = mode_name(n_max)
        if n_max == 0:           # the batcher's own cost: one client on a server without one
            base = serve(args.model, ["--devices", args.devices, "-np", "1", "--spec-n-max", "0", *flags])
            try:
                table.append((mode, "-np 1", level_row(base.url, 1, args, n_max)))
            finally:
                base.close()
        srv = serve(args.model, ["--devices", args.devices, "-np", str(np_max), "--spec-n-max", str(n_max), *flags])
        try:
            for c in levels:
                table.append((mode, f"-np {np_max}", level_row(srv.url, c, args, n_max)))
        finally:
            srv.close()
    print(f"\n{'spec':<9} {'server':<7} {'clients':>7} {'agg t/s':>9} {'(min-max)':>15} {'x one':>6} "
          f"{'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7} {'accept':>7} {'failed':>6}")
    for mode, server, r in table:
        one = next(x for m, s, x in table if m == mode and s != "-np 1" and x["clients"] == 1)
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        print(f"{mode:<9} {server:<7} {r['clients']:>7} {r['tps']:>9.1f} {r['lo']:>7.1f}-{r['hi']:<7.1f} "
              f"{r['tps'] / one['tps']:>6.2f} {r['ttft50']:>7.1f}ms {r['ttft99']:>5.1f}ms {r['itl50']:>6.1f}ms "
              f"{r['itl99']:>5.1f}ms {acc:>7} {r['failed']:>6}")
    batched = {(m, r["clients"]): r["tps"] for m, s, r in table if s != "-np 1"}
    fixed = [mode_name(m) for m in modes if isinstance(m, int)]
    online = [mode_name(m) for m in modes if isinstance(m, str)]
    if fixed and online:
        print("\nonline n_max against the best fixed n_max, per number of clients (aggregate t/s):")
        for c in levels:
            best = max(fixed, key=lambda m: batched[(m, c)])
            cells = "  ".join(f"{m} {batched[(m, c)]:.1f} ({batched[(m, c)] / batched[(best, c)]:.3f})"
                              for m in online)
            print(f"  {c} clients: best fixed {best} {batched[(best, c)]:.1f};  {cells}")
    fc = forecast(args.model, ["--devices", args.devices, "--probe"])     # calibrated on this box
    if fc and 0 in modes:
        print("\nforecast (offload plan --json --probe: this box's probed costs) vs measured, aggregate t/s:")
        print(f"{'sequences':>9} {'plain fc':>9} {'plain meas':>10} {'best n fc':>9} {'best fc':>9} "
              f"{'best fixed meas':>16}")
        for c in levels:
            f = fc.get(c)
            if f is None:
                continue
            best = max(fixed, key=lambda m: batched[(m, c)])
            print(f"{c:>9} {f['plain_tps']:>9.1f} {batched[('off', c)]:>10.1f} {f['best_n_max']:>9} "
                  f"{f['best_tps']:>9.1f} {best:>8} {batched[(best, c)]:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
