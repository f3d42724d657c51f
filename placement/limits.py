"""The runtime's fixed sizes and type sets, defined once.

The planner counts what the runtime allocates, so a number both need lives here and both
import it: ``placement`` (memory and compute estimates), ``cpu_kernels`` (int8 activation
padding, which weight types decode with int8 activations, which calls ask for them), ``gpu`` (dequantization and
attention chunks, op-offload staging) and ``offload`` (the compiled decode batch, the cache
padding). Standard library and ``gguf`` only: every package may import it, none of them is
imported here.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as Q

# Decode and verify batches: at most this many tokens take the compiled CPU path (blocks,
# head, embedding rows, the hybrid hand-off); larger batches are prompt batches.
DECODE_TOKENS = 16
# Prompt batches (more tokens than a compiled step takes) quantize the CPU kernels'
# activations to int8 by default (``--prefill-activations``).
INT8_FROM = DECODE_TOKENS + 1

# Weight types whose batch-1 int8 path (activations quantized per 32, VNNI dot products) measured
# faster than their float path on a Xeon: "auto" decode activations use int8 for these where no
# set was measured on the CPU at hand (offload.decode_int8 measures one at load, and the planner
# counts with this one). The measured ratios and the rule: docs/cpu-kernels.md, "Decode and verify batches".
DECODE_INT8_TYPES = frozenset({Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_1, Q.MXFP4, Q.IQ4_NL,
                               Q.IQ4_XS, Q.IQ1_S, Q.IQ2_XXS})
# Weight types with no int8 decoder in cpu_kernels: their activations stay float.
FLOAT_ACTIVATION_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})

# What the CPU kernels are asked for (cpu_kernels.matmul.use_int8's ``int8``): True, False, or AUTO
# (per weight type: int8 for DECODE_INT8_TYPES); None leaves it to the process setting.
AUTO = "auto"
# --decode-activations: the request of decode/verify batches on the CPU routed experts.
DECODE_ACTIVATIONS = {"auto": AUTO, "int8": True, "float": False}

# Row padding of int8 activations (cpu_kernels.rowdot8.quantize_rows): codes past a row's end
# that a step may read (times scale 0), per-32 scales and per-4 sums a vector load may read.
XQ_PAD = 64
DX_PAD = 16
S4_PAD = 16

# Prompt batches on the int8 path (more than DECODE_TOKENS tokens) run as a GEMM with 16
# tokens in the lanes of a register (cpu_kernels.gemm8): the call packs its quantized
# activations into tiles of GEMM_LANES lanes first. An expert's last partial tile is packed
# only when it holds at least GEMM_MIN_LANES tokens (fewer go token by token): at 256 experts
# (8 tokens an expert on average) 8 measured faster than 1, 4 or 16.
GEMM_LANES = 16
GEMM_MIN_LANES = 8


def gemm_packed_bytes(lanes: int, cols: int) -> int:
    """Bytes of ``lanes`` packed lanes of ``cols`` values (cpu_kernels.gemm8.pack_lanes: the
    int8 codes, a float32 scale per 32 and a float32 sum per 16, and the int64 row index of
    each lane)."""
    return lanes * (cols + 4 * (cols // 32) + 4 * (cols // 16) + 8)


def gemm_lanes(rows: int, groups: int = 1) -> int:
    """Packed lanes for ``rows`` rows in at most ``groups`` groups, each padded to whole tiles:
    a matmul's tokens (one group, exact), an upper bound for an MoE layer's assignments by expert."""
    if groups <= 1:
        return -(-rows // GEMM_LANES) * GEMM_LANES
    return rows + (GEMM_LANES - 1) * min(groups, rows)

# GPU-resident matrices dequantize at most this many values per step (gpu.quant), and so do
# the tiles of attention over a quantized KV cache (gpu.attention.kv_tile).
CHUNK_VALUES = 16 << 20
# Attention with sinks keeps at most this many float32 scores live at once (gpu.attention).
SCORE_VALUES = 16 << 20


def kv_tile_cells(n_head: int, n_kv: int, t: int, width: int) -> int:
    """Cells per tile of attention over a quantized KV cache (gpu.attention.attend_tiles): at
    most CHUNK_VALUES dequantized K (or V) values and SCORE_VALUES scores, at least one cache
    pad (256) of cells."""
    return max(CACHE_PAD, min(CHUNK_VALUES // (n_kv * width), SCORE_VALUES // (n_head * t)))


# Op offload copies an expert tensor's touched experts in chunks of at most this many bytes
# (gpu.experts): large enough that each copy runs at the link's speed.
STAGING_CHUNK_BYTES = 256 << 20


def staging_buffer_bytes(tensor_bytes: int, n_expert: int) -> int:
    """One op-offload staging buffer for an (n_expert, ...) expert tensor of ``tensor_bytes``:
    the chunk size, within [one expert's slice, the whole tensor]. The staging stays small
    next to a big model's expert tensors (DeepSeek-V3's Q6_K ffn_down_exps is 3.1 GB) while
    each copy is long enough to run at the link's speed."""
    return min(tensor_bytes, max(STAGING_CHUNK_BYTES, tensor_bytes // n_expert))

# llama.cpp pads the KV cache to a multiple of 256 cells; so do the planner and the runtime.
CACHE_PAD = 256


def pad(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def int8_request(batch: int, int8_from: int | None, decode: str | None = None) -> bool | str | None:
    """The int8 request for a CPU kernel call over ``batch`` tokens: decode/verify batches (at
    most ``DECODE_TOKENS``) as ``decode`` says (a key of ``DECODE_ACTIVATIONS``; the routed
    experts), larger ones, or any when ``decode`` is None, int8 from ``int8_from`` tokens on
    (prompt prefill); None when ``int8_from`` is None there (the process setting)."""
    if decode is not None and batch <= DECODE_TOKENS:
        return DECODE_ACTIVATIONS[decode]
    return None if int8_from is None else batch >= int8_from


def wants_int8(request: bool | str, qtype: Q, auto_types: frozenset | None = None) -> bool:
    """Whether weights of ``qtype`` are to take int8 activations under ``request`` (True, False
    or AUTO: the types in ``auto_types``, the set chosen for the CPU at hand — offload.decode_int8
    — or DECODE_INT8_TYPES where none was chosen). Whether they then do is the kernels' to say:
    an int8 decoder for the type (none for FLOAT_ACTIVATION_TYPES) and an integer dot product
    on the CPU (cpu_kernels.matmul.use_int8)."""
    if request == AUTO:
        return qtype in (DECODE_INT8_TYPES if auto_types is None else auto_types)
    return bool(request)
