"""The compiled CPU block: a decoder block whose every tensor is in RAM runs decode and
verify steps (T <= ``DECODE_TOKENS``) as two compiled calls, ``cpu_kernels.block``'s
``attention_half`` and ``moe_half`` (or ``dense_half``).

Design (see docs/compiled-blocks.md): at load, ``compile_block`` reads the reference
``Block`` (the torch path, built as usual) and binds its raw GGUF views, quant tags, norm
weights, biases and routing settings into a named record per half (``AttentionArgs``,
``MoeArgs``, ``DenseArgs``: one field per kernel parameter, in the kernel's order); the first call compiles
(or loads from Numba's cache) the entries for exactly those argument types, and every later call
goes straight to those compiled entry points — no registry lookup, type dispatch or Numba
argument typing per call (measured on this box: ~0.8 µs for a 50-argument call, against
~30 µs through the dispatcher). Larger batches (prompt prefill) go to the reference block,
whose matmuls amortise their dispatch over many tokens and whose torch attention is faster
there. Both paths share the block's KV cache (``gpu.kv_cache.KVCache``, float or block-quantized), so
``length`` / ``truncate(n)`` — the speculative loop's rollback — work unchanged, and a
prefill by one path is read by the other.

The model loop steps consecutive compiled blocks of one kind as a ``BlockRun`` (``block_runs``):
one compiled call, ``cpu_kernels.block.blocks_run``, for up to ``RUN_BLOCKS`` blocks, so a
decode token pays the Python side of a compiled call once per run, not twice per block.

An architecture declares which compiled parts its blocks take (``CompiledParts``: its model
file passes ``GQA_BLOCK``, ``HANDOFF_ONLY`` or ``REFERENCE`` with a reason); a block is bound
only for those. Anything the compiled block does not cover (a tensor on a GPU, a window
cache, an attention or router kind other than GQA + sigmoid/softmax top-k) keeps the
reference block, and every block's ``path`` says which it takes and why ("compiled",
"reference: attention on CUDA0"; ``offload run -v`` prints them). ``OFFLOAD_BLOCKS=reference``
forces the reference path everywhere.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import numba
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from cpu_kernels import block as kb
from cpu_kernels import settings
from cpu_kernels.entry import first_call
from cpu_kernels.kv_rows import KV_TYPES
from cpu_kernels.layout import weight_bytes
from cpu_kernels.registry import get_kernel
from gpu.attention import Attention
from gpu.ffn import SwiGLU
from gpu.kv_cache import KVCache, SequenceBatch
from gpu.router import SigmoidRouter, SoftmaxRouter
from offload.cpu_ops import CpuExperts, RawGroupedLinear, RawLinear, to_host
from offload.moe import MoE
from placement.limits import DECODE_TOKENS

ENV = "OFFLOAD_BLOCKS"   # "reference": the torch path for every block


def compiled_enabled() -> bool:
    return os.environ.get(ENV, "compiled").lower() != "reference"


# -- what an architecture declares ----------------------------------------------------

@dataclass(frozen=True)
class CompiledParts:
    """Which compiled CPU parts an architecture's blocks take, declared in its model file
    (``compile_block(block, parts)`` in its block builder): ``attention`` the kind ``attention_half`` computes
    ("gqa": GQA with NeoX RoPE, optional q/k/v biases and per-head q/k norms; None: none),
    ``ffn`` the second halves it may take ("moe": ``moe_half``, "dense": ``dense_half``),
    ``handoff`` whether an MoE block on the reference path may hand its RAM-resident experts to
    the compiled ``routed_ffn`` (``offload.moe``'s hybrid hand-off), and ``reason``: what a
    block with no compiled attention reports (``path``). A block is bound only for the parts
    declared here; everything else takes the reference path and says why."""
    attention: str | None = None
    ffn: tuple[str, ...] = ()
    handoff: bool = False
    reason: str = "not declared by the architecture"

    def because(self, reason: str) -> CompiledParts:
        """These parts, with ``reason`` as what a block on the reference path reports."""
        return replace(self, reason=reason)


ATTENTION_KINDS = ("gqa",)
FFN_KINDS = ("moe", "dense")
GQA_BLOCK = CompiledParts(attention="gqa", ffn=FFN_KINDS, handoff=True)   # glm4moe, qwen3moe
HANDOFF_ONLY = CompiledParts(handoff=True)      # reference blocks whose CPU experts take the hand-off
REFERENCE = CompiledParts()                     # nothing compiled


# -- the compiled halves' bound arguments, by name ---------------------------------------

@dataclass(frozen=True, eq=False)
class _KernelArgs:
    """A compiled half's arguments that are bound at load, one field per kernel parameter in
    the kernel's order; ``BEFORE``/``AFTER`` name the per-call ones around them (a test holds
    ``BEFORE + fields + AFTER`` to the kernel's signature). ``as_args()`` is the one place
    the record becomes the kernel's positional tuple."""
    KERNEL: ClassVar
    BEFORE: ClassVar[tuple[str, ...]]
    AFTER: ClassVar[tuple[str, ...]] = ("chunks",)

    def as_args(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True, eq=False)
class AttentionArgs(_KernelArgs):
    """``attention_half``: raw GGUF rows ``w*`` with their QTags ``t*``, biases ``b*`` and
    per-head norms or None."""
    KERNEL: ClassVar = staticmethod(kb.attention_half)
    BEFORE: ClassVar = ("x", "y", "positions", "cos", "sin", "kvt", "kc", "vc", "n_past", "eps")
    attn_norm: np.ndarray
    tq: object
    wq: np.ndarray
    bq: np.ndarray | None
    tk: object
    wk: np.ndarray
    bk: np.ndarray | None
    tv: object
    wv: np.ndarray
    bv: np.ndarray | None
    to: object
    wo: np.ndarray
    q_norm: np.ndarray | None
    k_norm: np.ndarray | None
    n_head: int
    n_rot: int


@dataclass(frozen=True, eq=False)
class MoeArgs(_KernelArgs):
    """``moe_half``: the router (``route_kind`` one of ``cpu_kernels.block``'s kinds), the
    routed experts (gate and up may be one fused tensor: row offsets ``g0``/``u0``), their
    int8 decode scratch ``qx``/``qh`` (None: float), the shared expert or None."""
    KERNEL: ClassVar = staticmethod(kb.moe_half)
    BEFORE: ClassVar = ("y", "eps")
    ffn_norm: np.ndarray
    tr: object
    wr: np.ndarray
    probs_b: np.ndarray | None
    route_kind: int
    k_used: int
    w_norm: bool
    w_scale: float
    tg: object
    wg: np.ndarray
    g0: int
    tu: object
    wu: np.ndarray
    u0: int
    td: object
    wd: np.ndarray
    n_ff: int
    qx: tuple | None
    qh: tuple | None
    tsg: object = None
    wsg: np.ndarray | None = None
    tsu: object = None
    wsu: np.ndarray | None = None
    tsd: object = None
    wsd: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class DenseArgs(_KernelArgs):
    """``dense_half``: a dense SwiGLU FFN's raw rows and QTags."""
    KERNEL: ClassVar = staticmethod(kb.dense_half)
    BEFORE: ClassVar = ("y", "eps")
    ffn_norm: np.ndarray
    tg: object
    wg: np.ndarray
    tu: object
    wu: np.ndarray
    td: object
    wd: np.ndarray


@dataclass(frozen=True, eq=False)
class Bound:
    """What ``_bind`` found for a block: the norms' eps, each half's record and the KV cache
    (K, V) types' QTags."""
    eps: float
    attention: AttentionArgs
    ffn: MoeArgs | DenseArgs
    kv_tag: object


# the routers moe_half computes, by class (group-limited sigmoid routing excepted)
ROUTE_KINDS = {SigmoidRouter: kb.SIGMOID, SoftmaxRouter: kb.SOFTMAX}


def raw_rows(lin):
    """(QTag, uint8 row view) of a RawLinear or RawGroupedLinear (its bias, if any, is the
    caller's to bind), None if it is anything else."""
    if not isinstance(lin, (RawLinear, RawGroupedLinear)):
        return None
    kern = get_kernel(lin.qtype, lin.name)
    return kern.tag, weight_bytes(lin.data, kern, 2, lin.name)


def host_vector(t) -> np.ndarray | None:
    return None if t is None else np.ascontiguousarray(t.detach().float().cpu().numpy())


def _bind(block, parts: CompiledParts) -> Bound | str:
    """The bound records of ``block`` for the halves ``parts`` declares, or why it takes the
    reference path (a short phrase: its ``path`` reads "reference: <phrase>")."""
    if parts.attention is None:
        return parts.reason
    if not compiled_enabled():
        return f"{ENV}=reference"
    attn, ffn = block.attn, block.ffn
    if block.device_name != "CPU" or block.device.type != "cpu":
        return f"attention on {block.device_name}"
    if not isinstance(attn, Attention):
        return f"attention kind {type(attn).__name__} not compiled"
    # what the compiled attention does not do: sinks, sliding windows, a non-default scale
    # (gpt-oss), interleaved rotary pairs (it rotates NeoX halves)
    for why, present in (("sinks", attn.sinks is not None), ("sliding window", bool(attn.window)),
                         ("attention scale", attn.scale is not None),
                         ("interleaved rotary", attn.rope.interleaved)):
        if present:
            return why
    projs = [raw_rows(p) for p in (attn.q, attn.k, attn.v, attn.o)]
    if None in projs:
        return "attention projections off the CPU"
    (tq, wq), (tk, wk), (tv, wv), (to, wo) = projs
    d = attn.head_dim
    if wq.shape[0] != attn.n_head * d or wk.shape[0] != attn.n_head_kv * d:
        return "q/k rows are not heads x head_dim"
    if d % 16 or wo.shape[0] % 16:
        return f"head_dim {d} or n_embd {wo.shape[0]} not a multiple of 16"
    cache = block.new_cache()
    if type(cache) is not KVCache:            # the plain cache the kernel reads and writes raw
        return f"KV cache {type(cache).__name__}"
    if cache.k.device.type != "cpu" or any(n not in KV_TYPES for n in cache.type_names):
        return f"KV cache {'/'.join(cache.type_names)} on {cache.k.device}"
    attention = AttentionArgs(
        host_vector(block.attn_norm.weight), tq, wq, host_vector(attn.q.bias), tk, wk, host_vector(attn.k.bias), tv, wv,
        host_vector(attn.v.bias), to, wo, None if attn.q_norm is None else host_vector(attn.q_norm.weight),
        None if attn.k_norm is None else host_vector(attn.k_norm.weight), attn.n_head, attn.rope.n_rot)
    if isinstance(ffn, SwiGLU):
        ffn_args = _bind_dense(block, ffn) if "dense" in parts.ffn else "dense FFN not declared"
    else:
        ffn_args = _bind_moe(block, ffn) if "moe" in parts.ffn else "MoE FFN not declared"
    if isinstance(ffn_args, str):
        return ffn_args
    return Bound(block.attn_norm.eps, attention, ffn_args, tuple(get_kernel(Q[n]).tag for n in cache.type_names))


def _bind_dense(block, ffn: SwiGLU) -> DenseArgs | str:
    dense = [raw_rows(p) for p in (ffn.gate, ffn.up, ffn.down)]
    if None in dense:
        return "dense FFN off the CPU"
    if dense[0][1].shape[0] % 16:
        return f"dense n_ff {dense[0][1].shape[0]} not a multiple of 16"
    (tg, wg), (tu, wu), (td, wd) = dense
    return DenseArgs(host_vector(block.ffn_norm.weight), tg, wg, tu, wu, td, wd)


def _bind_moe(block, ffn) -> MoeArgs | str:
    if not isinstance(ffn, MoE):
        return f"FFN kind {type(ffn).__name__} not compiled"
    if not isinstance(ffn.experts, CpuExperts):
        return "routed experts off the CPU"
    # hot experts on a GPU (the CPU side skips them) and biased or non-SiLU experts run in
    # the reference MoE; op offload only takes batches past DECODE_TOKENS, which go there anyway
    if ffn.hot or ffn.owned is not None:
        return "hot experts on a GPU"
    if ffn.experts.act != "silu":
        return f"experts act {ffn.experts.act}"
    if ffn.experts.biases:
        return "expert biases"
    router = ffn.router
    kind = ROUTE_KINDS.get(type(router))
    if kind is None:
        return f"router {type(router).__name__} not compiled"
    if kind == kb.SIGMOID and router.n_group > 1:
        return "group-limited routing"
    rp = raw_rows(router.proj)
    if rp is None:
        return "router off the CPU"
    if router.proj.bias is not None:
        return "router bias"
    shared = ()
    if ffn.shared is not None:
        sh = [raw_rows(p) for p in (ffn.shared.gate, ffn.shared.up, ffn.shared.down)]
        if None in sh:
            return "shared expert off the CPU"
        if sh[0][1].shape[0] % 16:
            return f"shared expert n_ff {sh[0][1].shape[0]} not a multiple of 16"
        shared = tuple(x for pair in sh for x in pair)
    ew = ffn.experts.weights
    (gk, gb, g0, _), (uk, ub, u0, _) = ew._parts
    dk, db = ew._down
    if ew.n_ff % 16:
        return f"expert n_ff {ew.n_ff} not a multiple of 16"
    # the routed experts' activations as the reference's moe_ffn takes them at T <= DECODE_TOKENS
    # (int8 per phase for the decode mode's types), their scratch bound here once
    qx, qh = ffn.experts.decode_scratch(router.k, DECODE_TOKENS)
    return MoeArgs(host_vector(block.ffn_norm.weight), rp[0], rp[1],
                   host_vector(router.bias) if kind == kb.SIGMOID else None, kind, router.k, bool(router.norm),
                   float(router.scale), gk.tag, gb, g0, uk.tag, ub, u0, dk.tag, db, ew.n_ff, qx, qh, *shared)


class BoundBlock:
    """What a compiled block keeps of the reference block it was bound from (``reference``: the
    torch block, for prefill and fallback): the block interface (``device_name``, ``device``,
    ``profile``, ``new_cache()``, ``arrive``), its parts read through for code that inspects
    blocks, whether a part was replaced since binding, and the RoPE tables as numpy."""

    path = "compiled"

    def __init__(self, reference):
        self.reference = reference
        self.device_name, self.device = reference.device_name, reference.device
        self.profile = reference.profile
        self.rope = reference.attn.rope
        self._rope_tables = (None, None, None)        # (cos tensor, cos, sin as numpy)
        ffn = reference.ffn
        self._bound_parts = (ffn, getattr(ffn, "router", None))

    # the reference's parts, read through (replacing one is done on the reference)
    attn = property(lambda self: self.reference.attn)
    ffn = property(lambda self: self.reference.ffn)
    attn_norm = property(lambda self: self.reference.attn_norm)
    ffn_norm = property(lambda self: self.reference.ffn_norm)

    def _rebound(self) -> bool:
        """Whether someone replaced a part of the reference since binding (e.g. ``offload
        tune`` wraps routers to record them): then the reference path must run."""
        ffn = self.reference.ffn
        return ffn is not self._bound_parts[0] or getattr(ffn, "router", None) is not self._bound_parts[1]

    def new_cache(self):
        return self.reference.new_cache()

    def arrive(self, x: torch.Tensor) -> torch.Tensor:
        return self.reference.arrive(x)

    def _tables(self, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """RoPE cos/sin tables as numpy, converted again only when the table grows."""
        cos, sin = self.rope.tables(n_pos)
        if cos is not self._rope_tables[0]:
            self._rope_tables = (cos, cos.numpy(), sin.numpy())
        return self._rope_tables[1], self._rope_tables[2]


class CompiledBlock(BoundBlock):
    """``BoundBlock`` over ``cpu_kernels.block``'s halves (``__call__``: a decode or verify step
    compiled, anything else the reference)."""

    def __init__(self, reference, bound: Bound):
        super().__init__(reference)
        self.attn_args, self.ffn_args = bound.attention, bound.ffn
        self._eps, self._kv_tag = float(bound.eps), bound.kv_tag
        # the kernels' positional tuples, made once (the records' as_args)
        self._attn_args, self._ffn_args = bound.attention.as_args(), bound.ffn.as_args()
        self._ffn_half = type(bound.ffn).KERNEL
        self._attn_entry = self._ffn_entry = self._seqs_entry = None
        self._seq_lists = TypedCaches()                # (kc list, vc list) of the last batch

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        t = x.shape[0]
        if t > DECODE_TOKENS or self._rebound():
            return self.reference(x, positions, cache)
        xh, pos, cos, sin, chunks = self._step_inputs(x, positions)
        y = np.empty_like(xh)
        with self.profile.time("cpu_block"):
            if isinstance(cache, SequenceBatch):
                self._attend_sequences(xh, y, pos, cos, sin, cache, chunks)
            else:
                need = cache.reserve(t)
                kc, vc = cache.raw()
                attn = (xh, y, pos, cos, sin, self._kv_tag, kc, vc, cache.length, self._eps) + self._attn_args + (chunks,)
                if self._attn_entry is not None:
                    self._attn_entry(*attn)
                else:
                    self._attn_entry = first_call(kb.attention_half, attn)[0]
                cache.length = need
            ffn = (y, self._eps) + self._ffn_args + (chunks,)
            if self._ffn_entry is not None:
                self._ffn_entry(*ffn)
            else:
                self._ffn_entry = first_call(self._ffn_half, ffn)[0]
        return torch.from_numpy(y)

    def _attend_sequences(self, xh, y, pos, cos, sin, batch: SequenceBatch, chunks: int) -> None:
        """Several sequences (continuous batching): ``attention_half_seqs``, the projections
        once over every row and each sequence's rows over its own cache; the FFN half then
        reads each touched expert once for the batch."""
        needs = [c.reserve(n) for c, n in zip(batch.caches, batch.rows)]
        raws = [c.raw() for c in batch.caches]
        kcs, vcs = self._seq_lists.get(raws, lambda: (kb.typed_list(tuple(r[0] for r in raws)),
                                                      kb.typed_list(tuple(r[1] for r in raws))))
        starts = np.zeros(len(raws) + 1, np.int64)
        np.cumsum(batch.rows, out=starts[1:])
        n_pasts = np.array([c.length for c in batch.caches], np.int64)
        args = (xh, y, pos, cos, sin, self._kv_tag, kcs, vcs, starts, n_pasts,
                self._eps) + self._attn_args + (chunks,)
        if self._seqs_entry is not None:
            self._seqs_entry(*args)
        else:
            self._seqs_entry = first_call(kb.attention_half_seqs, args)[0]
        for c, need in zip(batch.caches, needs):
            c.length = need

    def _step_inputs(self, x: torch.Tensor, positions: torch.Tensor):
        """(x, positions, cos, sin, threads) as the compiled entries take them."""
        xh = to_host(x)
        pos = positions.numpy()
        if pos.dtype != np.int64 or not pos.flags.c_contiguous:    # the entry was compiled for these
            pos = np.ascontiguousarray(pos, dtype=np.int64)
        cos, sin = self._tables(int(pos[-1]) + 1 if len(pos) else 1)
        return xh, pos, cos, sin, settings.apply_threads()

class TypedCaches:
    """Caches' raw (kc, vc) buffers as the typed lists a compiled entry takes, built again only
    when a buffer changed (a cache grew, or other sequences came). Rebuilt whole rather than
    patched: a typed list's item assignment is compiled on its first use, and that would land
    (~2.5 MiB of code) in some later decode step instead of the first."""

    def __init__(self):
        self._seen, self._lists = None, None

    def get(self, raws: list, build):
        """``build()``'s lists for the buffers ``raws``, built on a change only."""
        seen = self._seen
        if seen is None or len(raws) != len(seen) or any(r is not s for r, s in zip(raws, seen)):
            self._seen, self._lists = raws, build()
        return self._lists


RUN_BLOCKS = 16     # blocks per compiled run call at most (each run length compiles once)


class BlockRun:
    """Consecutive ``CompiledBlock``s of one kind (same argument types, RoPE table and cache
    type) stepped by one compiled call, ``cpu_kernels.block.blocks_run``: a decode step then
    crosses from Python into compiled code once per run instead of twice per block, and
    none of the wrapper's Python runs per block. Several sequences stepped together
    (``SequenceBatch`` caches) take it the same way. Batches past
    ``DECODE_TOKENS``, a rebound block (see ``CompiledBlock._rebound``) or caches of unequal
    length take the blocks one by one (the same kernels: tests hold both ways to each other
    and to the reference)."""

    def __init__(self, blocks: list[CompiledBlock]):
        self.blocks = blocks
        first = blocks[0]
        self.profile = first.profile
        # Numba typed lists, bound once: a call unboxes each as one pointer, where a tuple
        # of the run's ~600 arrays would be unboxed array by array at every call
        self._bound = kb.typed_list(tuple((b._eps, b._attn_args) for b in blocks))
        ffn = kb.typed_list(tuple(b._ffn_args for b in blocks))
        self._moe, self._dense = (ffn, None) if isinstance(first.ffn_args, MoeArgs) else (None, ffn)
        self._typed = {False: TypedCaches(), True: TypedCaches()}     # one sequence / several
        self._entries = {}                  # several sequences or not -> the compiled entry

    @staticmethod
    def _lockstep(batches) -> bool:
        """Whether every block holds the same sequences at the same lengths (the rows of one
        step): then the run can take them in one call."""
        first = batches[0]
        lengths = [c.length for c in first.caches]
        return all(b.rows == first.rows and [c.length for c in b.caches] == lengths for b in batches[1:])

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, caches) -> torch.Tensor:
        several = isinstance(caches[0], SequenceBatch)      # continuous batching: one per block
        if x.shape[0] > DECODE_TOKENS or any(b._rebound() for b in self.blocks) or \
                (several and not self._lockstep(caches)) or \
                (not several and any(c.length != caches[0].length for c in caches)):
            for b, c in zip(self.blocks, caches):
                x = b(x, positions, c)
            return x
        first = self.blocks[0]
        xh, pos, cos, sin, chunks = first._step_inputs(x, positions)
        xh = xh.copy()                      # the run uses it as scratch; x stays the caller's
        if several:
            rows = caches[0].rows
            n_pasts = np.array([c.length for c in caches[0].caches], np.int64)
            for batch in caches:
                for c, n in zip(batch.caches, batch.rows):
                    c.reserve(n)
            starts = np.zeros(len(rows) + 1, np.int64)
            np.cumsum(rows, out=starts[1:])
            raws = [c.raw() for batch in caches for c in batch.caches]
            n_seq = len(rows)

            def per_block(j):               # k (j = 0) or v buffers: a list per block of its sequences'
                return kb.typed_list(tuple(kb.typed_list(tuple(r[j] for r in raws[i:i + n_seq]))
                                          for i in range(0, len(raws), n_seq)))
            kcs, vcs = self._typed[True].get(raws, lambda: (per_block(0), per_block(1)))
            where = (None, 0, (kcs, vcs, starts, n_pasts))
        else:
            n_past = caches[0].length
            for c in caches:
                c.reserve(x.shape[0])
            raws = [c.raw() for c in caches]
            where = (self._typed[False].get(raws, lambda: kb.typed_list(tuple(raws))), n_past, None)
        args = (xh, np.empty_like(xh), pos, cos, sin, first._kv_tag, *where, self._bound, self._moe, self._dense,
                chunks)
        with self.profile.time("cpu_block"):
            if several not in self._entries:
                self._entries[several], y = first_call(kb.blocks_run, args)
            else:
                y = self._entries[several](*args)
        if several:
            for batch in caches:
                for c, n, past in zip(batch.caches, batch.rows, n_pasts):
                    c.length = int(past) + n
        else:
            for c in caches:
                c.length = n_past + x.shape[0]
        return torch.from_numpy(y)


def _run_key(block):
    """Blocks with equal keys can share one ``blocks_run`` call."""
    if not isinstance(block, CompiledBlock):
        return None
    return (block._ffn_half, block.rope, tuple(t.name for t in block._kv_tag),
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


def compile_block(block, parts: CompiledParts):
    """``CompiledBlock`` for a wholly CPU-resident block whose halves ``parts`` declares (GQA
    attention, an MoE or dense FFN) with a KV cache of ``kv_rows.KV_TYPES``; the block itself
    otherwise (or when ``OFFLOAD_BLOCKS=reference``), its ``path`` saying why. Either way the block's
    ``path`` is "compiled" or "reference: <why>" (``path_lines`` lists them at load)."""
    if not parts.handoff and isinstance(block.ffn, MoE):
        block.ffn.compiled_handoff = False
    bound = _bind(block, parts)
    if isinstance(bound, str):
        block.path = f"reference: {bound}"
        return block
    return CompiledBlock(block, bound)


def path_lines(model) -> list[str]:
    """One line per run of consecutive trunk blocks with one ``path`` ("blocks 0-2: reference:
    dense FFN off the CPU", "blocks 3-47: compiled"), then the NextN head's block's."""
    out, blocks, i = [], model.blocks, 0
    while i < len(blocks):
        j = i + 1
        while j < len(blocks) and blocks[j].path == blocks[i].path:
            j += 1
        out.append((f"block {i}" if j - i == 1 else f"blocks {i}-{j - 1}") + f": {blocks[i].path}")
        i = j
    if model.nextn is not None:
        out.append(f"nextn block: {model.nextn.block.path}")
    return out
