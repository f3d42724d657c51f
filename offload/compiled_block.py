"""The compiled CPU block: a decoder block whose every tensor is in RAM runs decode and
verify steps (T <= ``DECODE_TOKENS``) as two compiled calls, ``cpu_kernels.block``'s
``attention_half`` and ``moe_half`` (or ``dense_half``).

Design (see docs/compiled-blocks.md): at load, ``compile_block`` reads the reference
``Block`` (the torch path, built as usual) and binds its raw GGUF views, quant tags, norm
weights, biases and routing settings into an argument tuple per half; the first call compiles
(or loads from Numba's cache) the entries for exactly those argument types, and every later call
goes straight to those compiled entry points — no registry lookup, type dispatch or Numba
argument typing per call (measured on this box: ~0.8 µs for a 50-argument call, against
~30 µs through the dispatcher). Larger batches (prompt prefill) go to the reference block,
whose matmuls amortise their dispatch over many tokens and whose torch attention is faster
there. Both paths share the block's KV cache (``gpu.kv_cache.KVCache``, f32/f16/bf16), so
``length`` / ``truncate(n)`` — the speculative loop's rollback — work unchanged, and a
prefill by one path is read by the other.

The model loop steps consecutive compiled blocks of one kind as a ``BlockRun`` (``block_runs``):
one compiled call, ``cpu_kernels.block.blocks_run``, for up to ``RUN_BLOCKS`` blocks, so a
decode token pays the Python side of a compiled call once per run, not twice per block.

Anything the compiled block does not cover (a tensor on a GPU, a quantized KV cache, an
attention or router kind other than GQA + sigmoid/softmax top-k) keeps the reference
block. ``OFFLOAD_BLOCKS=reference`` forces the reference path everywhere.
"""
from __future__ import annotations

import os

import numba
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from numba.typed import List

from cpu_kernels import block as kb
from cpu_kernels import settings
from cpu_kernels.entry import first_call
from cpu_kernels.layout import weight_bytes
from cpu_kernels.registry import get_kernel
from gpu.ffn import SwiGLU
from gpu.router import SigmoidRouter, SoftmaxRouter
from offload.cpu_ops import CpuExperts, RawLinear, to_host
from offload.moe import MoE
from placement.limits import DECODE_TOKENS

KV_TYPES = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}
ENV = "OFFLOAD_BLOCKS"   # "reference": the torch path for every block


def compiled_enabled() -> bool:
    return os.environ.get(ENV, "compiled").lower() != "reference"


def _raw(lin):
    """(QTag, uint8 row view) of a RawLinear, None if it is anything else."""
    if not isinstance(lin, RawLinear):
        return None
    kern = get_kernel(lin.qtype, lin.name)
    return kern.tag, weight_bytes(lin.data, kern, 2, lin.name)


def _vec(t) -> np.ndarray | None:
    return None if t is None else np.ascontiguousarray(t.detach().float().cpu().numpy())


