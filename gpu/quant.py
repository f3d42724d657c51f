"""GGUF quant blocks → float, in torch, on whatever device holds them.

GPU-resident weights stay as the file's raw blocks (a uint8 tensor, exactly the bytes the
planner counts) and are dequantized per call, a bounded chunk at a time. One function per
type, registered by ``gguf.GGMLQuantizationType``; each mirrors ggml's block layout
(``block_q4_0``, ``block_q4_K``, …, as in ggml-quants.c / gguf-py's reference) and is tested
against ``gguf.quants.dequantize``.

Each function takes blocks ``(N, type_size)`` uint8 and returns ``(N, block_size)`` float32.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from gpu import fused
from gpu.qtypes import IQ4_NL_VALUES, MXFP4_VALUES
from placement.limits import CHUNK_VALUES

DEQUANTIZERS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {}


def _register(qtype: Q):
    def deco(fn):
        DEQUANTIZERS[qtype] = fn
        return fn
    return deco


def supported(qtype: Q) -> bool:
    return qtype in DEQUANTIZERS or qtype in (Q.F32, Q.F16)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(N, 2) uint8 → (N, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(N, 16) packed 4-bit → (N, 32): low nibbles are elements 0..15, high ones 16..31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(x: torch.Tensor, n_bits: int) -> torch.Tensor:
    """(N, B) uint8 → (N, B*8//n_bits) fields, least significant first within each byte."""
    shifts = torch.arange(0, 8, n_bits, device=x.device, dtype=torch.uint8)
    return ((x[..., None] >> shifts) & ((1 << n_bits) - 1)).flatten(-2)


@_register(Q.BF16)
def _bf16(b):   # (N, 2): the high half of a float32
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


@_register(Q.Q8_0)
def _q8_0(b):   # d f16, qs[32] int8
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


@_register(Q.Q4_0)
def _q4_0(b):   # d f16, qs[16]: (q - 8) * d
    return _f16(b[:, :2]) * (_nibbles(b[:, 2:]).float() - 8)


@_register(Q.Q4_1)
def _q4_1(b):   # d f16, m f16, qs[16]: q * d + m
    return _f16(b[:, :2]) * _nibbles(b[:, 4:]).float() + _f16(b[:, 2:4])


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    """qh[4] little-endian uint32 → (N, 32) fifth bits, bit j for element j."""
    return _bits(qh, 1) << 4


@_register(Q.Q5_0)
def _q5_0(b):   # d f16, qh[4], qs[16]: (q - 16) * d
    return _f16(b[:, :2]) * ((_nibbles(b[:, 6:]) | _q5_high(b[:, 2:6])).float() - 16)


@_register(Q.Q5_1)
def _q5_1(b):   # d f16, m f16, qh[4], qs[16]: q * d + m
    return _f16(b[:, :2]) * (_nibbles(b[:, 8:]) | _q5_high(b[:, 4:8])).float() + _f16(b[:, 2:4])


def _lookup(table, idx: torch.Tensor) -> torch.Tensor:
    return torch.tensor(table, dtype=torch.float32, device=idx.device)[idx.long()]


@_register(Q.IQ4_NL)
def _iq4_nl(b):   # d f16, qs[16]: d * kvalues[q]
    return _f16(b[:, :2]) * _lookup(IQ4_NL_VALUES, _nibbles(b[:, 2:]))


@_register(Q.MXFP4)
def _mxfp4(b):    # e (E8M0), qs[16]: 2^(e-128) * doubled e2m1 value
    d = torch.exp2(b[:, :1].float() - 128)
    return d * _lookup(MXFP4_VALUES, _nibbles(b[:, 1:]))


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed scale bytes of Q4_K/Q5_K → 8 six-bit (scale, min) pairs, (N, 8) each."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat((lo_sc, hi_sc), 1).float(), torch.cat((lo_m, hi_m), 1).float()


@_register(Q.Q4_K)
def _q4_k(b):   # d, dmin, scales[12], qs[128]; 8 sub-blocks of 32: d*sc*q - dmin*m
    n = b.shape[0]
    sc, m = _k_scale_min(b[:, 4:16])
    qs = b[:, 16:].reshape(n, 4, 32)
    q = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32).float()
    y = _f16(b[:, 0:2])[..., None] * sc[..., None] * q - _f16(b[:, 2:4])[..., None] * m[..., None]
    return y.reshape(n, 256)


