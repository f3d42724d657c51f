"""offload's compute buffers: what one forward pass of a ubatch allocates, device by device.

The runtime (``offload.runtime`` over ``gpu/`` and ``cpu_kernels``) allocates no graph
buffer up front: torch, numpy and the Numba kernels allocate each activation when it is
computed and free it when the last reference goes (and with ``offload.host_memory``'s fixed
mmap threshold, freed blocks leave RSS). So the compute buffer of a device is the **largest
number of bytes live on it at any moment of one forward pass** of ``T = ubatch`` tokens
attending to ``L = ctx`` keys (the last prompt chunk of a full context; decoding, T = 1,
needs less). The CPU experts' worker thread counts at the moments it runs (beside the
shared expert), like any other allocation on the CPU.

The pass is modelled as the code runs it: the embedding lookup, each block's attention and
FFN, the output layer — each a list of *moments*, a moment being the bytes live on each
device at one point (what the code holds there, in exact products of the shapes it
allocates; the methods below cite the code). ``compute(device)`` = the largest moment on
it; devices sharing one memory (the CPU and GPUs backed by host RAM) peak together, so their
joint compute is the largest moment of their sum.

Device kinds: ``CPU`` runs CPU-resident matrices and experts in Numba (float32 results,
nothing dequantized) and its blocks' attention in torch on the CPU; a GPU device keeps raw
GGUF bytes and dequantizes each matrix per call, at most ``CHUNK_VALUES`` values at a time,
into its compute dtype ``c`` (the dequantizer's temporaries: ``DEQUANT_BYTES`` per value); a
GPU device in ``MemorySettings.host_backed`` (``--virtual-gpus``) is torch on the CPU: ``c``
= f32 under ``gpu_dtype="auto"``, and attention upcasts the cache to float32 as on the CPU.
CUDA attention is assumed to run torch's memory-efficient kernel (the bool mask becomes a
bias in the cache dtype); that branch is not measured here (no CUDA on the development box).

Prompt batches on the CPU: the runtime's default (``offload.runtime.load``'s
``int8_prefill``) gives the Numba kernels int8 activations for batches of more than
``DECODE_TOKENS`` tokens, so a CPU matrix or MoE layer fed ``n ≥ INT8_FROM``
rows of a quantized type holds ``int8_activation_bytes`` for them (codes, scales and the
partial sums ``cpu_kernels.matmul.quantized_activations`` makes) instead of the float path's
16-value sums. Counted whenever the runtime asks for int8; the float path (a CPU without
VNNI, or ``--prefill-activations float``) holds less. These sizes, type sets and the request
rule (``int8_request``, ``wants_int8``) are ``placement.limits``', which the runtime imports too.

DeepSeek-V4 (``deepseek4``; ../shared/deepseek4.md §2) is walked from its math, since its
runtime model is being written beside this count (``ForwardModel.dsv4_block``): an
approximation, stated term by term, not yet held to measured allocations. What it counts:

* the hidden state between blocks is (T, hc_mult, n_embd) float32 — hc_mult (4) times the
  rows of other models — held as each block's residual and on the previous block's home;
* around each sublayer a hyper-connection: X's square beside the (T, (2+hc)·hc) mixing
  projection (float32), the broadcast pre·X into y (T, E); after it X' = post ⊗ f(y) + comb·X
  (two X-sized products and their sum beside the old X);
* attention: q LoRA (qr kept), q (T, H·D) with its per-head RMS and RoPE temporaries, the
  shared K=V row appended to the window ring; on compressed blocks the compressor's kv and
  gate projections and five (T, coff·D) temporaries of its softmax pooling; on CSA blocks the
  indexer (its own compressor at 2·128, qI (T, 64·128), head weights, the scores over every
  ``ceil(ctx/4)`` key ``c`` queries at a time as the sink attention chunks them, two
  (c, heads, keys) products, the (T, keys) scores and the top-k); attention with sinks
  (``sink_attention_bytes``) over L = window cells + compressed entries (HCA: every
  ``ceil(ctx/128)`` entry; CSA: every ``ceil(ctx/4)`` entry masked to the top-k, with the
  (T, entries) bool mask and float bias — a runtime that gathers the top-k rows per query
  instead would hold T·top_k·D values: 512 MiB at T = 512, not counted); the window and the
  entries concatenated in the cache type; the inverse RoPE, attn_output_a over the groups
  (its (T, groups·o_lora) result), attn_output_b;
* the MoE as for other models (the hash blocks' ``ffn_gate_tid2eid`` is a lookup, not a
  matrix; the SwiGLU clamp's temporaries are not counted);
* the hc head where the output is: the state moved there, its square and the (T, hc)
  mixing, then output_norm and the last row's logits; an MTP block's glue per stream:
  enorm(embed) broadcast, hnorm of each stream, the (T, hc, 2E) concatenation, eh_proj over
  T·hc rows.

Decode/verify batches (at most ``DECODE_TOKENS``) on the CPU routed experts: by default
(``--decode-activations auto``) the kernels take int8 activations where the experts' types
are in ``DECODE_INT8_TYPES`` (per phase, as ``cpu_kernels.moe.moe_ffn``: gate·up when gate
and up both are, down when down is), counted the same way. The compiled block and the
hybrid hand-off quantize into scratch bound at load (not part of a pass); the reference
``moe_ffn`` allocates it per call, which this counts.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from placement.devices import CPU
from placement.limits import (CHUNK_VALUES, DECODE_TOKENS, DX_PAD, FLOAT_ACTIVATION_TYPES, INT8_FROM, S4_PAD,
                              SCORE_VALUES, XQ_PAD, gemm_lanes, gemm_packed_bytes, int8_request, kv_tile_cells,
                              staging_buffer_bytes, wants_int8)
from placement.tensors import ModelSpec, Role, TensorInfo

Moment = dict[str, int]     # bytes live on each device at one point of the pass

F32 = 4
INT64 = 8
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
ROUTING_BYTES = 64          # moe_ffn / group_by_expert index arrays, per (token, expert) pair
                            # (flat, tok, order, first: int64; weights f32; keep bool; ≤ 53 B)

# Peak bytes per value while gpu.quant dequantizes raw blocks (its float32 intermediates and
# float32 result; a conversion to f16/bf16 afterwards stays below it). From the code, e.g.
# Q8_0: int8 copy → float (4) × f16 scale → product (4) + per-block scale = 8.125; Q6_K keeps
# ql/qh unpacked, the 6-bit values, scales and the product alive. Checked against the torch
# profiler for every type in tests/runtime/test_memory_runtime.py.
DEQUANT_BYTES: dict[Q, float] = {
    Q.BF16: 8.0, Q.Q8_0: 8.125, Q.Q4_0: 8.125, Q.Q4_1: 8.125, Q.Q5_0: 8.125, Q.Q5_1: 8.125,
    Q.IQ4_NL: 13.125, Q.MXFP4: 13.125, Q.Q2_K: 12.8125, Q.Q3_K: 13.5, Q.Q4_K: 12.375,
    Q.Q5_K: 13.375, Q.Q6_K: 18.375, Q.IQ4_XS: 13.625,
    # lattice types: int64 grid indices, gathered float32 grid rows, ±1 signs, products
    Q.IQ2_XXS: 13.75, Q.IQ2_XS: 17.375, Q.IQ2_S: 17.375, Q.IQ3_XXS: 16.5, Q.IQ3_S: 18.25,
    Q.IQ1_S: 9.5625, Q.IQ1_M: 11.5,
}
# gguf.quants.dequantize (numpy), which the CPU embedding lookup runs on the gathered rows,
# works over groups of 16–31 rows (_apply_over_grouped_rows): a float32 result per group, all
# kept until they are concatenated into the float32 output, and one group's temporaries at a
# time — at most NUMPY_GROUP_SCRATCH bytes per value (the largest of gguf's dequantizers,
# Q5_K's, is 11.5; the lattice types' grid gathers take more, with a fixed part that shows
# for a single row: NUMPY_GROUP_SCRATCH_OF; checked for every type in
# tests/runtime/test_memory_runtime.py).
NUMPY_GROUP_ROWS = 31
NUMPY_GROUP_SCRATCH = 12
NUMPY_GROUP_SCRATCH_OF: dict[Q, float] = {
    Q.IQ2_XXS: 17, Q.IQ2_XS: 17, Q.IQ2_S: 17, Q.IQ3_XXS: 17, Q.IQ3_S: 17, Q.IQ1_S: 13, Q.IQ1_M: 13,
}


def int8_activation_bytes(n: int, cols: int) -> int:
    """cpu_kernels.matmul.quantized_activations of ``n`` rows of ``cols`` values: int8
    codes xq (cols + XQ_PAD), per 32 a float32 scale dx (+ DX_PAD), per 16 the sum bsums,
    per 4 the sum xs4 and its scale dx8 (+ S4_PAD each): about 3.4·cols + 256 bytes a row."""
    return n * (cols + XQ_PAD + F32 * (cols // 32 + DX_PAD + cols // 16 + 2 * (cols // 4 + S4_PAD)))


def cpu_input_bytes(n: int, cols: int, int8: bool, packed: bool = True) -> int:
    """What a CPU kernel (``cpu_kernels.matmul`` / ``moe_ffn``) derives from ``n`` rows of
    its input before multiplying: int8 activations, or the float path's 16-value sums
    (cpu_kernels.layout.bsums_of); with ``packed``, a prompt batch's int8 activations packed
    into GEMM tiles as well (``cpu_kernels.matmul``; the routed experts count theirs per
    assignment)."""
    if not int8:
        return n * (cols // 16) * F32
    tiles = gemm_packed_bytes(gemm_lanes(n), cols) if packed and n > DECODE_TOKENS else 0
    return int8_activation_bytes(n, cols) + tiles


def cpu_lookup_bytes(embd: TensorInfo, n: int) -> int:
    """Peak bytes of offload.cpu_ops.RawEmbedding looking up ``n`` rows of ``embd``: the
    gathered raw rows, then (unless F32, used as gathered) gguf's numpy dequantization."""
    cols = embd.shape[-1]
    raw = n * embd.n_bytes // embd.shape[0]
    if embd.ggml_type == Q.F32:
        return raw
    if embd.ggml_type == Q.F16:
        return raw + n * cols * F32                                # .astype(float32)
    scratch = NUMPY_GROUP_SCRATCH_OF.get(embd.ggml_type, NUMPY_GROUP_SCRATCH)
    return raw + 2 * n * cols * F32 + int(min(n, NUMPY_GROUP_ROWS) * cols * scratch)


