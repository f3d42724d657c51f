"""The op-offload threshold ``--op-offload auto`` picks, and predicted prefill t/s around it.

    python -m bench.op_offload [--ctx 32768]

GLM-4.5-Air and DeepSeek-V3 fixtures, whole-tensor auto-fit on one 24 GiB GPU + RAM,
``bench/profiles/rtx4090_epyc.yaml`` (RTX 4090: PCIe 4.0 x16 at 0.8 × 31.5 GB/s = 25.2 GB/s;
CPU 250 GB/s read; the batched-matmul rates are ``placement.hardware``'s priors, 1000 GFLOP/s
CPU and 80 TFLOP/s GPU; ``offload tune`` measures the CPU's and, on a CUDA box, the link for
a real box). Uniform routing. A prediction, not a measurement. The plans set aside op
offload's staging (two 256 MiB chunks on CUDA0, ``placement.compute.op_offload_staging_bytes``).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from offload.gguf_model import open_model
from placement.compute import op_offload_staging_bytes
from placement.devices import format_bytes, parse_devices
from placement.hardware import HardwareProfile
from placement.op_offload import PrefillModel, batches_around
from placement.planner import PlanOptions, make_plan
from placement.speculative import complete_hardware
from tests.fixtures.real_models import deepseek_v3, glm45_air, write_fixture

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "bench" / "profiles" / "rtx4090_epyc.yaml"
MODELS = {"GLM-4.5-Air": (glm45_air, "CUDA0=24GiB,CPU=128GiB"),
          "DeepSeek-V3": (deepseek_v3, "CUDA0=24GiB,CPU=384GiB")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("-ub", "--ubatch", type=int, default=512)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        for name, (make, box) in MODELS.items():
            model = open_model(str(write_fixture(make(), tmp, tokenizer="none")))
            plan = make_plan(model, parse_devices(box), PlanOptions(ctx=args.ctx, ubatch=args.ubatch))
            hw = complete_hardware(HardwareProfile.from_yaml(PROFILE), plan)
            m = PrefillModel(plan, model, hw)
            t = m.threshold()
            gpu = hw.gpus["CUDA0"]
            print(f"== {name}: --devices {box}, {len(m.layers)} layers with RAM-resident experts; "
                  f"CUDA0 link {gpu.link_gbps:.1f} GB/s ({gpu.source})")
            staging = op_offload_staging_bytes(model.tensors, lambda x: plan.tensors[x.name])
            cuda0 = next(x for x in plan.totals if x.name == "CUDA0")
            print(f"op-offload threshold (auto): {t} tokens; staging on CUDA0 {format_bytes(staging.get('CUDA0', 0))} "
                  f"(two chunks, pinned and double-buffered), in its compute {format_bytes(cuda0.compute_bytes)}")
            print(f"{'batch':>6} {'prefill t/s, CPU experts':>25} {'streamed to CUDA0':>18}")
            for b in batches_around(t, args.ubatch):
                print(f"{b:>6} {m.tokens_per_second(b, streamed=False):>25.1f} "
                      f"{m.tokens_per_second(b, streamed=True):>18.1f}")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
