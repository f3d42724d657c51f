"""The planner's compute model (placement.compute) against what the runtime really allocates.

1. One GPU-resident projection (gpu.linear.Linear over raw GGUF bytes on torch's CPU
   device, the way a --virtual-gpus device runs): the torch allocator's peak, from the
   profiler's allocation events, is bounded by ``placement.compute.projection`` — for every
   quant type with a torch dequantizer — and the bound is tight. Likewise the CPU embedding
   lookup (gguf's numpy dequantize, traced by tracemalloc) and ``cpu_lookup_bytes``.
2. A whole run, with the allocator as ``offload run`` sets it (``offload.host_memory``): a tiny
   model is loaded — RSS grows by at least the host's planned weights — and runs a prompt of a
   full ubatch; the peak RSS above the loaded state stays under the planner's KV + compute of
   the host (the CPU and the virtual GPUs) for the same plan. An upper-bound check: it is
   memory, not time. What loading adds beyond the weights (the tokenizer, parsed header,
   Python objects) is no plan's business and is left out by measuring from the loaded state.
3. ``offload.host_memory.return_freed_memory`` really gives freed blocks back (glibc's
   default, the control, keeps them); ``placement`` imports neither torch, numba nor offload.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch.profiler import ProfilerActivity, profile

from gpu.linear import Linear
from gpu.quant import DEQUANTIZERS, QuantTensor
from offload.cpu_ops import RawEmbedding
from placement.compute import Devices, cpu_lookup_bytes, projection
from placement.devices import CPU
from placement.tensors import Role, TensorInfo
from tests.subprocess_env import bare_env
from tests.tiny_models import ARCHS as WRITTEN_ARCHS
from tests.tiny_models import TinySpec, random_tensor, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def torch_peak(fn) -> int:
    """Peak bytes live in torch's CPU allocator while ``fn`` runs (allocations made inside)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        if e.device_type() == torch.autograd.DeviceType.CPU:
            live += e.nbytes()
            peak = max(peak, live)
    return peak


TYPES = [Q.F16, *DEQUANTIZERS]


