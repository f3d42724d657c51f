"""CPU-resident experts stay memory-mapped: loading and running a model whose experts are
on the CPU must not grow the process's anonymous memory (RssAnon: private copies) by
anything like the experts' size, while the mapped file pages (RssFile) hold them. With the
experts on a virtual GPU (an upload: a copy of the raw bytes in torch memory) it is the
other way round — the positive control that the measurement sees copies — and the file
pages of the uploaded tensors have been dropped from the process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from tests.tiny_models import TinySpec, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, sys, torch
import offload.runtime as rt
torch.set_num_threads(1)

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

path, warm, experts_on = sys.argv[1], sys.argv[2], sys.argv[3]
ids = list(range(1, 33))
with rt.load(warm, quiet=True) as s:          # kernels loaded/compiled outside the measurement
    s.logits(ids)
before = {f: rss(f) for f in ("RssAnon", "RssFile")}
plan = dict(devices="CPU=16GiB") if experts_on == "CPU" else \
    dict(devices=f"{experts_on}=16GiB,CPU=16GiB", n_gpu_layers=0, override_tensor=[f"_exps={experts_on}"])
with rt.load(path, virtual_gpus=True, quiet=True, **plan) as s:
    loaded = rss("RssFile")            # before any token: residency comes from loading
    s.logits(ids)
    anon = rss("RssAnon")
print(json.dumps({"RssAnon": anon - before["RssAnon"], "RssFile": loaded - before["RssFile"]}))
"""


def _expert_bytes(tiny) -> int:
    from offload.gguf_model import open_model
    return sum(t.n_bytes for t in open_model(tiny.path).tensors if "_exps" in t.name)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_cpu_experts_are_not_copied(tmp_path):
    spec = TinySpec(n_expert=64, n_expert_used=8, expert_type=Q.Q8_0, seed=21)
    big = write_tiny_model(tmp_path / "big.gguf", spec)
    warm = write_tiny_model(tmp_path / "warm.gguf", TinySpec(seed=22))
    experts = _expert_bytes(big)

    def growth(where):
        out = subprocess.run([sys.executable, "-c", PROBE, str(big.path), str(warm.path), where],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    on_cpu, on_gpu = growth("CPU"), growth("CUDA0")
    mib = lambda d: {k: f"{v / 2**20:.1f} MiB" for k, v in d.items()}  # noqa: E731
    print(f"experts {experts / 2**20:.1f} MiB; growth with CPU experts {mib(on_cpu)}, "
          f"with virtual-GPU experts {mib(on_gpu)}")
    assert on_cpu["RssAnon"] < 0.25 * experts    # in place: only activations and small tensors
    assert on_cpu["RssFile"] > 0.75 * experts    # ... and resident from load (mapped pages)
    assert on_gpu["RssAnon"] > 0.9 * experts     # positive control: the uploaded raw bytes
    assert on_gpu["RssFile"] < 0.25 * experts    # whose file pages were dropped after upload
    # (RssFile moves by a few MiB on its own — library pages, the page cache — hence the
    # 0.75 / 0.25 margins; the cases they separate differ by the whole expert size)