def dequant_bytes_per_value(qtype: Q, dtype: str) -> float:
    """Scratch per value of a GPU matrix dequantized into ``dtype`` (0: used as stored)."""
    if qtype == Q.F32:
        return 0.0 if dtype == "f32" else DTYPE_BYTES[dtype]
    if qtype == Q.F16:
        return 0.0 if dtype == "f16" else DTYPE_BYTES[dtype]
    return max(DEQUANT_BYTES.get(qtype, 0.0), F32 + DTYPE_BYTES[dtype])


class Devices:
    """What kind each device is: the CPU, a CUDA GPU, or a GPU backed by host RAM; and from
    which batch the CPU kernels take int8 activations (None: never)."""

    def __init__(self, gpu_dtype: str, host_backed: Iterable[str], int8_from: int | None = INT8_FROM,
                 decode: str = "auto"):
        """``decode``: the routed experts' decode activations ("auto", "int8", "float"), as the
        runtime's ``decode_activations``."""
        self.gpu_dtype = gpu_dtype
        self.host_backed = frozenset(host_backed)
        self.int8_from = int8_from
        self.decode = decode

    def int8(self, n: int, types: Iterable[Q], routed: bool = False) -> bool:
        """Whether a CPU kernel over weights of ``types`` called for a batch of ``n`` tokens
        uses int8 activations (placement.limits.int8_request and wants_int8, as the runtime asks;
        FLOAT_ACTIVATION_TYPES have no int8 decoder; a VNNI CPU assumed); ``routed``: the routed
        experts, whose decode batches follow ``decode``."""
        request = int8_request(n, self.int8_from, self.decode if routed else None)
        return bool(request) and all(wants_int8(request, t) and t not in FLOAT_ACTIVATION_TYPES for t in types)

    def torch_cpu(self, dev: str) -> bool:
        return dev == CPU or dev in self.host_backed

    def dtype(self, dev: str) -> str:
        """Compute dtype of GPU-resident weights (offload.runtime.compute_dtypes)."""
        if self.gpu_dtype != "auto":
            return self.gpu_dtype
        return "f32" if self.torch_cpu(dev) else "bf16"


def _mat(t: TensorInfo) -> tuple[int, int]:
    """(rows, cols) of one projection: a 2-D tensor, or one expert of a stacked one."""
    return t.shape[-2], t.shape[-1]


