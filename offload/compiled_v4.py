"""The compiled CPU block of DeepSeek-V4 (``deepseek4``): a block whose every tensor is in RAM
runs decode and verify steps (T <= ``DECODE_TOKENS`` rows) as two compiled calls,
``cpu_kernels.v4_attention.v4_attention_half`` (mHC, attention of any of the three kinds with
its compressors and indexer, mHC back) and ``cpu_kernels.v4_ffn.v4_ffn_half`` (mHC, the
√softplus or hash router, clamped routed and shared experts, mHC back).

As ``offload.compiled_block`` does for GQA blocks: the reference block (the torch path,
``offload.models.deepseek4.Deepseek4Block``) is built as usual and its raw GGUF views, norms and
settings are bound once at load; prompt batches and anything else the kernels do not cover
take the reference block. Several sequences stepped as one batch (a ``SequenceBatch``) run the
attention half per sequence and one FFN half over every row. Both paths share
the block's ``Dsv4Cache``: this side computes the same bookkeeping integers the cache parts
compute (``WindowKVCache.make_room``, ``CompressorState.keep_after``,
``CompressedRows.reserve``) and lets the kernel write the rows, so a prefill by one path is
continued by the other and ``truncate`` (speculative rollback) works unchanged.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from cpu_kernels import settings
from cpu_kernels.entry import first_call
from cpu_kernels.kv_rows import KV_TYPES
from cpu_kernels.registry import get_kernel
from cpu_kernels.v4_attention import v4_attention_half
from cpu_kernels.v4_ffn import v4_ffn_half
from gpu.compressed_attention import CompressedAttention, Compressor
from gpu.dsv4_cache import CompressorState, CompressedRows, Dsv4Cache
from gpu.kv_cache import SequenceBatch, spans, type_name
from gpu.router import HashRouter, SqrtSoftplusRouter
from offload.compiled_block import (ENV, BoundBlock, CompiledParts, compile_block, compiled_enabled, host_vector,
                                    raw_rows)
from offload.cpu_ops import CpuExperts, CpuHyperConnection, to_host
from offload.errors import OffloadError
from offload.moe import MoE
from placement.limits import DECODE_TOKENS

f32 = np.float32


def _raw(lin) -> tuple | None:
    """``raw_rows`` of a projection without a bias (V4's have none: one that had would not be
    bound here), None otherwise."""
    return None if getattr(lin, "bias", None) is not None else raw_rows(lin)


def _hc(hc, eps: float) -> tuple | str:
    if not isinstance(hc, CpuHyperConnection):
        return "hyper-connection off the CPU"
    if hc.norm_eps != eps:
        return "hyper-connection norm eps differs from the block's"
    fn, base, scale = hc._host
    return fn, base, scale, int(hc.iters), float(hc.hc_eps)


def _compressor(c: Compressor) -> tuple | str:
    kv, gate = _raw(c.kv), _raw(c.gate)
    if kv is None or gate is None:
        return "compressor off the CPU"
    if c.dim % 16:
        return f"compressor width {c.dim} not a multiple of 16"
    return kv + gate + (host_vector(c.ape), host_vector(c.norm.weight))


def bind_attention(block) -> tuple | str:
    """(eps, hc, attn_norm, proj, shape, compressor weights or None, indexer weights or None)
    for ``v4_attention_half``, or why the block keeps the reference path."""
    attn, eps = block.attn, float(block.attn_norm.eps)
    if not isinstance(attn, CompressedAttention) or not attn.causal:
        return "attention kind not compiled"
    if any(n.eps != eps for n in (attn.q_a_norm, attn.kv_norm)):
        return "norm eps differ"
    hc = _hc(block.attn_hc, eps)
    if isinstance(hc, str):
        return hc
    projs = [_raw(p) for p in (attn.q_a, attn.q_b, attn.kv, attn.o_a, attn.o_b)]
    if None in projs:
        return "attention projections off the CPU"
    (tqa, wqa), (tqb, wqb), (tkv, wkv), (toa, woa), (tob, wob) = projs
    h, d = attn.n_head, attn.head_dim
    if wqa.shape[0] % 16 or d % 16 or (h * d // attn.o_groups) % 16 or woa.shape[0] % 16 \
            or (woa.shape[0] // attn.o_groups) % 4:
        return "attention widths not multiples of 16"
    proj = (tqa, wqa, host_vector(attn.q_a_norm.weight), tqb, wqb, tkv, wkv, host_vector(attn.kv_norm.weight), toa, woa,
            tob, wob, host_vector(attn.sinks))
    shape = (h, d, attn.rope.n_rot, attn.o_groups, attn.window)
    comp = index = None
    if attn.compressor is not None:
        comp = _compressor(attn.compressor)
        if isinstance(comp, str):
            return comp
        comp += (attn.compressor.ratio, attn.compressor.overlap)
    if attn.indexer is not None:
        ix = attn.indexer
        icomp = _compressor(ix.compressor)
        iproj = [_raw(p) for p in (ix.q_b, ix.proj)]
        if isinstance(icomp, str) or None in iproj:
            return "indexer off the CPU"
        if ix.compressor.ratio != attn.compressor.ratio:
            return "indexer ratio differs"
        index = (icomp + (ix.compressor.ratio, ix.compressor.overlap), *iproj[0], *iproj[1], ix.n_head,
                 ix.head_dim, ix.top_k)
    return eps, hc, host_vector(block.attn_norm.weight), proj, shape, comp, index


def bind_ffn(block, clamps: tuple[float, float]) -> tuple | str:
    """``v4_ffn_half``'s arguments after (x, out, tokens), up to ``chunks``, or why the block
    keeps the reference path. ``clamps``: the block's (routed, shared) SwiGLU limits."""
    ffn, eps = block.ffn, float(block.ffn_norm.eps)
    hc = _hc(block.ffn_hc, eps)
    if isinstance(hc, str):
        return hc
    if not isinstance(ffn, MoE) or not isinstance(ffn.experts, CpuExperts):
        return "routed experts off the CPU"
    if ffn.hot or ffn.owned is not None:
        return "hot experts on a GPU"
    experts = ffn.experts
    if experts.act != "swiglu_clamp" or experts.biases:
        return f"experts act {experts.act}"
    router = ffn.router
    rp = _raw(router.proj)
    if rp is None:
        return "router off the CPU"
    if isinstance(router, SqrtSoftplusRouter):
        probs_b, table, k = host_vector(router.bias), None, router.k
    elif isinstance(router, HashRouter):
        probs_b, table = None, np.ascontiguousarray(router.table.cpu().numpy())
        k = table.shape[1]
    else:
        return f"router {type(router).__name__} not compiled"
    shared = ffn.shared
    sh = [_raw(p) for p in (shared.gate, shared.up, shared.down)] if shared is not None else [None]
    if None in sh:
        return "shared expert off the CPU"
    ew = experts.weights
    if ew.n_ff % 16 or sh[0][1].shape[0] % 16:
        return "expert widths not multiples of 16"
    (gk, gb, g0, _), (uk, ub, u0, _) = ew._parts
    dk, db = ew._down
    qx, qh = experts.decode_scratch(k, DECODE_TOKENS)
    return (eps, *hc, host_vector(block.ffn_norm.weight), rp[0], rp[1], probs_b, table, k, float(router.scale),
            gk.tag, gb, g0, uk.tag, ub, u0, dk.tag, db, ew.n_ff, f32(clamps[0]), qx, qh,
            *sh[0], *sh[1], *sh[2], f32(clamps[1]))


