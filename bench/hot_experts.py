"""What hot experts buy on big models, predicted from routing measured on the shipped one.

    python -m bench.hot_experts [--routing routing.yaml] [--ctx 32768]

Without ``--routing`` it first measures one: ``offload profile`` on the shipped model
(32 experts, top-4) over prompts cut from Python standard-library modules of this Python
(``STDLIB``, 40 lines per prompt; the model was trained on the standard library, so this is
its own kind of text), prompt tokens only.

**How the profile is carried onto GLM-4.5-Air (128 experts, top-8) and DeepSeek-V3 (256,
top-8)** (``placement.routing.RoutingCounts.mapped_onto``): for each measured layer, the share
of the layer's assignments that its r-th hottest expert gets, with the ranking made on the
*other* prompts and the share counted on the held-out one (leave one prompt out); as a
cumulative curve over the *fraction* of experts (the hottest 1/8 of the experts take x % of
the hits), linear in between; each MoE layer of the big model takes the curve of the measured
layer at the same relative depth, and its r-th expert gets the curve's increment over
[(r-1)/E, r/E].

The planner picks hot experts by the whole profile's ranking (in-sample, as
``offload plan --routing`` would); the forecast credits each rank with its held-out share.

**Why that is honest**: the skew is measured, not assumed; the held-out ranking scores hot
experts on text they were not chosen on, so noise in small counts (which makes some experts
look hot in-sample) does not count as a hit — the in-sample rows show how much that would
add; the stretch onto more experts spreads each measured expert's hits evenly over the
experts of its slot, which can only flatten the measured skew, never sharpen it. What it
assumes: that a big model's hottest fraction of experts takes the same share as the tiny
model's (published routing statistics of large MoEs are more skewed, so this likely
understates the gain), and, for batches, that tokens route independently (the measured
consecutive-token distinct counts of ``offload profile`` are lower than that, so U(B) is
overstated for both columns alike).

Devices: one 24 GiB GPU + RAM (128 GiB for GLM-4.5-Air, 384 GiB for DeepSeek-V3, which drafts
with its MTP-only GGUF), ``bench/profiles/rtx4090_epyc.yaml``, context 32768, default
acceptance. Plans: the whole-tensor auto-fit; the same with its leftover VRAM filled with hot
experts (``offload plan --routing``); and, as a what-if, ``--cpu-moe --fit on --routing``
(every expert tensor in RAM, the GPU's room above the dense part all hot experts, the
KTransformers layout). A prediction, not a measurement.
"""
from __future__ import annotations

import argparse
import inspect
import importlib
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from offload.gguf_model import open_model
from placement.cost import predicted_decode_tps, speculation_table
from placement.devices import format_bytes, parse_devices
from placement.hardware import HardwareProfile
from placement.hot_experts import hot_bytes
from placement.planner import PlanOptions, make_plan
from placement.routing import RoutingCounts
from placement.speculative import complete_hardware, plan_footprint
from tests.fixtures.real_models import deepseek_v3, deepseek_v3_mtp_only, glm45_air, write_fixture

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "tiny-glm4moe-mtp.gguf"
PROFILE = ROOT / "bench" / "profiles" / "rtx4090_epyc.yaml"
STDLIB = ("textwrap", "json.encoder", "csv", "string", "heapq", "bisect", "fractions", "queue",
          "shlex", "calendar")
LINES_PER_PROMPT = 40
MODELS = {"GLM-4.5-Air": (glm45_air, None, "CUDA0=24GiB,CPU=128GiB"),
          "DeepSeek-V3": (deepseek_v3, deepseek_v3_mtp_only, "CUDA0=24GiB,CPU=384GiB")}


def stdlib_prompts(path: Path) -> int:
    chunks = []
    for name in STDLIB:
        lines = inspect.getsource(importlib.import_module(name)).splitlines()
        chunks += ["\n".join(lines[i:i + LINES_PER_PROMPT]) for i in range(0, len(lines), LINES_PER_PROMPT)
                   if any(line.strip() for line in lines[i:i + LINES_PER_PROMPT])]
    path.write_text("\n---\n".join(chunks) + "\n")
    return len(chunks)