def _bind(block) -> tuple | None:
    """(eps, attention arguments, FFN half, its arguments) after the per-call ones, or None
    when the compiled block does not cover this block."""
    attn, ffn = block.attn, block.ffn
    if block.device.type != "cpu" or type(attn).__name__ != "Attention":
        return None
    # what the compiled attention does not do: sinks, sliding windows, a non-default scale
    # (gpt-oss), interleaved rotary pairs (it rotates NeoX halves)
    if getattr(attn, "sinks", None) is not None or getattr(attn, "window", 0) or \
            getattr(attn, "scale", None) is not None or getattr(attn.rope, "interleaved", False):
        return None
    projs = [_raw(p) for p in (attn.q, attn.k, attn.v, attn.o)]
    if None in projs:
        return None
    (tq, wq), (tk, wk), (tv, wv), (to, wo) = projs
    d = attn.head_dim
    if wq.shape[0] != attn.n_head * d or wk.shape[0] != attn.n_head_kv * d or d % 16 or \
            wo.shape[0] % 16:
        return None
    attn_args = (_vec(block.attn_norm.weight), tq, wq, _vec(attn.q.bias), tk, wk, _vec(attn.k.bias),
                 tv, wv, _vec(attn.v.bias), to, wo,
                 None if attn.q_norm is None else _vec(attn.q_norm.weight),
                 None if attn.k_norm is None else _vec(attn.k_norm.weight),
                 attn.n_head, attn.rope.n_rot)
    head = (block.attn_norm.eps, attn_args)
    if isinstance(ffn, SwiGLU):
        dense = [_raw(p) for p in (ffn.gate, ffn.up, ffn.down)]
        if None in dense or dense[0][1].shape[0] % 16:
            return None
        return head + (kb.dense_half, (_vec(block.ffn_norm.weight),) + tuple(x for pair in dense for x in pair))
    if not isinstance(ffn, MoE) or not isinstance(ffn.experts, CpuExperts):
        return None
    # hot experts on a GPU (the CPU side skips them) and biased or non-SiLU experts run in
    # the reference MoE; op offload only takes batches past DECODE_TOKENS, which go there anyway
    if ffn.hot or ffn.owned is not None or ffn.experts.act != "silu" or ffn.experts.biases:
        return None
    router = ffn.router
    if isinstance(router, SigmoidRouter):
        kind, bias = kb.SIGMOID, _vec(router.bias)
    elif isinstance(router, SoftmaxRouter):
        kind, bias = kb.SOFTMAX, None
    else:
        return None
    rp = _raw(router.proj)
    if rp is None or router.proj.bias is not None:
        return None
    shared = (None,) * 6
    if ffn.shared is not None:
        sh = [_raw(p) for p in (ffn.shared.gate, ffn.shared.up, ffn.shared.down)]
        if None in sh or sh[0][1].shape[0] % 16:
            return None
        shared = tuple(x for pair in sh for x in pair)
    ew = ffn.experts.weights
    (gk, gb, g0, _), (uk, ub, u0, _) = ew._parts
    dk, db = ew._down
    if ew.n_ff % 16:
        return None
    # the routed experts' activations as the reference's moe_ffn takes them at T <= DECODE_TOKENS
    # (int8 per phase for the decode mode's types), their scratch bound here once
    qx, qh = ffn.experts.decode_scratch(router.k, DECODE_TOKENS)
    moe_args = ((_vec(block.ffn_norm.weight), rp[0], rp[1], bias, kind, router.k, bool(router.norm),
                 float(router.scale), gk.tag, gb, g0, uk.tag, ub, u0, dk.tag, db, ew.n_ff, qx, qh) + shared)
    return head + (kb.moe_half, moe_args)


