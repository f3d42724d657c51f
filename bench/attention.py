"""A prompt's attention over a long cache on the CPU: the compiled kernel against torch's tiles.

    python -m bench.attention [--keys 2048,8192,32768] [--queries 512] [--cache q8_0,q4_0] [--repeat 3]

One micro-batch of ``--queries`` prompt tokens at the end of a cache of ``--keys`` cells, 32
query heads over 4 KV heads of 128 (Qwen3-30B-A3B's attention), causal, in the threads the
kernels use:

* offload: ``cpu_kernels.kv_attention.attend_cache`` (the compiled blocks' attention half),
  one (head, query) per task, each cached row read in place through ``kv_rows``;
* peer: ``gpu.attention.attend_tiles`` (torch, the same cached bytes dequantized per tile);
* ceilings, measured in the same run: the cache's K and V bytes read once at the memory-read
  rate (``bench.cpu_kernels.ceiling_gbps``), and the same bytes read once per query (what a
  kernel that walks the cache per query streams, this one included; a (head group)'s rows
  stay in L2/L3 up to tens of thousands of cells, so it is not what bounds it: the dot
  products are).

"off x torch" is offload's speed in units of torch's (torch ms / offload ms). Medians of --repeat
calls after one untimed call (Numba compiles outside the timing).
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from bench.cpu_kernels import _median_time, ceiling_gbps
from cpu_kernels.kv_attention import attend_cache
from cpu_kernels.registry import get_kernel
from gpu.attention import attend_tiles
from gpu.kv_cache import KVCache

N_HEAD, N_KV, D = 32, 4, 128


def _median(fn, repeat: int) -> float:
    fn()                                    # untimed: Numba compiles (or loads) here
    return _median_time(fn, repeat)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="2048,8192,32768", help="cache cells, comma-separated")
    ap.add_argument("--queries", type=int, default=512, help="prompt tokens in the micro-batch (default 512)")
    ap.add_argument("--cache", default="q8_0,q4_0", help="quantized cache types, comma-separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="skip torch's tiles (slow at long caches)")
    a = ap.parse_args(argv)
    ceiling = ceiling_gbps(np.ones(1 << 28, np.uint8), 5)
    print(f"memory-read ceiling {ceiling:.1f} GB/s; {N_HEAD} heads over {N_KV} KV heads of {D}, "
          f"{a.queries} queries, {torch.get_num_threads()} torch threads")
    print(f"{'cache':>5} {'keys':>6} {'offload ms':>11} {'torch ms':>9} {'off x torch':>11} "
          f"{'once ms':>8} {'per-query ms':>13} {'off/once':>9}")
    g = torch.Generator().manual_seed(0)
    for name in a.cache.split(","):
        qtype = Q[name.upper()]
        for n_keys in (int(k) for k in a.keys.split(",")):
            cache = KVCache(N_KV, D, device=torch.device("cpu"), dtype=qtype)
            keys = values = None
            for lo in range(0, n_keys, 4096):           # appended in pieces, as prompts fill it
                n = min(4096, n_keys - lo)
                keys, values = cache.append(torch.randn(N_KV, n, D, generator=g), torch.randn(N_KV, n, D, generator=g))
            q = torch.randn(a.queries, N_HEAD, D, generator=g)
            out = np.empty((a.queries, N_HEAD, D), np.float32)
            kt, vt = get_kernel(keys.qtype).tag, get_kernel(values.qtype).tag
            rk, rv = keys.raw.numpy(), values.raw.numpy()
            kb = rk.nbytes + rv.nbytes
            qn = q.numpy()

            def run():
                attend_cache(qn, kt, rk, vt, rv, n_keys, D, D ** -0.5, None, 0, out)
            off = _median(run, a.repeat)
            peer = float("nan") if a.no_torch else _median(lambda: attend_tiles(q, keys, values), a.repeat)
            once = kb / (ceiling * 1e9)
            print(f"{name:>5} {n_keys:>6} {off * 1e3:>11.1f} {peer * 1e3:>9.1f} {peer / off:>11.2f} "
                  f"{once * 1e3:>8.2f} {once * a.queries * 1e3:>13.1f} {off / once:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