def _advance(state: CompressorState, rows: CompressedRows, args: tuple, t: int, count: int) -> None:
    """The state after the kernel's step: rows from ``keep`` on held, t more positions seen."""
    state.start += args[2]
    state.length += t
    rows.count = count


class CompiledV4Block(BoundBlock):
    """``BoundBlock`` over the two compiled halves (``__call__(x, positions, cache, tokens=)``);
    it shows the reference's hyper-connections too."""

    def __init__(self, reference, attention: tuple, ffn: tuple, cache_tag):
        super().__init__(reference)
        self._cache_tag = cache_tag                # the QTag of the cache type (kv_rows)
        self.name = reference.ffn.experts.weights.name      # the experts' tensor prefix, for errors
        self._views: dict[int, tuple] = {}       # id(cache storage) -> (it, its numpy view)
        (self._eps, self._hc, self._attn_norm, self._proj, self._shape, comp_w, index_w) = attention
        self._comp_w, self._index_w = comp_w, index_w
        self._ffn = ffn
        self._hashed = isinstance(reference.ffn.router, HashRouter)     # the token ids pick the experts
        self._n_expert = reference.ffn.experts.weights.n_expert
        self._entries = [None, None]

    attn_hc = property(lambda self: self.reference.attn_hc)
    ffn_hc = property(lambda self: self.reference.ffn_hc)

    def _compiles(self, x: torch.Tensor, cache) -> bool:
        """Whether this step runs compiled: a decode or verify batch (of one sequence, or of
        several whose caches a ``SequenceBatch`` holds; the caches of the bound block's kind,
        checked at binding), the parts as bound (``offload tune`` may wrap a router to record it)."""
        return (x.shape[0] <= DECODE_TOKENS and x.device.type == "cpu"
                and (type(cache) is Dsv4Cache or type(cache) is SequenceBatch) and not self._rebound())

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache, *, tokens=None) -> torch.Tensor:
        """Several sequences (continuous batching): the attention half per sequence over its
        own rows and cache, the FFN half once over every row (each touched expert read once)."""
        if not self._compiles(x, cache) or (tokens is None and self._hashed):
            return self.reference(x, positions, cache, tokens=tokens)
        xh = np.ascontiguousarray(to_host(x))
        pos, tok, n_pos = _step_ids(positions, tokens)
        tables = self._tables(n_pos)
        chunks = settings.apply_threads()
        mid = np.empty_like(xh)
        with self.profile.time("cpu_block"):
            if type(cache) is SequenceBatch:
                for c, (lo, hi) in zip(cache.caches, spans(cache.rows)):
                    self._attend(xh[lo:hi], mid[lo:hi], pos[lo:hi], tables, c, chunks)
            else:
                self._attend(xh, mid, pos, tables, cache, chunks)
            out = np.empty_like(xh)
            ffn = (mid, out, tok) + self._ffn + (chunks,)
            if self._entries[1] is None:
                self._entries[1], touched = first_call(v4_ffn_half, ffn)
            else:
                touched = self._entries[1](*ffn)
        if touched < 0:         # the kernel read nothing out of bounds and wrote nothing
            raise OffloadError(f"{self.name}: a token id outside ffn_gate_tid2eid, or an expert id outside "
                               f"0..{self._n_expert - 1} in it")
        return torch.from_numpy(out)

    def _attend(self, xh, mid, pos, tables, cache: Dsv4Cache, chunks: int) -> None:
        """The attention half of one sequence's rows xh into mid, advancing its cache."""
        t = xh.shape[0]
        win = cache.window
        win.make_room(t)
        comp = index = None
        if self._comp_w is not None:
            comp_state = self._state_args(cache.state, cache.compressed, t)
            comp = self._comp_w + comp_state
        if self._index_w is not None:
            icomp_w, *rest = self._index_w
            index_state = self._state_args(cache.index_state, cache.index, t)
            index = (icomp_w + index_state, *rest)
        attn = (xh, mid, pos, self._eps, self._hc, self._attn_norm, self._proj, self._shape, *tables,
                (self._cache_tag, self._rows(win.k)[0], win.start, win.length), comp, index, chunks)
        if self._entries[0] is None:
            self._entries[0], counts = first_call(v4_attention_half, attn)
        else:
            counts = self._entries[0](*attn)
        win.length += t
        if comp is not None:
            _advance(cache.state, cache.compressed, comp_state, t, counts[0])
        if index is not None:
            _advance(cache.index_state, cache.index, index_state, t, counts[1])

    def _rows(self, storage: torch.Tensor) -> np.ndarray:
        """A cache part's storage in the cache type as a uint8 numpy view (…, row bytes)."""
        return self._view(storage, lambda: storage.view(torch.uint8).numpy())

    def _view(self, storage: torch.Tensor, make) -> np.ndarray:
        """``make()`` (a numpy view) for this cache storage tensor, made again only when the
        storage was replaced (it grew, or another cache came); the entry holds the tensor, so its
        id is not reused meanwhile, and several sequences' caches each keep their own."""
        seen = self._views.get(id(storage))
        if seen is None or seen[0] is not storage:
            if len(self._views) > 64 * 5:      # caches come and go with requests: drop the old ones
                self._views.clear()
            seen = self._views[id(storage)] = (storage, make())
        return seen[1]

    def _state_args(self, state: CompressorState, rows: CompressedRows, t: int) -> tuple:
        """(buf, held, keep, entries, count) of a compressor for a step of t positions (``keep``
        relative to the first held row), with room made for the entries it completes (the
        kernel writes them; ``_advance`` commits)."""
        keep = state.keep_after(t)
        rows.reserve((state.length + t) // state.ratio - state.length // state.ratio)
        return (self._view(state.buf, state.buf.numpy), state.length - state.start, keep - state.start,
                self._rows(rows.rows), rows.count)

_last_step: list = [None]       # (positions, tokens, their host arrays): see _step_ids


def _step_ids(positions: torch.Tensor, tokens: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray, int]:
    """(positions, token ids) as int64 host arrays and the rope table rows they need, converted
    once per model step: every block of a step is given the same two tensors (the memo holds
    them, so their identities are not reused while it does)."""
    last = _last_step[0]
    if last is not None and last[0] is positions and last[1] is tokens:
        return last[2]
    pos = np.ascontiguousarray(positions.numpy(), dtype=np.int64)
    tok = (np.zeros(len(pos), np.int64) if tokens is None
           else np.ascontiguousarray(tokens.cpu().numpy(), dtype=np.int64))
    out = (pos, tok, int(pos.max()) + 1 if len(pos) else 1)
    _last_step[0] = (positions, tokens, out)
    return out


def compile_v4_block(block, parts: CompiledParts, clamps: tuple[float, float]):
    """``CompiledV4Block`` for a wholly CPU-resident deepseek4 block; the block itself otherwise
    (``compile_block`` with ``parts`` sets its ``path`` and hand-off), saying why."""
    why = None
    if not compiled_enabled():
        why = f"{ENV}=reference"
    elif block.device_name != "CPU" or block.device.type != "cpu":
        why = f"block on {block.device_name}"
    attention = ffn = None
    if why is None:
        cache = block.new_cache()
        kinds = {type_name(cache.window.k_type)} | {type_name(p.dtype) for p in (cache.compressed, cache.index)
                                                    if p is not None}
        if len(kinds) > 1 or not kinds <= set(KV_TYPES):
            why = "cache type " + "/".join(sorted(kinds))
    if why is None:
        attention = bind_attention(block)
        why = attention if isinstance(attention, str) else None
    if why is None:
        ffn = bind_ffn(block, clamps)
        why = ffn if isinstance(ffn, str) else None
    if why is not None:
        return compile_block(block, parts.because(why))
    return CompiledV4Block(block, attention, ffn, get_kernel(Q[kinds.pop()]).tag)
