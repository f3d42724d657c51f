"""The what-if of the cost model: one DeepSeek-V3-shaped model on two boxes, before running.

    python -m bench.whatif [--ctx 32768]

Writes the real-shaped DeepSeek-V3 fixture and its MTP-only draft (sparse files, a few MB
on disk) to a temp dir and runs ``offload plan`` for "one 24 GB GPU + 384 GB RAM" and
"8×80 GB GPUs", with the hardware profiles in ``bench/profiles/``. Prints each n_max table
and the break-even n_max of each. A prediction, not a measurement: ``offload tune``
measures a real box.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.fixtures.real_models import deepseek_v3, deepseek_v3_mtp_only, write_fixture

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "bench" / "profiles"
BOXES = {
    "1x RTX 4090 (24 GB) + 384 GB RAM": ("CUDA0=24GiB,CPU=384GiB", "rtx4090_epyc.yaml"),
    "8x H100 (80 GB)": (",".join(f"CUDA{i}=80GiB" for i in range(8)) + ",CPU=384GiB", "8xh100.yaml"),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=32768)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_fixture(deepseek_v3(), tmp, tokenizer="vocab")
        draft = write_fixture(deepseek_v3_mtp_only(), tmp, tokenizer="vocab")
        summary = []
        for box, (devices, profile) in BOXES.items():
            base = [sys.executable, "-m", "offload", "plan", str(model), "--draft", str(draft),
                    "-c", str(args.ctx), "--devices", devices, "--hw-profile", str(PROFILES / profile)]
            table = subprocess.run(base, cwd=ROOT, check=True, capture_output=True, text=True).stdout
            spec = json.loads(subprocess.run(base + ["--json"], cwd=ROOT, check=True, capture_output=True,
                                             text=True).stdout)["speculative"]
            start = table.index("speculative decoding")
            print(f"== {box}: --devices {devices} --hw-profile bench/profiles/{profile}")
            print(table[start:table.index("\n\n", start)] + "\n")
            summary.append((box, spec["break_even_n_max"], spec["best_n_max"], spec["predicted_plain_tps"]))
    for box, even, best, tps in summary:
        print(f"{box:34s} plain {tps:6.2f} t/s   break-even n_max {even}   best n_max {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
