"""Depth benchmark: offload's CPU decode and prefill next to llama.cpp's on random-weight
qwen3moe models, the fixed cost per block, and GB/s against the memory-read ceiling.

    python -m bench.depth [--only wide,narrow,prefill,sweep] [-t 2] [--tokens 32] [--cpu-target avx2]
                          [--prompt 256] [--repeat 3] [--rounds 1] [--keep DIR] [--json PATH]
                          [--expert-type Q4_0|Q4_K|Q5_K|Q6_K|MXFP4|Q8_0] [--decode-activations auto|int8|float]

Models (written at run time into a temp folder, or into ``--keep DIR`` and reused from
there by later runs): qwen3moe, 32 experts per block, top-8, Q4_0 experts (``--expert-type``:
another type for all three expert tensors, a different file), Q8_0 attention,
output and token embedding, F32 norms and router, the byte-level vocabulary of the tiny
test models (``tests.tiny_models.tiny_vocab``), so both offload and llama.cpp load them:

* ``wide``: 48 blocks at Qwen3-30B-A3B widths (n_embd 2048, 32 q heads / 4 KV heads of 128,
  expert FFN 768), 5.05 GB (4.7 GiB);
* ``narrow``: the same 48 blocks narrow (n_embd 512, 4 q heads / 1 KV head of 128, expert FFN
  256), 0.38 GB;
* ``sweep``: the narrow model at 4, 12, 24 and 48 blocks.

Quantized weights are random quant bytes with sane random fp16 scales
(``cpu_kernels.synth.set_scales``; magnitude so a row's output has about the input's scale);
every bit pattern of a Q4_0 / Q8_0 block is valid, and whatever the bytes dequantize to *is*
the weight, so no float slab has to be quantized (4.8 GB is written in about a minute).

Workloads (``--only``): ``wide`` and ``narrow`` = greedy decode of ``--tokens`` tokens after an
8-token prompt; ``prefill`` = one ``--prompt``-token prompt (256) on the wide model, as one
ubatch; ``sweep`` = decode on each sweep model. On request only: ``v4`` and ``v4-prefill``, the
same decode and prefill on a random deepseek4 at V4-Flash's depth and layout, reduced widths
(``bench.depth_v4``; ``--v4-expert-type``, MXFP4 by default). Each engine and model runs in a fresh
process (``--one``), CPU only, ``-t`` threads: offload with ``threads=-t`` for its Numba
kernels, ``--prefill-activations`` (int8, as ``offload run``) for prompt batches,
``--decode-activations`` (auto, as ``offload run``) for the routed experts' decode batches, and torch
on ``--torch-threads`` (1, as ``offload run``); llama.cpp through
llama-cpp-python with ``n_threads = n_threads_batch = -t``, no GPU layers, ``n_batch =
n_ubatch = --prompt``, memory-mapped weights (its default; the file is read through once
before each process so neither engine pays disk reads). Each process warms up first (one
untimed pass of the same workload), then times ``--repeat`` passes; ``--rounds N`` runs N
such processes per engine, alternating engines; the median over all passes is reported
(``--stat best``: the fastest pass, and the highest ceiling).
Both are given the same token ids; the greedy tokens' agreement is printed as a sanity check
(llama.cpp's 8-bit activations make late divergence normal). Without llama-cpp-python only
offload's column is filled; a crashed process leaves its cells "fail" and says why.

Printed per workload: t/s of each engine and their ratio; active bytes per token (every
non-expert tensor once — one row of the embedding — plus top-k/n_expert of the routed
expert bytes: what one decode token must read), GB/s = active bytes x t/s and its ratio to
the ceiling, and the physical limit t/s = ceiling / active bytes. For prefill the bytes are
the whole model read once per ubatch (a 256-token batch touches every expert), so its GB/s
is bytes per batch / time per batch and its limit is left out (prefill is compute-bound).
Below the table each prefill row also gets its compute rate: 2 x the multiply-adds of the
blocks' matrices per token (projections, top-k of the routed experts, shared experts) x t/s,
in GOP/s and as a share of the int8 peak measured at the end of the run
(``bench.cpu_kernels.int8_peak_gops``: -t threads of independent ``vpdpbusd`` chains, what
the cores can issue; with AVX2 ``vpmaddubsw`` + ``vpmaddwd`` + ``vpaddd``).

Fixed cost per block, in µs per token (both engines):

* sweep fit: least squares of seconds per token s(L) = a + b*L over the sweep's block
  counts L; fixed cost = b - (active bytes of one block / ceiling), i.e. the slope minus the
  time the block's weight bytes take at the read ceiling;
* on the ``wide`` / ``narrow`` rows: (s - active bytes / ceiling) / blocks, the whole token's
  time beyond its reads spread over the blocks (an upper bound: it includes the head).

``--cpu-target avx2|avx-vnni|avx512`` (``cpu_kernels.targets``' classes haswell, alderlake,
cascadelake) compiles both engines for a narrower x86 class than this CPU's: offload's
processes get that Numba target (``NUMBA_CPU_NAME`` and ``NUMBA_CPU_FEATURES``), llama.cpp's
load its libraries built with ``GGML_NATIVE=OFF`` and the class's flags
(``bench.llama_build``, built once into the cache); the int8 peak is measured with the
target's instructions. The header names the target: such a run measures the instruction
set, not that class's cores or memory system.

The memory-read ceiling is ``bench.cpu_kernels.ceiling_gbps`` with ``-t`` Numba threads over
a 1 GiB buffer, measured before each engine process and once at the end; their median (or
with ``--stat best`` their maximum) is used and their range printed with the load average
(the box may be shared: read the ratios, not the t/s; with a load average above the core
count, two-thread runs of both engines mostly measure scheduling).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter

from bench.cpu_kernels import ceiling_gbps, load_line

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("wide", "narrow", "prefill", "sweep", "v4", "v4-prefill")
DEFAULT_WORKLOADS = WORKLOADS[:4]        # the deepseek4 ones on request (bench.depth_v4)
SWEEP_BLOCKS = (4, 12, 24, 48)
DECODE_PROMPT = 8
FORMAT_VERSION = 1          # bump when the writer changes, so --keep files are rewritten


class BenchError(Exception):
    """Something the run needs is missing: one line, exit 2."""


@dataclass(frozen=True)
class DepthSpec:
    """One random qwen3moe model of the benchmark."""
    n_layer: int = 48
    n_embd: int = 2048
    n_head: int = 32
    n_head_kv: int = 4
    head_dim: int = 128
    n_expert: int = 32
    n_expert_used: int = 8
    n_ff_exp: int = 768
    expert_type: Q = Q.Q4_0
    dense_type: Q = Q.Q8_0          # attention, output, token embedding
    seed: int = 0
    arch = "qwen3moe"

    def write_keys(self, w: GGUFWriter) -> int:
        """qwen3moe's keys and the tiny vocabulary → its size."""
        from tests.tiny_models import add_tiny_vocab
        w.add_block_count(self.n_layer)
        w.add_context_length(4096)
        w.add_embedding_length(self.n_embd)
        w.add_feed_forward_length(self.n_ff_exp)
        w.add_head_count(self.n_head)
        w.add_head_count_kv(self.n_head_kv)
        w.add_key_length(self.head_dim)
        w.add_value_length(self.head_dim)
        w.add_rope_dimension_count(self.head_dim)
        w.add_rope_freq_base(1e6)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_expert_count(self.n_expert)
        w.add_expert_used_count(self.n_expert_used)
        w.add_expert_feed_forward_length(self.n_ff_exp)
        w.add_expert_weights_norm(True)
        return add_tiny_vocab(w)

    def tensors(self, n_vocab: int) -> list[TensorPlan]:
        return tensors(self, n_vocab)

    @property
    def file_name(self) -> str:
        return (f"depth-v{FORMAT_VERSION}-qwen3moe-L{self.n_layer}-d{self.n_embd}-h{self.n_head}x{self.n_head_kv}"
                f"x{self.head_dim}-e{self.n_expert}k{self.n_expert_used}f{self.n_ff_exp}-"
                f"{self.expert_type.name}-{self.dense_type.name}-s{self.seed}.gguf")