def measure(tmp: Path) -> Path:
    prompts, out = tmp / "stdlib_prompts.txt", tmp / "routing.yaml"
    n = stdlib_prompts(prompts)
    print(f"== offload profile {SHIPPED.name} -f <{n} prompts of {LINES_PER_PROMPT} lines from "
          f"{', '.join(STDLIB)}> -n 0 -o routing.yaml")
    r = subprocess.run([sys.executable, "-m", "offload", "profile", str(SHIPPED), "--devices", "CPU=8GiB",
                        "-f", str(prompts), "-n", "0", "-o", str(out)], cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        sys.exit(r.stderr)
    print(r.stdout)
    return out


def predict(plan, model, draft, hw: HardwareProfile, hits: RoutingCounts | None) -> tuple[float, int]:
    fp = plan_footprint(plan, model, draft)
    table = speculation_table(fp, hw, max_n=6, hits=hits)
    return predicted_decode_tps(fp, hw, hits=hits), table.break_even_n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--routing", help="a routing profile of the shipped model (default: measure one)")
    ap.add_argument("--ctx", type=int, default=32768)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        routing = RoutingCounts.from_file(args.routing or str(measure(tmp)))
        print(f"routing: {routing.source}; {routing.tokens} tokens, {len(routing.prompts)} prompts, "
              f"{routing.n_expert} experts top-{routing.n_expert_used}\n")
        for name, (make, make_draft, box) in MODELS.items():
            model = open_model(str(write_fixture(make(), tmp, tokenizer="none")))
            draft = open_model(str(write_fixture(make_draft(), tmp, tokenizer="none"))) if make_draft else None
            spec = model.spec
            moe = [i for i in range(spec.n_layer) if spec.is_moe_layer(i)]
            devices = parse_devices(box)
            base_opts = PlanOptions(ctx=args.ctx)
            base = make_plan(model, devices, base_opts, draft=draft)
            hw = complete_hardware(HardwareProfile.from_yaml(PROFILE), base)
            print(f"== {name} ({spec.n_expert} experts, top-{spec.n_expert_used}, {len(moe)} MoE layers) on "
                  f"--devices {box}, -c {args.ctx}, --hw-profile {PROFILE.relative_to(ROOT)}")
            print(f"{'plan':<44} {'hot experts on CUDA0':>22} {'decode t/s':>11} {'break-even':>11}")
            tps, even = predict(base, model, draft, hw, None)
            print(f"{'whole-tensor fit, uniform routing':<44} {'-':>22} {tps:>11.2f} {even:>11}")
            # the planner ranks by the whole profile (in-sample: what `offload plan --routing` sees);
            # the forecast credits each rank with its held-out share (or, as a bound, in-sample)
            # the shipped model's NextN block (blk.4, profiled as drafting routes it) onto the big one's
            shipped = open_model(str(SHIPPED)).spec
            nextn = ((shipped.n_layer - 1, spec.n_layer - 1 if spec.n_nextn else None)
                     if shipped.n_layer - 1 in routing.layers else None)
            ranking = routing.mapped_onto(spec.n_expert, spec.n_expert_used, moe, model=model.path, in_sample=True,
                                          nextn=nextn)
            for label, in_sample in (("held-out", False), ("in-sample", True)):
                hits = routing.mapped_onto(spec.n_expert, spec.n_expert_used, moe, model=model.path,
                                           in_sample=in_sample, nextn=nextn)
                for layout, opts in (("whole-tensor fit", base_opts),
                                     ("--cpu-moe --fit on", PlanOptions(ctx=args.ctx, cpu_moe=True, fit="on"))):
                    whole = make_plan(model, devices, opts, draft=draft)
                    hot = make_plan(model, devices, replace(opts, routing=ranking), draft=draft)
                    for plan, what in ((whole, "without"), (hot, "with")):
                        n = sum(len(es) for es in plan.hot_experts.get("CUDA0", {}).values())
                        held = f"{n} ({format_bytes(hot_bytes(plan.hot_experts, model.tensors).get('CUDA0', 0))})"
                        tps, even = predict(plan, model, draft, hw, hits)
                        print(f"{f'{layout}, {label} skew, {what} hot':<44} {held if n else '-':>22} "
                              f"{tps:>11.2f} {even:>11}")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
