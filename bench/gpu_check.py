"""One prepared check of the CUDA path (fused dequant-matmul kernels, gpu/triton_matmul.py).

    python -m bench.gpu_check              # on a CUDA machine (< 8 min on an H200)
    python -m bench.gpu_check --interpret  # numerics only, on the CPU (Triton interpreter)

On a CUDA device it prints:
  (a) each fused kernel's GB/s at B = 1 and 16 against the device's memory bandwidth measured
      in the same run (a device-to-device copy), and the per-call-dequant path's time for the
      same weight; all timed with CUDA events;
  (b) decode of a wide random model (near-real widths, experts in RAM through the CPU
      kernels, everything else on the GPU) with the fused kernels vs per-call dequantization;
  (c) CUDA graphs: not implemented, said so;
  (d) logits parity of that model against the all-CPU path (f32 and bf16 on the GPU);
  (e) attention over a quantized KV cache at 8k context (one decode token, 64 query heads
      on 8 KV heads of 128): the Triton kernel (gpu/triton_kv_attention.py) against torch's
      tile-by-tile dequantization and against an f16 cache, with its error beside;
  (f) that wide model with quantized KV caches on CUDA0 (gpu.attention routes decode
      batches to the kernel of (e)): logits against the f16 cache's, and decode tokens/s.
With ``--interpret`` it checks every fused type against ``gguf.quants.dequantize`` + float64
for B = 1, 3, 16 under Triton's interpreter, the logits of a tiny model with the fused
kernel forced onto a virtual GPU against the CPU path, and compiles every kernel ahead of
time for sm_80 and sm_90 (``--aot``; ptxas ships with triton, no GPU needed), printing
registers and spills. Exit status 1 if any check fails.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# f32 kernel vs float64 product: K products accumulated in float32 (see tests/kernels/test_triton_kernels.py)
KERNEL_TOL = 1e-5           # of Σ|x·w|
# logits in f32: summation order only (~1e-6 of the scale). In bf16 a router near-tie can flip
# an expert, so the fused path is held to today's per-call-dequant path (see tests/kernels/test_fused_runtime.py)
LOGIT_TOL_F32 = 1e-4
BF16_SLACK = 2.0


def _numerics() -> bool:
    """Every fused type, B = 1, 3, 16, against gguf's dequantizer and a float64 product."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from gpu.qtypes import FUSED_TYPES
    from gpu.triton_matmul import fused_linear
    from tests.tiny_models import random_blocks

    dev = torch.device("cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda")
    print(f"kernel numerics on {dev} (tolerance {KERNEL_TOL:g} of sum|x*w| per output)")
    print(f"  {'type':<8} {'B':>3} {'rows x cols':>12} {'max err / sum|x*w|':>20}  result")
    ok = True
    for qtype in sorted(FUSED_TYPES, key=lambda q: q.name):
        qk, size = GGML_QUANT_SIZES[qtype]
        rows, cols = 72, 768
        rng = np.random.default_rng(int(qtype))
        raw = random_blocks(rng, rows * cols // qk, qtype, 0.1).reshape(rows, cols // qk * size)
        w = dequantize(raw, qtype).astype(np.float64)
        for b in (1, 3, 16):
            x = rng.standard_normal((b, cols)).astype(np.float32)
            got = fused_linear(torch.from_numpy(raw).to(dev), qtype, torch.from_numpy(x).to(dev))
            x64 = x.astype(np.float64)
            rel = (np.abs(got.cpu().numpy() - x64 @ w.T) / (np.abs(x64) @ np.abs(w).T + 1e-30)).max()
            passed = bool(rel <= KERNEL_TOL)
            ok &= passed
            print(f"  {qtype.name:<8} {b:>3} {f'{rows}x{cols}':>12} {rel:>20.2e}  {'ok' if passed else 'FAIL'}")
    return ok


def _rel(got, want) -> float:
    import numpy as np
    return float(np.abs(got - want).max() / np.abs(want).max())


def _tiny_parity() -> bool:
    """A tiny model with Q6_K dense weights, experts in RAM, the rest on a virtual GPU whose
    projections go through the (interpreted) fused kernel, against the all-CPU path."""
    from gguf import GGMLQuantizationType as Q

    import gpu.fused as fused
    import offload.runtime as rt
    from tests.tiny_models import TinySpec, write_tiny_model

    ids = [3, 17, 257, 101, 46, 290, 5, 77]
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_model(Path(tmp) / "tiny.gguf", TinySpec(dense_type=Q.Q6_K, n_ff=256, n_head=8, seed=5))
        with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as s:
            want = s.logits(ids)
        fused.FUSED_DEVICE_TYPES = ("cpu",)
        try:
            with rt.load(tiny.path, devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True, virtual_gpus=True,
                         cache_type="f32", quiet=True) as s:
                got = s.logits(ids)
        finally:
            fused.FUSED_DEVICE_TYPES = ("cuda",)
    rel = _rel(got, want)
    passed = rel <= LOGIT_TOL_F32
    print(f"tiny model, fused kernel on a virtual GPU (interpreted) vs CPU path: max |diff| / max |logit| "
          f"= {rel:.2e} (tolerance {LOGIT_TOL_F32:g})  {'ok' if passed else 'FAIL'}")
    return passed


def _aot(capabilities: list[int]) -> bool:
    """Every fused type compiled ahead of time (no GPU needed; triton ships ptxas) for each
    compute capability, bf16 and f32 x: registers per thread and spills as ptxas reports them."""
    import re
    import subprocess

    import torch
    from triton.backends.nvidia.compiler import get_ptxas

    from gpu.qtypes import FUSED_TYPES
    from gpu.triton_matmul import compile_for

    print("kernels compiled ahead of time (BLOCK_N 32, BLOCK_K 128, 4 warps): registers/thread, spill bytes")
    ok = True
    for cap in capabilities:
        line = []
        for qtype in sorted(FUSED_TYPES, key=lambda q: q.name):
            for dtype in (torch.bfloat16, torch.float32):
                try:
                    k = compile_for(qtype, dtype, cap)
                except Exception as exc:   # noqa: BLE001  (report which type fails, go on)
                    print(f"  sm_{cap} {qtype.name} {dtype}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    ok = False
                    continue
                with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                    f.write(k.asm["ptx"])
                    f.flush()
                    r = subprocess.run([get_ptxas(cap).path, "-v", "--gpu-name", f"sm_{cap}a" if cap >= 90 else f"sm_{cap}",
                                        f.name, "-o", os.devnull], capture_output=True, text=True)
                regs = re.search(r"Used (\d+) registers", r.stderr)
                spill = re.search(r"(\d+) bytes spill stores", r.stderr)
                line.append(f"{qtype.name}/{'bf16' if dtype == torch.bfloat16 else 'f32'} "
                            f"{regs.group(1) if regs else '?'}r {spill.group(1) if spill else '?'}s")
        print(f"  sm_{cap}: " + ", ".join(line))
    return ok


def _aot_subprocess() -> bool:
    """``_aot`` in a fresh interpreter without TRITON_INTERPRET (compiling needs the real kernel)."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--aot", "80,90"], env=env,
                       capture_output=True, text=True)
    print(r.stdout, end="")
    if r.returncode:
        print(r.stderr[-3000:], end="")
    return r.returncode == 0


# -- on a CUDA device ---------------------------------------------------------------------
def _event_ms(fn, reps: int) -> float:
    """Mean milliseconds per call of ``fn``, CUDA events around ``reps`` calls after warm-up."""
    import torch
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _kernel_speed(rows: int, cols: int) -> bool:
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES

    import gpu.quant as gq
    from gpu.qtypes import FUSED_TYPES
    from gpu.triton_matmul import fused_linear
    from tests.tiny_models import random_blocks

    dev = torch.device("cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(big)
    copy_ms = _event_ms(lambda: dst.copy_(big), 10)
    ceiling = 2 * big.numel() / copy_ms / 1e6                     # read + write, GB/s
    del big, dst
    print(f"(a) fused kernels, W {rows} x {cols}, x bf16; ceiling = device-to-device copy: {ceiling:,.0f} GB/s")
    print(f"  {'type':<8} {'B':>3} {'MB':>7} {'fused ms':>9} {'GB/s':>8} {'of ceiling':>10} "
          f"{'dequant+mm ms':>14} {'speed-up':>9}")
    rng = np.random.default_rng(0)
    for qtype in sorted(FUSED_TYPES, key=lambda q: q.name):
        qk, size = GGML_QUANT_SIZES[qtype]
        raw = torch.from_numpy(random_blocks(rng, rows * cols // qk, qtype, 0.02)
                               .reshape(rows, cols // qk * size)).to(dev)
        t = gq.QuantTensor(raw, qtype, (rows, cols))
        for b in (1, 16):
            x = torch.randn(b, cols, device=dev, dtype=torch.bfloat16)
            ms = _event_ms(lambda: fused_linear(raw, qtype, x), 20)
            chunked = _event_ms(lambda: gq.dequantize(raw, qtype, dtype=torch.bfloat16) @ x.T, 5)
            gbs = raw.numel() / ms / 1e6
            print(f"  {qtype.name:<8} {b:>3} {raw.numel() / 1e6:>7.1f} {ms:>9.3f} {gbs:>8,.0f} "
                  f"{gbs / ceiling:>10.2f} {chunked:>14.3f} {chunked / ms:>8.1f}x")
        del raw, t
    return True


def _wide_model(tmp: str, n_layer: int):
    """Near-real widths (GLM-4.5-Air's attention, 1536-wide experts), 16 experts, Q4_K."""
    from gguf import GGMLQuantizationType as Q

    from tests.tiny_models import TinySpec, write_tiny_model
    spec = TinySpec(arch="glm4moe", expert_type=Q.Q4_K, dense_type=Q.Q4_K, n_embd=4096, n_head=96,
                    n_head_kv=8, head_dim=128, n_rot=64, n_layer=n_layer, n_dense=1, n_ff=10752,
                    n_expert=16, n_expert_used=8, n_ff_exp=1536, n_shared=1, nextn=False, seed=1)
    t0 = time.perf_counter()
    tiny = write_tiny_model(Path(tmp) / "wide.gguf", spec, keep_weights=False)
    size = os.path.getsize(tiny.path)
    print(f"wide model: {n_layer} blocks, n_embd 4096, 96 heads, 16 experts x 1536 (8 used) + 1 shared, "
          f"Q4_K, {size / 1e9:.2f} GB, written in {time.perf_counter() - t0:.0f} s")
    return tiny.path


def _decode(path, n_tokens: int) -> bool:
    import gpu.fused as fused
    import offload.runtime as rt
    from gpu.qtypes import TILE_B
    prompt = list(range(3, 11))
    plan = dict(devices="CUDA0=100GiB,CPU=100GiB", cpu_moe=True)
    print(f"(b) decode, experts in RAM, the rest on CUDA0 (bf16), {n_tokens} tokens after an 8-token prompt")
    with rt.load(path, quiet=True, **plan) as s:
        s.warmup()
        tps = {}
        for label, crossover in (("per-call dequant", 0), ("fused", TILE_B),
                                 ("per-call dequant", 0), ("fused", TILE_B)):
            fused.CROSSOVER = crossover
            list(s.generate(prompt, max_tokens=n_tokens, stop_at_eos=False))
            tps[label] = max(tps.get(label, 0.0), s.stats.eval_tps)      # best of two
        fused.CROSSOVER = TILE_B
    for label, v in tps.items():
        print(f"  {label:<17} {v:8.2f} tokens/s")
    print(f"  fused / per-call dequant: {tps['fused'] / tps['per-call dequant']:.2f}x")
    return True


def _parity(path) -> bool:
    import gpu.fused as fused
    import offload.runtime as rt
    from gpu.qtypes import TILE_B
    ids = list(range(3, 11))
    with rt.load(path, devices="CPU=100GiB", cache_type="f32", quiet=True) as s:
        want = s.logits(ids)
    err = {}
    for dtype in ("f32", "bf16"):
        for label, crossover in (("fused", TILE_B), ("per-call dequant", 0)):
            fused.CROSSOVER = crossover
            with rt.load(path, devices="CUDA0=100GiB,CPU=100GiB", cpu_moe=True, gpu_dtype=dtype,
                         cache_type="f32", quiet=True) as s:
                err[dtype, label] = _rel(s.logits(ids), want)
    fused.CROSSOVER = TILE_B
    print("(d) logits parity, experts in RAM + the rest on CUDA0 (8-token batch) vs all-CPU: "
          "max |diff| / max |logit|")
    checks = {"f32": err["f32", "fused"] <= LOGIT_TOL_F32,
              "bf16": err["bf16", "fused"] <= BF16_SLACK * err["bf16", "per-call dequant"] + 1e-3}
    for dtype in ("f32", "bf16"):
        want_txt = (f"<= {LOGIT_TOL_F32:g}" if dtype == "f32" else
                    f"<= {BF16_SLACK:g} x per-call dequant + 1e-3")
        print(f"  {dtype:<5} fused {err[dtype, 'fused']:.2e}, per-call dequant {err[dtype, 'per-call dequant']:.2e}"
              f"  (fused {want_txt})  {'ok' if checks[dtype] else 'FAIL'}")
    return all(checks.values())


def _kv_attention(n_ctx: int) -> bool:
    """One decode token's attention over an ``n_ctx``-cell cache per cache type: the Triton
    kernel vs ``attend_tiles`` (torch, dequantizes tile by tile) on the same quantized cache,
    and the f16 cache's ``attend_tiles`` as the baseline the quantized cache must beat."""
    import torch

    from gguf import GGMLQuantizationType as Q

    from gpu.attention import attend_tiles
    from gpu.kv_cache import KVCache
    from gpu.triton_kv_attention import attend_quantized

    dev, n_kv, n_head, d = torch.device("cuda"), 8, 64, 128
    g = torch.Generator().manual_seed(3)
    k = torch.randn(n_kv, n_ctx, d, generator=g).to(dev)
    v = torch.randn(n_kv, n_ctx, d, generator=g).to(dev)
    q = torch.randn(1, n_head, d, generator=g).to(dev)
    f16 = KVCache(n_kv, d, device=dev, dtype=torch.float16, capacity=n_ctx)
    fk, fv = f16.append(k, v)
    want = attend_tiles(q, fk, fv)
    f16_ms = _event_ms(lambda: attend_tiles(q, fk, fv), 20)
    print(f"(e) attention over the KV cache, {n_ctx} cells, {n_head} heads on {n_kv} KV heads of {d}, 1 token; "
          f"f16 cache with torch tiles: {f16_ms:.3f} ms")
    print(f"  {'type':<8} {'cache MB':>9} {'triton ms':>10} {'torch tiles ms':>15} {'f16 / triton':>13} "
          f"{'err / max':>10}  result")
    ok = True
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL):
        cache = KVCache(n_kv, d, device=dev, dtype=qtype, capacity=n_ctx)
        keys, values = cache.append(k, v)
        got = attend_quantized(q, keys, values)
        ref = attend_tiles(q, keys, values)
        err = float((got - ref).abs().max() / ref.abs().max())
        passed = err <= KERNEL_TOL
        ok &= passed
        tri = _event_ms(lambda: attend_quantized(q, keys, values), 20)
        tor = _event_ms(lambda: attend_tiles(q, keys, values), 5)
        mb = (keys.raw.numel() + values.raw.numel()) / 1e6
        print(f"  {qtype.name:<8} {mb:>9.1f} {tri:>10.3f} {tor:>15.3f} {f16_ms / tri:>12.2f}x {err:>10.1e}  "
              f"{'ok' if passed else 'FAIL'}  (vs f16 cache: {float((got - want).abs().max() / want.abs().max()):.1e})")
    return ok


def _cache_types(path, n_tokens: int) -> bool:
    """The wide model's attention on CUDA0 over f16, q8_0 and q4_0 caches: logits of an
    8-token prompt against the f16 cache's (q8_0 held to its issue bound, 1e-2 of the
    largest; q4_0 reported), then decode speed."""
    import offload.runtime as rt
    ids, prompt = list(range(3, 11)), list(range(3, 11))
    print(f"(f) quantized KV caches on CUDA0, experts in RAM: logits vs the f16 cache, "
          f"{n_tokens} tokens decoded")
    ok, base = True, None
    for ct in ("f16", "q8_0", "q4_0"):
        with rt.load(path, devices="CUDA0=100GiB,CPU=100GiB", cpu_moe=True, cache_type=ct, quiet=True) as s:
            logits = s.logits(ids)
            s.warmup()
            best = 0.0
            for _ in range(2):
                list(s.generate(prompt, max_tokens=n_tokens, stop_at_eos=False))
                best = max(best, s.stats.eval_tps)
        if base is None:
            base = logits
            print(f"  {ct:<5} {best:8.2f} tokens/s")
            continue
        rel = _rel(logits, base)
        passed = ct != "q8_0" or rel <= 1e-2
        ok &= passed
        print(f"  {ct:<5} {best:8.2f} tokens/s  logits err {rel:.2e}  {'ok' if passed else 'FAIL'}")
    return ok


def _section(fn, *args) -> bool:
    """Run one section; a failure is printed and counted, the other sections still run."""
    try:
        return fn(*args)
    except Exception:   # noqa: BLE001  (one prepared run: report everything, stop nothing)
        traceback.print_exc()
        print(f"{fn.__name__}: FAILED")
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="numerics on the CPU under the Triton interpreter")
    ap.add_argument("--rows", type=int, default=28672, help="(a) weight rows (default 28672)")
    ap.add_argument("--cols", type=int, default=8192, help="(a) weight columns (default 8192)")
    ap.add_argument("--layers", type=int, default=4, help="(b, d) blocks of the wide model (default 4)")
    ap.add_argument("--tokens", type=int, default=32, help="(b) tokens decoded per run (default 32)")
    ap.add_argument("--kv-ctx", type=int, default=8192, help="(e) cache cells (default 8192)")
    ap.add_argument("--only", default="abcdef", help="the sections to run after the numerics (default abcdef)")
    ap.add_argument("--aot", metavar="CAPS", help="only compile the kernels for these compute capabilities "
                    "(e.g. 80,90; no GPU needed) and print registers and spills")
    args = ap.parse_args(argv)
    if args.aot:
        return 0 if _aot([int(c) for c in args.aot.split(",")]) else 1
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"      # before triton is imported
    import torch
    if not args.interpret and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --interpret for the numerics on the CPU", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    if args.interpret:
        results = [_section(_numerics), _section(_tiny_parity), _section(_aot_subprocess)]
    else:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
        results = [_section(_numerics)]
        if "a" in args.only:
            results.append(_section(_kernel_speed, args.rows, args.cols))
        if "e" in args.only:
            results.append(_section(_kv_attention, args.kv_ctx))
        if set("bdf") & set(args.only):
            with tempfile.TemporaryDirectory() as tmp:
                path = _wide_model(tmp, args.layers)
                if "b" in args.only:
                    results.append(_section(_decode, path, args.tokens))
                if "c" in args.only:
                    print("(c) CUDA graphs: not implemented (no capture exists; nothing to compare)")
                if "d" in args.only:
                    results.append(_section(_parity, path))
                if "f" in args.only:
                    results.append(_section(_cache_types, path, args.tokens))
    print(f"gpu_check: {'all checks passed' if all(results) else 'SOME CHECKS FAILED'} "
          f"in {time.perf_counter() - t0:.0f} s")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