class CompiledBlock:
    """Block interface (``device_name``, ``device``, ``new_cache()``, ``__call__``) over
    ``cpu_kernels.block``; ``reference`` is the torch block it was bound from (prefill, fallback)."""

    def __init__(self, reference, eps: float, attn_args: tuple, ffn_half, ffn_args: tuple, kv_tag):
        self.reference = reference
        self.device_name, self.device = reference.device_name, reference.device
        self.profile = reference.profile
        self.rope = reference.attn.rope
        self._eps, self._kv_tag = float(eps), kv_tag
        self._attn_args, self._ffn_half, self._ffn_args = attn_args, ffn_half, ffn_args
        self._attn_entry = self._ffn_entry = None
        self._rope_tables = (None, None, None)        # (cos tensor, cos, sin as numpy)
        ffn = reference.ffn
        self._bound_parts = (ffn, getattr(ffn, "router", None))

    def __getattr__(self, name):
        # the reference block's parts (attn, ffn, norms) for code that inspects blocks
        if name == "reference":          # not yet set (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.reference, name)

    def _rebound(self) -> bool:
        """Whether someone replaced a part of the reference since binding (e.g. ``offload
        tune`` wraps routers to record them): then the reference path must run."""
        ffn = self.reference.ffn
        return ffn is not self._bound_parts[0] or getattr(ffn, "router", None) is not self._bound_parts[1]

    def new_cache(self):
        return self.reference.new_cache()

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        t = x.shape[0]
        if t > DECODE_TOKENS or self._rebound():
            return self.reference(x, positions, cache)
        xh, pos, cos, sin, chunks = self._step_inputs(x, positions)
        need = cache.reserve(t)
        y = np.empty_like(xh)
        kc, vc = cache.raw()
        attn = (xh, y, pos, cos, sin, self._kv_tag, kc, vc, cache.length, self._eps) + self._attn_args + (chunks,)
        ffn = (y, self._eps) + self._ffn_args + (chunks,)
        with self.profile.time("cpu_block"):
            if self._ffn_entry is not None:
                self._attn_entry(*attn)
                self._ffn_entry(*ffn)
            else:
                self._attn_entry = first_call(kb.attention_half, attn)[0]
                self._ffn_entry = first_call(self._ffn_half, ffn)[0]
        cache.length = need
        return torch.from_numpy(y)

    def _step_inputs(self, x: torch.Tensor, positions: torch.Tensor):
        """(x, positions, cos, sin, threads) as the compiled entries take them."""
        xh = to_host(x)
        pos = positions.numpy()
        if pos.dtype != np.int64 or not pos.flags.c_contiguous:    # the entry was compiled for these
            pos = np.ascontiguousarray(pos, dtype=np.int64)
        cos, sin = self._tables(int(pos[-1]) + 1 if len(pos) else 1)
        return xh, pos, cos, sin, settings.apply_threads()

    def _tables(self, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """RoPE cos/sin tables as numpy, converted again only when the table grows."""
        cos, sin = self.rope.tables(n_pos)
        if cos is not self._rope_tables[0]:
            self._rope_tables = (cos, cos.numpy(), sin.numpy())
        return self._rope_tables[1], self._rope_tables[2]


RUN_BLOCKS = 16     # blocks per compiled run call at most (each run length compiles once)


class BlockRun:
    """Consecutive ``CompiledBlock``s of one kind (same argument types, RoPE table and cache
    type) stepped by one compiled call, ``cpu_kernels.block.blocks_run``: a decode step then
    crosses from Python into compiled code once per run instead of twice per block, and
    none of the wrapper's Python runs per block. Batches past ``DECODE_TOKENS``, a rebound
    block (see ``CompiledBlock._rebound``) or caches of unequal length take the blocks one
    by one (the same kernels: tests hold both ways to each other and to the reference)."""

    def __init__(self, blocks: list[CompiledBlock]):
        self.blocks = blocks
        first = blocks[0]
        self.profile = first.profile
        # Numba typed lists, bound once: a call unboxes each as one pointer, where a tuple
        # of the run's ~600 arrays would be unboxed array by array at every call
        self._bound = List([(b._eps, b._attn_args) for b in blocks])
        ffn = List([b._ffn_args for b in blocks])
        self._moe, self._dense = (ffn, None) if first._ffn_half is kb.moe_half else (None, ffn)
        self._raws, self._seen = None, [None] * len(blocks)
        self._entry = None

    def _cache_raws(self, caches) -> List:
        """The caches' raw (kc, vc) buffers as a typed list, built again only when a cache's
        storage changed (it grew, or a new sequence's caches came). Rebuilt whole rather than
        patched: a typed list's item assignment is compiled on its first use, and that would
        land (~2.5 MiB of code) in some later decode step instead of the first."""
        raws = [c.raw() for c in caches]
        if self._raws is None or any(r is not s for r, s in zip(raws, self._seen)):
            self._raws, self._seen = List(raws), raws
        return self._raws

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, caches) -> torch.Tensor:
        n_past = caches[0].length
        if x.shape[0] > DECODE_TOKENS or any(c.length != n_past for c in caches) or \
                any(b._rebound() for b in self.blocks):
            for b, c in zip(self.blocks, caches):
                x = b(x, positions, c)
            return x
        first = self.blocks[0]
        xh, pos, cos, sin, chunks = first._step_inputs(x, positions)
        xh = xh.copy()                      # the run uses it as scratch; x stays the caller's
        for c in caches:
            c.reserve(x.shape[0])
        args = (xh, np.empty_like(xh), pos, cos, sin, first._kv_tag, self._cache_raws(caches), n_past,
                self._bound, self._moe, self._dense, chunks)
        with self.profile.time("cpu_block"):
            if self._entry is None:
                self._entry, y = first_call(kb.blocks_run, args)
            else:
                y = self._entry(*args)
        for c in caches:
            c.length = n_past + x.shape[0]
        return torch.from_numpy(y)


def _run_key(block):
    """Blocks with equal keys can share one ``blocks_run`` call."""
    if not isinstance(block, CompiledBlock):
        return None
    return (block._ffn_half, block.rope, block._kv_tag.name,
            numba.typeof((block._eps, block._attn_args)), numba.typeof(block._ffn_args))


def block_runs(blocks) -> list[tuple[object, int, int]]:
    """(step, lo, hi) covering ``blocks`` in order: ``step(x, positions, caches[lo:hi])`` is a
    ``BlockRun`` for consecutive compiled blocks of one kind (up to ``RUN_BLOCKS``), else one
    block's own call."""
    out, i = [], 0
    while i < len(blocks):
        key, j = _run_key(blocks[i]), i + 1
        if key is not None:
            while j < len(blocks) and j - i < RUN_BLOCKS and _run_key(blocks[j]) == key:
                j += 1
        if j - i > 1:
            out.append((BlockRun(blocks[i:j]), i, j))
        else:
            b = blocks[i]
            out.append((lambda x, pos, caches, b=b: b(x, pos, caches[0]), i, j))
        i = j
    return out


def compile_block(block):
    """``CompiledBlock`` for a wholly CPU-resident GQA block with an f32/f16/bf16 KV cache;
    the block itself otherwise (or when ``OFFLOAD_BLOCKS=reference``)."""
    if not compiled_enabled():
        return block
    cache = block.new_cache()
    if getattr(cache, "k", None) is None or cache.k.dtype not in KV_TYPES or cache.k.device.type != "cpu":
        return block
    bound = _bind(block)
    if bound is None:
        return block
    return CompiledBlock(block, *bound, get_kernel(KV_TYPES[cache.k.dtype]).tag)
