"""Speed of the Numba CPU expert kernels against this machine's memory-read ceiling.

    python -m bench.cpu_kernels [--mb 1024] [--types Q4_0,Q4_K] [--batches 1,2,4,8] [--moe-types Q4_K]
                                [--prompt 256] [--prompt-types Q4_0,Q4_K,Q8_0]
                                [--activations f32,int8] [--threads N] [--repeat 7]
                                [--no-compile] [--cpu-target avx2] [--json PATH]

Everything is measured in this run, compile time excluded (every kernel is called once
before it is timed):

* ceiling: a Numba streaming sum over the same buffer the kernels read (GB/s), measured
  next to every type; the run's median is the reference;
* matvec: batch-1 ``matmul`` over a weight set of ``--mb`` MB (several times the last-level
  cache) per quant type: effective GB/s of quantized bytes read and ratio to the ceiling,
  with float32 activations and (types with an int8 path, on a VNNI or AVX2 CPU) int8 activations;
  ``--batches 1,2,4,8`` adds decode/verify batches of those sizes, each with its time over
  batch 1's;
* moe: the fused expert FFN of one MoE layer (128 experts, top-8, n_embd 2048, n_ff 768,
  as Qwen3-30B-A3B) at B = 1..8 with uniform top-k routing: ms per call against the
  number of distinct experts the batch touches, plus the same batches routed to one set
  of 8 experts (distinct = 8 whatever B);
* prompt batch (VNNI or AVX2 CPUs): ``matmul`` of a 4096 x 2048 matrix and ``moe_ffn`` (32
  experts, top-8) over ``--prompt`` tokens as one call (the int8 GEMM) and as 16-token calls
  (the token routines) on the same activations, GOP/s and their share of the int8 peak
  (``int8_peak_gops``: what the cores can issue, measured in the run);
* compile: first call in a fresh process with an empty Numba cache, then a second fresh
  process on the now-filled cache (``cache=True``);
* llama.cpp: where ``llama_cpp`` (llama-cpp-python) is installed, its bundled ggml runs the
  same mat-vec on a copy of the same bytes (``ggml_mul_mat`` through
  ``ggml_graph_compute_with_ctx``, same thread count; activations quantized by ggml).

``--cpu-target avx2|avx-vnni|avx512`` runs the bench compiled for that x86 class, and
ggml from llama.cpp built for it (as ``bench.depth --cpu-target``).

``--json PATH`` writes {"ceiling_gbps", "matvec": [{type, batch, gbps, ratio, activations,
ceiling_next_gbps, ratio_next, x_b1 (ours)}],
"moe": [{type, batch, distinct_experts, ms, routing, activations}], "prompt": [{type, what,
tokens, gemm_gops, token_routines_gops, peak_gops}], ...} (temp file +
rename; ``activations`` is "f32" or "int8"; matvec rows of llama.cpp's ggml have
``"impl": "ggml"``, ours ``"impl": "offload"``).
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from numba import njit, prange, types
from llvmlite import ir
from numba.core import cgutils
from numba.extending import intrinsic

import cpu_kernels as ck
from cpu_kernels.pair8 import _V16I32, _V64I8, dpbusd
from cpu_kernels.registry import get_kernel
from cpu_kernels.simd import _byte_ptr
from cpu_kernels.simd8 import has_int8_dot
from cpu_kernels.synth import finite_floats, random_blocks, set_scales

FLOATS = (T.F32, T.F16, T.BF16)
COLS = 4096                     # row length of the mat-vec weight sets
MOE = dict(n_expert=128, k=8, n_embd=2048, n_ff=768)


@njit(parallel=True, nogil=True, cache=True)
def _stream_sum(words):
    """Sum of a uint64 [pieces, n] array, pieces in parallel: the memory-read ceiling."""
    out = np.zeros(words.shape[0], np.uint64)
    for i in prange(words.shape[0]):
        s = np.uint64(0)
        for j in range(words.shape[1]):
            s += words[i, j]
        out[i] = s
    return out.sum()


def _times(fn, n: int) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn``."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _median_time(fn, repeat):
    return statistics.median(_times(fn, repeat))


def ceiling_gbps(buf: np.ndarray, repeat: int) -> float:
    words = buf[: buf.size // 512 * 512].view(np.uint64).reshape(64, -1)
    _stream_sum(words)
    return buf.size / _median_time(lambda: _stream_sum(words), repeat) / 1e9


@intrinsic
def _dot_chains(typingctx, src, n):
    """n rounds of 8 independent u8 x s8 dot-product chains (``pair8.dpbusd`` on codes below
    128: one ``vpdpbusd`` zmm each with AVX512-VNNI, ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``
    per ymm half with AVX2) over operands loaded from ``src`` (1088 bytes), chain j of round i
    with the codes at byte 64 (i mod 8 + j), so nothing is loop-invariant and nothing
    folds; returns the lanes' sum so nothing is dead code."""
    if not (isinstance(src, types.Array) and isinstance(n, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        i64 = ir.IntType(64)
        p = _byte_ptr(context, builder, sig.args[0], args[0], ir.Constant(i64, 0), types.intp)

        def load(off):
            return builder.load(builder.bitcast(builder.gep(p, [off]), _V64I8.as_pointer()), align=1)
        b = load(ir.Constant(i64, 1024))
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16I32, [i] * 16)) for i in range(8)]
        with cgutils.for_range(builder, context.cast(builder, args[1], sig.args[1], types.intp)) as loop:
            base = builder.mul(builder.and_(loop.index, ir.Constant(i64, 7)), ir.Constant(i64, 64))
            for j, acc in enumerate(accs):
                off = builder.add(base, ir.Constant(i64, 64 * j))
                builder.store(dpbusd(builder, builder.load(acc), load(off), b, small=True), acc)
        total = builder.load(accs[0])
        for acc in accs[1:]:
            total = builder.add(total, builder.load(acc))
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), [_V16I32]),
                                            "llvm.vector.reduce.add.v16i32")
        return builder.sext(builder.call(fn, [total]), ir.IntType(64))
    return types.int64(src, n), codegen


