"""Fused dequant-matmul in Triton for decode shapes: ``y = x @ W^T`` with W read as the
file's raw GGUF blocks (uint8 rows, as ``QuantTensor.upload`` holds them), each byte read once.

One kernel for every type: a program owns ``BLOCK_N`` weight rows and walks the row in
tiles of ``BLOCK_K`` elements, viewed as (BLOCK_N, S, 32) — S sub-blocks of 32 elements,
the granularity every supported type shares. Per-sub-block fields (scales, mins, d) are
loaded once per (row, sub-block) and broadcast; each quant byte is loaded per element (a
nibble byte twice, from L1). The dequantized tile is cast to x's dtype and fed to ``tl.dot``
with a float32 accumulator; x is at most ``TILE_B`` = 16 rows (masked). Long rows are split
across programs (split-K) into float32 partials summed afterwards, so narrow matrices still
fill the device.

Block layouts are ggml's (ggml-common.h ``block_*``; decoding as ggml-quants.c
``dequantize_row_*`` and gguf-py's ``quants.py``), the same as ``gpu.quant``'s dequantizers.
Under ``TRITON_INTERPRET=1`` (set before this module is imported) the kernel runs on CPU
tensors through Triton's interpreter; that is how the tests check it without a GPU.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from gpu.qtypes import FUSED_KERNEL_IDS, TILE_B, VALUE_TABLES

# The branch ids of _dequant as compile-time constants, from the one table of fused types (a
# name here without an entry there fails at import; an entry without a branch fails to compile).
_Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1, _IQ4_NL, _MXFP4, _IQ4_XS, _Q4_K, _Q5_K, _Q6_K = (
    tl.constexpr(FUSED_KERNEL_IDS[q]) for q in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.MXFP4,
                                                Q.IQ4_XS, Q.Q4_K, Q.Q5_K, Q.Q6_K))


@triton.jit
def _u8(w, o):
    return tl.load(w + o).to(tl.int32)


@triton.jit
def _i8(w, o):
    return tl.load(w + o).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _f16(w, o):   # little-endian IEEE half at byte offset o
    bits = tl.load(w + o).to(tl.uint16) | (tl.load(w + (o + 1)).to(tl.uint16) << 8)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(w, o, j):   # element j (0..31) of 16 packed bytes at o: low nibbles 0..15, high 16..31
    return (_u8(w, o + (j % 16)) >> (4 * (j // 16))) & 15


@triton.jit
def _lookup16(table, n):
    """table[n] for 4-bit indices n without a per-element gather (measured on an H200: the
    gather held IQ4_NL to 81 GB/s where Q4_0, the same layout without a table, ran at 478):
    the 16 entries are uniform scalar loads, the element's value a select tree on n's bits."""
    b0 = (n & 1) != 0
    b1 = (n & 2) != 0
    b2 = (n & 4) != 0
    v0 = tl.where(b1, tl.where(b0, tl.load(table + 3), tl.load(table + 2)),
                  tl.where(b0, tl.load(table + 1), tl.load(table + 0)))
    v1 = tl.where(b1, tl.where(b0, tl.load(table + 7), tl.load(table + 6)),
                  tl.where(b0, tl.load(table + 5), tl.load(table + 4)))
    v2 = tl.where(b1, tl.where(b0, tl.load(table + 11), tl.load(table + 10)),
                  tl.where(b0, tl.load(table + 9), tl.load(table + 8)))
    v3 = tl.where(b1, tl.where(b0, tl.load(table + 15), tl.load(table + 14)),
                  tl.where(b0, tl.load(table + 13), tl.load(table + 12)))
    return tl.where((n & 8) != 0, tl.where(b2, v3, v2), tl.where(b2, v1, v0))


@triton.jit
def _k4_scale_min(w, base, sub):
    """ggml get_scale_min_k4: 8 six-bit (scale, min) pairs packed in scales[12] at base+4."""
    a = _u8(w, base + 4 + sub % 4)          # scales[sub]      (sub < 4) / scales[sub-4]
    b = _u8(w, base + 8 + sub)              # scales[sub + 4]
    c = _u8(w, base + 4 + sub)              # scales[sub]
    lo = sub < 4
    sc = tl.where(lo, a & 63, (b & 15) | ((a >> 6) << 4))
    mn = tl.where(lo, b & 63, (b >> 4) | ((c >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant(wp, base, sub, j, table, QTYPE: tl.constexpr):
    """wp: the weight's first byte; base: (BN, S, 1) int32 byte offsets of each sub-block's
    block; sub: (1, S, 1) sub-block index in its block; j: (1, 1, 32) element in the
    sub-block → (BN, S, 32) float32 weights."""
    if QTYPE == _Q8_0:       # block_q8_0: d f16, qs[32] int8
        w = _f16(wp, base) * _i8(wp, base + 2 + j)
    elif QTYPE == _Q4_0:     # block_q4_0: d f16, qs[16]: (q - 8) * d
        w = _f16(wp, base) * (_nibble(wp, base + 2, j) - 8).to(tl.float32)
    elif QTYPE == _Q4_1:     # block_q4_1: d f16, m f16, qs[16]: q * d + m
        w = _f16(wp, base) * _nibble(wp, base + 4, j).to(tl.float32) + _f16(wp, base + 2)
    elif QTYPE == _Q5_0:     # block_q5_0: d f16, qh[4] (bit j: 5th bit of element j), qs[16]
        q = _nibble(wp, base + 6, j) | (((_u8(wp, base + 2 + j // 8) >> (j % 8)) & 1) << 4)
        w = _f16(wp, base) * (q - 16).to(tl.float32)
    elif QTYPE == _Q5_1:     # block_q5_1: d f16, m f16, qh[4], qs[16]: q * d + m
        q = _nibble(wp, base + 8, j) | (((_u8(wp, base + 4 + j // 8) >> (j % 8)) & 1) << 4)
        w = _f16(wp, base) * q.to(tl.float32) + _f16(wp, base + 2)
    elif QTYPE == _IQ4_NL:   # block_iq4_nl: d f16, qs[16]: d * kvalues_iq4nl[q]
        w = _f16(wp, base) * _lookup16(table, _nibble(wp, base + 2, j))
    elif QTYPE == _MXFP4:    # block_mxfp4: e (E8M0), qs[16]: 2^(e-128) * doubled e2m1 value
        e = _u8(wp, base)
        # ggml_e8m0_to_fp32_half, exact: denormal for e < 2, else exponent bits e-1
        half = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)
        w = half * _lookup16(table, _nibble(wp, base + 1, j))
    elif QTYPE == _IQ4_XS:   # block_iq4_xs: d f16, scales_h u16, scales_l[4], qs[128]
        sh = (_u8(wp, base + 2 + sub // 4) >> (2 * (sub % 4))) & 3
        sl = (_u8(wp, base + 4 + sub // 2) >> (4 * (sub % 2))) & 15
        dl = _f16(wp, base) * ((sl | (sh << 4)) - 32).to(tl.float32)
        w = dl * _lookup16(table, _nibble(wp, base + 8 + 16 * sub, j))
    elif QTYPE == _Q4_K:     # block_q4_K: d, dmin, scales[12], qs[128] (32 bytes per 2 sub-blocks)
        sc, mn = _k4_scale_min(wp, base, sub)
        q = (_u8(wp, base + 16 + 32 * (sub // 2) + j) >> (4 * (sub % 2))) & 15
        w = _f16(wp, base) * sc * q.to(tl.float32) - _f16(wp, base + 2) * mn
    elif QTYPE == _Q5_K:     # block_q5_K: d, dmin, scales[12], qh[32], qs[128]; qh bit sub of byte j
        sc, mn = _k4_scale_min(wp, base, sub)
        q = (_u8(wp, base + 48 + 32 * (sub // 2) + j) >> (4 * (sub % 2))) & 15
        q = q | (((_u8(wp, base + 16 + j) >> sub) & 1) << 4)
        w = _f16(wp, base) * sc * q.to(tl.float32) - _f16(wp, base + 2) * mn
    elif QTYPE == _Q6_K:     # block_q6_K: ql[128], qh[64], scales[16] int8, d; halves of 128, rows of 32
        h = sub // 4
        g = sub % 4
        lo = (_u8(wp, base + 64 * h + 32 * (g % 2) + j) >> (4 * (g // 2))) & 15
        hi = (_u8(wp, base + 128 + 32 * h + j) >> (2 * g)) & 3
        sc = _i8(wp, base + 192 + 8 * h + 2 * g + j // 16)
        w = _f16(wp, base + 208) * sc * ((lo | (hi << 4)) - 32).to(tl.float32)
    else:
        tl.static_assert(False, "no _dequant branch for this QTYPE (gpu.qtypes.FUSED_KERNEL_IDS)")
    return w


@triton.jit
def _fused_kernel(w_ptr, x_ptr, y_ptr, table, B, N, K, w_row_stride, x_row_stride, tiles_per_split,
                  QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
                  BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    S: tl.constexpr = BLOCK_K // 32
    SUBS: tl.constexpr = QK // 32                                   # sub-blocks per block
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_off = tl.minimum(rows, N - 1) * w_row_stride                # (BN,) clamped: loads stay in bounds
    bs = tl.arange(0, BLOCK_B)
    s_idx = tl.arange(0, S)
    j = tl.arange(0, 32)[None, None, :]
    acc = tl.zeros((BLOCK_B, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * tiles_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + tiles_per_split * BLOCK_K, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        g = k0 // 32 + s_idx                                        # (S,) global sub-block
        base = row_off[:, None, None] + ((g // SUBS) * TYPE_SIZE)[None, :, None]
        w = _dequant(w_ptr, base, (g % SUBS)[None, :, None], j, table, QTYPE)   # (BN, S, 32)
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        kk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + bs[:, None] * x_row_stride + kk[None, :], mask=bs[:, None] < B, other=0.0)
        wq = w.to(xt.dtype)                                         # what the product runs in
        if UPCAST:   # float32 x, or the interpreter (its tl.dot multiplies bf16 raw bits):
            # the same products — bf16·bf16 is exact in float32 — in an IEEE float32 dot
            acc += tl.dot(xt.to(tl.float32), tl.trans(wq.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(xt, tl.trans(wq))
    out = y_ptr + pid_k * B * N + bs[:, None] * N + rows[None, :]
    tl.store(out, acc, mask=(bs[:, None] < B) & (rows[None, :] < N))


@lru_cache(maxsize=None)
def _table(qtype: Q, device: torch.device) -> torch.Tensor:
    """The type's 16-entry value table on ``device`` (a dummy for types without one)."""
    return torch.tensor(VALUE_TABLES.get(qtype, (0,) * 16), dtype=torch.float32, device=device)


