"""Wall time of ``offload plan`` on the DeepSeek-V3 fixture (1086 tensors, full-size tokenizer).

    python -m bench.plan_speed [--repeat 5] [--with-gguf-reader]

Writes the real-shaped DeepSeek-V3 header (sparse, real vocab and merge counts) to a temp
dir, then reports, all measured in this run:

* the end-to-end ``python -m offload plan`` process (what a user waits for), next to the
  floor of the same interpreter starting and importing the command (nothing planned);
* the in-process phases: header read, auto-fit, YAML, table;
* optionally ``gguf.GGUFReader`` on the same file (why offload walks the header itself).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOXES = ["CUDA0=24GiB,CPU=512GiB", "CUDA0=24GiB,CUDA1=24GiB,CUDA2=12GiB,CPU=512GiB"]


def wall(cmd: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def timed(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--with-gguf-reader", action="store_true", help="also time gguf.GGUFReader (slow)")
    args = p.parse_args(argv)

    from offload.gguf_model import open_model
    from placement.devices import parse_devices
    from placement.fit import fit
    from placement.memory import MemorySettings
    from placement.plan_file import plan_to_yaml
    from placement.report import format_plan
    from tests.fixtures.real_models import deepseek_v3, write_fixture

    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_fixture(deepseek_v3(), tmp, tokenizer="full"))
        header_mib = Path(path).stat().st_blocks * 512 / 2**20
        print(f"fixture: {Path(path).name}, {header_mib:.1f} MiB on disk (header; data region sparse)")

        floor = wall([sys.executable, "-c", "import offload.commands.plan"], args.repeat)
        print(f"\n{'end to end (subprocess, median of ' + str(args.repeat) + ')':<66} {'seconds':>8} {'x floor':>8}")
        print(f"{'  python + imports, nothing planned (floor)':<66} {floor:8.3f} {1.0:8.2f}")
        for box in BOXES:
            cmd = [sys.executable, "-m", "offload", "plan", path, "--devices", box]
            t = wall(cmd, args.repeat)
            print(f"{'  offload plan --devices ' + box.split(',CPU')[0] + ',CPU=…':<66} {t:8.3f} {t / floor:8.2f}")

        t_read, model = timed(lambda: open_model(path), args.repeat)
        devices = parse_devices(BOXES[1])
        targets = {d.name: 1 << 30 for d in devices if d.is_gpu}
        t_fit, plan = timed(lambda: fit(model, devices, targets, MemorySettings(model.spec.n_ctx_train),
                                        ctx_floor=4096), args.repeat)
        t_yaml, _ = timed(lambda: plan_to_yaml(plan), args.repeat)
        t_table, _ = timed(lambda: format_plan(plan, model), args.repeat)
        print(f"\n{'in-process phases (median)':<66} {'seconds':>8}")
        for label, t in (("read header (1086 tensors, 257k tokenizer strings)", t_read),
                         ("auto-fit, 3 GPUs (incl. context search)", t_fit),
                         ("YAML", t_yaml), ("table", t_table)):
            print(f"  {label:<64} {t:8.3f}")
        if args.with_gguf_reader:
            from gguf import GGUFReader
            t_reader, _ = timed(lambda: GGUFReader(path), 1)
            print(f"  {'gguf.GGUFReader on the same file (1 run)':<64} {t_reader:8.3f}  "
                  f"({t_reader / t_read:.0f}x our header read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