@njit(parallel=True, nogil=True, cache=True)
def _int8_chains(src, n, threads):
    out = np.zeros(threads, np.int64)
    for t in prange(threads):
        out[t] = _dot_chains(src, n)
    return out


INT8_OPS_PER_ROUND = 8 * 64 * 2          # 8 chains of 64 multiply-adds (2 ops each)


def int8_peak_gops(threads: int, repeat: int = 5, n: int = 1 << 22) -> float | None:
    """The CPU's int8 dot-product rate measured here, GOP/s (2 per u8 x s8 multiply-add):
    ``threads`` threads each running 8 independent dot-product chains (so latency is hidden;
    ``vpdpbusd`` with VNNI, the ``vpmaddubsw`` sequence with AVX2: the compile target's
    instructions, ``pair8.dpbusd``) — what ``threads`` cores can issue, the ceiling a
    compute-bound int8 kernel is held to. None where the int8 paths do not run
    (``simd8.has_int8_dot``)."""
    if not has_int8_dot():
        return None
    src = (np.arange(1088) % 128).astype(np.uint8)
    _int8_chains(src, 16, threads)
    secs = _median_time(lambda: _int8_chains(src, n, threads), repeat)
    return threads * n * INT8_OPS_PER_ROUND / secs / 1e9


def weight_view(buf: np.ndarray, qtype: T, rng) -> np.ndarray:
    """The buffer as a [rows, row_bytes] weight of qtype with valid scales (in place)."""
    block, size = GGML_QUANT_SIZES[qtype]
    row_bytes = COLS // block * size
    w = buf[: buf.size // row_bytes * row_bytes].reshape(-1, row_bytes)
    if qtype in FLOATS:
        finite_floats(w.reshape(-1), qtype)
        return w.view(np.float32) if qtype == T.F32 else w.view(np.float16) if qtype == T.F16 else w
    set_scales(w, qtype, rng)
    return w


class _Ggml:
    """Just enough of ggml's C API (ctypes) to time one mat-vec the way llama.cpp's CPU
    backend runs it. Loaded from llama-cpp-python's bundled libraries."""

    class Params(ctypes.Structure):
        _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p),
                    ("no_alloc", ctypes.c_bool)]

    def __init__(self):
        spec = importlib.util.find_spec("llama_cpp")
        lib = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(spec.origin).parent / "lib")   # as llama_cpp
        self.base = ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        vp, b, c = ctypes.c_void_p, self.base, self.cpu
        for name, res, args in (("ggml_init", vp, [self.Params]),
                                ("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
                                ("ggml_mul_mat", vp, [vp, vp, vp]), ("ggml_new_graph", vp, [vp]),
                                ("ggml_build_forward_expand", None, [vp, vp]), ("ggml_get_data", vp, [vp]),
                                ("ggml_nbytes", ctypes.c_size_t, [vp]), ("ggml_free", None, [vp])):
            getattr(b, name).restype, getattr(b, name).argtypes = res, args
        c.ggml_graph_compute_with_ctx.restype = ctypes.c_int
        c.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
        if hasattr(c, "ggml_cpu_init"):
            c.ggml_cpu_init()

    @staticmethod
    def available() -> bool:
        try:
            return importlib.util.find_spec("llama_cpp") is not None
        except (ImportError, ValueError):
            return False

    def matvec_seconds(self, qt, w_bytes: np.ndarray, x: np.ndarray, threads: int, repeat: int) -> float:
        b = self.base
        rows, cols = w_bytes.shape[0], x.shape[-1]
        ctx = b.ggml_init(self.Params(w_bytes.nbytes + 4 * (rows + cols) + (64 << 20), None, False))
        try:
            a = b.ggml_new_tensor_2d(ctx, int(qt), cols, rows)
            v = b.ggml_new_tensor_2d(ctx, int(T.F32), cols, 1)
            if b.ggml_nbytes(a) != w_bytes.nbytes:
                raise ValueError(f"ggml sizes {qt.name} differently")
            ctypes.memmove(b.ggml_get_data(a), w_bytes.ctypes.data, w_bytes.nbytes)
            ctypes.memmove(b.ggml_get_data(v), np.ascontiguousarray(x, np.float32).ctypes.data, 4 * cols)
            graph = b.ggml_new_graph(ctx)
            b.ggml_build_forward_expand(graph, b.ggml_mul_mat(ctx, a, v))
            self.cpu.ggml_graph_compute_with_ctx(ctx, graph, threads)          # warm up
            return _median_time(lambda: self.cpu.ggml_graph_compute_with_ctx(ctx, graph, threads), repeat)
        finally:
            b.ggml_free(ctx)


def modes_for(qt, modes):
    """Activation modes that apply to qt: int8 only where the type has codes and the CPU an integer dot."""
    return [m for m in modes if m == "f32" or (get_kernel(qt).has_int8 and has_int8_dot())]


def bench_matvec(buf, types, modes, repeat, rng, threads, ggml, batches=(1,)):
    """Each type's mat-vec over the weight set, per activation mode and per batch size in
    ``batches`` (a decode/verify batch of B tokens: its time over batch 1's, ``x_b1``)."""
    rows = []
    xs = {b: rng.standard_normal((b, COLS)).astype(np.float32) for b in sorted({1, *batches})}
    for qt in types:
        w = weight_view(buf, qt, rng)
        nbytes = w.nbytes
        ceil = ceiling_gbps(buf, 3)
        for mode in modes_for(qt, modes):
            ck.set_int8_activations(mode == "int8")
            one = None
            for b, x in xs.items():
                ck.matmul(x, w, qt)                             # compile / warm up
                t = _median_time(lambda: ck.matmul(x, w, qt), repeat)
                one = t if b == 1 else one
                if b not in batches:
                    continue
                rows.append(dict(type=qt.name, batch=b, gbps=nbytes / t / 1e9, activations=mode,
                                 impl="offload", ceiling_next=ceil, x_b1=t / one))
                print(f"  {qt.name:7s} {mode:5s} B={b:<2d} {rows[-1]['gbps']:6.2f} GB/s  {t / one:5.2f}x batch 1  "
                      f"(ceiling measured next to it {ceil:5.1f})", flush=True)
        if ggml is not None:
            t = ggml.matvec_seconds(qt, w.view(np.uint8), x, threads, repeat)
            rows.append(dict(type=qt.name, batch=1, gbps=nbytes / t / 1e9, activations="ggml",
                             impl="ggml", ceiling_next=ceil))
            print(f"  {qt.name:7s} ggml  {rows[-1]['gbps']:6.2f} GB/s   (llama.cpp's ggml, same bytes)",
                  flush=True)
    ck.set_int8_activations(False)
    return rows


def _expert_layer(qt, rng):
    E, D, F = MOE["n_expert"], MOE["n_embd"], MOE["n_ff"]
    block, size = GGML_QUANT_SIZES[qt]

    def tensor(rows, cols):
        a = rng.integers(0, 256, size=(E, rows, cols // block * size), dtype=np.uint8)
        if qt in FLOATS:
            finite_floats(a.reshape(-1), qt)
            return a.view(np.float16) if qt == T.F16 else a.view(np.float32) if qt == T.F32 else a
        set_scales(a, qt, rng)
        return a
    g, u, d = tensor(F, D), tensor(F, D), tensor(D, F)
    return ck.ExpertWeights(g, u, d, qt, qt, qt, name="bench")


def bench_moe(types, modes, repeat, rng, total_mb):
    E, k, D = MOE["n_expert"], MOE["k"], MOE["n_embd"]
    rows = []
    for qt in types:
        first = _expert_layer(qt, rng)
        layer_mb = (first.gate.nbytes + first.up.nbytes + first.down.nbytes) / 1e6
        # Several layers, cycled, so repeated calls do not find the experts in cache.
        layers = [first] + [_expert_layer(qt, rng) for _ in range(max(0, int(total_mb // layer_mb)))]
        per_expert_mb = layer_mb / E
        for mode in modes_for(qt, modes):
            ck.set_int8_activations(mode == "int8")
            print(f"  {qt.name} ({mode} activations): {len(layers)} layers of {layer_mb:.0f} MB, "
                  f"{per_expert_mb:.2f} MB per expert")
            print(f"    {'B':>2} {'routing':>8} {'distinct':>8} {'U(B)':>6} {'ms':>8} {'ms/expert':>9} {'GB/s':>6}")
            for B in range(1, 9):
                for routing in ("top-k", "same-8"):
                    rows.append(_moe_point(qt, mode, B, routing, layers, per_expert_mb, repeat, rng))
    ck.set_int8_activations(False)
    return rows


def _moe_point(qt, mode, B, routing, layers, per_expert_mb, repeat, rng):
    """Median ms of moe_ffn for B tokens: top-k = uniform random top-8 of 128 per token;
    same-8 = every token routed to one random set of 8 experts."""
    E, k, D = MOE["n_expert"], MOE["k"], MOE["n_embd"]
    x = rng.standard_normal((B, D)).astype(np.float32)
    wts = rng.random((B, k)).astype(np.float32)

    def ids():
        if routing == "same-8":
            return np.tile(rng.choice(E, k, replace=False), (B, 1))
        return np.stack([rng.choice(E, k, replace=False) for _ in range(B)])
    ck.moe_ffn(x, ids(), wts, layers[0])                          # compile / warm up
    times, distinct = [], []
    for i in range(repeat * 3):
        sel = ids()
        distinct.append(len(np.unique(sel)))
        t = time.perf_counter()
        ck.moe_ffn(x, sel, wts, layers[i % len(layers)])
        times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    dist = float(np.mean(distinct))
    u = E * (1 - (1 - k / E) ** B)
    print(f"    {B:2d} {routing:>8} {dist:8.1f} {u:6.1f} {ms:8.2f} {ms / dist:9.3f} "
          f"{dist * per_expert_mb / ms:6.2f}", flush=True)
    return dict(type=qt.name, batch=B, routing=routing, distinct_experts=int(round(dist)),
                distinct_mean=dist, ms=ms, activations=mode)


_COMPILE_PROBE = """
import time, numpy as np
t0 = time.perf_counter()
import cpu_kernels as ck
from cpu_kernels.synth import random_blocks
from gguf import GGMLQuantizationType as T
t1 = time.perf_counter()
w = random_blocks(T.Q4_K, (64, 1024), np.random.default_rng(0))
x = np.ones((1, 1024), np.float32)
t2 = time.perf_counter(); ck.matmul(x, w, T.Q4_K); t3 = time.perf_counter()
ck.matmul(x, w, T.Q4_K); t4 = time.perf_counter()
print(t1 - t0, t3 - t2, t4 - t3)
"""


def bench_prompt(types, n_tok, repeat, rng, threads):
    """Prompt batches on the int8 path: ``matmul`` of a 4096 x 2048 matrix and ``moe_ffn`` (MOE's
    shape, 32 experts so each holds ~n_tok/4 tokens) over ``n_tok`` tokens as one call (the
    GEMM, ``cpu_kernels.gemm8``) and as calls of 16 tokens (the token routines, ``rowdot8``, the
    same activations), GOP/s (2 per multiply-add) and their share of the int8 peak measured here."""
    peak = int8_peak_gops(threads)
    print(f"  int8 peak (-t {threads}: 8 independent dot-product chains a thread): {peak:.0f} GOP/s")
    x = rng.standard_normal((n_tok, MOE["n_embd"])).astype(np.float32)
    E, k, n_ff, n_embd = 32, MOE["k"], MOE["n_ff"], MOE["n_embd"]
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(n_tok)])
    wts = np.full((n_tok, k), 1 / k, np.float32)
    rows = []
    print(f"  {'what':28s} {'GEMM GOP/s':>10} {'/peak':>6} {'16 a call':>10} {'/peak':>6} {'ratio':>6}")
    for qt in types:
        w = random_blocks(qt, (4096, n_embd), rng)
        experts = ck.ExpertWeights(*(random_blocks(qt, shape, rng) for shape in
                                     ((E, n_ff, n_embd), (E, n_ff, n_embd), (E, n_embd, n_ff))), qt, qt, qt)
        cases = (("matmul 4096x2048", 4096 * n_embd, lambda b: ck.matmul(x[b], w, qt, int8=True)),
                 (f"moe_ffn E{E} k{k}", 3 * n_ff * n_embd * k,
                  lambda b: ck.moe_ffn(x[b], ids[b], wts[b], experts, int8=True)))
        for what, macs, call in cases:
            whole = 2 * macs * n_tok / _median_time(lambda: call(slice(None)), repeat) / 1e9
            tiles = 2 * macs * n_tok / _median_time(
                lambda: [call(slice(i, i + 16)) for i in range(0, n_tok, 16)], repeat) / 1e9
            row = dict(type=qt.name, what=what, tokens=n_tok, gemm_gops=whole, token_routines_gops=tiles,
                       peak_gops=peak)
            rows.append(row)
            print(f"  {qt.name + ' ' + what:28s} {whole:10.0f} {whole / peak:6.2f} {tiles:10.0f} {tiles / peak:6.2f} "
                  f"{whole / tiles:6.2f}")
    return rows


def bench_compile():
    """First Q4_K matmul in a fresh process: empty Numba cache, then the cache it filled."""
    out = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        for label in ("cold (empty cache)", "warm (cache from the previous process)"):
            r = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parents[1], check=True)
            imp, first, second = map(float, r.stdout.split())
            out.append(dict(process=label, import_s=imp, first_call_s=first, second_call_s=second))
            print(f"  {label:40s} import {imp:5.2f} s  first call {first:6.2f} s  second call {second * 1e3:6.2f} ms")
    return out


def load_line():
    try:
        la = os.getloadavg()
        return f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {os.cpu_count()} CPUs"
    except OSError:
        return "load average unavailable"


_TARGET_ENV, _HEADER_ENV = "OFFLOAD_BENCH_CPU_TARGET", "OFFLOAD_BENCH_CPU_TARGET_HEADER"


def _rerun_for_target(target: str, argv: list[str], no_ggml: bool) -> int:
    """This bench again in a process compiled for ``target`` (Numba's target must be set
    before Numba compiles anything), ggml from llama.cpp built for it; its exit status."""
    from bench.llama_build import target_envs
    try:
        envs = target_envs(target, _Ggml.available() and not no_ggml,
                           log=lambda m: print(f"[llama_build] {m}", file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"bench.cpu_kernels: --cpu-target: {e}", file=sys.stderr)
        return 2
    env = dict(os.environ, **envs.offload, **envs.llama, **{_TARGET_ENV: target, _HEADER_ENV: envs.header})
    return subprocess.run([sys.executable, "-m", "bench.cpu_kernels", *argv], env=env).returncode


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024, help="mat-vec weight set size in MB (default 1024)")
    ap.add_argument("--types", default=",".join(t.name for t in ck.supported_types()))
    ap.add_argument("--moe-types", default="Q4_K,Q8_0")
    ap.add_argument("--moe-mb", type=int, default=1024, help="bytes of expert layers cycled through")
    ap.add_argument("--activations", default="f32,int8", help="f32 and/or int8 (comma list)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--moe-threads", type=int, default=None,
                    help="threads for the moe table (default: --threads). On a box whose other core "
                         "is busy, each parallel region waits for the descheduled worker (~4 ms here)")
    ap.add_argument("--batches", default="1",
                    help="mat-vec batch sizes, comma list (default 1; e.g. 1,2,4,8: decode/verify batches, "
                         "each row's time against batch 1's)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--no-compile", action="store_true", help="skip the fresh-process compile timing")
    ap.add_argument("--no-ggml", action="store_true", help="skip llama.cpp's ggml even if installed")
    ap.add_argument("--prompt", type=int, default=256,
                    help="tokens of the prompt-batch table (GEMM against 16-token calls; 0: skip)")
    ap.add_argument("--prompt-types", default="Q4_0,Q4_K,Q8_0")
    ap.add_argument("--cpu-target", default="native",
                    help="run compiled for another x86 class this CPU can run (avx2, avx-vnni, avx512; as "
                         "bench.depth), the ggml column from llama.cpp built for it (default native)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cpu_target != os.environ.get(_TARGET_ENV, "native"):
        return _rerun_for_target(args.cpu_target, sys.argv[1:] if argv is None else argv, args.no_ggml)
    try:
        types = [T[n.strip()] for n in args.types.split(",") if n.strip()]
        moe_types = [T[n.strip()] for n in args.moe_types.split(",") if n.strip()]
        prompt_types = [T[n.strip()] for n in args.prompt_types.split(",") if n.strip()]
    except KeyError as e:
        print(f"bench.cpu_kernels: unknown quant type {e.args[0]}", file=sys.stderr)
        return 2
    modes = [m.strip() for m in args.activations.split(",") if m.strip()]
    if not modes or any(m not in ("f32", "int8") for m in modes):
        print(f"bench.cpu_kernels: --activations takes f32 and/or int8, got {args.activations!r}",
              file=sys.stderr)
        return 2
    try:
        batches = tuple(int(b) for b in args.batches.split(",") if b.strip())
    except ValueError:
        batches = ()
    if not batches or not all(1 <= b <= 16 for b in batches):
        print(f"bench.cpu_kernels: --batches takes sizes 1..16 (decode/verify batches), got {args.batches!r}",
              file=sys.stderr)
        return 2
    ck.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"cpu_kernels bench: {numba.config.NUMBA_NUM_THREADS if args.threads is None else args.threads} "
          f"threads, {args.mb} MB weight sets; {load_line()}")
    print(os.environ.get(_HEADER_ENV) or "CPU target: native")
    buf = rng.integers(0, 256, size=args.mb << 20, dtype=np.uint8)

    print(f"matvec (batch {', '.join(map(str, batches))}):")
    ggml = _Ggml() if _Ggml.available() and not args.no_ggml else None
    threads = args.threads or numba.config.NUMBA_NUM_THREADS
    matvec = bench_matvec(buf, types, modes, args.repeat, rng, threads, ggml, batches)
    ceiling = statistics.median([r["ceiling_next"] for r in matvec] + [ceiling_gbps(buf, 3)])
    print(f"\nmemory-read ceiling (median over the run): {ceiling:.2f} GB/s")
    print(f"  {'type':7s} {'act':5s} {'GB/s':>6} {'ratio':>6} {'next':>6}   (next: to the ceiling measured "
          f"next to that type, which tracks other load on a shared box)")
    for r in matvec:
        r["ratio"] = r["gbps"] / ceiling
        r["ceiling_next_gbps"] = r.pop("ceiling_next")
        r["ratio_next"] = r["gbps"] / r["ceiling_next_gbps"]
        print(f"  {r['type']:7s} {r['activations']:5s} B={r['batch']:<2d} {r['gbps']:6.2f} {r['ratio']:6.2f} "
              f"{r['ratio_next']:6.2f}")
    del buf

    prompt = []
    if args.prompt and not has_int8_dot():
        print("\nprompt batch: skipped (no integer dot product: int8 activations do not run on this CPU)")
    elif args.prompt:
        print(f"\nprompt batch of {args.prompt} tokens, int8 activations, {threads} threads "
              "(each call once untimed first):")
        prompt = bench_prompt(prompt_types, args.prompt, args.repeat, rng, threads)

    moe_threads = args.moe_threads or args.threads
    ck.set_num_threads(moe_threads)
    print(f"\nmoe (fused expert FFN, per call, {moe_threads or numba.config.NUMBA_NUM_THREADS} threads):")
    moe = bench_moe(moe_types, modes, args.repeat, rng, args.moe_mb)
    compile_rows = []
    if not args.no_compile:
        print("\ncompile time (Q4_K matmul, fresh processes):")
        compile_rows = bench_compile()
    print(f"\n{load_line()}")
    if args.json:
        doc = dict(ceiling_gbps=ceiling, matvec=matvec, moe=moe, prompt=prompt, compile=compile_rows,
                   threads=args.threads or numba.config.NUMBA_NUM_THREADS,
                   moe_threads=moe_threads or numba.config.NUMBA_NUM_THREADS, mb=args.mb, load=load_line())
        tmp = args.json.with_name(args.json.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
