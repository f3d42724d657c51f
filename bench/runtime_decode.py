"""Decode speed of ``offload`` on the CPU next to llama.cpp's (llama-cpp-python) for the same
GGUF, prompt and thread count, measured in the same run; prints the ratio.

    python -m bench.runtime_decode [MODEL.gguf] [-n 64] [-t THREADS] [--repeat 3]

Greedy decoding, all tensors on the CPU (offload: raw GGUF blocks through cpu_kernels; the
torch part on one thread). Timings exclude loading and the first (warm-up) token. If
llama-cpp-python is not installed, only offload's numbers are printed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    "


def offload_decode(path: str, n: int, threads: int, repeat: int) -> tuple[list[float], list[int]]:
    import torch

    import offload.runtime as rt
    torch.set_num_threads(1)
    with rt.load(path, quiet=True, threads=threads) as s:
        s.warmup()
        tps, toks = [], None
        for _ in range(repeat):
            out = list(s.generate(PROMPT, max_tokens=n, stop_at_eos=False))
            tps.append(s.stats.eval_tps)
            toks = out
        return tps, toks


def llama_decode(path: str, n: int, threads: int, repeat: int, prompt_ids: list[int]):
    import llama_cpp
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(prompt_ids) + n + 8, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    tps, toks = [], None
    for _ in range(repeat):
        llm.reset()
        llm.eval(prompt_ids)
        out = [int(llm.scores[llm.n_tokens - 1].argmax())]
        t0 = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([out[-1]])
            out.append(int(llm.scores[llm.n_tokens - 1].argmax()))
        tps.append((n - 1) / (time.perf_counter() - t0))
        toks = out
    return tps, toks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "models" / "tiny-glm4moe-mtp.gguf"))
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    import offload.runtime as rt
    with rt.load(a.model, quiet=True) as s:
        prompt_ids = s.tokenize(PROMPT)
    ours, our_toks = offload_decode(a.model, a.n, a.threads, a.repeat)
    fmt = lambda v: f"{statistics.mean(v):8.2f} ± {statistics.pstdev(v):5.2f}"  # noqa: E731
    print(f"model {a.model}, {a.n} tokens greedy, {a.threads} threads, {a.repeat} repeats")
    print(f"{'engine':<12} {'decode t/s':>18}")
    print(f"{'offload':<12} {fmt(ours)}")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama-cpp-python not installed: no reference row")
        return 0
    ref, ref_toks = llama_decode(a.model, a.n, a.threads, a.repeat, prompt_ids)
    print(f"{'llama.cpp':<12} {fmt(ref)}")
    print(f"ratio offload / llama.cpp = {statistics.mean(ours) / statistics.mean(ref):.2f}")
    same = sum(x == y for x, y in zip(our_toks, ref_toks))
    print(f"greedy tokens identical to llama.cpp's: {same}/{len(ref_toks)} "
          "(llama.cpp quantizes activations to 8 bits, so late divergence is expected)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
