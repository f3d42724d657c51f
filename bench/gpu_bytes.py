"""Bytes a decode token moves on each GPU of a plan for its weights: fused dequant-matmul
kernels vs today's per-call dequantization — computed from the plan, not measured.

    python -m offload plan MODEL.gguf --devices CUDA0=24GiB,CPU=384GiB --json > plan.json
    python -m bench.gpu_bytes plan.json [--bandwidth 1000,4800]

Per token (B = 1, plain decoding: the NextN block and the KV cache are left out):
- a GPU matrix is read whole; a GPU expert tensor only for the ``n_expert_used`` of its
  ``n_expert`` experts that a token routes to;
- fused (a type in ``gpu.qtypes.FUSED_TYPES``): its raw GGUF bytes, once;
- today (per-call dequant, and any type without a fused kernel): the raw bytes, plus the
  bf16 copy written (2 B per weight) and read back by the matmul (2 B per weight) — a lower
  bound: the torch dequantizers also materialize float32 intermediates;
- float32/float16 tensors (norms, biases, routers) are read once either way.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from gguf import GGMLQuantizationType as Q

from gpu.qtypes import FUSED_TYPES
from offload.gguf_model import open_model
from placement.tensors import Role

BF16_ROUND_TRIP = 4          # bytes per weight: bf16 written by the dequant, read by the matmul


def token_bytes(tensors, device_of: dict[str, str], n_expert_used: int):
    """→ {device: {"fused": bytes, "today": bytes, "by_type": {type: (fused, today)}}}"""
    out: dict[str, dict] = defaultdict(lambda: {"fused": 0, "today": 0, "by_type": defaultdict(lambda: [0, 0])})
    for t in tensors:
        dev = device_of[t.name]
        if dev == "CPU" or t.nextn or t.role is Role.EMBEDDING:
            continue                    # CPU side; the draft head; embedding: one row per token
        share = n_expert_used / t.n_experts if t.n_experts else 1.0
        raw = t.n_bytes * share
        if t.ggml_type in (Q.F32, Q.F16):
            fused = today = raw
        else:
            today = raw + BF16_ROUND_TRIP * t.n_elements * share
            fused = raw if t.ggml_type in FUSED_TYPES else today
        d = out[dev]
        d["fused"] += fused
        d["today"] += today
        d["by_type"][t.ggml_type.name][0] += fused
        d["by_type"][t.ggml_type.name][1] += today
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan", help="`offload plan ... --json` output")
    ap.add_argument("--bandwidth", default="1000,4800",
                    help="GPU memory bandwidths in GB/s to convert bytes to ms (default 1000,4800)")
    args = ap.parse_args(argv)
    with open(args.plan) as f:
        plan = json.load(f)
    model = open_model(plan["model"])
    spec = model.spec
    bws = [float(b) for b in args.bandwidth.split(",")]
    print(f"{plan['model']}: {spec.arch}, {spec.n_expert_used} of {spec.n_expert} experts per token; "
          f"plan devices {', '.join(d['name'] for d in plan['devices'])}")
    per_dev = token_bytes(model.tensors, plan["tensors"], spec.n_expert_used)
    for dev, d in sorted(per_dev.items()):
        print(f"{dev}: weight bytes moved per decode token (B = 1)")
        print(f"  {'type':<7} {'fused MB':>10} {'today MB':>10}")
        for name, (fz, td) in sorted(d["by_type"].items()):
            print(f"  {name:<7} {fz / 1e6:>10.1f} {td / 1e6:>10.1f}")
        print(f"  {'total':<7} {d['fused'] / 1e6:>10.1f} {d['today'] / 1e6:>10.1f}   "
              f"today / fused = {d['today'] / d['fused']:.2f}x")
        for bw in bws:
            print(f"  at {bw:,.0f} GB/s: fused {d['fused'] / bw / 1e6:.2f} ms, today {d['today'] / bw / 1e6:.2f} ms "
                  "per token (bytes / bandwidth, no launch or compute cost)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