WIDE = DepthSpec()
NARROW = DepthSpec(n_embd=512, n_head=4, n_head_kv=1, n_ff_exp=256)


class TensorPlan(NamedTuple):
    name: str                       # GGUF name, as llama.cpp names qwen3moe's tensors
    shape: tuple[int, ...]          # numpy order
    qtype: Q
    std: float                      # of the weight values
    mean: float = 0.0               # norm weights: 1 + 0.1 * N(0, 1)
    value: np.ndarray | None = None  # written as is (deepseek4's I32 routing tables)


def tensors(spec: DepthSpec, n_vocab: int) -> list[TensorPlan]:
    """The model's tensors in file order."""
    d, hd, e, f = spec.n_embd, spec.head_dim, spec.n_expert, spec.n_ff_exp
    qd, kvd, dense, exps = spec.n_head * hd, spec.n_head_kv * hd, spec.dense_type, spec.expert_type
    T = TensorPlan
    out = [T("token_embd.weight", (n_vocab, d), dense, 1.0)]
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        out += [T(p + "attn_norm.weight", (d,), Q.F32, 0.1, 1.0),
                T(p + "attn_q.weight", (qd, d), dense, d ** -0.5),
                T(p + "attn_k.weight", (kvd, d), dense, d ** -0.5),
                T(p + "attn_v.weight", (kvd, d), dense, d ** -0.5),
                T(p + "attn_output.weight", (d, qd), dense, qd ** -0.5),
                T(p + "attn_q_norm.weight", (hd,), Q.F32, 0.1, 1.0),
                T(p + "attn_k_norm.weight", (hd,), Q.F32, 0.1, 1.0),
                T(p + "ffn_norm.weight", (d,), Q.F32, 0.1, 1.0),
                T(p + "ffn_gate_inp.weight", (e, d), Q.F32, d ** -0.5),
                T(p + "ffn_gate_exps.weight", (e, f, d), exps, d ** -0.5),
                T(p + "ffn_up_exps.weight", (e, f, d), exps, d ** -0.5),
                T(p + "ffn_down_exps.weight", (e, d, f), exps, f ** -0.5)]
    out += [T("output_norm.weight", (d,), Q.F32, 0.1, 1.0), T("output.weight", (n_vocab, d), dense, d ** -0.5)]
    return out


