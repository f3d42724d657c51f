"""``offload run`` on one model under three plans — all on the CPU, experts on the CPU with
the rest on a (virtual) GPU, and layers over virtual CUDA0+CUDA1 — printing the text, t/s,
what each device holds vs the plan, and the process's peak RSS growth against the planner's
estimate of host RAM for the same plan: weights + KV + compute buffers of the CPU and of the
virtual GPUs (which live in host RAM here; the plan is re-totalled with them as
``MemorySettings.host_backed``, so their compute is torch-on-the-CPU's, and the joint compute
is the largest step of one forward pass summed over those devices).

    python -m bench.runtime_plans [MODEL.gguf] [-n 64] [-c 512] [--json out.jsonl]

The prompt is ``ctx - n`` tokens, processed as one ubatch of that size (the plan's
``--ubatch``), so the largest step the planner counts — a full ubatch attending to (nearly)
the whole context — really runs. Each plan runs in a fresh process. Before measuring, a tiny
model with the same architecture and quant types runs the same plan shape, so Numba kernels,
torch's thread pool and the allocator's arenas are set up outside the measurement (a tiny
model, so that the memory it frees and the allocator keeps is small). RSS growth = peak RSS
(VmHWM, reset through /proc/self/clear_refs) during load + generation minus the RSS just
before loading. CPU weights are memory-mapped and made resident at load, so they count.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
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


def one(model_path: str, plan: str, n: int, ctx: int) -> dict:
    import torch

    import offload.runtime as rt
    from offload.gguf_model import open_model
    from placement.compute import live_peak_of_group
    from placement.memory import forward_steps
    from placement.plan import host_footprint, kv_blocks, replan

    torch.set_num_threads(1)
    n_prompt = ctx - n
    options = dict(PLANS[plan], ctx=ctx, ubatch=n_prompt)
    start = _status("VmRSS")
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
        moments = forward_steps(model.spec, list(model.tensors), host_plan.tensors, host_plan.settings,
                                kv_blocks=kv_blocks(model, host_plan.drafting == "in-model NextN"))
        return {
            "plan": plan, "text": text, "prompt_tps": st.prompt_tps, "eval_tps": st.eval_tps,
            "n_prompt": len(ids), "ubatch": s.plan.settings.ubatch,
            "allocated": dict(s.allocated),
            "planned_weights": {t.name: t.weights_bytes for t in host_plan.totals},
            "planned_compute": {t.name: t.compute_bytes for t in host_plan.totals},
            "host": [host.weights_bytes, host.kv_bytes, host.compute_bytes],
            "live": live_peak_of_group(moments, {"CPU", *s.devices.virtual}),
            "kv_held": sum(st.memory["kv"].values()),
            "first_pass_kept": before - start, "rss_loaded": loaded, "rss_growth": growth,
        }


ALLOCATORS = {
    "glibc default": {},
    # a fixed threshold: blocks of 64 KiB and more come from mmap and go back to the system
    # when freed, so RSS follows the live allocations (no heap slack, no per-thread arena)
    "mmap >= 64 KiB": {"MALLOC_MMAP_THRESHOLD_": "65536"},
}


def main() -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # see offload.commands.run.quiet_openmp
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "tiny-glm4moe-mtp.gguf"))
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--json", help="also write one JSON line per plan and allocator here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.model, a.one, a.n, a.ctx)))
        return 0
    runs: dict[tuple[str, str], dict] = {}
    for plan in PLANS:
        for alloc, env in ALLOCATORS.items():
            out = subprocess.run([sys.executable, "-m", "bench.runtime_plans", a.model, "-n", str(a.n),
                                  "-c", str(a.ctx), "--one", plan], cwd=ROOT, capture_output=True,
                                 text=True, env={**os.environ, **env})
            if out.returncode:
                sys.stderr.write(out.stderr)
                return out.returncode
            runs[plan, alloc] = json.loads(out.stdout.strip().splitlines()[-1]) | {"allocator": alloc}
    first = next(iter(runs.values()))
    print(f"model {a.model}: a {first['n_prompt']}-token prompt as one ubatch of {first['ubatch']}, "
          f"then {a.n} tokens greedy; ctx {a.ctx}; torch threads 1")
    print("peak RSS growth (load + run) vs the planner's host estimate for the plan "
          "(weights + KV + compute of CPU and virtual GPUs)\n")
    allocs = list(ALLOCATORS)
    print(f"{'plan':<20} {'prompt t/s':>10} {'decode t/s':>10} {'planned host':>13}  "
          + "  ".join(f"{x:>22}" for x in allocs))
    print(f"{'':<20} {'':>10} {'':>10} {'W + KV + C (MiB)':>13}  "
          + "  ".join(f"{'growth':>13} {'ratio':>8}" for _ in allocs))
    for plan in PLANS:
        r = runs[plan, allocs[0]]
        w, kv, comp = r["host"]
        planned = w + kv + comp
        cells = "  ".join(f"{runs[plan, x]['rss_growth'] / MIB:11.2f}Mi {runs[plan, x]['rss_growth'] / planned:8.3f}"
                          for x in allocs)
        print(f"{plan:<20} {r['prompt_tps']:10.1f} {r['eval_tps']:10.1f} {planned / MIB:11.2f}Mi  {cells}")
        print(f"{'':<20} {'':>10} {'':>10} {f'{w / MIB:.2f}+{kv / MIB:.2f}+{comp / MIB:.2f}':>13}")
    print("\nper plan: weights held / planned per device (MiB), planned compute per device; the "
          "model's live peak (no arena); RSS after loading; the first pass's lasting RSS")
    for plan in PLANS:
        r = runs[plan, allocs[-1]]
        held = ", ".join(f"{d} {b / MIB:.2f}/{r['planned_weights'].get(d, 0) / MIB:.2f} "
                         f"(+{r['planned_compute'].get(d, 0) / MIB:.2f})"
                         for d, b in sorted(r["allocated"].items()))
        print(f"  {plan:<20} {held}; live {r['live'] / MIB:.2f}; loaded "
              + ", ".join(f"{runs[plan, x]['rss_loaded'] / MIB:.2f}" for x in allocs)
              + "; first pass " + ", ".join(f"{runs[plan, x]['first_pass_kept'] / MIB:.1f}" for x in allocs))
    for plan in PLANS:
        print(f"--- {plan} text:\n{runs[plan, allocs[0]]['text']}")
    if a.json:
        Path(a.json).write_text("".join(json.dumps(r) + "\n" for r in runs.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
