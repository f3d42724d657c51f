"""Memory per device: weights, KV cache, compute buffers.

**Weights** — the exact byte size of every tensor placed on the device (GGUF header sizes).
A model without ``output.weight`` (tied embeddings) also pays a copy of ``token_embd`` on the
device of the output layer when that is not token_embd's device, as llama.cpp does.

**KV cache** — per block, on the device of the block's attention weights (its largest
attention tensor)::

    kv(block) = cells × n_head_kv × (row_bytes(cache_type, head_dim_k)
                                     + row_bytes(cache_type, head_dim_v))

* ``cells`` = the context rounded up to a multiple of 256 (llama.cpp pads the cache); for a
  sliding-window block ``min(cells, pad256(sliding_window + ubatch))``.
* MLA GGUFs (``attention.key_length_mla`` present, DeepSeek-V2/V3, Kimi): the cache holds the
  compressed latent only — one K row of ``kv_lora_rank + rope dims`` (= ``key_length``, with
  ``head_count_kv`` = 1) and no V, as llama.cpp's V-less MLA cache.
* NextN blocks: counted only when drafting with them (the draft head keeps its own cache
  over the whole context). A ``--draft`` GGUF's blocks likewise.
* DeepSeek-V4 (``compress_ratios`` present): K = V, one shared row, per block as
  ``Dsv4Cache`` says — the window ring (``kv_cells`` of a sliding-window block), compressed
  entries ``ceil(ctx/ratio)`` (CSA 4, HCA 128), the indexer's ``ceil(ctx/4)`` keys on CSA
  blocks, and the compressors' float32 state with ``DECODE_TOKENS`` rows for rollback. V4-Flash
  at f16: 263.4 MiB at 32k, 908.4 MiB at 128k, 6.77 GiB at 1M for its 43 blocks (6880 B a
  token of compressed caches, 32.25 MiB of rings, 16 MiB of state); an MTP block keeps only
  its ring (768 cells, 0.75 MiB).
* ``row_bytes(t, n) = n / block_size(t) × type_size(t)`` (ggml_row_size). A block-quantized
  cache type quantizes each head's row on its own, so head_dim must be whole blocks of 32.
  deepseek4's window ring, compressed entries and indexer keys all take the cache type (K = V:
  ``-ctv`` must equal ``-ctk``, as llama.cpp requires); the compressors' state stays float32.

**Compute buffer** — what *offload's runtime* allocates beyond weights and KV during one
forward pass of ``T = ubatch`` tokens attending to ``L = ctx`` keys (the last prompt chunk of
a full context), per device: the most bytes live there at any moment. The runtime has no
graph buffer: torch, numpy and the Numba kernels allocate each activation when it is
computed and free it after its last use, and ``offload run`` fixes glibc's mmap threshold
(``offload.host_memory``) so that freed blocks leave the process's RSS. ``placement.compute``
walks the pass as the code runs it and gives the bytes live on each device at each step::

    compute(device) = max over the steps of one pass of the bytes live on the device

    embedding, CPU     = T·row_bytes(token_embd) + 2·T·E·4 + min(T, 31)·E·12
                         (gathered raw rows; gguf's numpy dequantize: group results + output,
                         one 16–31-row group's temporaries)
    attention, home    = 2·T·E·4 + T·(Q + K + V)·4             x, attn_norm(x), q, k, v
                         + the largest of: each projection's own peak;
                           RoPE  T·(H·R + Q)·4;
                           KV append  T·(K + V)·cache_bytes + kv(block)/2  (storage doubling);
                           SDPA on the CPU  T·L + (T + L)·8 (bool mask, index vectors)
                               + T·L·4 (mask as a float bias) + L·(K + V)·4 (f16/bf16 cache
                               upcast) + T·Q·4 (output);
                           SDPA on CUDA  mask + T·Q·2·cb + T·L·cb  (cb = cache bytes/value)
                           with sinks (gpt-oss, explicit, c = min(T, 16 Mi // (H·L)) queries
                               at a time)  2·T·Q·4 + L·(K + V)·4 (upcast unless f32)
                               + H·c·L·4 (scores) + c·L·11 + (c + L)·8 (mask) + 2·c·Q·4;
                         L = ctx, or a sliding-window block's cells when fewer
    FFN, home          = 3·T·E·4 (x, h, ffn_norm(h)) + T·k·12 (expert ids, weights)
                         + dense FFN / shared expert: 3·T·n_ff·4 beside one projection;
                         router: 2·T·n_expert·4;
                         routed experts on the CPU (cpu_kernels.moe_ffn in a worker thread,
                           at the same time as the shared expert): T·E·4 + A·n_ff_exp·4
                           + A·E·4 + (T·E + A·n_ff_exp)/16·4 + A·64 (routing indices)
                           (T > 16: the int8 activations of X and H in place of the /16 sums),
                           + host copies T·E·4 + T·k·12 when the home is a GPU;  A = T·k
                           with expert biases (gpt-oss) at least T·E·4 + A·E·4·17/16
                           + 3·A·n_ff_exp·4 + A·64 (gate and up apart, then swiglu_oai)
                         routed experts on a GPU: 2·A·E·c + 3·T·n_ff_exp·c + one expert
                           matrix dequantized, then A·E·4
    output, its device = 2·T·E·4 + the output projection of the last row (logits="last")
    projection on a GPU = n·cols·(c + 4 if moved) + max(chunk·cols·dq(type) + n·rows·c
                            (+ n·chunk·c if chunked),  n·rows·(c + 4) (+ n·rows·4 bias))
                          chunk = min(rows, 16 Mi values // cols): raw GGUF bytes are
                          dequantized per call, a chunk of rows at a time, into c
    projection on the CPU = n·rows·4 + n·cols/16·4      (Numba over the mapped bytes)
                          + (n > 16, quantized type: int8 activations, about 3.4·cols + 256
                             bytes a row, in place of the cols/16 sums: compute.int8_activation_bytes)

with E = n_embd, Q = n_head·head_dim_k, K/V = n_head_kv·head_dim_k/v, R = rotary dims,
c = bytes of the GPU compute dtype (``MemorySettings.gpu_dtype``; "auto": bf16 on CUDA, f32
on a GPU backed by host RAM), dq(type) = the torch dequantizer's peak bytes per value
(``placement.compute.DEQUANT_BYTES``: 8.1 for Q8_0 … 18.4 for Q6_K; 4 for F16 → f32). A block
computes on its home (the device of its largest attention tensor); the hidden state handed
over by the previous block stays referenced on that block's home meanwhile. A GPU listed in
``MemorySettings.host_backed`` (``--virtual-gpus``) computes like the CPU (torch on the
host); the CPU and such devices share one memory and peak at the same moments, so their
joint compute is the largest step of their *sum* (``placement.compute.peak_of_group``).
Every per-value constant is checked against the allocators (torch profiler, tracemalloc) in
``tests/runtime/test_memory_runtime.py``.

Kept for the whole run and added to the CPU's compute: the routed experts' int8 decode
scratch (``placement.compute.decode_int8_scratch_bytes``: per MoE layer with RAM-resident
experts of an int8-at-decode type, int8 activations of 16 rows of n_embd and 16·k rows of
n_ff, bound at load; ~1.3 MB a layer at DeepSeek-V3's widths). Not counted: the hand-off's
float buffers (16 tokens of x, ids, weights, output) and the compiled block's per-call
routing scratch.

Not counted: what loading adds beyond the weights and no placement changes — the tokenizer
(1.3 MiB for the shipped model's 4,096 tokens + 3,839 merges, about 170 B per entry; it
grows with the vocabulary), the parsed header, Python objects; per-thread scratch of torch's and Numba's
kernels. Speculative verify batches of B ≤ n_max + 1 tokens compute
B rows of logits (B·n_vocab·(c + 4)), covered while the ubatch's 2·T·E·4 is larger. Without
the fixed mmap threshold (an embedder that skips ``offload.host_memory``), glibc keeps freed
blocks: measured 3–12 MiB above this estimate on the shipped model.

This is offload's runtime, not llama.cpp's: ``--emit llama.cpp`` gives the same tensor map,
and llama.cpp's graph buffers (an f32 logits row per token of the ubatch, the full score
matrix of non-flash attention) are larger; the fit target (default 1 GiB per GPU) is the
margin to leave for them.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from placement.compute import (Devices, ForwardModel, decode_int8_scratch_bytes, op_offload_staging_bytes,
                               peak_per_device)
from placement.devices import CPU, Device
from placement.errors import PlacementError
from placement.layers import output_slot_member
from placement.limits import CACHE_PAD, DECODE_TOKENS, pad
from placement.tensors import ModelSpec, Role, TensorInfo

# The KV cache types llama.cpp's -ctk/-ctv accept.
CACHE_TYPES: dict[str, GGMLQuantizationType] = {
    t.name.lower(): t for t in (
        GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1)
}


FLOAT_CACHE_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16})


def cache_type(name: str) -> GGMLQuantizationType:
    try:
        return CACHE_TYPES[name.lower()]
    except KeyError:
        raise PlacementError(
            f"unknown --cache-type {name!r} (one of {', '.join(CACHE_TYPES)})") from None


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if n % block:
        raise PlacementError(f"a KV row of {n} values is not a multiple of {qtype.name}'s block of {block}")
    return n // block * size


GPU_DTYPES = ("auto", "f32", "f16", "bf16")


@dataclass(frozen=True)
class MemorySettings:
    ctx: int
    cache_type: str = "f16"              # K's (and V's, unless cache_type_v says otherwise)
    ubatch: int = 512
    gpu_dtype: str = "auto"              # what GPU-resident weights are dequantized into
    host_backed: tuple[str, ...] = ()    # GPU devices backed by host RAM (--virtual-gpus)
    cache_type_v: str | None = None      # V's type where it differs from K's (llama.cpp's -ctv)
    parallel: int = 1                    # sequences at once (-np), each with caches of its own

    def __post_init__(self) -> None:
        cache_type(self.cache_type)
        if self.parallel < 1:
            raise PlacementError(f"-np (sequences at once) must be >= 1, got {self.parallel}")
        if self.cache_type_v is not None:
            cache_type(self.cache_type_v)
        if self.ctx < 1 or self.ubatch < 1:
            raise PlacementError(f"context and ubatch must be >= 1 (got {self.ctx}, {self.ubatch})")
        if self.gpu_dtype not in GPU_DTYPES:
            raise PlacementError(f"unknown GPU compute dtype {self.gpu_dtype!r} (one of {', '.join(GPU_DTYPES)})")

    @property
    def v_type(self) -> str:
        """V's cache type name (K's unless -ctv set another)."""
        return self.cache_type if self.cache_type_v is None else self.cache_type_v

    @property
    def type_label(self) -> str:
        """"q8_0", or "q8_0/f16" for K and V of different types."""
        return self.cache_type if self.v_type == self.cache_type else f"{self.cache_type}/{self.v_type}"


def kv_cells(spec: ModelSpec, layer: int, s: MemorySettings) -> int:
    cells = pad(s.ctx, CACHE_PAD)
    if spec.is_swa_layer(layer) and spec.sliding_window:
        cells = min(cells, pad(spec.sliding_window + s.ubatch, CACHE_PAD))
    return cells


@dataclass(frozen=True)
class Dsv4Cache:
    """What one deepseek4 block keeps per sequence, in rows; the runtime allocates exactly
    these (``offload/models/deepseek4.py``) and ``kv_bytes`` counts them. K = V throughout
    (one shared head), so no V rows.

    * ``window_cells``: the raw K ring of ``head_dim_k`` (every block, the sliding window
      plus a ubatch, as any sliding-window block's ``kv_cells``), cache type;
    * ``compressed_rows``: compressed K entries of ``head_dim_k``, ``ceil(ctx / ratio)``
      (CSA ratio 4, HCA ratio 128; none for ratio 0), cache type;
    * ``indexer_rows``: the lightning indexer's compressed keys of ``indexer_head_dim``,
      ``ceil(ctx / 4)`` on CSA blocks, cache type;
    * ``state_rows`` / ``indexer_state_rows``: the compressors' per-token inputs (kv and gate,
      float32) still needed: the window being filled plus, for CSA's overlapping windows, the
      one before it, plus ``DECODE_TOKENS`` more so that rolling back a verify batch restores
      a window exactly. ``state_width`` / ``indexer_state_width`` values a row.
    """
    window_cells: int
    compressed_rows: int = 0
    indexer_rows: int = 0
    state_rows: int = 0
    state_width: int = 0
    indexer_state_rows: int = 0
    indexer_state_width: int = 0


def dsv4_cache(spec: ModelSpec, layer: int, s: MemorySettings) -> Dsv4Cache:
    """Block ``layer``'s deepseek4 cache at ``s.ctx`` (see ``Dsv4Cache``)."""
    window = kv_cells(spec, layer, s)
    r = spec.compress_ratio(layer)
    if not r:
        return Dsv4Cache(window)
    coff = 2 if r == 4 else 1                     # CSA's windows overlap: two projections per token
    rows = coff * r + DECODE_TOKENS
    entries = -(-s.ctx // r)
    if r != 4:
        return Dsv4Cache(window, entries, 0, rows, 2 * coff * spec.head_dim_k)
    return Dsv4Cache(window, entries, entries, rows, 2 * coff * spec.head_dim_k,
                     rows, 2 * coff * spec.indexer_head_dim)


def kv_row_bytes(t: GGMLQuantizationType, width: int, what: str) -> int:
    """Bytes of one cached row of ``width`` values: each head's row is quantized on its own (rows
    never share a block, so a token appends and rolls back exactly), so a block-quantized cache
    type needs each row to be whole blocks."""
    block, size = GGML_QUANT_SIZES[t]
    if width % block:
        raise PlacementError(f"--cache-type {t.name.lower()} needs KV rows of a multiple of {block} "
                             f"values; this model's {what} rows have {width}")
    return width // block * size


def kv_bytes(spec: ModelSpec, layer: int, s: MemorySettings) -> int:
    """KV cache bytes of one block at ``s.ctx``, for each of ``s.parallel`` sequences (see the
    module docstring)."""
    return s.parallel * _sequence_kv_bytes(spec, layer, s)


def _sequence_kv_bytes(spec: ModelSpec, layer: int, s: MemorySettings) -> int:
    t, tv = cache_type(s.cache_type), cache_type(s.v_type)
    if (spec.compress_ratios or spec.is_mla) and tv != t:
        raise PlacementError(f"-ctv {s.v_type} differs from -ctk {s.cache_type}: {spec.arch}'s cache keeps "
                             "K only (V is read from the K rows), so K and V take one type")
    if spec.compress_ratios:
        c = dsv4_cache(spec, layer, s)
        return ((c.window_cells + c.compressed_rows) * kv_row_bytes(t, spec.head_dim_k, "K (head_dim_k)")
                + (kv_row_bytes(t, spec.indexer_head_dim, "indexer key") * c.indexer_rows if c.indexer_rows else 0)
                + 4 * (c.state_rows * c.state_width + c.indexer_state_rows * c.indexer_state_width))
    n_kv = spec.n_head_kv[layer]
    per_cell = n_kv * kv_row_bytes(t, spec.head_dim_k, "K (head_dim_k)")
    if not spec.is_mla:  # MLA: V is a view of the latent K row
        per_cell += n_kv * kv_row_bytes(tv, spec.head_dim_v, "V (head_dim_v)")
    return kv_cells(spec, layer, s) * per_cell


def cache_value_bytes(s: MemorySettings) -> float:
    """Bytes per cached K/V value (a q8_0 cache: 34 / 32)."""
    block, size = GGML_QUANT_SIZES[cache_type(s.cache_type)]
    return size / block


def forward_model(spec: ModelSpec, tensors: Sequence[TensorInfo], s: MemorySettings) -> ForwardModel:
    return ForwardModel(spec, tensors, s.ubatch, s.ctx, cache_value_bytes(s),
                        Devices(s.gpu_dtype, s.host_backed), lambda layer: kv_bytes(spec, layer, s),
                        kv_cells=lambda layer: kv_cells(spec, layer, s),
                        dsv4_cache=(lambda layer: dsv4_cache(spec, layer, s)) if spec.compress_ratios else None,
                        tiled_cache=quantized_cache(s))


def quantized_cache(s: MemorySettings) -> tuple[GGMLQuantizationType, GGMLQuantizationType] | None:
    """(K type, V type) when either is block-quantized (attention then reads the cache in tiles)."""
    k, v = cache_type(s.cache_type), cache_type(s.v_type)
    return None if k in FLOAT_CACHE_TYPES and v in FLOAT_CACHE_TYPES else (k, v)


def forward_steps(spec: ModelSpec, tensors: Sequence[TensorInfo], placement: Mapping[str, str],
                  s: MemorySettings, *, kv_blocks: Iterable[int]) -> list[dict[str, int]]:
    """The steps of one forward pass (bytes per device each) under ``placement``; the blocks
    that run are those that keep a KV cache."""
    return forward_model(spec, tensors, s).steps(lambda t: placement[t.name], sorted(kv_blocks))


def attention_device(block_tensors: Iterable[TensorInfo], placement: Mapping[str, str]) -> str | None:
    """Where a block's KV cache lives: with its largest attention tensor."""
    attn = [t for t in block_tensors if t.role is Role.ATTENTION]
    if not attn:
        return None
    return placement[max(attn, key=lambda t: t.n_bytes).name]


def tied_output(tensors: Sequence[TensorInfo]) -> TensorInfo | None:
    """A model without ``output.weight`` computes its logits with ``token_embd`` (tied
    embeddings); llama.cpp loads a second copy on the output layer's device. Returned as a
    stand-in OUTPUT tensor of the same size, or None for an untied model."""
    if any(t.role is Role.OUTPUT and t.name.startswith("output.") for t in tensors):
        return None                  # (deepseek4's hc head, output_hc_*, is OUTPUT too but no matrix)
    embd = next((t for t in tensors if t.role is Role.EMBEDDING and t.name == "token_embd.weight"), None)
    return None if embd is None else replace(embd, name="output.weight (tied to token_embd)", role=Role.OUTPUT)


@dataclass(frozen=True)
class Footprint:
    weights_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0


def footprint(spec: ModelSpec, tensors: list[TensorInfo], placement: Mapping[str, str],
              s: MemorySettings, *, kv_blocks: Iterable[int]) -> dict[str, Footprint]:
    """Per-device weights / KV / compute of one model under ``placement`` (name → device).

    ``kv_blocks`` are the blocks that keep a KV cache (the trunk, plus NextN blocks when
    drafting with them).
    """
    weights: dict[str, int] = defaultdict(int)
    by_block: dict[int, list[TensorInfo]] = defaultdict(list)
    for t in tensors:
        dev = placement[t.name]
        weights[dev] += t.n_bytes
        if t.layer is not None:
            by_block[t.layer].append(t)
    tied = tied_output(tensors)
    out_dev = next((placement[t.name] for t in tensors if output_slot_member(t)), None)
    if tied is not None and out_dev is not None:
        if out_dev != placement["token_embd.weight"]:
            weights[out_dev] += tied.n_bytes             # a second copy, off token_embd's device
    kv: dict[str, int] = defaultdict(int)
    for layer in kv_blocks:
        dev = attention_device(by_block.get(layer, ()), placement)
        if dev is not None:
            kv[dev] += kv_bytes(spec, layer, s)
    compute = peak_per_device(forward_steps(spec, tensors, placement, s, kv_blocks=kv_blocks))
    for dev, n in op_offload_staging_bytes(tensors, lambda t: placement[t.name], s.host_backed).items():
        compute[dev] = compute.get(dev, 0) + n          # op offload's staging buffers, kept between passes
    scratch = decode_int8_scratch_bytes(spec, tensors, lambda t: placement[t.name], Devices(s.gpu_dtype, s.host_backed))
    if scratch:
        compute[CPU] = compute.get(CPU, 0) + scratch    # int8 decode scratch of the RAM-resident experts, bound at load
    devices = set(weights) | set(kv)
    return {d: Footprint(weights[d], kv[d], compute.get(d, 0)) for d in devices}


def add_footprints(*parts: Mapping[str, Footprint]) -> dict[str, Footprint]:
    """Model + a separate draft model: weights and KV add up; the draft runs between the
    model's passes with the same allocator, so a device's compute is the larger of the two."""
    out: dict[str, Footprint] = {}
    for part in parts:
        for dev, f in part.items():
            o = out.get(dev, Footprint())
            out[dev] = Footprint(o.weights_bytes + f.weights_bytes, o.kv_bytes + f.kv_bytes,
                                 max(o.compute_bytes, f.compute_bytes))
    return out


@dataclass(frozen=True)
class DeviceTotals:
    """One row of the plan's table (all in bytes)."""

    name: str
    budget_bytes: int
    target_bytes: int
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    @property
    def free_after_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def above_target_bytes(self) -> int:
        return self.free_after_bytes - self.target_bytes


def device_totals(devices: Iterable[Device], targets: Mapping[str, int],
                  use: Mapping[str, Footprint]) -> list[DeviceTotals]:
    out = []
    for d in devices:
        f = use.get(d.name, Footprint())
        out.append(DeviceTotals(d.name, d.budget_bytes, targets.get(d.name, 0),
                                f.weights_bytes, f.kv_bytes, f.compute_bytes))
    return out
