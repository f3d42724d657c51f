"""What sampling a token costs: offload's chain against llama.cpp's, on the same logits.

    python -m bench.sampling [--vocab 4096,32000,129280,151936] [--reps 2000]

llama.cpp's defaults (top-k 40 → top-p 0.95 → min-p 0.05 → temperature 0.8 → a seeded draw)
per vocabulary size, both engines in this process:

* offload: ``Sampler.probs`` then ``Sampler.draw`` (what ``offload run`` does per token);
* llama.cpp (llama-cpp-python, when installed): the same chain through ``llama_sampler_apply``
  on a ``llama_token_data_array`` whose logits are refreshed per token, as its common sampler
  does from a context's logits;
* the floor: one ``argmax`` over the logits (greedy's whole cost; one read of the row).

Medians of --reps calls, alternating engines in rounds of 100; logits are a seeded normal
scaled by 3 (float32). The ratio is llama.cpp's time over offload's: above 1, offload is faster.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics

import numpy as np

from bench.cpu_kernels import _times
from offload.sampling import LLAMA_MIN_P, LLAMA_TEMPERATURE, LLAMA_TOP_K, LLAMA_TOP_P, Sampler


def llama_chain(z: np.ndarray):
    """A per-token closure running llama.cpp's default chain on ``z``, or None without it."""
    try:
        import llama_cpp as lc
    except ImportError:
        return None
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    for s in (lc.llama_sampler_init_top_k(LLAMA_TOP_K), lc.llama_sampler_init_top_p(LLAMA_TOP_P, 1),
              lc.llama_sampler_init_min_p(LLAMA_MIN_P, 1), lc.llama_sampler_init_temp(LLAMA_TEMPERATURE),
              lc.llama_sampler_init_dist(1234)):
        lc.llama_sampler_chain_add(chain, s)
    cells = np.zeros(z.size, dtype=[("id", np.int32), ("logit", np.float32), ("p", np.float32)])
    cells["id"] = np.arange(z.size)
    data = cells.ctypes.data_as(ctypes.POINTER(lc.llama_token_data))
    cur = lc.llama_token_data_array(data=data, size=z.size, selected=-1, sorted=False)
    ref = ctypes.byref(cur)

    def step():
        cells["logit"] = z
        cells["p"] = 0.0
        cur.data, cur.size, cur.selected, cur.sorted = data, z.size, -1, False
        lc.llama_sampler_apply(chain, ref)
        return int(cells["id"][cur.selected]) if cur.data is data else None

    step.free = lambda: lc.llama_sampler_free(chain)
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="4096,32000,129280,151936", help="vocabulary sizes, comma-separated")
    ap.add_argument("--reps", type=int, default=2000, help="calls per engine and size (default 2000)")
    a = ap.parse_args(argv)
    print(f"{'vocab':>7} {'offload us':>11} {'llama.cpp us':>13} {'llama/offload':>14} {'argmax us':>10} "
          f"{'offload/argmax':>15}")
    for v in (int(x) for x in a.vocab.split(",")):
        z = (np.random.default_rng(v).standard_normal(v) * 3).astype(np.float32)
        s = Sampler(temperature=LLAMA_TEMPERATURE, top_k=LLAMA_TOP_K, top_p=LLAMA_TOP_P, min_p=LLAMA_MIN_P, seed=1)
        ours = lambda: s.draw(s.probs(z))      # noqa: E731
        theirs = llama_chain(z)
        times = {"offload": [], "llama": [], "argmax": []}
        for _ in range(max(1, a.reps // 100)):
            times["offload"] += _times(ours, 100)
            if theirs is not None:
                times["llama"] += _times(theirs, 100)
            times["argmax"] += _times(lambda: np.argmax(z), 100)
        if theirs is not None:
            theirs.free()
        med = {k: statistics.median(t) * 1e6 if t else float("nan") for k, t in times.items()}
        print(f"{v:>7} {med['offload']:>11.1f} {med['llama']:>13.1f} {med['llama'] / med['offload']:>14.2f} "
              f"{med['argmax']:>10.1f} {med['offload'] / med['argmax']:>15.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