@pytest.mark.parametrize("qtype", TYPES, ids=[t.name for t in TYPES])
def test_projection_bound_matches_torch_allocations(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 512, 1024
    raw, raw_dtype, _ = random_tensor(rng, (rows, cols), qtype, 0.02)
    data = torch.from_numpy(np.ascontiguousarray(raw) if raw_dtype is None else raw.view(np.uint8).copy())
    lin = Linear(QuantTensor(data, qtype, (rows, cols)), compute_dtype=torch.float32)
    info = TensorInfo("blk.0.attn_q.weight", (rows, cols), qtype, data.numel(), 0, Role.ATTENTION)
    kinds = Devices("auto", host_backed=("CUDA0",))      # torch on the CPU: f32 compute
    for n in (1, 64):
        x = torch.randn(n, cols)
        measured = torch_peak(lambda: lin(x))
        planned = projection(info, "CUDA0", "CUDA0", n, kinds)["CUDA0"]
        assert measured <= planned, (qtype.name, n, measured, planned)
        # tight: the planner's per-type scratch (DEQUANT_BYTES) is the dequantizer's own peak
        # rounded up to 1/8 B per value, and it adds the (n, rows) output to the scratch's
        # peak rather than to the dequantized matrix's (which outlives the scratch): ≤ 3.5%
        assert measured >= 0.965 * planned, (qtype.name, n, measured, planned)


@pytest.mark.parametrize("t,n_keys,window,cache", [(1, 300, 0, torch.float16), (64, 300, 16, torch.float16),
                                                  (600, 4096, 0, torch.float32), (600, 4096, 128, torch.bfloat16)])
def test_sink_attention_bound_matches_torch_allocations(t, n_keys, window, cache):
    """gpu.attention.attend_with_sinks (gpt-oss) against ``sink_attention_bytes``: decode,
    a prompt chunk with a window, and 600 queries over 4,096 keys (chunked: 512 queries at a
    time) — bounded. Measured/planned here: 0.97, 0.75, 0.85, 0.95 — the bound counts the mask
    as with a window (int64 distances) and a q-chunk copy beside the product, which
    torch does not always make; so "tight" is 0.7 here, looser than the projections'."""
    from gpu.attention import attend_with_sinks
    from placement.compute import sink_attention_bytes
    n_head, n_kv, d = 8, 2, 64
    g = torch.Generator().manual_seed(t)
    q = torch.randn(t, n_head, d, generator=g)
    keys = torch.randn(n_kv, n_keys, d, generator=g).to(cache)
    values = torch.randn(n_kv, n_keys, d, generator=g).to(cache)
    sinks = torch.randn(n_head, generator=g)
    measured = torch_peak(lambda: attend_with_sinks(q, keys, values, sinks, window=window))
    planned = sink_attention_bytes(t, n_keys, n_head, n_head * d, 2 * n_kv * d, keys.element_size())
    assert measured <= planned, (measured, planned)
    assert measured >= 0.7 * planned, (measured, planned)


@pytest.mark.parametrize("qtype", [Q.F32, *TYPES], ids=[t.name for t in [Q.F32, *TYPES]])
def test_cpu_embedding_lookup_bound_matches_numpy_allocations(qtype):
    """offload.cpu_ops.RawEmbedding (gathered raw rows → gguf.quants.dequantize in numpy):
    its peak, from tracemalloc (numpy reports its buffers there), is bounded by
    ``placement.compute.cpu_lookup_bytes`` for one token, a group of 16–31 rows, and a
    ubatch."""
    rng = np.random.default_rng(100 + int(qtype))
    n_vocab, cols = 64, 2048
    raw, _, _ = random_tensor(rng, (n_vocab, cols), qtype, 0.02)
    raw = np.ascontiguousarray(raw)
    lookup = RawEmbedding(raw, qtype, cols)
    info = TensorInfo("token_embd.weight", (n_vocab, cols), qtype, raw.nbytes, None, Role.EMBEDDING)
    for n in (1, 20, 47, 512):
        ids = torch.from_numpy(rng.integers(0, n_vocab, n))
        tracemalloc.start()
        try:
            lookup(ids)
            measured = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        planned = cpu_lookup_bytes(info, n)
        # + the objects of the call (array headers, the list of group results: ≤ 10 KiB,
        # whatever n), which no plan counts
        assert measured <= planned + 16 * 1024, (qtype.name, n, measured, planned)
        if n == 512:
            # tight at a ubatch: the group scratch is one bound for all types (12 B/value vs
            # 4–11.5 measured) on ≤ 31 of the 512 rows, a few % of the whole
            assert measured >= 0.9 * planned, (qtype.name, n, measured, planned)


def traced_peak(fn) -> int:
    """Peak bytes numpy allocated while ``fn`` ran (numpy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# Q4_K (int8 activations from INT8_FROM tokens) and F16 (float only) by default; Q8_0 and MXFP4,
# two more int8 types of the same bound, are the full tier
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.F16, *(pytest.param(t, marks=pytest.mark.full) for t in (Q.Q8_0, Q.MXFP4))],
                         ids=lambda t: t.name)
def test_cpu_projection_bound_matches_numpy_allocations(qtype):
    """offload.cpu_ops.RawLinear (cpu_kernels.matmul) as the runtime builds it, int8
    activations from INT8_FROM tokens: its numpy peak (tracemalloc) equals
    ``placement.compute.projection``'s CPU bytes up to the call's own objects — the result
    and the sums of 16 for decode batches and float types, the quantized activations
    (codes, scales, partial sums) and the GEMM's packed copy of them
    (``placement.limits.gemm_packed_bytes``) for prompt batches of quantized types. (The
    kernels' per-thread scratch — for the GEMM four decoded rows, ``gemm8.thread_scratch_bytes``
    — is allowed for beside the call's objects; no plan counts it.)"""
    from cpu_kernels.simd8 import has_int8_dot
    from offload.cpu_ops import RawLinear
    from cpu_kernels import settings
    from cpu_kernels.gemm8 import thread_scratch_bytes
    from placement.limits import DECODE_TOKENS, INT8_FROM
    rng = np.random.default_rng(200 + int(qtype))
    rows, cols = 256, 2048
    raw, raw_dtype, _ = random_tensor(rng, (rows, cols), qtype, 0.02)
    raw = np.ascontiguousarray(raw) if raw_dtype is None else raw.view(np.uint8).copy()
    lin = RawLinear(raw, qtype, name="blk.0.attn_q.weight", int8_batch=INT8_FROM)
    info = TensorInfo("blk.0.attn_q.weight", (rows, cols), qtype, raw.nbytes, 0, Role.ATTENTION)
    kinds = Devices("auto", ())
    for n in (1, DECODE_TOKENS, INT8_FROM, 512):
        x = torch.randn(n, cols)
        lin(x)                                  # compiled before tracing
        measured = traced_peak(lambda: lin(x))
        planned = projection(info, CPU, CPU, n, kinds)[CPU]
        scratch = settings.apply_threads() * thread_scratch_bytes(cols) if n > DECODE_TOKENS else 0
        print(qtype.name, n, measured, planned)
        assert measured <= planned + scratch + 16 * 1024, (qtype.name, n, measured, planned)   # + the call's objects
        if has_int8_dot() or not kinds.int8(n, (qtype,)):
            assert measured >= planned, (qtype.name, n, measured, planned)


def test_int8_activation_terms_are_the_kernels():
    """The planner's int8 terms restate cpu_kernels facts; held to them here: the bytes
    ``quantized_activations`` allocates and the types with an int8 decoder. (The batch from
    which the runtime asks for int8 and the types decoding with int8 under
    ``--decode-activations auto`` are placement.limits', which both import.)"""
    from cpu_kernels.matmul import quantized_activations
    from cpu_kernels.registry import get_kernel
    from placement import compute
    from placement.limits import FLOAT_ACTIVATION_TYPES
    for n, cols in ((1, 32), (3, 256), (17, 2048), (5, 768)):
        arrays = quantized_activations(np.ones((n, cols), np.float32))
        assert sum(a.nbytes for a in arrays) == compute.int8_activation_bytes(n, cols), (n, cols)
    known = [t for t in Q if t in DEQUANTIZERS or t in (Q.F32, Q.F16, Q.BF16)]
    assert {t for t in known if not get_kernel(t).has_int8} == FLOAT_ACTIVATION_TYPES


def test_placement_imports_neither_torch_numba_nor_offload():
    code = ("import sys, placement.plan, placement.fit, placement.report, placement.plan_file, "
            "placement.compute, placement.footprint, placement.cost, placement.cost_fit, placement.routing, "
            "placement.hot_experts, placement.planner, placement.speculative, placement.op_offload, placement.limits\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numba', 'offload', 'gpu', "
            "'cpu_kernels'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


PROBE = r"""
import ctypes, gc, json, sys
from dataclasses import replace
from pathlib import Path
from offload.host_memory import return_freed_memory
assert return_freed_memory()            # as offload run does, before torch loads
import torch
import offload.runtime as rt
from offload.gguf_model import open_model
from placement.plan import host_footprint, replan
torch.set_num_threads(1)

def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

path, plan = sys.argv[1], json.loads(sys.argv[2])
ids = [1 + (i * 37) % 250 for i in range(plan["ubatch"])]
def run(loaded=None):
    with rt.load(path, virtual_gpus=True, quiet=True, **plan) as s:
        if loaded is not None:
            loaded.append(rss("VmRSS"))
        s.warmup()
        list(s.generate(ids, max_tokens=8, stop_at_eos=False))
        return s
# a first pass sets up what a process keeps once (Numba kernels, torch's and MKL's buffers)
run()
gc.collect()
ctypes.CDLL(None).malloc_trim(0)
before = rss("VmRSS")
loaded = []
Path("/proc/self/clear_refs").write_text("5")
s = run(loaded)
peak = rss("VmHWM")
model = open_model(path)
host_plan = replan(s.plan, model, replace(s.plan.settings, host_backed=tuple(s.devices.virtual)))
host = host_footprint(host_plan, model)
print(json.dumps({"before": before, "loaded": loaded[0], "peak": peak, "weights": host.weights_bytes,
                  "kv": host.kv_bytes, "compute": host.compute_bytes}))
"""

PLANS = {
    "all-cpu": dict(devices="CPU=16GiB"),
    "experts-cpu+CUDA0": dict(devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True),
    "CUDA0+CUDA1+CPU": dict(devices="CUDA0=8GiB,CUDA1=8GiB,CPU=16GiB", tensor_split="1,1", n_cpu_moe=2),
}


WIDE = dict(n_embd=512, n_head=8, n_ff=1024, n_expert=16, n_expert_used=4, n_ff_exp=256, seed=31)
ARCHS = {
    "glm4moe": TinySpec(**WIDE, n_head_kv=2, head_dim=64, n_rot=32),
    # MLA with the latent cache: 8 heads of 64 + 32 dims, a 128-wide latent
    "deepseek2": TinySpec(**WIDE, arch="deepseek2", q_lora_rank=128, kv_lora_rank=128, qk_nope=64,
                          n_rot=32, v_head_dim=64, n_group=4, n_group_used=2, yarn_factor=4.0),
    # the older attn_kv_b layout: full per-head keys and values, unfused attention
    "deepseek2-kv_b": TinySpec(**WIDE, arch="deepseek2", q_lora_rank=0, kv_lora_rank=128, qk_nope=64,
                               n_rot=32, v_head_dim=64, mla=False, gating="softmax"),
    # sinks (explicit attention), a 64-token window on the even blocks, biased swiglu_oai experts
    "gpt-oss": TinySpec(**WIDE, arch="gpt-oss", n_head_kv=2, head_dim=64, window=64, yarn_factor=4.0),
    "qwen3moe": TinySpec(**WIDE, arch="qwen3moe", nextn=False, n_head_kv=2, head_dim=64, n_rot=32),
    # four residual streams; window-only, CSA (with its indexer) and HCA blocks; hash routing
    "deepseek4": TinySpec(**WIDE, arch="deepseek4", head_dim=64, n_layer=4, compress_ratios=(0, 4, 128, 4),
                          n_hash=1, window=16, rms_eps=1e-6, yarn_factor=4.0, yarn_orig_ctx=64, swiglu_limit=2.0),
}


def test_every_architecture_has_a_case():
    """Compute bytes = the plan for every architecture the tiny-model writer knows."""
    assert {s.arch for s in ARCHS.values()} == set(WRITTEN_ARCHS)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
# all-CPU and the three-device plan (CPU experts, two virtual GPUs) for every architecture by
# default; the single-GPU plan in between, and qwen3moe's plans beyond all-CPU (glm4moe's
# blocks without the shared experts and NextN), are the full tier
@pytest.mark.parametrize("plan,arch", [
    pytest.param(p, a, marks=pytest.mark.full) if p == "experts-cpu+CUDA0" or (a == "qwen3moe" and p != "all-cpu")
    else (p, a) for a in ARCHS for p in PLANS], ids=lambda v: v)
def test_peak_rss_growth_stays_under_the_host_estimate(tmp_path, plan, arch):
    spec = ARCHS[arch]
    tiny = write_tiny_model(tmp_path / "tiny.gguf", spec)
    options = dict(PLANS[plan], ctx=512, ubatch=448)
    env = bare_env(OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([sys.executable, "-c", PROBE, str(tiny.path), json.dumps(options)],
                         cwd=ROOT, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    load, run = r["loaded"] - r["before"], r["peak"] - r["loaded"]
    print(f"{plan}: RSS +{mib(load)} at load (weights planned {mib(r['weights'])}), "
          f"+{mib(run)} more at the run's peak (KV {mib(r['kv'])} + compute {mib(r['compute'])} planned)")
    # the measurement sees the load: the host's weights (mapped and made resident, or
    # uploaded to a virtual GPU) are in RSS
    assert load >= r["weights"]
    assert run <= r["kv"] + r["compute"]


FREED = r"""
import json, sys
import numpy as np
from offload.host_memory import return_freed_memory
fixed = return_freed_memory() if sys.argv[1] == "fixed" else False

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

n = 4 << 20
a = np.ones(n, np.uint8); del a        # glibc's dynamic threshold rises past 4 MiB here
b = np.ones(n, np.uint8)               # ... so this block comes from the heap
held = rss(); del b
print(json.dumps({"fixed": fixed, "returned": held - rss(), "n": n}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_return_freed_memory_gives_freed_blocks_back():
    """With offload.host_memory's fixed mmap threshold a freed 4 MiB block leaves RSS; under
    glibc's default (the control) the same block stays resident in the heap; a user's own
    MALLOC_MMAP_THRESHOLD_ is left alone."""
    def probe(mode, **env):
        out = subprocess.run([sys.executable, "-c", FREED, mode], cwd=ROOT, capture_output=True, text=True,
                             env=bare_env(**env), check=True)
        return json.loads(out.stdout)
    fixed, default = probe("fixed"), probe("default")
    assert fixed["fixed"] and fixed["returned"] >= 0.9 * fixed["n"]
    assert default["returned"] < 0.1 * default["n"]
    assert not probe("fixed", MALLOC_MMAP_THRESHOLD_="65536")["fixed"]


@pytest.mark.parametrize("t,n_keys,k_type,v_type", [(1, 2000, Q.Q8_0, Q.Q8_0), (64, 1000, Q.Q4_0, Q.Q4_0),
                                                    (600, 4096, Q.Q8_0, Q.IQ4_NL)])
def test_tiled_attention_bound_matches_torch_allocations(t, n_keys, k_type, v_type):
    """gpu.attention.attend_tiles (a quantized KV cache) against ``tiled_attention_bytes``:
    decode over one tile, a prompt chunk, 600 queries over two tiles of 4,096 keys with K and V
    of different types. Bounded, and tight (measured/planned 0.92, 0.98, 0.97 here: the bound
    counts the raw tile's copy for every tile and the index vectors of the mask beside it)."""
    from gpu.attention import attend_tiles
    from gpu.kv_cache import KVCache
    from placement.compute import tiled_attention_bytes
    n_head, n_kv, d = 8, 2, 64
    g = torch.Generator().manual_seed(t)
    cache = KVCache(n_kv, d, device=torch.device("cpu"), dtype=k_type, dtype_v=v_type, capacity=n_keys)
    keys, values = cache.append(torch.randn(n_kv, n_keys, d, generator=g), torch.randn(n_kv, n_keys, d, generator=g))
    q = torch.randn(t, n_head, d, generator=g)
    measured = torch_peak(lambda: attend_tiles(q, keys, values))
    planned = tiled_attention_bytes(t, n_keys, n_head, n_kv, d, d, k_type, v_type)
    print(f"tiled attention: measured/planned {measured / planned:.3f}")
    assert measured <= planned, (measured, planned)
    assert measured >= 0.85 * planned, (measured, planned)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL], ids=lambda t: t.name)
def test_kv_append_quantize_bound_matches_torch_allocations(qtype):
    """gpu.quantize on appended rows (K as attention passes it: (H_kv, T, D), not contiguous)
    against QUANTIZE_BYTES: bounded and within 2% (the table is the measurement rounded up)."""
    from gpu.quantize import quantize
    from placement.compute import QUANTIZE_BYTES
    x = torch.randn(512, 2, 128, generator=torch.Generator().manual_seed(0)).transpose(0, 1)
    measured = torch_peak(lambda: quantize(x, qtype))
    planned = x.numel() * QUANTIZE_BYTES[qtype]
    assert 0.98 * planned <= measured <= planned, (measured, planned)