def projection(t: TensorInfo, dev: str, home: str, n: int, kinds: Devices, *,
               bias: bool = False, f32: bool = False) -> Moment:
    """Peak bytes per device while ``n`` tokens go through the matrix ``t`` on ``dev``,
    called from ``home``, *including* its float32 result on ``home``.

    CPU (offload.cpu_ops.RawLinear → cpu_kernels.matmul): bsums of the input (n·cols/16)
    or its int8 activations (``cpu_input_bytes``), the result Y (n·rows), and a host copy of
    the input when home is elsewhere.
    GPU (gpu.linear.Linear → QuantTensor.linear): the input moved to ``dev`` and cast to c;
    the dequantized chunk (``min(rows, CHUNK_VALUES // cols)`` rows × cols values × the
    type's scratch); the output (n·rows·c) and, when chunked, one chunk's output; then the
    float32 copy (c ≠ f32) and ``+ bias`` (a new tensor); the result moved home.
    """
    rows, cols = _mat(t)
    if dev == CPU:
        derived = cpu_input_bytes(n, cols, kinds.int8(n, (t.ggml_type,)))
        if home == CPU:
            return {CPU: derived + n * rows * F32}
        return {CPU: derived + n * (cols + rows) * F32, home: n * rows * F32}
    dtype = "f32" if f32 else kinds.dtype(dev)
    c = DTYPE_BYTES[dtype]
    x_in = (n * cols * F32 if dev != home else 0) + (n * cols * c if c != F32 else 0)
    per_value = dequant_bytes_per_value(t.ggml_type, dtype)
    if per_value:
        chunk = min(rows, max(1, CHUNK_VALUES // cols))
        linear = chunk * cols * per_value + n * rows * c + (n * chunk * c if chunk < rows else 0)
    else:
        linear = n * rows * c
    y = n * rows * F32
    after = (n * rows * c if c != F32 else 0) + y + (y if bias else 0)   # .float(), + bias
    if dev == home:
        return {dev: int(x_in + max(linear, after))}
    return {dev: int(x_in + max(linear, after)), home: y}


def sink_attention_bytes(T: int, L: int, H: int, Qw: int, KVw: int, cache_bytes: float) -> int:
    """gpu.attention.attend_with_sinks's peak, c queries at a time: the cache upcast to
    float32 (unless it is), q's head-major copy and the (T, H·D) output throughout; per chunk
    the (H, c, L) scores, the chunk's mask (int64 distances and three bool arrays) and index
    vectors, the q chunk and its product, the row maxima and sums."""
    f = F32
    c = max(1, min(T, SCORE_VALUES // max(1, H * L)))
    upcast = 0 if cache_bytes == F32 else L * KVw * f
    return (upcast + 2 * T * Qw * f + H * c * L * f + c * L * (INT64 + 3) + (c + L) * INT64
            + 2 * c * Qw * f + 2 * H * c * f)


# Peak bytes per value while gpu.quantize quantizes appended KV rows (a quantized cache):
# the float copy, its block views, the scale and code temporaries and the packed result;
# measured with the torch profiler (tests/runtime/test_memory_runtime.py), rounded up.
QUANTIZE_BYTES: dict[Q, float] = {Q.Q8_0: 24.25, Q.Q4_0: 14.25, Q.Q4_1: 14.5, Q.Q5_0: 28.25, Q.Q5_1: 28.5,
                                  Q.IQ4_NL: 36.5}


def append_bytes(T: int, k_width: int, v_width: int, k_type: Q, v_type: Q, cache_bytes: float) -> int:
    """KVCache.append of T rows: K then V encoded into the cache's format one after the other,
    each quantized (QUANTIZE_BYTES) or cast (``cache_bytes`` per value) while the other is not."""
    enc = lambda t, w: T * w * QUANTIZE_BYTES.get(t, cache_bytes)   # noqa: E731
    return int(max(enc(k_type, k_width), enc(v_type, v_width)))


def tiled_attention_bytes(T: int, L: int, H: int, Hkv: int, Dk: int, Dv: int, k_type: Q, v_type: Q, *,
                          shared: bool = False) -> int:
    """gpu.attention.attend_tiles's peak (attention over a quantized KV cache): q's head-major
    copy, the running output and softmax state and the (T, L) bool mask throughout; per tile
    of c cells (``kv_tile_cells``) the K tile's dequantization (its raw cells copied, as they
    are not contiguous across heads), then the V tile's beside it, then both tiles beside the
    (H, T, c) scores and the tile's inverted mask; at the end the normalised output beside the
    running one. ``shared``: V is K's tile (MLA's latent). A float V (-ctv f16) is one float32
    copy per value."""
    f = F32
    c = min(L, kv_tile_cells(H, Hkv, T, max(Dk, Dv)))

    def tile(t: Q, width: int) -> int:      # raw copy + dequantizer scratch and result
        block, size = GGML_QUANT_SIZES[t]
        return int(c * Hkv * width * (size / block + DEQUANT_BYTES.get(t, f)))

    fixed = T * H * (Dk + Dv + 2) * f + T * L + (T + L) * INT64
    tiles = c * Hkv * (Dk + (0 if shared else Dv)) * f
    loop = max(tile(k_type, Dk), 0 if shared else c * Hkv * Dk * f + tile(v_type, Dv),
               tiles + H * T * c * f + 2 * T * c)
    return fixed + max(loop, T * H * Dv * f)


def _plus(*parts: Moment) -> Moment:
    out: Moment = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0) + v
    return out


@dataclass
class BlockTensors:
    """One block's tensors by job (GGUF names), each with its device."""

    attn: dict[str, TensorInfo]           # "attn_q" → tensor (2-D matrices only)
    heads: dict[str, TensorInfo]          # per-head stacks (H, out, in): MLA's "attn_k_b", "attn_v_b"
    attn_bias: set[str]
    q_norm: bool
    sinks: bool                           # attn_sinks (gpt-oss): attention computed explicitly
    expert_bias: bool                     # ffn_*_exps.bias (gpt-oss): gate/up run unfused
    router: TensorInfo | None
    experts: list[TensorInfo]             # ffn_{gate,up,gate_up,down}_exps
    shared: dict[str, TensorInfo]         # "gate"/"up"/"down" of the shared expert
    dense: dict[str, TensorInfo]          # "gate"/"up"/"down" of the dense FFN
    nextn: dict[str, TensorInfo]          # "eh_proj", "shared_head_head", "embed_tokens"

    @classmethod
    def of(cls, tensors: Iterable[TensorInfo]) -> "BlockTensors":
        b = cls({}, {}, set(), False, False, False, None, [], {}, {}, {})
        for t in tensors:
            # "blk.3.attn_q.weight" → "attn_q"; "blk.2.indexer.attn_q_b.weight" → "indexer.attn_q_b"
            kind = t.name.split(".", 2)[2].rsplit(".", 1)[0] if t.name.count(".") >= 3 else ""
            if t.role is Role.ATTENTION and len(t.shape) == 2:
                b.attn[kind] = t
            elif t.role is Role.ATTENTION and len(t.shape) == 3:
                b.heads[kind] = t
            elif t.role is Role.ATTENTION and t.name.endswith(".bias"):
                b.attn_bias.add(kind)
            elif t.name.endswith("attn_q_norm.weight"):
                b.q_norm = True
            elif t.name.endswith("attn_sinks.weight"):
                b.sinks = True
            elif t.role is Role.ROUTED_EXPERTS and t.name.endswith(".bias"):
                b.expert_bias = True
            elif t.role is Role.ROUTER and len(t.shape) == 2 and kind == "ffn_gate_inp":
                b.router = t              # (deepseek4's ffn_gate_tid2eid is a lookup table, not a matrix)
            elif t.role is Role.ROUTED_EXPERTS and len(t.shape) == 3:
                b.experts.append(t)
            elif t.role is Role.SHARED_EXPERTS and len(t.shape) == 2:
                b.shared[kind.removeprefix("ffn_").removesuffix("_shexp")] = t
            elif t.role is Role.DENSE_FFN and len(t.shape) == 2:
                b.dense[kind.removeprefix("ffn_")] = t
            elif t.role is Role.NEXTN and len(t.shape) == 2:
                b.nextn[t.name.split(".")[3]] = t
        return b


class ForwardModel:
    """The moments of one forward pass of a model (see the module docstring). Methods take
    ``device_of(tensor) → device`` (the placement) and return lists of moments."""

    def __init__(self, spec: ModelSpec, tensors: Sequence[TensorInfo], T: int, L: int,
                 cache_bytes: float, kinds: Devices, kv_block_bytes: Callable[[int], int],
                 kv_cells: Callable[[int], int] | None = None, dsv4_cache: Callable[[int], Any] | None = None,
                 tiled_cache: tuple[Q, Q] | None = None):
        self.spec, self.kinds = spec, kinds
        # (K type, V type) of a quantized cache: attention reads it in tiles (attend_tiles)
        self.tiled_cache = tiled_cache
        self.T, self.L, self.kvb = T, L, cache_bytes
        self.kv_block_bytes = kv_block_bytes
        self.kv_cells = kv_cells
        self.dsv4_cache = dsv4_cache      # deepseek4: placement.memory.dsv4_cache at these settings
        # the hidden state between blocks: (T, hc_mult, n_embd) float32 with hyper-connections
        # (deepseek4's residual streams), else (T, n_embd)
        self.streams = max(1, spec.hc_mult)
        self.state = T * self.streams * spec.n_embd * F32
        by_block: dict[int, list[TensorInfo]] = defaultdict(list)
        self.globals: dict[str, TensorInfo] = {}
        for t in tensors:
            if t.layer is None:
                self.globals[t.name] = t
            else:
                by_block[t.layer].append(t)
        self.block_tensors = dict(by_block)
        self.blocks = {i: BlockTensors.of(ts) for i, ts in by_block.items()}
        # a block computes with its largest attention tensor (placement.memory.attention_device)
        self.anchor = {i: max((t for t in ts if t.role is Role.ATTENTION), key=lambda t: t.n_bytes)
                       for i, ts in by_block.items() if any(t.role is Role.ATTENTION for t in ts)}

    # -- helpers ------------------------------------------------------------------------
    def home(self, block: int, device_of) -> str | None:
        """Where a block computes: with its largest attention tensor (placement.memory)."""
        anchor = self.anchor.get(block)
        return device_of(anchor) if anchor is not None else None

    def _proj(self, t: TensorInfo | None, home: str, n: int, device_of, **kw) -> Moment:
        return {} if t is None else projection(t, device_of(t), home, n, self.kinds, **kw)

    # -- moments ------------------------------------------------------------------------
    # Each method returns the moments of one part of the pass: the bytes live on
    # each device at that moment (the caller adds what it holds meanwhile).

    def embedding(self, embd: TensorInfo, dev: str) -> list[Moment]:
        """offload.cpu_ops.RawEmbedding (CPU: gathered rows + numpy dequantize) or
        gpu.linear.Embedding (gathered raw rows + torch dequantize to float32)."""
        T, E = self.T, self.spec.n_embd
        if dev == CPU:
            return [{dev: cpu_lookup_bytes(embd, T)}]
        rows = T * embd.n_bytes // max(1, embd.shape[0])
        return [{dev: int(rows + T * E * max(F32, dequant_bytes_per_value(embd.ggml_type, "f32")))}]

    def attention(self, i: int, b: BlockTensors, h: str, device_of) -> list[Moment]:
        """gpu.attention.Attention on home ``h`` after attn_norm; x and n1 live throughout."""
        if "attn_kv_a_mqa" in b.attn:
            return self.latent_attention(i, b, h, device_of)
        s, T, L = self.spec, self.T, self.L
        if self.kv_cells is not None:       # a sliding-window cache holds at most its cells
            L = min(L, self.kv_cells(i))
        H, Dk, Dv, Hkv = s.n_head, s.head_dim_k, s.head_dim_v, s.n_head_kv[i]
        Qw, Kw, Vw = H * Dk, Hkv * Dk, Hkv * Dv
        f = F32
        te = T * s.n_embd * f
        base = {h: 2 * te}                             # x, attn_norm(x)
        proj = lambda name: self._proj(b.attn.get(name), h, T, device_of,  # noqa: E731
                                       bias=name in b.attn_bias)
        q, k, v = ({h: T * w * f} for w in (Qw, Kw, Vw))
        qkv = _plus(base, q, k, v)
        moments = [{h: 3 * te},                        # x + RMSNorm's float copy and result
                   _plus(base, proj("attn_q")),
                   _plus(base, q, proj("attn_k")),
                   _plus(base, q, k, proj("attn_v"))]
        # other attention matrices (MLA's low-rank pairs, …: architectures offload does not
        # run yet) — bounded as one more projection beside q, k, v
        moments += [_plus(qkv, proj(name)) for name in b.attn
                    if name not in ("attn_q", "attn_k", "attn_v", "attn_output")]
        if b.q_norm:                                            # RMSNorm over (T, H, D): copy + result
            moments.append(_plus(qkv, {h: 2 * T * Qw * f}))
        # NeoX rope of q (gpu.rope.Rope: x·C + x[perm]·S): x·C, x[perm] and x[perm]·S live
        # at once (then x·C, x[perm]·S and their sum), beside the old q; plus the (T, 1, D)
        # factor rows C and S, kept for the whole pass (one per positions tensor): from here
        # on they sit beside every step of the attention
        rows = {h: 2 * T * Dk * f}
        moments.append(_plus(qkv, rows, {h: 3 * T * Qw * f}))
        qkv = _plus(qkv, rows)
        # KVCache.append: k, v cast to the cache dtype; growing storage holds the old copy too
        append = (int(T * (Kw + Vw) * self.kvb) if self.tiled_cache is None
                  else append_bytes(T, Kw, Vw, *self.tiled_cache, self.kvb))
        moments.append(_plus(qkv, {h: append + self.kv_block_bytes(i) // 2}))
        mask = T * L + (T + L) * INT64                          # bool (T, L) mask + its index vectors
        if self.tiled_cache is not None:                        # quantized: tiles, mask inside
            sdpa = tiled_attention_bytes(T, L, H, Hkv, Dk, Dv, *self.tiled_cache)
            after = 2 * T * Qw * f
            mask = 0
        elif b.sinks:
            sdpa = sink_attention_bytes(T, L, H, Qw, Kw + Vw, self.kvb)
            after = 2 * T * Qw * f                              # the output + its (T, H·D) copy
        elif self.kinds.torch_cpu(h):
            # CPU SDPA (flash kernel): the bool mask as a float (T, L) bias; a non-f32 cache
            # upcast to float32 for the product (K and V of L keys); output (T, H·D)
            sdpa = mask + T * L * f + (0 if self.kvb == F32 else L * (Kw + Vw) * f) + T * Qw * f
            after = mask + 2 * T * Qw * f                       # SDPA output + its (T, H·D) copy
        else:
            # CUDA: q cast to the cache dtype; the mask as a bias in that dtype; output in it
            sdpa = mask + int(T * Qw * self.kvb * 2 + T * L * self.kvb)
            after = mask + int(T * Qw * self.kvb) + T * Qw * (f + int(self.kvb))
        mask = 0 if b.sinks or self.tiled_cache is not None else mask
        moments += [_plus(qkv, {h: sdpa}), _plus(qkv, {h: after}),
                    _plus(qkv, {h: mask + T * Qw * f}, proj("attn_output")),
                    {h: 3 * te}]                       # x, attn output, x + attn → h
        return moments

    def per_head(self, t: TensorInfo | None, h: str, device_of) -> Moment:
        """offload.weights.WeightStore.per_head (gpu.linear.HeadLinear) over T tokens, with its
        (T, H, out) float32 result on ``h``: the whole stack dequantized (into c; float32 on
        the CPU, from the mapped bytes), the input moved and cast, the einsum output in c and
        its float32 copy."""
        if t is None:
            return {}
        T, f = self.T, F32
        n_head, rows, cols = t.shape
        dev = device_of(t)
        dtype = "f32" if dev == CPU else self.kinds.dtype(dev)
        c = DTYPE_BYTES[dtype]
        w = int(n_head * rows * cols * max(dequant_bytes_per_value(t.ggml_type, dtype), c))
        x_in = (T * n_head * cols * f if dev != h else 0) + (T * n_head * cols * c if c != F32 else 0)
        y = T * n_head * rows * f
        here = x_in + w + T * n_head * rows * c + (y if c != F32 else 0)
        return {dev: here} if dev == h else {dev: here, h: y}

    def latent_attention(self, i: int, b: BlockTensors, h: str, device_of) -> list[Moment]:
        """gpu.mla.LatentAttention on home ``h`` after attn_norm (x and n1 live throughout);
        every named intermediate of its ``__call__`` stays referenced until it returns.
        Absorbed (attn_k_b/attn_v_b): MQA over the latent rows, keys and values one tensor
        (torch's fused kernel). Expanded (attn_kv_b): per-head keys/values of different widths,
        which torch's CPU attention computes unfused: scores, weights and a key copy, bounded
        by 3·H·T·L + H·L·Dk values."""
        s, T, L, f = self.spec, self.T, self.L, F32
        H, R, C = s.n_head, s.n_rot, s.kv_lora_rank
        absorbed = s.is_mla
        Dq = s.head_dim_k_mla if absorbed else s.head_dim_k
        Dv = s.head_dim_v_mla if absorbed else s.head_dim_v
        N = Dq - R
        te = T * s.n_embd * f
        proj = lambda name: self._proj(b.attn.get(name), h, T, device_of)  # noqa: E731
        live = {h: 2 * te}                                      # x, attn_norm(x)
        moments = [{h: 3 * te}]
        if "attn_q_a" in b.attn:                                # q_b(norm(q_a(x)))
            ql = T * b.attn["attn_q_a"].shape[0] * f
            moments += [_plus(live, proj("attn_q_a")), _plus(live, {h: 3 * ql}),
                        _plus(live, {h: ql}, proj("attn_q_b"))]
        else:
            moments.append(_plus(live, proj("attn_q")))
        live = _plus(live, {h: T * H * Dq * f})                 # q
        moments.append(_plus(live, {h: 3 * T * H * R * f}))     # rope of q_pe: x·C, x[perm], ·S
        live = _plus(live, {h: T * H * R * f})                  # q_pe
        moments.append(_plus(live, proj("attn_kv_a_mqa")))
        live = _plus(live, {h: T * (C + R) * f})                # ckv
        moments.append(_plus(live, {h: 3 * T * C * f}))         # kv_a_norm: float copy, result
        live = _plus(live, {h: T * (C + 3 * R) * f})            # c, k_pe (+ its rope temporaries)
        mask = T * L + (T + L) * INT64 if T > 1 else 0
        upcast = 0 if self.kvb == F32 else f                    # CPU attention upcasts the cache
        grow = self.kv_block_bytes(i) // 2                      # KVCache storage doubling
        if absorbed:
            row = T * (C + R)
            append = (int(row * self.kvb) if self.tiled_cache is None
                      else append_bytes(T, C + R, 0, *self.tiled_cache, self.kvb))
            moments.append(_plus(live, {h: row * f + append + grow}))    # cat + append
            moments.append(_plus(live, self.per_head(b.heads.get("attn_k_b"), h, device_of)))
            live = _plus(live, {h: T * H * C * f})              # q_lat
            qcat = T * H * (C + R) * f
            sdpa = mask + (T * L * f if T > 1 else 0) + 2 * L * (C + R) * upcast + qcat
            if self.tiled_cache is not None:
                sdpa = tiled_attention_bytes(T, L, H, 1, C + R, C + R, *self.tiled_cache, shared=True) + qcat
            moments.append(_plus(live, {h: qcat + sdpa}))
            live = _plus(live, {h: qcat})                       # the attention output (T, H, C + R)
            moments.append(_plus(live, self.per_head(b.heads.get("attn_v_b"), h, device_of)))
            live = _plus(live, {h: T * H * Dv * f})
        else:
            moments.append(_plus(live, proj("attn_kv_b")))
            live = _plus(live, {h: T * H * (N + Dv) * f})       # kv
            k = T * H * Dq * f
            append = (int(T * H * (Dq + Dv) * self.kvb) if self.tiled_cache is None
                      else append_bytes(T, H * Dq, H * Dv, *self.tiled_cache, self.kvb))
            moments.append(_plus(live, {h: k + append + grow}))
            live = _plus(live, {h: k + T * H * Dq * f})         # k, the cat'd query
            sdpa = (mask + T * L * f + 3 * H * T * L * f + H * L * Dq * f
                    + H * L * (Dq + Dv) * upcast + T * H * Dv * f)
            if self.tiled_cache is not None:
                sdpa = tiled_attention_bytes(T, L, H, H, Dq, Dv, *self.tiled_cache)
            moments.append(_plus(live, {h: sdpa}))
            live = _plus(live, {h: T * H * Dv * f})
        moments += [_plus(live, {h: T * H * Dv * f}, proj("attn_output")),   # reshape copy + o
                    {h: 3 * te}]
        return moments

    def swiglu(self, mats: Mapping[str, TensorInfo], h: str, device_of) -> list[Moment]:
        """gpu.ffn.SwiGLU: down(silu(gate(x)) * up(x)) over ``mats`` (n_ff wide); ends with
        its (T, E) output on ``h``."""
        T, f = self.T, F32
        gate, up, down = mats.get("gate"), mats.get("up"), mats.get("down")
        if gate is None or up is None or down is None:
            return []
        tf = T * gate.shape[0] * f
        return [self._proj(gate, h, T, device_of),
                {h: 2 * tf},                           # g, silu(g)
                _plus({h: tf}, self._proj(up, h, T, device_of)),
                {h: 3 * tf},                           # silu(g), u, product
                _plus({h: tf}, self._proj(down, h, T, device_of))]

    def routed(self, b: BlockTensors, h: str, device_of) -> tuple[list[Moment], bool]:
        """The routed experts' moments, and whether they run in the CPU worker thread
        (concurrently with the shared expert). They end with the (T, E) sum on ``h``
        (the CPU worker's result array stays referenced until it is added)."""
        s, T, f = self.spec, self.T, F32
        E, k = s.n_embd, max(1, s.n_expert_used)
        A, n_ff = T * k, s.n_ff_exp
        te = T * E * f
        devs = {device_of(t) for t in b.experts}
        if devs == {CPU}:
            # cpu_kernels.moe_ffn in the worker thread: Y (T, E), H (A, n_ff), out (A, E),
            # what the kernels derive from X (T rows) and H (A rows): bsums, or int8
            # activations (a prompt batch, or a decode batch of DECODE_INT8_TYPES); the routing index arrays;
            # the main thread made host copies of x/ids/weights first when home is a GPU
            int8_in = self.kinds.int8(T, [t.ggml_type for t in b.experts if "down" not in t.name], routed=True)
            int8_h = self.kinds.int8(T, [t.ggml_type for t in b.experts if "down" in t.name], routed=True)
            # a prompt batch's GEMM packs X per assignment (A rows in up to n_expert tiles
            # padded), then H alike: one after the other, so the larger of the two
            lanes = gemm_lanes(A, s.n_expert)
            gemm_x = gemm_packed_bytes(lanes, E) if int8_in and T > DECODE_TOKENS else 0
            gemm_h = gemm_packed_bytes(lanes, n_ff) if int8_h and T > DECODE_TOKENS else 0
            worker = (te + A * n_ff * f + A * E * f + cpu_input_bytes(T, E, int8_in, packed=False)
                      + cpu_input_bytes(A, n_ff, int8_h, packed=False) + max(gemm_x, gemm_h) + A * ROUTING_BYTES)
            if b.expert_bias:   # moe_ffn's _biased_glu: X per assignment (+ what it derives and packs), g, u,
                # σ's temporary
                worker = max(worker, te + A * E * f + cpu_input_bytes(A, E, int8_in, packed=False) + gemm_x
                             + 3 * A * n_ff * f + A * ROUTING_BYTES)
            copies = {CPU: te + T * k * (INT64 + f)} if h != CPU else {}
            moved = {h: te} if h != CPU else {}        # Y moved home (a view on the CPU)
            return [_plus(copies, {CPU: worker}), _plus({CPU: te}, moved)], True
        if len(devs) == 1:
            # gpu.experts.TorchExperts on g: gathered inputs xs and outputs ys (A, E) in c, one
            # touched expert at a time (≤ T tokens: gate/up/silu/product in c + one expert
            # matrix dequantized), then the float32 ys·w and the (T, E) sum
            g = devs.pop()
            c = DTYPE_BYTES[self.kinds.dtype(g)]
            own = {g: (te + A * (INT64 + f) if g != h else 0) + A * ROUTING_BYTES + 2 * A * E * c}
            mats = max((projection(t, g, g, T, self.kinds)[g] for t in b.experts), default=0)
            return [_plus(own, {g: 3 * T * n_ff * c + mats}),
                    _plus(own, {g: te + A * E * f + (A * E * f if c != F32 else 0)}),
                    {g: te, h: te}], False
        # offload.moe.StagedExperts (stages on several devices): inputs/outputs gathered at
        # home, each stage a projection of ≤ T tokens on its device
        own = {h: 3 * A * E * f + te + 3 * T * n_ff * f + A * ROUTING_BYTES}
        return [_plus(own, projection(t, device_of(t), h, T, self.kinds)) for t in b.experts], False

    def ffn(self, i: int, b: BlockTensors, h: str, device_of) -> list[Moment]:
        """The block's FFN on home ``h``: x and h = x + attn live, plus ffn_norm(h)."""
        s, T, f = self.spec, self.T, F32
        te = T * s.n_embd * f
        base = {h: 3 * te}                             # x, h, ffn_norm(h)
        moments = [{h: 4 * te}]                        # the norm's float copy and result
        if b.router is None:
            moments += [_plus(base, m) for m in self.swiglu(b.dense, h, device_of)]
            return moments + [{h: 5 * te}]             # + FFN output, + residual sum
        n_exp, k = max(1, s.n_expert), max(1, s.n_expert_used)
        # router: logits, scores, choice (T, n_expert) float32; ids/weights (T, k)
        moments.append(_plus(base, self._proj(b.router, h, T, device_of, f32=True), {h: 2 * T * n_exp * f}))
        base = _plus(base, {h: T * k * (INT64 + f)})
        routed, concurrent = self.routed(b, h, device_of)
        # no shared expert: offload.moe.MoE starts y as zeros (T, E)
        shared = self.swiglu(b.shared, h, device_of) or [{h: te}]
        if concurrent:          # offload.moe.MoE: the CPU worker's peak meets each shared-expert moment
            busy = routed[0]
            moments += [_plus(base, busy, m) for m in shared]
            moments += [_plus(base, {h: te}, routed[-1])]       # y, Y, Y on h (+ their sum below)
        else:                   # routed first, then the shared expert beside their sum y
            moments += [_plus(base, m) for m in routed]
            moments += [_plus(base, {h: te}, m) for m in shared]
        moments.append(_plus(base, {h: 3 * te}))                # y, routed, y + routed
        return moments

    # -- deepseek4 --------------------------------------------------------------------------
    def hc_pre(self, fn: TensorInfo | None, h: str, device_of) -> list[Moment]:
        """A hyper-connection collapsing the streams before a sublayer (§2.2), the state X
        held by the caller: X's square for the RMS factor beside the mixing projection ``fn``
        (over T rows of hc·E values, float32), then the broadcast product pre·X (X-sized) and
        its sum y (T, E). Leaves y and the (T, 2+hc, hc) mixing weights."""
        te, X = self.T * self.spec.n_embd * F32, self.state
        mix = self.T * (2 + self.streams) * self.streams * F32
        return [_plus({h: X + mix}, self._proj(fn, h, self.T, device_of, f32=True)),
                {h: 4 * mix + X + te}]                  # Sinkhorn's temporaries; pre·X and y

    def hc_post(self, h: str) -> Moment:
        """X' = post ⊗ f(y) + comb·X beside the sublayer's output and the old X (held by the
        caller): the two X-sized products and their sum."""
        return {h: self.T * self.spec.n_embd * F32 + 3 * self.state}

    def dsv4_attention(self, i: int, b: BlockTensors, h: str, device_of) -> list[Moment]:
        """deepseek4's attention (§2.5-2.7) on home ``h`` after attn_norm (y and its norm
        live throughout): q LoRA with per-head RMS and RoPE on the last n_rot dims, the one
        shared K=V row appended to the window ring; on compressed blocks the compressor's two
        projections and its softmax pooling; on CSA blocks the indexer (its own compressor,
        q from the q LoRA, head weights, scores over every compressed key ``c`` queries at a
        time, top-k); attention with sinks over the window plus the compressed entries (CSA:
        all entries, masked to the top-k: the (T, entries) mask and its float bias); the
        inverse RoPE, the grouped output projection and attn_output_b."""
        s, T, f = self.spec, self.T, F32
        H, Dk, R = s.n_head, s.head_dim_k, s.n_rot
        Qw, te = H * Dk, T * s.n_embd * F32
        c = self.dsv4_cache(i) if self.dsv4_cache is not None else None
        proj = lambda name, n=T: self._proj(b.attn.get(name), h, n, device_of)  # noqa: E731
        base = {h: 2 * te}                                      # y, attn_norm(y)
        ql = T * s.q_lora_rank * f
        moments = [{h: 3 * te}, _plus(base, proj("attn_q_a")), _plus(base, {h: 3 * ql})]
        live = _plus(base, {h: ql})                             # qr (the indexer reads it too)
        moments.append(_plus(live, proj("attn_q_b")))
        live = _plus(live, {h: T * Qw * f})                     # q
        moments += [_plus(live, {h: 2 * T * Qw * f}),          # per-head RMS: float copy, result
                    _plus(live, {h: 3 * T * H * R * f}),        # RoPE of the last R dims
                    _plus(live, proj("attn_kv"))]
        kvw = T * Dk * f
        moments.append(_plus(live, {h: 3 * kvw}))               # kv, kv_norm's copy and result
        live = _plus(live, {h: kvw})
        moments.append(_plus(live, {h: int(kvw / f * self.kvb)}))   # appended to the window ring
        r = s.compress_ratio(i)
        for who, width in (("attn", (2 if r == 4 else 1) * Dk), ("indexer", 2 * s.indexer_head_dim)):
            if not r or (who == "indexer" and r != 4):
                continue
            cw = T * width * f                                  # kv and gate: (T, coff·d) each
            moments += [_plus(live, proj(f"{who}_compressor_kv")),
                        _plus(live, {h: cw}, proj(f"{who}_compressor_gate")),
                        _plus(live, {h: 5 * cw})]               # + ape, softmax's exp and weights, product
        entries = c.compressed_rows if c is not None else 0
        mask = 0
        if r == 4:
            Hi, Di = s.indexer_n_head, s.indexer_head_dim
            N, K = (c.indexer_rows if c is not None else 0), s.indexer_top_k
            moments.append(_plus(live, proj("indexer.attn_q_b")))
            idx = _plus(live, {h: T * Hi * Di * f})            # qI
            moments += [_plus(idx, {h: 3 * T * Hi * R * f}), _plus(idx, proj("indexer.proj"))]
            idx = _plus(idx, {h: T * Hi * f})                   # head weights
            cq = max(1, min(T, SCORE_VALUES // max(1, Hi * N)))
            up = 0 if self.kvb == F32 else N * Di * f           # the indexer keys upcast
            moments += [_plus(idx, {h: up + 2 * cq * Hi * N * f + T * N * f}),   # products, ReLU, scores
                        _plus(idx, {h: T * N * f + T * min(K, N) * (INT64 + f)})]  # top-k
            mask = T * min(K, N) * INT64 + T * entries * (1 + f)     # picks, bool mask, float bias
        W = min(c.window_cells, self.L) if c is not None else self.L
        La = W + entries
        keys = int(La * Dk * self.kvb)                          # window ++ compressed, one K=V tensor
        sdpa = keys + mask + sink_attention_bytes(T, La, H, Qw, Dk, self.kvb)
        moments.append(_plus(live, {h: sdpa}))
        live = _plus(base, {h: ql + 2 * T * Qw * f})            # the output and its (T, H·D) copy
        g = T * s.o_groups * s.o_lora_rank * f
        moments += [_plus(live, {h: 3 * T * H * R * f}),        # inverse RoPE
                    _plus(live, proj("attn_output_a")),         # per group: (T, D·H/G) → o_lora
                    _plus(base, {h: g}, proj("attn_output_b")),
                    {h: 3 * te}]
        return moments

    def dsv4_block(self, i: int, b: BlockTensors, h: str, device_of) -> list[Moment]:
        """A deepseek4 block (§2.3): each sublayer between a hyper-connection's collapse and
        expansion, the block's input state X held as the residual throughout."""
        X = {h: self.state}
        mix = {h: 2 * self.T * (2 + self.streams) * self.streams * F32}   # post and comb kept
        moments = []
        for fn, sub in (("hc_attn_fn", self.dsv4_attention(i, b, h, device_of)),
                        ("hc_ffn_fn", self.ffn(i, b, h, device_of))):
            moments += [_plus(X, m) for m in self.hc_pre(b.attn.get(fn), h, device_of)]
            moments += [_plus(X, mix, m) for m in sub]
            moments.append(_plus(X, mix, self.hc_post(h)))
        return moments

    def output(self, out_t: TensorInfo | None, norm_dev: str, last_home: str, device_of,
               hc_fn: TensorInfo | None = None) -> list[Moment]:
        """output_norm over all T rows, then logits of the last row (logits="last"). With
        hyper-connections (deepseek4) the hc head first collapses the streams, where the output
        is: the state moved there, its square for the RMS factor beside the (T, hc) mixing
        projection ``hc_fn`` (``output_hc_fn``, float32), and the collapsed (T, E) rows."""
        te = self.T * self.spec.n_embd * F32
        base = {last_home: self.state}
        moments = []
        if self.streams > 1:
            moved = self.state if norm_dev != last_home else 0
            moments.append(_plus(base, {norm_dev: moved + self.state + te},
                                 self._proj(hc_fn, norm_dev, self.T, device_of, f32=True)))
            base = _plus(base, {norm_dev: te})
        moments.append(_plus(base, {norm_dev: 2 * te}))
        if out_t is not None:
            moments.append(_plus(base, {norm_dev: te}, self._proj(out_t, norm_dev, 1, device_of)))
        return moments

    def nextn_glue(self, b: BlockTensors, h: str, device_of) -> list[Moment]:
        """offload.models.shared.base.NextN before its block: enorm(embed(t)), hnorm(h), their
        (T, 2E) concatenation and eh_proj (the trunk's hidden state is held by the caller).
        deepseek4 (§2.10): per stream — enorm(embed(t)) broadcast to the hc streams, hnorm of
        each stream of the trunk's state, their (T, hc, 2E) concatenation and eh_proj over its
        T·hc rows."""
        te = self.T * self.spec.n_embd * F32
        if self.streams > 1:
            X = self.state
            base = {h: 2 * te + 2 * X}                           # e, enorm(e), its broadcast, hnorm(h)
            return [_plus(base, {h: X}),                         # hnorm's float copy
                    _plus(base, {h: 2 * X}),                     # cat
                    _plus(base, {h: 2 * X}, self._proj(b.nextn.get("eh_proj"), h, self.T * self.streams,
                                                       device_of))]
        base = {h: 3 * te}                             # e, enorm(e), hnorm(h)
        return [_plus(base, {h: 2 * te}),                        # cat
                _plus(base, {h: 2 * te}, self._proj(b.nextn.get("eh_proj"), h, self.T, device_of))]

    def run_order(self, blocks: Iterable[int]) -> list[int]:
        """The blocks of ``blocks`` that exist, in the order the pass runs them."""
        return sorted(i for i in blocks if i in self.blocks)

    def embedding_device(self, device_of) -> str:
        embd = self.globals.get("token_embd.weight")
        return device_of(embd) if embd is not None else CPU

    def block_steps(self, i: int, device_of, prev: str, trunk_home: str) -> list[Moment]:
        """Block ``i``'s steps. ``prev``: the device holding the hidden state handed over
        (the previous block's home, or the embedding's), still referenced there during the
        block; ``trunk_home``: the last trunk block's home (a NextN block reads its state)."""
        b, h = self.blocks[i], self.home(i, device_of)
        if h is None:
            return []
        carry = {prev: self.state} if prev != h else {}
        moments = []
        if self.spec.is_nextn_layer(i):
            carry = _plus(carry, {trunk_home: self.state})
            moments += self.nextn_glue(b, h, device_of)
        if self.streams > 1:
            moments += self.dsv4_block(i, b, h, device_of)
        else:
            moments += self.attention(i, b, h, device_of) + self.ffn(i, b, h, device_of)
        out = [_plus(carry, m) for m in moments]
        if self.spec.is_nextn_layer(i):
            head = b.nextn.get("shared_head_head") or self.globals.get("output.weight")
            hc_fn = b.nextn.get("hc_head_fn") or self.globals.get("output_hc_fn.weight")
            out += self.output(head, h, h, device_of, hc_fn=hc_fn)
        return out

    def global_steps(self, device_of, trunk_home: str) -> list[Moment]:
        """The embedding lookup and the output layer (``output.weight``, or ``token_embd``
        on the output layer's device for tied embeddings)."""
        out = []
        embd = self.globals.get("token_embd.weight")
        if embd is not None:
            out += self.embedding(embd, device_of(embd))
            if self.streams > 1:      # the rows repeated into the hc streams
                out.append({device_of(embd): self.T * self.spec.n_embd * F32 + self.state})
        norm = self.globals.get("output_norm.weight")
        hc_fn = self.globals.get("output_hc_fn.weight")
        if norm is not None:
            out_t = self.globals.get("output.weight")
            if out_t is not None:     # the norm runs where the output matrix is (models/parts.output_ends)
                out += self.output(out_t, device_of(out_t), trunk_home, device_of, hc_fn=hc_fn)
            else:
                dev = device_of(norm)
                out += self.output(embd, dev, trunk_home, lambda _t: dev, hc_fn=hc_fn)
        return out

    def homes(self, device_of, order: Sequence[int]) -> tuple[dict[int, str], str]:
        """Per block of ``order``: the device handing it the hidden state; and the last
        trunk block's home."""
        prev = trunk_home = self.embedding_device(device_of)
        prevs = {}
        for i in order:
            h = self.home(i, device_of)
            if h is None:
                continue
            prevs[i] = prev
            if not self.spec.is_nextn_layer(i):
                trunk_home = h
            prev = h
        return prevs, trunk_home

    def steps(self, device_of, blocks: Iterable[int]) -> list[Moment]:
        """Every step of one forward pass: embedding, each block's attention and FFN (NextN
        blocks that run add their glue and head), output."""
        order = self.run_order(blocks)
        prevs, trunk_home = self.homes(device_of, order)
        out = self.global_steps(device_of, trunk_home)
        for i in order:
            if i in prevs:
                out += self.block_steps(i, device_of, prevs[i], trunk_home)
        return out


def peak_per_device(moments: Iterable[Moment]) -> dict[str, int]:
    """compute(device) = its largest moment."""
    out: dict[str, int] = {}
    for m in moments:
        for k, v in m.items():
            if v > out.get(k, 0):
                out[k] = v
    return out


def peak_of_group(moments: Sequence[Moment], group: Iterable[str]) -> int:
    """The compute of devices that share one memory (the CPU and GPUs backed by host RAM):
    the largest moment of their *sum* (they peak at the same moments, not one after
    another)."""
    group = set(group)
    return max((sum(v for d, v in m.items() if d in group) for m in moments), default=0)


def tensor_staging_bytes(t: TensorInfo) -> int:
    """One op-offload staging buffer for expert tensor ``t`` (``limits.staging_buffer_bytes``)."""
    return staging_buffer_bytes(t.n_bytes, t.shape[0])


def streamable_expert_blocks(tensors: Sequence[TensorInfo]) -> dict[int, list[TensorInfo]]:
    """Trunk blocks op offload can stream, with their 3-D routed-expert tensors: those without
    expert biases (the streamed path computes plain SwiGLU experts)."""
    by_block: dict[int, list[TensorInfo]] = defaultdict(list)
    for t in tensors:
        if t.layer is not None and not t.nextn and t.role is Role.ROUTED_EXPERTS:
            by_block[t.layer].append(t)
    return {i: ts for i, ts in by_block.items() if all(len(t.shape) == 3 for t in ts)}


def block_anchors(tensors: Sequence[TensorInfo]) -> dict[int, TensorInfo]:
    """Each block's largest attention tensor: where the block computes (its home)."""
    attn: dict[int, TensorInfo] = {}
    for t in tensors:
        if t.role is Role.ATTENTION and t.layer is not None and (t.layer not in attn or t.n_bytes > attn[t.layer].n_bytes):
            attn[t.layer] = t
    return attn


def op_offload_staging_bytes(tensors: Sequence[TensorInfo], device_of: Callable[[TensorInfo], str],
                             host_backed: Iterable[str] = ()) -> dict[str, int]:
    """Op offload's staging VRAM, a term of its own in each GPU's compute bytes:
    ``offload.runtime`` gives every GPU that RAM-resident experts stream to one pair of
    ``gpu.experts.StagingBuffers``, each a chunk (``staging_buffer_bytes``) of the largest
    routed-expert tensor streamed there (double buffering: chunk i+1 is copied while chunk i
    computes). Streamed: trunk
    blocks whose expert tensors are all on the CPU (``streamable_expert_blocks``), to the
    block's own GPU (its attention's), else the first GPU. Counted whenever the plan has such
    blocks and a real GPU, since ``--op-offload auto`` (the default) may stream; not on
    host-backed GPUs (``--virtual-gpus``), to which ``auto`` never streams."""
    gpus = sorted({device_of(t) for t in tensors} - {CPU})
    if not gpus:
        return {}
    attn = block_anchors(tensors)
    largest: dict[str, int] = {}
    for i, mats in streamable_expert_blocks(tensors).items():
        if any(device_of(t) != CPU for t in mats):
            continue
        home = device_of(attn[i]) if i in attn else CPU
        gpu = home if home != CPU else gpus[0]
        largest[gpu] = max(largest.get(gpu, 0), max(tensor_staging_bytes(t) for t in mats))
    skip = set(host_backed)
    return {g: 2 * n for g, n in largest.items() if g not in skip}


def decode_int8_scratch_bytes(spec: ModelSpec, tensors: Sequence[TensorInfo],
                              device_of: Callable[[TensorInfo], str], kinds: Devices) -> int:
    """Host bytes the routed experts' int8 decode scratch holds for the whole run
    (``cpu_kernels.moe.routed_int8_scratch``, bound at load by each compiled MoE block and by
    each hybrid hand-off): per MoE layer with RAM-resident routed experts and no expert biases
    (those run ``moe_ffn``, which allocates per call), int8 activations of ``DECODE_TOKENS``
    rows of n_embd where gate and up take int8 at decode, of ``DECODE_TOKENS · k`` rows of
    n_ff where down does (``Devices.int8(routed=True)``)."""
    by_block: dict[int, list[TensorInfo]] = defaultdict(list)
    for t in tensors:
        if t.layer is not None:
            by_block[t.layer].append(t)
    k = max(1, spec.n_expert_used)
    total = 0
    for ts in by_block.values():
        b = BlockTensors.of(ts)
        mats = [t for t in b.experts if device_of(t) == CPU]
        if not mats or b.expert_bias:
            continue
        gate_up = [t for t in mats if "down" not in t.name]
        down = [t for t in mats if "down" in t.name]
        if gate_up and kinds.int8(DECODE_TOKENS, [t.ggml_type for t in gate_up], routed=True):
            total += int8_activation_bytes(DECODE_TOKENS, _mat(gate_up[0])[1])
        if down and kinds.int8(DECODE_TOKENS, [t.ggml_type for t in down], routed=True):
            total += int8_activation_bytes(DECODE_TOKENS * k, _mat(down[0])[1])
    return total