@lru_cache(maxsize=None)
def _n_programs_wanted(device: torch.device) -> int:
    """Enough programs to fill the device: a few per streaming multiprocessor."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 1


_OFFSET_LIMIT = 2**31 - 1   # the kernel's byte offsets within a matrix are int32 (fewer registers)


def _block_k(cols: int) -> int:
    for bk in (128, 64, 32):
        if cols % bk == 0:
            return bk
    raise ValueError(f"row length {cols} is not a multiple of 32")


def _kernel_id(qtype: Q) -> int:
    """The ``QTYPE`` the kernel switches on; a type without a decode branch never reaches it."""
    if qtype not in FUSED_KERNEL_IDS:
        raise NotImplementedError(f"no fused kernel for {qtype.name}")
    return FUSED_KERNEL_IDS[qtype]


def fused_linear(raw: torch.Tensor, qtype: Q, x: torch.Tensor, *, block_n: int = 32,
                 split_k: int | None = None) -> torch.Tensor:
    """raw: (N, row_bytes) uint8 GGUF rows (rows may be strided, bytes within a row contiguous),
    x: (B, K) with B ≤ 16 → (B, N) in x's dtype. ``split_k``: programs per row (default: enough
    to give the device a few programs per multiprocessor)."""
    qtype_id = _kernel_id(qtype)
    qk, type_size = GGML_QUANT_SIZES[qtype]
    n, row_bytes = raw.shape
    b, k = x.shape
    if not 0 < b <= TILE_B:
        raise ValueError(f"fused kernel takes 1..{TILE_B} rows of x, got {b}")
    if row_bytes != k // qk * type_size or k % qk or raw.stride(1) != 1:
        raise ValueError(f"{qtype.name} rows of {row_bytes} bytes (stride {raw.stride()}) do not hold {k} columns")
    x = x.contiguous()
    span = max(1, _OFFSET_LIMIT // raw.stride(0))                   # rows whose byte offsets fit int32
    if n > span:
        return torch.cat([fused_linear(raw[r:r + span], qtype, x, block_n=block_n, split_k=split_k)
                          for r in range(0, n, span)], dim=1)
    bk = _block_k(k)
    tiles = k // bk
    n_blocks = triton.cdiv(n, block_n)
    if split_k is None:
        split_k = max(1, min(tiles, _n_programs_wanted(x.device) // n_blocks))
    per_split = triton.cdiv(tiles, split_k)
    split_k = triton.cdiv(tiles, per_split)                          # no empty splits
    part = torch.empty((split_k, b, n), dtype=torch.float32, device=x.device)
    _fused_kernel[(n_blocks, split_k)](
        raw, x, part, _table(qtype, x.device), b, n, k, raw.stride(0), x.stride(0), per_split,
        QTYPE=qtype_id, QK=qk, TYPE_SIZE=type_size, BLOCK_B=TILE_B, BLOCK_N=block_n,
        BLOCK_K=bk, UPCAST=x.dtype == torch.float32 or x.device.type == "cpu")
    y = part[0] if split_k == 1 else part.sum(0)
    return y.to(x.dtype)


def compile_for(qtype: Q, x_dtype: torch.dtype, capability: int, *, block_n: int = 32, block_k: int = 128,
                num_warps: int = 4):
    """Compile the kernel ahead of time for an NVIDIA GPU of compute ``capability`` (80:
    Ampere, 90: Hopper) on a machine without one — triton ships ptxas — so lowering errors
    and shared-memory use show before any device run. Needs the compiled (not interpreted)
    kernel: call it without TRITON_INTERPRET. Returns triton's compiled kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if not hasattr(_fused_kernel, "arg_names"):
        raise RuntimeError("compile_for needs the compiled kernel: unset TRITON_INTERPRET")
    qk, type_size = GGML_QUANT_SIZES[qtype]
    x_ty = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[x_dtype]
    runtime = dict(w_ptr="*u8", x_ptr=x_ty, y_ptr="*fp32", table="*fp32", B="i32", N="i32", K="i32",
                   w_row_stride="i32", x_row_stride="i32", tiles_per_split="i32")
    constants = dict(QTYPE=_kernel_id(qtype), QK=qk, TYPE_SIZE=type_size, BLOCK_B=TILE_B, BLOCK_N=block_n,
                     BLOCK_K=block_k, UPCAST=x_dtype == torch.float32)
    src = ASTSource(fn=_fused_kernel, signature=runtime | {k: "constexpr" for k in constants},
                    constexprs=constants)
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
