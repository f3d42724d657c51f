"""The hybrid hand-off's cost (block on a GPU, its routed experts in RAM), old next to new in
the same run: ``moe_ffn`` over fresh host arrays (``OFFLOAD_HANDOFF=reference``) against the
bound ``RoutedHandoff`` (host buffers, one compiled call per MoE layer).

    python -m bench.hybrid_handoff [MODEL.gguf] [-t 2] [--calls 200] [--tokens 32] [--rounds 3]

The model is placed as ``--n-gpu-layers 99 --cpu-moe --virtual-gpus`` (the blocks on a
CPU-backed CUDA0, the experts in RAM), so the hand-off's CPU path is what runs; a real GPU
adds the device copies. Printed, medians over ``--rounds`` alternating rounds:

* per MoE layer and decode token (T = 1), µs (median per call, the variants called in
  turn): the CPU side alone (host copies + experts +
  back to torch), the bare compiled expert kernel on the same input (the peer: what the
  experts cost without any hand-off), their difference (the hand-off's own cost), and the
  whole MoE layer call (router, shared expert, CPU side);
* greedy decode t/s of the whole model, every MoE layer on the old or on the new hand-off.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT = list(range(3, 11))


def _interleaved(fns, n: int) -> list[float]:
    """Median µs per call of each fn, called in turn n times (a busy box's preemptions hit
    single calls, which the median drops, and drift hits every fn alike)."""
    times = [[] for _ in fns]
    clock = time.perf_counter
    for _ in range(n):
        for fn, t in zip(fns, times):
            t0 = clock()
            fn()
            t.append(clock() - t0)
    return [statistics.median(t) * 1e6 for t in times]


def layer_costs(moes, n_embd: int, calls: int) -> dict[str, tuple[float, float]]:
    """(old, new) µs per layer for a one-token step, averaged over the MoE layers."""
    from cpu_kernels import settings
    from offload.cpu_ops import to_host
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((1, n_embd)).astype(np.float32))
    out = {"cpu side": [0.0, 0.0], "kernel": [0.0, 0.0], "layer": [0.0, 0.0]}
    for moe in moes:
        ids, w = moe.router(x)
        moe.compiled_handoff = True
        h = moe._bound_handoff(x, ids)
        assert h is not None, "the compiled hand-off did not take a one-token step"
        ex, owned = moe.experts, moe.owned

        def old_side():
            return torch.from_numpy(ex(to_host(x), ids.cpu().numpy(), to_host(w), owned)).to(x.device)

        def new_side():
            return h.run(h.load(x, ids, w)).to(x.device, non_blocking=True)

        def kernel():                     # the experts alone, on what new_side loaded
            h._entry(1, *h._args, settings.apply_threads())

        def layer(compiled):
            def call():
                moe.compiled_handoff = compiled
                moe(x)
            return call

        old_s, new_s, k, old_l, new_l = _interleaved([old_side, new_side, kernel, layer(False), layer(True)], calls)
        for key, v in (("cpu side", (old_s, new_s)), ("kernel", (k, k)), ("layer", (old_l, new_l))):
            for i in (0, 1):
                out[key][i] += v[i] / len(moes)
    return {key: tuple(v) for key, v in out.items()}


def decode_tps(s, moes, compiled: bool, tokens: int) -> float:
    for m in moes:
        m.compiled_handoff = compiled
    list(s.generate(PROMPT, max_tokens=tokens, stop_at_eos=False))
    return s.stats.eval_tps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "tiny-glm4moe-mtp.gguf"),
                    help="default: the shipped model (e.g. a narrow model that bench.depth --keep DIR wrote)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200, help="calls per layer and timing (default 200)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per pass (default 32)")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)

    import offload.runtime as rt
    from offload.moe import MoE
    torch.set_num_threads(1)
    with rt.load(a.model, devices="CUDA0=64GiB,CPU=64GiB", n_gpu_layers=99, cpu_moe=True, virtual_gpus=True,
                 threads=a.threads, quiet=True) as s, torch.inference_mode():
        moes = [b.ffn for b in s.model.blocks if isinstance(getattr(b, "ffn", None), MoE)]
        n_embd = moes[0].experts.weights.n_embd
        decode_tps(s, moes, True, 4)                                   # bind and warm both paths
        decode_tps(s, moes, False, 4)
        rows: dict[str, list[tuple[float, float]]] = {}
        tps: list[tuple[float, float]] = []
        for _ in range(a.rounds):
            for key, v in layer_costs(moes, n_embd, a.calls).items():
                rows.setdefault(key, []).append(v)
            tps.append((decode_tps(s, moes, False, a.tokens), decode_tps(s, moes, True, a.tokens)))
    med = lambda vals, i: statistics.median(v[i] for v in vals)  # noqa: E731
    print(f"model {Path(a.model).name}: {len(moes)} MoE layers on CUDA0 (virtual), experts in RAM; "
          f"threads {a.threads}; load average {os.getloadavg()[0]:.2f}; medians of {a.rounds} rounds")
    print(f"{'per MoE layer, T=1 (µs)':34s} {'old':>9s} {'new':>9s} {'new/old':>8s}")
    side = rows["cpu side"]
    kern = rows["kernel"]
    lines = [("CPU side (copies+experts+back)", med(side, 0), med(side, 1)),
             ("  bare expert kernel (peer)", med(kern, 0), med(kern, 1)),
             ("  hand-off = CPU side - kernel", med(side, 0) - med(kern, 0), med(side, 1) - med(kern, 1)),
             ("whole MoE layer call", med(rows["layer"], 0), med(rows["layer"], 1))]
    for name, old, new in lines:
        print(f"{name:34s} {old:9.1f} {new:9.1f} {new / old:8.2f}")
    old_tps, new_tps = med(tps, 0), med(tps, 1)
    print(f"{'decode t/s (whole model)':34s} {old_tps:9.2f} {new_tps:9.2f} {new_tps / old_tps:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