@_register(Q.Q5_K)
def _q5_k(b):   # d, dmin, scales[12], qh[32], qs[128]; bit 2j / 2j+1 of qh are sub-blocks 2j, 2j+1
    n = b.shape[0]
    sc, m = _k_scale_min(b[:, 4:16])
    qs = b[:, 48:].reshape(n, 4, 32)
    q = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(n, 8, 32)
    hi = ((b[:, 16:48][:, None, :] >> torch.arange(8, device=b.device, dtype=torch.uint8)[None, :, None]) & 1) << 4
    q = (q | hi).float()
    y = _f16(b[:, 0:2])[..., None] * sc[..., None] * q - _f16(b[:, 2:4])[..., None] * m[..., None]
    return y.reshape(n, 256)


@_register(Q.Q6_K)
def _q6_k(b):   # ql[128], qh[64], scales[16] int8, d f16; two halves of 128, four rows of 32
    n = b.shape[0]
    ql = b[:, :128].reshape(n, 2, 64)
    qh = b[:, 128:192].reshape(n, 2, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(n, 2, 8)
    d = _f16(b[:, 208:210]).reshape(n, 1, 1, 1)
    lo = torch.stack((ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4), 2)
    hi = torch.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)
    q = (lo | (hi << 4)).float() - 32                                   # (n, 2, 4, 32)
    s = sc.reshape(n, 2, 4, 2)[..., None].expand(n, 2, 4, 2, 16).reshape(n, 2, 4, 32)
    return (d * s * q).reshape(n, 256)


@_register(Q.Q2_K)
def _q2_k(b):   # scales[16] (lo: scale, hi: min), qs[64], d, dmin
    n = b.shape[0]
    sc = (b[:, :16] & 0x0F).float().reshape(n, 2, 4, 2, 1)
    mn = (b[:, :16] >> 4).float().reshape(n, 2, 4, 2, 1)
    qs = b[:, 16:80].reshape(n, 2, 1, 2, 16)
    shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8).reshape(1, 1, 4, 1, 1)
    q = ((qs >> shifts) & 3).float()                                   # (n, 2 halves, 4 shifts, 2, 16)
    d, dmin = _f16(b[:, 80:82]).reshape(n, 1, 1, 1, 1), _f16(b[:, 82:84]).reshape(n, 1, 1, 1, 1)
    return (d * sc * q - dmin * mn).reshape(n, 256)


@_register(Q.Q3_K)
def _q3_k(b):   # hmask[32], qs[64], scales[12] (16 six-bit, biased by 32), d
    n = b.shape[0]
    s = b[:, 96:108].to(torch.int32)
    lo = torch.cat((s[:, 0:8] & 0x0F, s[:, 0:8] >> 4), 1)              # low 4 bits of scales 0..15
    hi = ((s[:, 8:12][:, None, :] >> torch.tensor([0, 2, 4, 6], device=b.device)[:, None]) & 3)
    scales = (lo | (hi.reshape(n, 16) << 4)).float() - 32              # (n, 16)
    qs = b[:, 32:96].reshape(n, 2, 1, 2, 16)
    shifts = torch.arange(0, 8, 2, device=b.device, dtype=torch.uint8).reshape(1, 1, 4, 1, 1)
    q = ((qs >> shifts) & 3).to(torch.int32)                           # (n, 2, 4, 2, 16)
    hm = b[:, :32].reshape(n, 1, 1, 2, 16)
    bit = torch.arange(8, device=b.device, dtype=torch.uint8).reshape(1, 2, 4, 1, 1)
    q = q - 4 * (((hm >> bit) & 1) == 0).to(torch.int32)
    d = _f16(b[:, 108:110]).reshape(n, 1, 1, 1, 1)
    return (d * scales.reshape(n, 2, 4, 2, 1) * q.float()).reshape(n, 256)


