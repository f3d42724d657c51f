"""Per-layer KV cache on the layer's device with ``truncate(n)`` rollback.

Storage grows by doubling, so appending one token is a slice copy, not a re-allocation;
``truncate`` only moves the length (the stale tail is overwritten by the next append).
Doubling stops at ``max_cells`` (the planner's cell count for the context), so the cache never
holds more than the plan counted.

``head_dim_v=0`` makes a K-only cache: MLA's compressed latent (one row of
``kv_lora_rank + rope dims`` per token, whose first ``kv_lora_rank`` values serve as V), as
llama.cpp's V-less MLA cache and the planner count it.

A cache type is a torch float dtype, or a block-quantized GGUF type (a quantized
``--cache-type``: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL). A quantized cache stores each
head's row of D values as D / 32 GGUF blocks (uint8 storage, exactly the planner's bytes),
quantized as it is appended (``gpu.quantize``, ggml's reference rounding); rows never share
a block, so appending and rolling back are exact, byte for byte. Its ``append`` returns
``QuantRows``, which attention dequantizes a tile of cells at a time. K and V may have
different types (llama.cpp's ``-ctk`` / ``-ctv``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from gpu.quant import dequantize
from gpu.quantize import QUANTIZERS, quantize

CacheType = torch.dtype | Q
# the compiled CPU block's names for the float cache types (cpu_kernels.kv_rows)
FLOAT_TYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def type_name(t: CacheType) -> str:
    """The cache type's GGUF name (F16, Q8_0, ...)."""
    return t.name if isinstance(t, Q) else FLOAT_TYPE_NAMES[t]


@dataclass(frozen=True)
class QuantRows:
    """The first cells of a quantized cache: raw (H_kv, cells, D / 32 · block bytes)."""
    raw: torch.Tensor
    qtype: Q
    width: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.raw.shape[0], self.raw.shape[1], self.width

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def tile(self, j0: int, j1: int) -> torch.Tensor:
        """Cells j0..j1-1 as float32 (H_kv, j1 - j0, D)."""
        return dequantize(self.raw[:, j0:j1], self.qtype)

    def float(self) -> torch.Tensor:
        return self.tile(0, self.raw.shape[1])