# std of the integer code a random block holds: Q4_0 (q - 8), q uniform 0..15; Q8_0 int8.
# K-quants and MXFP4 (sub-block scales and mins are random bytes too): the std of
# gguf's dequantization of cpu_kernels.synth.random_blocks at scale 1, over 1.04 (the spread
# of the random block scales, uniform 0.5..1.5: Q4_0's 4.61 measures 4.83 that way)
_CODE_STD = {Q.Q4_0: 4.61, Q.Q8_0: 73.9, Q.Q4_K: 323.0, Q.Q5_K: 667.0, Q.Q6_K: 1344.0, Q.MXFP4: 11.6}
EXPERT_TYPES = tuple(t.name for t in _CODE_STD)
V4_EXPERT_TYPES = ("MXFP4", "Q4_0", "Q8_0")     # llama.cpp's deepseek4 runs these on a CPU


def _random_data(rng: np.random.Generator, t: TensorPlan) -> np.ndarray:
    from cpu_kernels.synth import reader_shape, set_scales
    if t.value is not None:
        return t.value
    if t.qtype == Q.F32:
        return np.float32(t.mean) + rng.standard_normal(t.shape, dtype=np.float32) * np.float32(t.std)
    rshape = reader_shape(t.qtype, t.shape)
    raw = np.frombuffer(rng.bytes(int(np.prod(rshape))), np.uint8).reshape(rshape).copy()
    set_scales(raw, t.qtype, rng, t.std / _CODE_STD[t.qtype])
    return raw