@_register(Q.IQ4_XS)
def _iq4_xs(b):  # d f16, scales_h u16, scales_l[4], qs[128]; 8 sub-blocks of 32
    n = b.shape[0]
    d = _f16(b[:, :2])
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    sl = _bits(b[:, 4:8], 4).to(torch.int32)                            # (n, 8)
    shf = (sh >> (2 * torch.arange(8, device=b.device))) & 3
    dl = d * ((sl | (shf << 4)).float() - 32)                           # (n, 8)
    qs = b[:, 8:].reshape(n, 8, 16)
    q = _lookup(IQ4_NL_VALUES, torch.cat((qs & 0x0F, qs >> 4), -1))     # (n, 8, 32)
    return (dl[..., None] * q).reshape(n, 256)


# ---- lattice ("i-") quants: groups of 8 (IQ3: 4) weights index a fixed grid, plus signs.
# The grids and ggml's ksigns_iq2xs are gguf-py's (the values its numpy dequantizers use),
# copied once per device. Arithmetic in gguf-py's order, so results are bit-identical.

@functools.lru_cache(maxsize=None)
def _iq_table(name: str, device: torch.device) -> torch.Tensor:
    """gguf-py's grid of type ``name`` as float32 (entries, 8 or 4), or "ksigns": (128, 8)
    of ±1.0 (bit j of ksigns_iq2xs[i] set: weight j negated)."""
    if name == "ksigns":
        k = np.frombuffer(gguf_quants.IQ2_XXS.ksigns, dtype=np.uint8)
        t = np.where((k[:, None] >> np.arange(8)) & 1, np.float32(-1), np.float32(1))
    else:
        cls = getattr(gguf_quants, name)
        cls.init_grid()
        t = np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)
    return torch.from_numpy(np.ascontiguousarray(t)).to(device)


