"""``offload run`` on one model under three plans — all on the CPU, experts on the CPU with
the rest on a (virtual) GPU, and layers over virtual CUDA0+CUDA1 — printing the text, t/s,
what each device holds vs the plan, and the process's peak RSS growth against the planner's
estimate of host RAM for the same plan: weights + KV + compute of the CPU and of the virtual
GPUs, which live in host RAM here (the plan is re-totalled with them as
``MemorySettings.host_backed``: their compute is torch-on-the-CPU's, and the joint compute is
the largest step of one forward pass summed over those devices).

    python -m bench.runtime_plans [MODEL.gguf] [-n 64] [-c 512] [--json out.jsonl]

The prompt is ``ctx - n`` tokens of code, processed as one ubatch of that size (the plan's
``--ubatch``), so the largest step the planner counts — a full ubatch attending to (nearly)
the whole context — really runs. Each plan runs in a fresh process, twice: with the
allocator as ``offload run`` sets it (``offload.host_memory``: glibc's mmap threshold fixed at
64 KiB) and with glibc's default dynamic threshold, to show what that keeps resident.

In each process a first load + prompt of the same plan sets up what a process pays once
(Numba kernels loaded from cache, torch's thread pool and per-op buffers); it is closed,
``malloc_trim`` returns what the allocator kept, and then RSS growth = peak RSS (VmHWM,
reset through /proc/self/clear_refs) during the second load + generation minus the RSS just
before it. CPU weights are memory-mapped and made resident at load, so they count.
``load extra`` is RSS after loading minus the weights loaded: the runtime's objects that no
plan describes (mostly the tokenizer; also the parsed header and the module objects).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
PLANS = {
    "all-cpu": dict(devices="CPU=16GiB"),
    "experts-cpu+CUDA0": dict(devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True),
    "CUDA0+CUDA1+CPU": dict(devices="CUDA0=8GiB,CUDA1=8GiB,CPU=16GiB", tensor_split="1,1", n_cpu_moe=2),
}
ALLOCATORS = ("offload", "glibc default")
MIB = 2 ** 20


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def prompt_ids(session, n: int) -> list[int]:
    """``n`` token ids of code: PROMPT repeated."""
    one = session.tokenize(PROMPT)
    return (one * (n // len(one) + 1))[:n]


def one(model_path: str, plan: str, n: int, ctx: int, allocator: str) -> dict:
    if allocator == "offload":
        from offload.host_memory import return_freed_memory
        if not return_freed_memory():
            raise SystemExit("mallopt is not available (not glibc)")
    import torch

    import offload.runtime as rt
    from offload.gguf_model import open_model
    from placement.plan import host_footprint, replan

    torch.set_num_threads(1)
    n_prompt = ctx - n
    options = dict(PLANS[plan], ctx=ctx, ubatch=n_prompt)
    with rt.load(model_path, virtual_gpus=True, quiet=True, **options) as s:    # the first pass
        list(s.generate(prompt_ids(s, n_prompt), max_tokens=2, stop_at_eos=False))
    del s
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)          # what the allocator kept from it goes back
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")                 # reset the peak (VmHWM)
    with rt.load(model_path, virtual_gpus=True, quiet=True, **options) as s:
        loaded = _status("VmRSS") - before
        s.warmup()
        ids = prompt_ids(s, n_prompt)
        text = s.detokenize(s.generate(ids, max_tokens=n, stop_at_eos=False))
        growth = _status("VmHWM") - before
        st = s.stats
        model = open_model(model_path)
        host_plan = replan(s.plan, model, replace(s.plan.settings, host_backed=tuple(s.devices.virtual)))
        host = host_footprint(host_plan, model)
        return {
            "plan": plan, "allocator": allocator, "text": text,
            "prompt_tps": st.prompt_tps, "eval_tps": st.eval_tps,
            "n_prompt": len(ids), "ubatch": s.plan.settings.ubatch,
            "allocated": dict(s.allocated), "kv_held": sum(st.memory["kv"].values()),
            "planned_weights": {t.name: t.weights_bytes for t in host_plan.totals},
            "planned_compute": {t.name: t.compute_bytes for t in host_plan.totals},
            "host": [host.weights_bytes, host.kv_bytes, host.compute_bytes],
            "rss_loaded": loaded, "rss_growth": growth,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "tiny-glm4moe-mtp.gguf"))
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--json", help="also write one JSON line per plan and allocator here")
    ap.add_argument("--one", nargs=2, metavar=("PLAN", "ALLOCATOR"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        plan, alloc = a.one
        print(json.dumps(one(a.model, plan, a.n, a.ctx, alloc)))
        return 0
    runs: dict[tuple[str, str], dict] = {}
    for plan in PLANS:
        for alloc in ALLOCATORS:
            out = subprocess.run([sys.executable, "-m", "bench.runtime_plans", a.model, "-n", str(a.n),
                                  "-c", str(a.ctx), "--one", plan, alloc], cwd=ROOT, capture_output=True,
                                 text=True)
            if out.returncode:
                sys.stderr.write(out.stderr)
                return out.returncode
            runs[plan, alloc] = json.loads(out.stdout.strip().splitlines()[-1])
    first = next(iter(runs.values()))
    print(f"model {a.model}: a {first['n_prompt']}-token prompt as one ubatch of {first['ubatch']}, "
          f"then {a.n} tokens greedy; ctx {a.ctx}; torch threads 1")
    print("peak RSS growth (load + run) vs the planner's host estimate for the plan "
          "(weights + KV + compute of the CPU and the virtual GPUs), MiB\n")
    print(f"{'plan':<18} {'planned host = W + KV + C':>30}  {'allocator':<13} {'prompt t/s':>10} "
          f"{'decode t/s':>10} {'RSS growth':>10} {'ratio':>6} {'load extra':>10}")
    for plan in PLANS:
        w, kv, comp = runs[plan, ALLOCATORS[0]]["host"]
        planned = w + kv + comp
        for i, alloc in enumerate(ALLOCATORS):
            r = runs[plan, alloc]
            terms = f"{planned / MIB:.2f} = {w / MIB:.2f} + {kv / MIB:.2f} + {comp / MIB:.2f}" if i == 0 else ""
            extra = r["rss_loaded"] - sum(r["allocated"].values())
            print(f"{plan if i == 0 else '':<18} {terms:>30}  {alloc:<13} {r['prompt_tps']:10.1f} "
                  f"{r['eval_tps']:10.1f} {r['rss_growth'] / MIB:10.2f} {r['rss_growth'] / planned:6.3f} "
                  f"{extra / MIB:10.2f}")
    print("\nper plan: weights held / planned per device (+ planned compute), MiB; KV held")
    for plan in PLANS:
        r = runs[plan, ALLOCATORS[0]]
        held = ", ".join(f"{d} {b / MIB:.2f}/{r['planned_weights'].get(d, 0) / MIB:.2f} "
                         f"(+{r['planned_compute'].get(d, 0) / MIB:.2f})"
                         for d, b in sorted(r["allocated"].items()))
        print(f"  {plan:<18} {held}; KV {r['kv_held'] / MIB:.2f}")
    for plan in PLANS:
        print(f"--- {plan} text:\n{runs[plan, ALLOCATORS[0]]['text']}")
    if a.json:
        Path(a.json).write_text("".join(json.dumps(r) + "\n" for r in runs.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
