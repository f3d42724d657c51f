"""DeepSeek-V4's per-block caches, each with ``length`` and an exact ``truncate(n)``.

A block keeps (``placement.memory.Dsv4Cache`` sizes each part; the plan counts these bytes):

* the raw window ring: the last ``sliding_window`` K rows (K = V, one shared head), a K-only
  ``WindowKVCache``;
* on compressed blocks, the compressed K entries (``CompressedRows``: entry w summarises
  positions w·r … w·r + r − 1 and exists once position w·r + r − 1 was seen), and on CSA
  blocks the lightning indexer's own compressed keys;
* the compressors' per-token inputs (``CompressorState``: kv and gate rows in float32) of the
  window being filled, CSA's previous window (its windows overlap), and enough earlier rows that
  a rollback of up to ``DECODE_TOKENS`` positions can recompute every entry it drops from the
  same rows, bit for bit.

Rolling back is then: keep the first n positions of the ring, keep ``n // r`` entries, keep the
state rows before n. Rolling back further than the state rows reach raises ``ValueError``.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from gpu.kv_cache import CacheType, QuantRows, WindowKVCache, cache_storage, encode_rows
from placement.limits import DECODE_TOKENS


class CompressedRows:
    """Compressed K entries (rows of ``width``) in the cache type; ``count`` of them valid.
    ``max_rows`` (the plan's ``ceil(ctx / r)``) is allocated at once; None grows on demand.
    A quantized cache type (``gpu.kv_cache``) stores each entry as its own GGUF blocks,
    quantized once when the entry is made, so rolling back (``count``) is exact."""

    def __init__(self, width: int, *, max_rows: int | None, device: torch.device, dtype: CacheType):
        self.max_rows, self.width, self.dtype = max_rows, width, dtype
        self.rows = cache_storage(1, max_rows if max_rows is not None else 16, width, dtype, device)[0]
        self.count = 0

    def reserve(self, m: int) -> int:
        """Room for m more entries (grown, or past the plan's ``max_rows`` refused); returns
        count + m (a compiled block writes them in place, then advances ``count``)."""
        need = self.count + m
        if need > self.rows.shape[0]:
            if self.max_rows is not None:
                raise ValueError(f"{need} compressed entries exceed the {self.max_rows} the plan sized")
            grown = self.rows.new_empty(max(need, 2 * self.rows.shape[0]), self.rows.shape[1])
            grown[:self.count] = self.rows[:self.count]
            self.rows = grown
        return need

    def append(self, new: torch.Tensor) -> None:
        """new: (m, width) float entries, stored in the cache type."""
        need = self.reserve(new.shape[0])
        self.rows[self.count:need] = encode_rows(new, self.dtype)
        self.count = need

    def values(self, take: torch.Tensor | None = None) -> torch.Tensor:
        """The valid entries (or those at indices ``take``) as float32 (n, width); a quantized
        cache dequantizes only those."""
        rows = self.rows[:self.count] if take is None else self.rows[take]
        return QuantRows(rows[None], self.dtype, self.width).float()[0] if isinstance(self.dtype, Q) else rows.float()

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


class CompressorState:
    """A compressor's per-token inputs, float32 rows of ``width`` (kv then gate) for positions
    ``start`` … ``length − 1``. ``rows`` (the plan's ``state_rows``) bound what is kept."""

    def __init__(self, width: int, *, ratio: int, overlap: bool, rows: int | None, device: torch.device):
        self.ratio, self.overlap = ratio, overlap
        rows = rows if rows is not None else (2 if overlap else 1) * ratio + DECODE_TOKENS
        self.buf = torch.empty(rows, width, device=device, dtype=torch.float32)
        self.start = self.length = 0

    def first_needed(self, n: int) -> int:
        """The first position an entry still to come may read once n positions were seen:
        the start of the window being filled, or of the one before it (CSA's overlap)."""
        w = n // self.ratio - (1 if self.overlap else 0)
        return max(0, w * self.ratio)

    def extend(self, new: torch.Tensor) -> tuple[torch.Tensor, int]:
        """new: (T, width) rows of the next T positions → (rows of positions first..length−1
        incl. these, first), then keeps only what a later entry or a rollback of up to
        ``DECODE_TOKENS`` positions needs."""
        rows = torch.cat([self.buf[:self.length - self.start], new.float()])
        first = self.start
        keep = self.keep_after(new.shape[0])
        self.length += new.shape[0]
        self.buf[:rows.shape[0] - (keep - first)] = rows[keep - first:]
        self.start = keep
        return rows, first

    def keep_after(self, t: int) -> int:
        """The first position still held once t more were seen (what a later entry or a
        rollback of up to ``DECODE_TOKENS`` positions needs); refuses a state that would
        outgrow the planned rows. Nothing changes here (a compiled block moves the rows,
        then sets ``start`` and ``length``)."""
        # never before what is held: after a rollback of up to DECODE_TOKENS the state starts
        # later than first_needed asks, and rows[keep - first:] must not index from the end
        length = self.length + t
        keep = max(self.first_needed(max(0, length - DECODE_TOKENS)), self.start)
        if length - keep > self.buf.shape[0]:
            raise ValueError(f"compressor state of {length - keep} rows exceeds the {self.buf.shape[0]} planned")
        return keep

    def check_truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a compressor state of length {self.length} to {n}")
        if self.first_needed(n) < self.start:
            raise ValueError(f"compressor state keeps positions {self.start}..{self.length - 1}: "
                             f"cannot roll back to {n}")

    def truncate(self, n: int) -> None:
        self.check_truncate(n)
        self.length = n

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * 4


class Dsv4Cache:
    """One block's caches: ``window`` (every block), ``compressed`` + ``state`` (CSA and HCA
    blocks), ``index`` + ``index_state`` (CSA blocks' indexer); None where a block has none."""

    def __init__(self, window: WindowKVCache, compressed: CompressedRows | None = None,
                 state: CompressorState | None = None, index: CompressedRows | None = None,
                 index_state: CompressorState | None = None):
        self.window, self.compressed, self.state = window, compressed, state
        self.index, self.index_state = index, index_state

    @property
    def length(self) -> int:
        return self.window.length

    def __len__(self) -> int:
        return self.length

    @property
    def k(self) -> torch.Tensor:
        """The window ring's storage (what generic checks read as a cache's rows)."""
        return self.window.k

    def truncate(self, n: int) -> None:
        """Keep the first n positions of every part (checked before anything moves)."""
        states = [s for s in (self.state, self.index_state) if s is not None]
        for s in states:
            s.check_truncate(n)
        self.window.truncate(n)           # raises, before changing anything, past the ring
        for s in states:
            s.truncate(n)
        for rows, s in ((self.compressed, self.state), (self.index, self.index_state)):
            if rows is not None:
                rows.count = min(rows.count, n // s.ratio)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (self.window, self.compressed, self.state, self.index, self.index_state)
                   if p is not None)