def _sign_bits(s: torch.Tensor) -> torch.Tensor:
    """(..., ) sign bytes (uint8) → (..., 8) ±1.0, bit j negating weight j."""
    bits = (s[..., None] >> torch.arange(8, device=s.device, dtype=torch.uint8)) & 1
    return torch.where(bits == 0, 1.0, -1.0)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """(..., 4k) uint8 → (..., k) int64, little-endian words."""
    return b.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _u16(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _ksigns(aux: torch.Tensor) -> torch.Tensor:
    """(n, 8) u32 words with 4 x 7-bit ksigns indices → (n, 8, 4, 8) ±1.0."""
    idx = (aux[..., None] >> torch.tensor([0, 7, 14, 21], device=aux.device)) & 127
    return _iq_table("ksigns", aux.device)[idx]


@_register(Q.IQ2_XXS)
def _iq2_xxs(b):   # d f16, per 32: 4 grid indices (u8) + u32 (4 x 7-bit ksigns, 4-bit scale)
    n = b.shape[0]
    d = _f16(b[:, :2]).reshape(n, 1, 1, 1)
    w = _u32(b[:, 2:]).reshape(n, 8, 2)
    db = d * (0.5 + (w[..., 1] >> 28).float().reshape(n, 8, 1, 1)) * 0.25
    idx = b[:, 2:].reshape(n, 8, 8)[..., :4].long()
    return (db * _iq_table("IQ2_XXS", b.device)[idx] * _ksigns(w[..., 1])).reshape(n, 256)


@_register(Q.IQ2_XS)
def _iq2_xs(b):    # d f16, qs u16[32] (9-bit index, 7-bit ksigns index), scales[8] (nibble per 16)
    n = b.shape[0]
    d = _f16(b[:, :2]).reshape(n, 1, 1, 1)
    qs = _u16(b[:, 2:66]).reshape(n, 16, 2)
    db = d * (0.5 + _bits(b[:, 66:74], 4).float().reshape(n, 16, 1, 1)) * 0.25
    grid = _iq_table("IQ2_XS", b.device)[qs & 511]
    return (db * grid * _iq_table("ksigns", b.device)[qs >> 9]).reshape(n, 256)


@_register(Q.IQ2_S)
def _iq2_s(b):     # d f16, qs[32], signs[32], qh[8] (2 high index bits per 8), scales[8]
    n = b.shape[0]
    d = _f16(b[:, :2]).reshape(n, 1, 1, 1)
    idx = b[:, 2:34].long() | (_bits(b[:, 66:74], 2).long() << 8)
    db = d * (0.5 + _bits(b[:, 74:82], 4).float().reshape(n, 16, 1, 1)) * 0.25
    grid = _iq_table("IQ2_S", b.device)[idx].reshape(n, 16, 2, 8)
    return (db * grid * _sign_bits(b[:, 34:66]).reshape(n, 16, 2, 8)).reshape(n, 256)


@_register(Q.IQ3_XXS)
def _iq3_xxs(b):   # d f16, qs[64] (indices of 4), u32[8] (4 x 7-bit ksigns, 4-bit scale)
    n = b.shape[0]
    d = _f16(b[:, :2]).reshape(n, 1, 1, 1)
    aux = _u32(b[:, 66:98])
    db = d * (0.5 + (aux >> 28).float().reshape(n, 8, 1, 1)) * 0.5
    grid = _iq_table("IQ3_XXS", b.device)[b[:, 2:66].long()].reshape(n, 8, 4, 8)
    return (db * grid * _ksigns(aux)).reshape(n, 256)


@_register(Q.IQ3_S)
def _iq3_s(b):     # d f16, qs[64], qh[8] (9th index bits), signs[32], scales[4] (nibble per 32)
    n = b.shape[0]
    d = _f16(b[:, :2]).reshape(n, 1, 1)
    idx = b[:, 2:66].long() | (_bits(b[:, 66:74], 1).long() << 8)
    db = d * (1 + 2 * _bits(b[:, 106:110], 4).float().reshape(n, 8, 1))
    grid = _iq_table("IQ3_S", b.device)[idx].reshape(n, 8, 32)
    return (db * grid * _sign_bits(b[:, 74:106]).reshape(n, 8, 32)).reshape(n, 256)


@_register(Q.IQ1_S)
def _iq1_s(b):     # d f16, qs[32], qh u16[8]: 3 high index bits per 8, scale (bits 12-14), delta sign
    n = b.shape[0]
    d = _f16(b[:, :2]).reshape(n, 1, 1, 1)
    qh = _u16(b[:, 34:50]).reshape(n, 8, 1)
    dl = d * (2 * ((qh >> 12) & 7) + 1).float().reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125).reshape(n, 8, 1, 1)
    idx = b[:, 2:34].long().reshape(n, 8, 4) | (((qh >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7) << 8)
    return (dl * (_iq_table("IQ1_S", b.device)[idx] + delta)).reshape(n, 256)


@_register(Q.IQ1_M)
def _iq1_m(b):     # qs[32], qh[16] (3 index bits + delta sign per 8), scales u16[4]: 3-bit scale per 16, d in top nibbles
    n = b.shape[0]
    sc = _u16(b[:, 48:56])                                              # (n, 4)
    d = ((sc & 0xF000) >> torch.tensor([12, 8, 4, 0], device=b.device)).sum(1)
    d = torch.where(d >= 0x8000, d - 0x10000, d).to(torch.int16)        # the f16's bits, in range
    d = d.view(torch.float16).float().reshape(n, 1, 1, 1, 1)
    s = (sc[..., None] >> torch.tensor([0, 3, 6, 9], device=b.device)) & 7
    dl = d * (2 * s + 1).float().reshape(n, 8, 2, 1, 1)
    qh = _bits(b[:, 32:48], 4).long().reshape(n, 8, 2, 2)
    idx = b[:, :32].long().reshape(n, 8, 2, 2) | ((qh & 7) << 8)
    delta = torch.where((qh & 8) == 0, 0.125, -0.125)[..., None]
    return (dl * (_iq_table("IQ1_S", b.device)[idx] + delta)).reshape(n, 256)


def dequantize(raw: torch.Tensor, qtype: Q, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Raw data of a tensor (as GGUFReader shapes it: uint8 ``(..., row_bytes)`` for block
    types, typed arrays for F32/F16) → float ``(..., cols)`` in ``dtype``."""
    if qtype in (Q.F32, Q.F16):
        return raw.to(dtype)
    if qtype not in DEQUANTIZERS:
        raise NotImplementedError(f"no torch dequantizer for {qtype.name}")
    block, size = GGML_QUANT_SIZES[qtype]
    lead = raw.shape[:-1]
    out = DEQUANTIZERS[qtype](raw.reshape(-1, size))
    return out.reshape(*lead, raw.shape[-1] // size * block).to(dtype)


_TORCH_OF = {np.uint8: torch.uint8, np.float32: torch.float32, np.float16: torch.float16}


class QuantTensor:
    """One GGUF tensor held on a torch device as the file's raw data — exactly the bytes the
    planner counts — dequantized when used. ``shape`` is the logical numpy-order shape.
    Indexing the leading dim (``t[e]`` for one expert of a 3-D tensor) is a view."""

    def __init__(self, raw: torch.Tensor, qtype: Q, shape: tuple[int, ...]):
        if not supported(qtype):
            raise NotImplementedError(f"no torch dequantizer for {qtype.name}")
        self.raw, self.qtype, self.shape = raw, qtype, tuple(shape)
        self.device = raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel() * self.raw.element_size()

    @classmethod
    def upload(cls, data, qtype: Q, shape: tuple[int, ...], device: torch.device) -> "QuantTensor":
        """Copy raw GGUF data (a read-only memmap view) to ``device`` without changing a byte,
        a slice at a time so the host-side temporary stays small."""
        raw = torch.empty(data.shape, dtype=_TORCH_OF[data.dtype.type], device=device)
        step = max(1, (CHUNK_VALUES * 4) // max(1, data[0].nbytes)) if data.ndim > 1 else data.shape[0]
        for i in range(0, data.shape[0], step):
            raw[i:i + step].copy_(torch.from_numpy(np.array(data[i:i + step])))
        return cls(raw, qtype, shape)

    def __getitem__(self, i) -> "QuantTensor":
        return QuantTensor(self.raw[i], self.qtype, self.shape[1:])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.raw, self.qtype, dtype=dtype)

    def rows(self, idx: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``idx`` of a 2-D tensor, dequantized (embedding lookup)."""
        return dequantize(self.raw[idx], self.qtype, dtype=dtype)

    def linear(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x @ W^T`` for a 2-D tensor. x: (T, in) → (T, out) in ``dtype``. Decode shapes on a
        GPU read the raw blocks once through the fused kernel (``gpu.fused``); otherwise W is
        dequantized in row chunks so the float temporary stays bounded whatever its size."""
        x = x.to(dtype)
        if fused.use_fused(self.qtype, x.device, x.shape[0]):
            return fused.linear(self.raw, self.qtype, x)
        if self.qtype == Q.F32 and dtype == torch.float32 or self.qtype == Q.F16 and dtype == torch.float16:
            return torch.nn.functional.linear(x, self.raw)
        rows, cols = self.shape
        step = max(1, CHUNK_VALUES // cols)
        if step >= rows:
            return torch.nn.functional.linear(x, self.dequantize(dtype))
        out = torch.empty(x.shape[0], rows, dtype=dtype, device=x.device)
        for r in range(0, rows, step):
            out[:, r:r + step] = torch.nn.functional.linear(x, dequantize(self.raw[r:r + step], self.qtype, dtype=dtype))
        return out
