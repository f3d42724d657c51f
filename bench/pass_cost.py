"""Where a decode token's time goes outside the blocks: plain greedy decode in-process, each
part of a one-token pass timed, medians per token.

    python -m bench.pass_cost [MODEL.gguf ...] [-n 400] [--threads 2,1]

Default models: the shipped ``models/tiny-glm4moe-mtp.gguf`` and the depth bench's narrow
4-block model in ``/tmp/depthkeep`` (when present). For each model and thread count it loads
the model all-CPU (compiled blocks), decodes ``-n`` tokens greedily after a short prompt
(twice; the first run is a warm-up) and prints per token, median over the second run's
one-token passes, wall µs and the main thread's CPU µs (``time.thread_time``) of:

- ``embed``: ``CausalLM.embed`` (token → hidden row);
- ``blocks``: the trunk's block runs (``BlockRun`` / a block's own call), and per block;
- ``output_head`` (the compiled output norm + lm_head, ``offload.compiled_head``) where the
  model has one, else ``output_norm`` and ``output`` (the torch reference path);
- ``rest``: the token's wall less the parts above — ``forward``'s own Python, the decode
  loop (``offload.speculative``), the finite check, sampling, the generator;
- ``token``: the interval between two yielded tokens (one pass each).

Wall is what the cost model's per-pass term is; with 2 threads Numba's worker wakes up
inside the parallel regions, so CPU time is printed for 1 thread (work on the main thread
only) next to it. The timers themselves cost ~0.3 µs per part (two clock reads each).
The load average is printed: on a shared box the figures move with it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPTH_KEEP = Path("/tmp/depthkeep")
PROMPT_LEN = 8


class _Timed:
    """Wraps a callable; records (wall, thread CPU) seconds of each one-token call while on."""

    def __init__(self, fn, log: list):
        self.fn, self.log, self.on = fn, log, False

    def __call__(self, x, *args, **kw):
        if not self.on or x.shape[0] != 1:
            return self.fn(x, *args, **kw)
        w0, c0 = time.perf_counter(), time.thread_time()
        out = self.fn(x, *args, **kw)
        self.log.append((time.perf_counter() - w0, time.thread_time() - c0))
        return out

    def __getattr__(self, name):          # the wrapped part's attributes (device, weight, ...)
        return getattr(self.fn, name)


class PassTimer:
    """Timers around a CausalLM's embedding, block runs and head parts; ``per_pass()`` sums
    each category per one-token pass."""

    def __init__(self, model):
        self.logs: dict[str, list] = {"embed": []}
        self.timers = [_Timed(model.embed, self.logs["embed"])]
        model.embed = self.timers[0]
        head = getattr(model, "output_head", None)       # the compiled output norm + lm_head
        self.heads, self._restore = [], None
        if head is not None:
            # call syntax looks __call__ up on the class, so the timer goes there (undone by close)
            cls, orig = type(head), type(head).__call__
            self.logs["output_head"] = []
            t = _Timed(lambda x, logits: orig(head, x, logits), self.logs["output_head"])
            cls.__call__ = lambda obj, x, logits, t=t: t(x, logits)
            self._restore = (cls, orig)
            self.heads.append("output_head")
            self.timers.append(t)
        else:
            for n in ("output_norm", "output"):
                self.logs[n] = []
                t = _Timed(getattr(model, n), self.logs[n])
                setattr(model, n, t)
                self.timers.append(t)
                self.heads.append(n)
        runs = model.block_runs()
        self.n_runs = len(runs)
        self.logs["blocks"] = []
        timed = []
        for step, lo, hi in runs:
            t = _Timed(step, self.logs["blocks"])
            self.timers.append(t)
            timed.append((t, lo, hi))
        runs[:] = timed                     # the list forward iterates (rebuilt only if blocks change)

    def close(self) -> None:
        if self._restore is not None:
            cls, orig = self._restore
            cls.__call__ = orig

    def set(self, on: bool) -> None:
        for t in self.timers:
            t.on = on

    def per_pass(self, n: int) -> dict[str, list[tuple[float, float]]]:
        """Category → n (wall, cpu) per pass (block runs summed within a pass)."""
        out = {}
        for name, log in self.logs.items():
            k = self.n_runs if name == "blocks" else 1
            if len(log) != n * k:
                raise RuntimeError(f"{name}: {len(log)} timed calls for {n} passes")
            out[name] = [(sum(w for w, _ in log[i * k:(i + 1) * k]), sum(c for _, c in log[i * k:(i + 1) * k]))
                         for i in range(n)]
        return out


def measure(path: str, n: int, threads: int) -> dict:
    """Median wall / CPU µs per token of each part for ``n`` greedy tokens on ``threads``."""
    import torch

    import offload.runtime as rt
    from bench.depth import prompt_ids
    torch.set_num_threads(1)
    with rt.load(path, quiet=True, threads=threads, devices="CPU=16GiB", ctx=PROMPT_LEN + n + 64) as s:
        s.warmup()
        timer = PassTimer(s.model)
        ids = prompt_ids(PROMPT_LEN, min(256, s.model.config.n_vocab))
        for timed in (False, True):            # warm-up run, then the timed one
            stamps = []
            for _ in s.generate(ids, max_tokens=n, stop_at_eos=False):
                stamps.append((time.perf_counter(), time.thread_time()))
                if timed and len(stamps) == 1:    # the prompt's pass is done: time the decode passes
                    timer.set(True)
        timer.set(False)
        timer.close()
        n_pass = len(stamps) - 1              # each interval between yields is one pass
        parts = timer.per_pass(n_pass)
        blocks = len(s.model.blocks)
        eval_tps = s.stats.eval_tps
    token = [(stamps[i + 1][0] - stamps[i][0], stamps[i + 1][1] - stamps[i][1]) for i in range(n_pass)]
    rest = [(tw - sum(p[i][0] for p in parts.values()), tc - sum(p[i][1] for p in parts.values()))
            for i, (tw, tc) in enumerate(token)]
    rows = {"token": token, **parts, "rest": rest}
    med = {k: (statistics.median(w for w, _ in v) * 1e6, statistics.median(c for _, c in v) * 1e6)
           for k, v in rows.items()}
    head = [tuple(sum(parts[h][i][j] for h in timer.heads) for j in range(2)) for i in range(n_pass)]
    if len(timer.heads) > 1:
        med["head (sum)"] = tuple(statistics.median(x[j] for x in head) * 1e6 for j in range(2))
    outside = [tuple(token[i][j] - parts["blocks"][i][j] for j in range(2)) for i in range(n_pass)]
    med["outside blocks"] = tuple(statistics.median(x[j] for x in outside) * 1e6 for j in range(2))
    med["per block"] = tuple(v / blocks for v in med["blocks"])
    return dict(median_us=med, blocks=blocks, runs=timer.n_runs, passes=n_pass, eval_tps=eval_tps)


def default_models() -> list[str]:
    out = [str(ROOT / "models" / "tiny-glm4moe-mtp.gguf")]
    out += [str(p) for p in sorted(DEPTH_KEEP.glob("depth-v1-qwen3moe-L4-*.gguf"))[:1]]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("-n", type=int, default=400, help="tokens per run (default 400)")
    ap.add_argument("--threads", default="2,1", help="Numba thread counts, comma-separated (default 2,1)")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    for path in args.models or default_models():
        for t in threads:
            r = measure(path, args.n, t)
            print(f"\n{Path(path).name}: {r['blocks']} blocks in {r['runs']} run call(s), threads {t}, "
                  f"{r['passes']} one-token passes, {r['eval_tps']:.1f} t/s (stats)")
            print(f"  {'part':<16} {'wall µs':>9} {'cpu µs':>9}   (medians per token)")
            for name, (w, c) in r["median_us"].items():
                print(f"  {name:<16} {w:9.1f} {c:9.1f}")
    print(f"\nload average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