def write_model(path: Path, spec, *, progress=None) -> Path:
    """Write ``spec`` (a ``DepthSpec``, or ``bench.depth_v4.V4DepthSpec``: its ``arch``,
    ``write_keys(w) → n_vocab`` and ``tensors(n_vocab)``) as a GGUF at ``path`` (through a temp
    file renamed at the end, so a half-written file never has the final name). Streams one
    tensor at a time."""
    from cpu_kernels.synth import reader_shape

    rng = np.random.default_rng(spec.seed)
    tmp = path.with_name(path.name + ".part")
    w = GGUFWriter(str(tmp), spec.arch)
    plan = spec.tensors(spec.write_keys(w))
    for name, shape, qtype, *_ in plan:
        if qtype in (Q.F32, Q.I32):
            dtype = np.dtype(np.float32 if qtype == Q.F32 else np.int32)
            w.add_tensor_info(name, shape, dtype, 4 * int(np.prod(shape)))
        else:
            rshape = reader_shape(qtype, shape)
            w.add_tensor_info(name, rshape, np.dtype(np.uint8), int(np.prod(rshape)), raw_dtype=qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        step = max(1, len(plan) // 8)
        for i, t in enumerate(plan):
            w.write_tensor_data(_random_data(rng, t))
            if progress is not None and (i + 1) % step == 0:
                progress(f"{i + 1}/{len(plan)} tensors")
        w.close()
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def model_bytes(spec, n_vocab: int) -> int:
    """Bytes of tensor data the writer writes (alignment padding aside)."""
    return sum(int(np.prod(t.shape)) // GGML_QUANT_SIZES[t.qtype][0] * GGML_QUANT_SIZES[t.qtype][1]
               for t in spec.tensors(n_vocab))


@dataclass(frozen=True)
class Bytes:
    """What a model's token reads, from its GGUF header."""
    total: int              # every tensor
    active: int             # one decode token: non-expert tensors, one embedding row, k/E of the experts
    active_per_block: float
    n_layer: int
    macs: int = 0           # multiply-adds per token of the blocks' matrices (projections, top-k experts)


def token_bytes(path: Path) -> Bytes:
    from offload.gguf_model import open_model
    from placement.tensors import Role
    m = open_model(path)
    k_of_e = m.spec.n_expert_used / m.spec.n_expert
    total = active = per_block = macs = 0.0
    for t in m.tensors:
        if t.role is Role.EMBEDDING:
            share = 1 / t.shape[0]
        elif t.role is Role.ROUTED_EXPERTS:
            share = k_of_e
        else:
            share = 1.0
        total += t.n_bytes
        active += t.n_bytes * share
        if t.layer is not None:
            per_block += t.n_bytes * share
            if len(t.shape) >= 2:
                macs += float(np.prod(t.shape, dtype=np.float64)) * share
    return Bytes(int(total), int(active), per_block / m.spec.n_layer, m.spec.n_layer, int(macs))


# -- one engine on one model, in its own process ------------------------------------------

def prompt_ids(n: int, n_vocab: int = 256) -> list[int]:
    """Fixed token ids (byte tokens), the same for both engines."""
    return [(7 + 37 * i) % n_vocab for i in range(n)]


def _offload_run(path: str, jobs: list[dict], threads: int, torch_threads: int, ctx: int,
                 prefill_activations: str = "int8", decode_activations: str = "auto") -> list[dict]:
    import torch

    import offload.runtime as rt
    torch.set_num_threads(torch_threads)
    out = []
    with rt.load(path, quiet=True, threads=threads, devices="CPU=64GiB", ctx=ctx,
                 int8_prefill=prefill_activations == "int8", decode_activations=decode_activations) as s:
        s.warmup()
        for job in jobs:
            ids = prompt_ids(job["prompt"])
            tps, tokens = [], []
            for rep in range(job["repeat"] + 1):       # the first pass is the warm-up
                if job["kind"] == "decode":
                    tokens = list(s.generate(ids, max_tokens=job["tokens"] + 1, stop_at_eos=False))
                    value = s.stats.eval_tps
                else:
                    tokens = list(s.generate(ids, max_tokens=1, ubatch=len(ids), stop_at_eos=False))
                    value = s.stats.prompt_tps
                if rep:
                    tps.append(value)
            out.append(dict(tps=tps, tokens=tokens))
    return out


def _llama_run(path: str, jobs: list[dict], threads: int, ctx: int) -> list[dict]:
    import llama_cpp
    batch = max(j["prompt"] for j in jobs)
    llm = llama_cpp.Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                          n_batch=batch, n_ubatch=batch, n_gpu_layers=0, logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()

    def last_token() -> int:
        # greedy from the last position's logits (without logits_all, Llama.scores is not filled)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))))
    out = []
    for job in jobs:
        ids = prompt_ids(job["prompt"])
        tps = []
        for rep in range(job["repeat"] + 1):           # the first pass is the warm-up
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            prompt_s = time.perf_counter() - t0
            tokens = [last_token()]
            if job["kind"] == "decode":
                t0 = time.perf_counter()
                for _ in range(job["tokens"]):
                    llm.eval([tokens[-1]])
                    tokens.append(last_token())
                value = job["tokens"] / (time.perf_counter() - t0)
            else:
                value = len(ids) / prompt_s
            if rep:
                tps.append(value)
        out.append(dict(tps=tps, tokens=tokens))
    return out


def run_one(engine: str, path: Path, jobs: list[dict], args, progress, ceilings: list[float]
            ) -> list[dict] | str:
    """Run ``jobs`` on ``path`` with ``engine`` in a fresh process: per job {"tps": timed t/s,
    "tokens": greedy ids of the last pass}, or a one-line reason it failed. Appends the read
    ceiling measured just before it."""
    _read_through(path)
    ceilings.append(measure_ceiling(args.threads))     # next to each process, while the box is as it is
    cmd = [sys.executable, "-m", "bench.depth", "--one", engine, str(path), json.dumps(jobs),
           "-t", str(args.threads), "--torch-threads", str(args.torch_threads),
           "--prefill-activations", args.prefill_activations, "--decode-activations", args.decode_activations]
    progress(f"{engine} on {path.name}: {', '.join(j['kind'] for j in jobs)}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_child_env(engine, args.envs))
    if r.returncode:
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else ""
        sig = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        progress(f"  {engine} failed ({sig}): {why}")
        return f"{sig}: {why}"[:200]
    progress(f"  done in {time.perf_counter() - t0:.0f} s")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _child_env(engine: str, envs=None) -> dict:
    """Each engine's process as its users run it: OpenMP's default wait policy for both
    (``offload.commands.run.runtime_process_settings``); under PASSIVE llama.cpp's two-thread
    decode of the narrow model measured 18 t/s against 139 t/s by default on an idle box
    here, offload's 46 vs 104 (their threads sleep and wake at every barrier). A user's
    ``OMP_WAIT_POLICY`` is passed on to both. ``envs`` (``bench.llama_build.TargetEnvs``): the
    ``--cpu-target``'s Numba target for offload, its llama.cpp build for llama.cpp."""
    env = dict(os.environ)
    if envs is not None:
        env.update(envs.offload if engine == "offload" else envs.llama)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _read_through(path: Path) -> None:
    """Read the file once so it sits in the page cache: neither engine pays disk reads."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 << 20)
        while f.readinto(buf):
            pass


def _one_main(engine: str, path: str, jobs_json: str, threads: int, torch_threads: int,
              prefill_activations: str, decode_activations: str) -> int:
    jobs = json.loads(jobs_json)
    ctx = max(j["prompt"] + j.get("tokens", 0) for j in jobs) + 16
    if engine == "offload":
        out = _offload_run(path, jobs, threads, torch_threads, ctx, prefill_activations, decode_activations)
    elif engine == "llama.cpp":
        out = _llama_run(path, jobs, threads, ctx)
    else:
        raise SystemExit(f"bench.depth: unknown engine {engine!r}")
    print(json.dumps(out))
    return 0


# -- the run ------------------------------------------------------------------------------

@dataclass
class Row:
    workload: str
    kind: str                   # decode | prefill
    blocks: int
    bytes: Bytes
    offload: list[float] | str | None = None     # timed t/s, or why it failed, or None (not run)
    llama: list[float] | str | None = None
    offload_tokens: list[int] = field(default_factory=list)    # greedy ids of the last pass
    llama_tokens: list[int] = field(default_factory=list)
    in_sweep: bool = False                       # a point of the block-count fit


STATS = {"median": statistics.median, "best": max}     # how passes (t/s) and ceilings are summarised


def summary(v, stat: str = "median") -> float | None:
    """The passes' t/s (or ceilings) summarised by ``stat``; None where it did not run or failed."""
    return STATS[stat](v) if isinstance(v, list) and v else None


def fixed_per_block(tps: float | None, b: Bytes, ceiling: float) -> float | None:
    """µs per block of a decode token's time beyond its reads at the ceiling."""
    if not tps:
        return None
    return (1 / tps - b.active / (ceiling * 1e9)) / b.n_layer * 1e6


def sweep_fit(rows: list[Row], engine: str, ceiling: float, stat: str = "median") -> tuple[float, float] | None:
    """(slope µs per block, fixed cost µs per block) from the sweep rows, or None."""
    pts = [(r.blocks, 1 / t) for r in rows if (t := summary(getattr(r, engine), stat)) is not None]
    if len(pts) < 2:
        return None
    blocks, secs = np.array(pts, float).T
    slope = np.polyfit(blocks, secs, 1)[0]
    read = rows[-1].bytes.active_per_block / (ceiling * 1e9)
    return slope * 1e6, (slope - read) * 1e6


def _fmt(v, spec=".2f", width=8) -> str:
    return f"{v:{width}{spec}}" if isinstance(v, (int, float)) else f"{'-' if v is None else 'fail':>{width}}"


def print_table(rows: list[Row], ceiling: float, fits: dict, stat: str = "median",
                int8_peak: float | None = None) -> None:
    print(f"\n{'workload':<16} {'offload t/s':>11} {'llama t/s':>10} {'ratio':>6} {'MB/token':>9} "
          f"{'off GB/s':>8} {'/ceil':>6} {'llama GB/s':>10} {'/ceil':>6} {'limit t/s':>9} "
          f"{'off µs/blk':>10} {'llama µs/blk':>12}")
    for r in rows:
        o, ll = summary(r.offload, stat), summary(r.llama, stat)
        ratio = o / ll if o and ll else None
        if r.kind == "decode":
            mb, limit = r.bytes.active / 1e6, ceiling * 1e9 / r.bytes.active
            gb = lambda t: t * r.bytes.active / 1e9 if t else None                  # noqa: E731
            fo, fl = fixed_per_block(o, r.bytes, ceiling), fixed_per_block(ll, r.bytes, ceiling)
        else:           # the whole model once per prompt batch
            n = r.blocks
            mb, limit = r.bytes.total / 1e6, None
            gb = lambda t: t / n * r.bytes.total / 1e9 if t else None               # noqa: E731
            fo = fl = None
        go, gl = gb(o), gb(ll)
        print(f"{r.workload:<16} {_fmt(o, '.2f', 11)} {_fmt(ll, '.2f', 10)} {_fmt(ratio, '.2f', 6)} "
              f"{mb:9.1f} {_fmt(go, '.2f', 8)} {_fmt(go and go / ceiling, '.2f', 6)} {_fmt(gl, '.2f', 10)} "
              f"{_fmt(gl and gl / ceiling, '.2f', 6)} {_fmt(limit, '.1f', 9)} {_fmt(fo, '.0f', 10)} "
              f"{_fmt(fl, '.0f', 12)}")
    for r in rows:
        if r.kind == "prefill" and r.bytes.macs:
            cells = []
            for engine, attr in (("offload", "offload"), ("llama.cpp", "llama")):
                t = summary(getattr(r, attr), stat)
                if t:
                    gops = 2 * r.bytes.macs * t / 1e9
                    share = f", {gops / int8_peak:.2f} of the int8 peak" if int8_peak else ""
                    cells.append(f"{engine} {gops:.0f} GOP/s{share}")
            if cells:
                peak = (f"int8 peak {int8_peak:.0f} GOP/s measured here (-t threads x 8 independent dot-product "
                        "chains of the target's instructions)" if int8_peak else "no integer dot product: no int8 peak")
                print(f"{r.workload}: the blocks' matrices {2 * r.bytes.macs / 1e9:.2f} GOP a token; "
                      + "; ".join(cells) + f" ({peak})")
    for engine, fit in fits.items():
        if fit is not None:
            slope, fixed = fit
            print(f"sweep fit ({engine}): {slope:.0f} µs per block per token; minus the block's reads at the "
                  f"ceiling = fixed cost {fixed:.0f} µs per block")
    same = [f"{r.workload} {agreement(r.offload_tokens, r.llama_tokens)}" for r in rows
            if r.kind == "decode" and r.offload_tokens and r.llama_tokens]
    if same:
        print("greedy tokens equal to llama.cpp's (it quantizes activations to 8 bits, so late divergence "
              "is expected): " + "; ".join(same))
    for r in rows:
        for engine in ("offload", "llama"):
            v = getattr(r, engine)
            if isinstance(v, str):
                print(f"{r.workload}: {engine} failed: {v}")


def agreement(ours: list[int], ref: list[int]) -> str:
    """'n/m' tokens equal, position by position."""
    return f"{sum(a == b for a, b in zip(ours, ref))}/{min(len(ours), len(ref))}"


def measure_ceiling(threads: int) -> float:
    import cpu_kernels as ck
    ck.set_num_threads(threads)
    buf = np.ones(1 << 30, np.uint8)        # touched pages: a zero page would read from cache
    try:
        return ceiling_gbps(buf, 5)
    finally:
        del buf


def _int8_peak(threads: int, envs) -> float | None:
    """``bench.cpu_kernels.int8_peak_gops`` in a process compiled for the run's CPU target
    (the target's own dot-product instructions); None where it has no int8 path."""
    code = ("import cpu_kernels as ck; from bench.cpu_kernels import int8_peak_gops; "
            f"ck.set_num_threads({threads}); print(int8_peak_gops({threads}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env=_child_env("offload", envs))
    out = r.stdout.strip().splitlines()
    if r.returncode or not out or out[-1] == "None":
        return None
    return float(out[-1])


def _llama_available() -> str | None:
    """None if llama-cpp-python imports, else the reason."""
    r = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True)
    if r.returncode:
        lines = r.stderr.strip().splitlines()
        return lines[-1] if lines else f"exit {r.returncode}"
    return None


def main(argv=None) -> int:
    from offload.commands.run import DECODE_ACTIVATIONS, PREFILL_ACTIVATIONS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(DEFAULT_WORKLOADS),
                    help=f"comma list of {', '.join(WORKLOADS)} (default {','.join(DEFAULT_WORKLOADS)})")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--torch-threads", type=int, default=1, help="offload's torch threads (default 1, as offload run)")
    ap.add_argument("--prefill-activations", choices=PREFILL_ACTIVATIONS, default="int8",
                    help="offload's activations for prompt batches, as offload run's flag (default int8)")
    ap.add_argument("--decode-activations", choices=DECODE_ACTIVATIONS, default="auto",
                    help="offload's routed-expert activations for decode batches, as offload run's flag (default auto)")
    ap.add_argument("--expert-type", choices=EXPERT_TYPES, default=WIDE.expert_type.name,
                    help=f"quant type of the qwen3moe models' expert tensors (default {WIDE.expert_type.name}; "
                         "another type writes other files)")
    ap.add_argument("--v4-expert-type", choices=V4_EXPERT_TYPES, default="MXFP4",
                    help="quant type of the deepseek4 model's expert tensors (default MXFP4, as V4-Flash ships)")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per pass (default 32)")
    ap.add_argument("--prompt", type=int, default=256, help="prefill prompt tokens (default 256)")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes per workload and process (default 3)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="processes per engine and model, alternating engines (default 1)")
    ap.add_argument("--stat", choices=tuple(STATS), default="median",
                    help="summary of the rounds x repeat passes and of the ceilings: median (default), or "
                         "best (fastest pass, highest ceiling: on a busy shared box contention only adds time)")
    ap.add_argument("--cpu-target", default="native",
                    help="compile both engines for another x86 class this CPU can run: avx2 (haswell), avx-vnni "
                         "(alderlake), avx512 (cascadelake), or native (default); llama.cpp is built for it once "
                         "(bench.llama_build, about 2 minutes) and cached")
    ap.add_argument("--keep", type=Path, default=None, help="write / reuse the model files in DIR")
    ap.add_argument("--no-llama", action="store_true", help="offload only, even if llama-cpp-python is installed")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--one", nargs=3, metavar=("ENGINE", "MODEL", "JOBS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        return _one_main(*a.one, a.threads, a.torch_threads, a.prefill_activations, a.decode_activations)
    only = [w.strip() for w in a.only.split(",") if w.strip()]
    bad = [w for w in only if w not in WORKLOADS]
    if bad or not only:
        print(f"bench.depth: --only takes {', '.join(WORKLOADS)}, got {a.only!r}", file=sys.stderr)
        return 2
    for name, v in (("--threads", a.threads), ("--torch-threads", a.torch_threads), ("--tokens", a.tokens),
                    ("--prompt", a.prompt), ("--repeat", a.repeat), ("--rounds", a.rounds)):
        if v < 1:
            print(f"bench.depth: {name} must be >= 1, got {v}", file=sys.stderr)
            return 2

    def progress(msg: str) -> None:
        print(f"[depth {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    llama_why = "--no-llama" if a.no_llama else _llama_available()
    if llama_why:
        progress(f"llama.cpp column left empty (llama-cpp-python: {llama_why})")
    from bench.llama_build import target_envs
    try:
        a.envs = target_envs(a.cpu_target, llama_why is None, log=lambda m: progress(f"llama.cpp build: {m}"))
    except ValueError as e:
        print(f"bench.depth: --cpu-target: {e}", file=sys.stderr)
        return 2
    progress(a.envs.header)
    tmp = None
    try:
        if a.keep is not None:
            a.keep.mkdir(parents=True, exist_ok=True)
            folder = a.keep
        else:
            tmp = tempfile.TemporaryDirectory(prefix="offload-depth-")
            folder = Path(tmp.name)
        return _run(a, only, folder, llama_why is None, progress)
    except (BenchError, OSError) as exc:
        print(f"bench.depth: {exc}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            tmp.cleanup()


def _model(folder: Path, spec, progress) -> Path:
    from tests.tiny_models import tiny_vocab
    path = folder / spec.file_name
    if path.exists():
        return path
    need = model_bytes(spec, len(tiny_vocab()[0]))
    free = shutil.disk_usage(folder).free
    if free < need * 1.05:
        raise BenchError(f"{folder} has {free / 1e9:.1f} GB free, {path.name} needs {need / 1e9:.1f} GB")
    progress(f"writing {path.name} ({need / 1e9:.2f} GB)")
    t0 = time.perf_counter()
    write_model(path, spec, progress=lambda m: progress(f"  {m}"))
    progress(f"  written in {time.perf_counter() - t0:.0f} s")
    return path


def _run(a, only, folder: Path, with_llama: bool, progress) -> int:
    progress(f"{load_line()}; models in {folder}")
    ceilings: list[float] = []
    decode = dict(kind="decode", prompt=DECODE_PROMPT, tokens=a.tokens, repeat=a.repeat)
    prefill = dict(kind="prefill", prompt=a.prompt, repeat=a.repeat)
    # per model: [(workload label, job)], run together in one process per engine
    work: list[tuple[DepthSpec, list[tuple[str, dict]]]] = []
    wide, narrow = (replace(s, expert_type=Q[a.expert_type]) for s in (WIDE, NARROW))
    if "wide" in only or "prefill" in only:
        jobs = ([("decode wide", decode)] if "wide" in only else []) + \
               ([(f"prefill {a.prompt} wide", prefill)] if "prefill" in only else [])
        work.append((wide, jobs))
    if "narrow" in only or "sweep" in only:
        work.append((narrow, [("decode narrow" if "narrow" in only else "sweep 48 blocks", decode)]))
    if "sweep" in only:
        work += [(replace(narrow, n_layer=n), [(f"sweep {n} blocks", decode)])
                 for n in SWEEP_BLOCKS if n != NARROW.n_layer]
    v4 = None
    if "v4" in only or "v4-prefill" in only:
        from bench.depth_v4 import V4
        v4 = replace(V4, expert_type=Q[a.v4_expert_type])
        work.append((v4, ([("v4 decode", decode)] if "v4" in only else []) +
                     ([(f"v4 prefill {a.prompt}", prefill)] if "v4-prefill" in only else [])))
    rows: list[Row] = []
    for spec, jobs in work:
        path = _model(folder, spec, progress)
        b = token_bytes(path)
        job_rows = [Row(label, job["kind"], spec.n_layer if job["kind"] == "decode" else a.prompt, b,
                        in_sweep="sweep" in only and spec.arch == NARROW.arch and spec.n_embd == NARROW.n_embd)
                    for label, job in jobs]
        engines = [("offload", "offload")] + ([("llama.cpp", "llama")] if with_llama else [])
        for _ in range(a.rounds):          # engines alternate, so a change in the box's load hits both
            for engine, attr in engines:
                if any(isinstance(getattr(r, attr), str) for r in job_rows):
                    continue                                    # failed in an earlier round
                res = run_one(engine, path, [j for _, j in jobs], a, progress, ceilings)
                progress(f"  read ceiling measured before it: {ceilings[-1]:.1f} GB/s")
                for i, row in enumerate(job_rows):
                    if isinstance(res, str):
                        setattr(row, attr, res)
                        continue
                    setattr(row, attr, (getattr(row, attr) or []) + res[i]["tps"])
                    setattr(row, f"{attr}_tokens", res[i]["tokens"])
        rows += job_rows
    ceilings.append(measure_ceiling(a.threads))
    ceiling = summary(ceilings, a.stat)
    sweep = sorted((r for r in rows if r.in_sweep), key=lambda r: r.blocks)
    fits = {e: sweep_fit(sweep, attr, ceiling, a.stat) for e, attr in (("offload", "offload"), ("llama.cpp", "llama"))}
    print(f"bench.depth: qwen3moe random weights, {NARROW.n_expert} experts top-{NARROW.n_expert_used}, "
          f"{a.expert_type} experts, {NARROW.dense_type.name} attention; threads -t {a.threads} "
          f"(offload torch {a.torch_threads}); decode {a.tokens} tokens after {DECODE_PROMPT} (offload's "
          f"routed-expert activations {a.decode_activations}), prefill {a.prompt} (offload's activations "
          f"{a.prefill_activations}); {a.stat} of {a.rounds} x {a.repeat} passes")
    print(a.envs.header)
    if v4 is not None:
        print(f"v4 rows: {v4.describe()}")
    print(f"memory-read ceiling (-t {a.threads}): {ceiling:.2f} GB/s, {a.stat} of {len(ceilings)} "
          f"measured before each process and at the end (min {min(ceilings):.2f}, max {max(ceilings):.2f}); "
          f"{load_line()}")
    sweep_only = sorted((r for r in rows if r.workload.startswith("sweep")), key=lambda r: r.blocks)
    rows = [r for r in rows if not r.workload.startswith("sweep")] + sweep_only
    int8_peak = _int8_peak(a.threads, a.envs) if any(r.kind == "prefill" for r in rows) else None
    print_table(rows, ceiling, fits, a.stat, int8_peak)
    if a.json:
        doc = dict(cpu_target=a.envs.name, target_header=a.envs.header,
                   ceiling_gbps=ceiling, ceilings=ceilings, int8_peak_gops=int8_peak,
                   threads=a.threads, torch_threads=a.torch_threads, tokens=a.tokens, prompt=a.prompt,
                   prefill_activations=a.prefill_activations, decode_activations=a.decode_activations,
                   expert_type=a.expert_type,
                   repeat=a.repeat, rounds=a.rounds, stat=a.stat, load=load_line(),
                   rows=[dict(asdict(r), offload_tps=summary(r.offload, a.stat),
                             llama_tps=summary(r.llama, a.stat))
                         for r in rows],
                   fits={e: (None if f is None else dict(slope_us=f[0], fixed_us=f[1])) for e, f in fits.items()})
        tmp = a.json.with_name(a.json.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
