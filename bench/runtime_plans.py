"""``offload run`` on one model under three plans — all on the CPU, experts on the CPU with
the rest on a (virtual) GPU, and layers over virtual CUDA0+CUDA1 — printing the text, t/s,
what each device holds vs the plan, and the process's peak RSS growth against the planner's
estimate for the host: the CPU's total plus those of the virtual GPUs (which live in host
RAM here), each weights + KV + compute buffers.

    python -m bench.runtime_plans [MODEL.gguf] [-n 64] [-c 512] [--json out.jsonl]

Each plan runs in a fresh process. RSS growth = peak RSS during load + generation minus the
RSS just before loading (after imports and a kernel warm-up on another model), so the
interpreter/torch baseline, which no plan accounts for, is left out; the peak is reset via
/proc/self/clear_refs first. CPU weights are memory-mapped and made resident at load;
``vs W+KV`` compares the growth with the plan's weights + KV alone, since the planner's
compute-buffer term is llama.cpp's graph buffers, which this runtime does not allocate
(torch allocates activations per call; they are small).
"""
from __future__ import annotations

import argparse
import os
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "
PLANS = {
    "all-cpu": dict(devices="CPU=16GiB"),
    "experts-cpu+CUDA0": dict(devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True),
    "CUDA0+CUDA1+CPU": dict(devices="CUDA0=8GiB,CUDA1=8GiB,CPU=16GiB", tensor_split="1,1", n_cpu_moe=2),
}


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def one(model: str, plan: str, n: int, ctx: int, warm: str) -> dict:
    import torch

    import offload.runtime as rt
    torch.set_num_threads(1)
    with rt.load(warm, devices="CPU=16GiB", quiet=True) as s:   # kernels compiled/loaded
        s.logits(list(range(1, 9)))
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")                 # reset the peak (VmHWM)
    with rt.load(model, virtual_gpus=True, quiet=True, ctx=ctx, **PLANS[plan]) as s:
        s.warmup()
        text = s.detokenize(s.generate(PROMPT, max_tokens=n, stop_at_eos=False))
        st = s.stats
        host = [t for t in s.plan.totals if t.name == "CPU" or t.name in s.devices.virtual]
        return {
            "plan": plan, "text": text, "prompt_tps": st.prompt_tps, "eval_tps": st.eval_tps,
            "allocated": dict(s.allocated),
            "planned_weights": {t.name: t.weights_bytes for t in s.plan.totals},
            "planned_host": sum(t.used_bytes for t in host),
            "planned_host_parts": [sum(t.weights_bytes for t in host), sum(t.kv_bytes for t in host),
                                   sum(t.compute_bytes for t in host)],
            "rss_growth": _status("VmHWM") - before,
            "profile": st.eval_profile,
        }


def main() -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")   # see offload.commands.run.quiet_openmp
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "tiny-glm4moe-mtp.gguf"))
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--json", help="also write one JSON line per plan here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--warm", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.model, a.one, a.n, a.ctx, a.warm)))
        return 0
    from tests.tiny_models import TinySpec, write_tiny_model
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        warm = write_tiny_model(Path(tmp) / "warm.gguf", TinySpec(seed=99)).path
        for plan in PLANS:
            out = subprocess.run([sys.executable, "-m", "bench.runtime_plans", a.model, "-n", str(a.n),
                                  "-c", str(a.ctx), "--one", plan, "--warm", str(warm)],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"model {a.model}: {a.n} tokens greedy after a {len(PROMPT)}-char prompt, ctx {a.ctx}")
    print(f"{'plan':<20} {'prompt t/s':>10} {'decode t/s':>10} {'RSS growth':>11} {'planned host':>12} "
          f"{'ratio':>6} {'vs W+KV':>7}  weights held / planned per device (MiB)")
    for r in rows:
        held = ", ".join(f"{d} {mib(b):.2f}/{mib(r['planned_weights'].get(d, 0)):.2f}"
                         for d, b in sorted(r["allocated"].items()))
        w, kv, _ = r["planned_host_parts"]
        ratio = r["rss_growth"] / r["planned_host"] if r["planned_host"] else float("nan")
        print(f"{r['plan']:<20} {r['prompt_tps']:10.1f} {r['eval_tps']:10.1f} {mib(r['rss_growth']):9.1f}Mi "
              f"{mib(r['planned_host']):10.1f}Mi {ratio:6.2f} {r['rss_growth'] / (w + kv):7.2f}  {held}")
    print("planned host = weights + KV + compute (MiB): " + "; ".join(
        f"{r['plan']}: " + " + ".join(f"{mib(x):.1f}" for x in r["planned_host_parts"]) for r in rows))
    for r in rows:
        print(f"--- {r['plan']} text:\n{r['text']}")
    if a.json:
        Path(a.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