def cache_storage(n_head: int, cap: int, width: int, t: CacheType, device) -> torch.Tensor:
    if isinstance(t, Q):
        if t not in QUANTIZERS:
            raise ValueError(f"no KV cache of type {t.name}")
        block, size = GGML_QUANT_SIZES[t]
        if width % block:
            raise ValueError(f"a {t.name} KV cache needs rows of a multiple of {block} values, not {width}")
        return torch.empty(n_head, cap, width // block * size, device=device, dtype=torch.uint8)
    return torch.empty(n_head, cap, width, device=device, dtype=t)


class KVCache:
    start = 0      # the position of the oldest row kept (a window cache drops old rows)

    def __init__(self, n_head_kv: int, head_dim: int, *, head_dim_v: int | None = None,
                 device: torch.device, dtype: CacheType = torch.float32, dtype_v: CacheType | None = None,
                 capacity: int = 256, max_cells: int | None = None):
        if max_cells is not None:
            capacity = min(capacity, max_cells)
        self.max_cells = max_cells
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.k_type, self.v_type = dtype, dtype if dtype_v is None else dtype_v
        self.head_dim, self.head_dim_v = head_dim, head_dim_v
        self.k = cache_storage(n_head_kv, capacity, head_dim, self.k_type, device)
        self.v = cache_storage(n_head_kv, capacity, head_dim_v, self.v_type, device) if head_dim_v else None
        self.length = 0
        self._raw: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.length

    def _grow(self, t: torch.Tensor, cap: int) -> torch.Tensor:
        new = t.new_empty(t.shape[0], cap, t.shape[2])
        new[:, :self.length] = t[:, :self.length]
        return new

    def append(self, k: torch.Tensor, v: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k, v: (H_kv, T, D) (v None for a K-only cache). Returns the cached keys/values
        (H_kv, length, D) incl. these (values None for a K-only cache)."""
        need = self.reserve(k.shape[1])
        self.k[:, self.length:need] = encode_rows(k, self.k_type)
        if self.v is not None:
            self.v[:, self.length:need] = encode_rows(v, self.v_type)
        self.length = need
        return (_rows(self.k, need, self.k_type, self.head_dim),
                None if self.v is None else _rows(self.v, need, self.v_type, self.head_dim_v))

    def reserve(self, t: int) -> int:
        """Make room for t more positions (a compiled block writes them in place, then
        advances ``length``); returns length + t."""
        need = self.length + t
        if need > self.k.shape[1]:
            cap = max(need, 2 * self.k.shape[1])
            if self.max_cells is not None:
                cap = max(need, min(cap, self.max_cells))   # past max_cells only if asked to
            self.k = self._grow(self.k, cap)
            if self.v is not None:
                self.v = self._grow(self.v, cap)
            self._raw = None
        return need

    def raw(self) -> tuple[np.ndarray, np.ndarray]:
        """The CPU storage of k and v as uint8 numpy views (H_kv, cells, D · element size),
        no copy; kept until the storage grows (compiled CPU blocks write and read it)."""
        if self._raw is None:
            self._raw = (self.k.view(torch.uint8).numpy(), self.v.view(torch.uint8).numpy())
        return self._raw

    def truncate(self, n: int) -> None:
        """Keep the first n positions (rollback of rejected draft tokens)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {n}")
        self.length = n

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    @property
    def type_names(self) -> tuple[str, str]:
        """GGUF names of the K and V types (the compiled CPU block's cache tags)."""
        return type_name(self.k_type), type_name(self.v_type)


def encode_rows(x: torch.Tensor, t: CacheType) -> torch.Tensor:
    """Rows (H, T, D) as the cache stores them."""
    return quantize(x, t) if isinstance(t, Q) else x.to(t)


def _rows(buf: torch.Tensor, n: int, t: CacheType, width: int) -> torch.Tensor | QuantRows:
    return QuantRows(buf[:, :n], t, width) if isinstance(t, Q) else buf[:, :n]


class WindowKVCache(KVCache):
    """The cache of a sliding-window block: only the keys a query can still see are kept.

    Query p sees keys p - window + 1 .. p. ``length`` stays the number of positions seen (the
    sequence length); ``start`` is the position of the oldest row kept. The storage never
    exceeds ``max_cells`` (the planner's ``min(pad256(ctx), pad256(window + ubatch))``): when an
    append of T rows would overflow it, the rows older than the last ``window - 1`` are dropped
    first (one shift, amortised over many appends). Rolling back (``truncate``) works as far as
    the rows kept allow — always within the batch just appended, which is what speculative
    verify needs; further back raises."""

    def __init__(self, n_head_kv: int, head_dim: int, *, window: int, max_cells: int | None,
                 device: torch.device, dtype: CacheType = torch.float32, dtype_v: CacheType | None = None,
                 head_dim_v: int | None = None):
        super().__init__(n_head_kv, head_dim, device=device, dtype=dtype, dtype_v=dtype_v,
                         max_cells=max_cells, head_dim_v=head_dim_v)
        self.window, self.start = window, 0

    def make_room(self, t: int) -> int:
        """Room for t more rows: when they would overflow ``max_cells``, the rows older than
        the last ``window - 1`` are dropped first. Returns the cell the first new row goes to
        (a compiled block writes them there, then advances ``length``)."""
        stored = self.length - self.start
        if self.max_cells is not None and stored + t > self.max_cells and stored > self.window - 1:
            keep = self.window - 1
            drop = stored - keep
            for buf in (self.k, self.v):
                if buf is not None:          # K-only (head_dim_v=0): no V rows
                    buf[:, :keep] = buf[:, drop:stored].clone()
            self.start += drop
        self.length -= self.start
        try:
            self.reserve(t)
        finally:
            self.length += self.start
        return self.length - self.start

    def append(self, k: torch.Tensor, v: torch.Tensor | None = None):
        self.make_room(k.shape[1])
        # the parent appends at ``length``: shift the view so it indexes the stored rows
        self.length -= self.start
        try:
            return super().append(k, v)
        finally:
            self.length += self.start

    def truncate(self, n: int) -> None:
        if 0 <= n <= self.length and self.start > max(0, n - self.window + 1):
            raise ValueError(f"sliding-window cache keeps positions {self.start}..{self.length - 1}: "
                             f"cannot roll back to {n}")
        super().truncate(n)


def spans(rows: list[int]) -> list[tuple[int, int]]:
    """(lo, hi) of each sequence's rows in a batch of sequences ``rows[i]`` rows long each."""
    out, lo = [], 0
    for n in rows:
        out.append((lo, lo + n))
        lo += n
    return out


class Segments(list):
    """What ``SequenceBatch.append`` returns for keys (or values): one sequence's cached rows
    per item, in batch order, with ``rows`` the new rows each sequence brought. ``attention.attend``
    attends each sequence's queries over its own item."""

    def __init__(self, items, rows: list[int]):
        super().__init__(items)
        self.rows = rows


class SequenceBatch:
    """Several sequences' caches of one block, stepped as one batch (continuous batching):
    the batch's T rows are the sequences' rows one after another, ``rows[i]`` of them for
    sequence i. ``append`` splits the new K/V rows (H, T, D) by sequence into each cache and
    returns ``Segments``; attention then runs per sequence over its own cache while every
    projection and the MoE see all T rows at once."""

    def __init__(self, caches: list, rows: list[int]):
        if len(caches) != len(rows):
            raise ValueError(f"{len(caches)} caches for {len(rows)} row counts")
        self.caches, self.rows = caches, rows

    def append(self, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple[Segments, Segments]:
        keys, values = [], []
        for cache, (lo, hi) in zip(self.caches, spans(self.rows)):
            kk, vv = cache.append(k[:, lo:hi], None if v is None else v[:, lo:hi])
            keys.append(kk)
            values.append(vv)
        return Segments(keys, self.rows), Segments(values, self.rows)
