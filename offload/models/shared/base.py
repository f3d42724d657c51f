"""What every architecture file uses and none restates: the block interface, a sequence's
caches, the causal LM's common ends (embedding, block runs, output head, the generate
contract) and the NextN (MTP) draft head. An architecture subclasses ``DecoderBlock`` and
``CausalLM`` and writes their ``__call__`` / ``forward`` as its own math
(``offload/models/<arch>.py``).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from gpu.kv_cache import CacheType, KVCache, SequenceBatch, spans
from gpu.norm import RMSNorm
from gpu.rope import Rope, rope_for
from offload.compiled_block import block_runs
from offload.compiled_head import CompiledHead
from offload.models.shared.config import ModelConfig
from offload.profile import Profile


class DecoderBlock:
    """The block interface the model loop, the caches, the compiled path and ``offload tune``
    keep: ``device_name``, ``device``, ``profile``, ``new_cache()`` (a fresh cache of the
    block's own kind, with ``length`` and ``truncate(n)``) and ``__call__(x, positions, cache)
    -> x``. An architecture's block names its parts as keywords (``attn_norm``, ``attn``,
    ``ffn_norm``, ``ffn`` where it has them: tune and the compiled path look them up by
    those names) and writes ``__call__`` as its math."""

    def __init__(self, *, device_name: str, device: torch.device, profile: Profile,
                 cache: Callable[[torch.device], object], **parts):
        self.device_name, self.device, self.profile = device_name, device, profile
        self._cache = cache
        self.path = "reference"     # offload.compiled_block.compile_block says which path and why
        for name, part in parts.items():
            setattr(self, name, part)

    def new_cache(self):
        """A fresh cache for this block, on its device, as the plan sized it."""
        return self._cache(self.device)

    def arrive(self, x: torch.Tensor) -> torch.Tensor:
        """x on this block's device: the hidden state moves only at a block boundary."""
        if x.device != self.device:
            with self.profile.time("transfer"):
                x = x.to(self.device)
        return x


@dataclass
class State:
    """One sequence's caches. ``truncate(n)`` rolls the trunk back to n positions; the draft
    head's cache (``nextn_cache``: anything with ``length`` and ``truncate``) is rolled back
    by the speculative loop, which knows how far it is valid."""
    caches: list[KVCache]
    nextn_cache: object | None = None

    @property
    def n_past(self) -> int:
        return self.caches[0].length

    def positions(self, n: int) -> torch.Tensor:
        """(n,) host tensor of the RoPE positions of the next n tokens."""
        return torch.arange(self.n_past, self.n_past + n)

    def truncate(self, n: int) -> None:
        for c in self.caches:
            c.truncate(n)


class BatchState:
    """Several sequences' ``State``s stepped as one batch (``CausalLM.forward_batch``): the
    batch's rows are sequence 0's ``rows[0]`` tokens, then sequence 1's, …; ``positions``
    are each sequence's own, and ``caches[i]`` is block i's caches as one ``SequenceBatch``
    (attention per sequence, everything else over all rows)."""

    def __init__(self, states: list[State], rows: list[int]):
        self.states, self.rows = states, rows
        self.caches = [SequenceBatch([s.caches[i] for s in states], rows) for i in range(len(states[0].caches))]

    def positions(self, n: int) -> torch.Tensor:
        if n != sum(self.rows):
            raise ValueError(f"{n} tokens for a batch of {sum(self.rows)} rows")
        return torch.cat([s.positions(r) for s, r in zip(self.states, self.rows)])


class CausalLM:
    """The ends every causal LM here shares; an architecture's ``forward(ids, state, *,
    logits)`` states what lies between them. ``forward`` runs the trunk over ids (T,) at
    positions ``state.n_past``.. and advances the caches by T; it returns logits ((T, n_vocab)
    for "all", (1, n_vocab) for "last", None for "none") and the final hidden states
    (T, n_embd) after ``output_norm``, which the output head and the NextN head read
    (deepseek4: its (T, n·n_embd) streams before the hc head, which its MTP head reads). It keeps
    one reference to the hidden state as it goes (a helper that takes x as an argument would
    hold the embedding through every block: its caller's argument stays alive)."""

    def __init__(self, *, config: ModelConfig, embed, blocks: list, output_norm: RMSNorm,
                 output, nextn: NextN | None):
        self.config, self.embed, self.blocks = config, embed, blocks
        self.output_norm, self.output, self.nextn = output_norm, output, nextn
        self._runs_for, self._runs = None, []
        self._head = None
        self._bound_head()              # bound (and compiled) at load, not in the first pass

    def final(self, x: torch.Tensor, logits: str) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``output_norm`` then ``output`` (one compiled call where it applies) → (logits, h)."""
        head = self.output_head
        if head is not None and head.takes(x.shape[0], logits):
            return head(x, logits)
        h = self.output_norm(x)
        if logits == "none":
            return None, h
        return self.output(h if logits == "all" else h[-1:]).float(), h

    @property
    def output_head(self) -> CompiledHead | None:
        """``output_norm`` + ``output`` as one compiled call (``offload.compiled_head``; None
        where it does not apply), bound again when someone replaces either part."""
        head = self._bound_head()
        return head if type(head) is CompiledHead else None

    def _bound_head(self):
        head = self._head
        if head is None or head.norm is not self.output_norm or head.output is not self.output:
            head = self._head = CompiledHead.bind(self.output_norm, self.output) or _NoHead(self)
        return head

    # whether ``forward`` can take a ``BatchState`` (its attention reads caches through
    # ``append``/``attend``); an architecture with caches of its own kind says False and
    # ``forward_batch`` runs its sequences one after another
    batches_sequences = True

    def forward_batch(self, seqs: list[tuple[torch.Tensor, State, str]]) -> list[tuple]:
        """Several sequences' passes as one: ``seqs`` holds (ids (T_i,), state, logits) each;
        returns each one's (logits, hidden) as its own ``forward`` would. One pass over the
        concatenated rows (``BatchState``); its logits are computed for every row when any
        sequence wants some."""
        if len(seqs) == 1 or not self.batches_sequences:
            return [self.forward(ids, state, logits=logits) for ids, state, logits in seqs]
        rows = [int(ids.shape[0]) for ids, _, _ in seqs]
        want = "all" if any(lg != "none" for _, _, lg in seqs) else "none"
        z, h = self.forward(torch.cat([ids for ids, _, _ in seqs]), BatchState([s for _, s, _ in seqs], rows),
                            logits=want)
        return [(None if lg == "none" else z[lo:hi] if lg == "all" else z[hi - 1:hi], h[lo:hi])
                for (_, _, lg), (lo, hi) in zip(seqs, spans(rows))]

    # A pipeline stage (``offload.pipeline``: a rank holding some of the blocks) runs a pass as
    # ``stage_in`` (first rank) → each of ``stage_steps`` → ``stage_out`` (last rank), sending
    # the ``stage_shape`` hidden state between ranks; an architecture whose residual is not one
    # (T, n_embd) row per token (deepseek4's streams) says how.

    def stage_in(self, ids: torch.Tensor) -> torch.Tensor:
        """The hidden state entering the first block: the embedding of ids (T,)."""
        return self.embed(ids)

    def stage_shape(self, t: int) -> tuple[int, ...]:
        """What one pass of t tokens sends from a stage's last block to the next's first."""
        return (t, self.config.n_embd)

    def stage_steps(self, positions: torch.Tensor, caches: list, ids: torch.Tensor) -> list:
        """This model's ``blocks`` at ``positions`` with their ``caches`` as steps ``x -> x``
        (the pass's token ids alongside, for blocks that route by them). The caller loops
        ``x = step(x)``: a helper taking x as an argument would hold its first x (a prompt
        batch's embedding) through every block, memory the planner does not count."""
        return [lambda x, run=run, lo=lo, hi=hi: run(x, positions, caches[lo:hi]) for run, lo, hi in self.block_runs()]

    def stage_out(self, x: torch.Tensor, logits: str) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The last block's output → ``forward``'s (logits, hidden states)."""
        return self.final(x, logits)

    def block_runs(self) -> list:
        """``offload.compiled_block.block_runs`` of the current ``blocks`` (rebuilt when
        someone replaces the list or one of its blocks, e.g. a test's reference blocks)."""
        if self._runs_for != self.blocks:
            self._runs_for, self._runs = list(self.blocks), block_runs(self.blocks)
        return self._runs

    def new_state(self, head=None) -> State:
        """Fresh caches for the trunk and for ``head`` (default: the model's NextN head)."""
        head = head if head is not None else self.nextn
        return State([b.new_cache() for b in self.blocks],
                     head.new_cache() if head is not None else None)


class _NoHead:
    """Remembers that no compiled head applies to these parts (so the check is not redone)."""

    def __init__(self, model: CausalLM):
        self.norm, self.output = model.output_norm, model.output


class NextN:
    """The NextN/MTP head of GLM-4.5 and DeepSeek-V3: from the trunk's post-``output_norm``
    hidden state at t and the token at t+1, one full decoder block with its own KV cache →
    logits for t+2 and its own pre-norm hidden state (which feeds the next chained draft step)."""

    def __init__(self, *, embed, enorm: RMSNorm, hnorm: RMSNorm, eh_proj, block, norm: RMSNorm, head):
        self.embed, self.enorm, self.hnorm, self.eh_proj = embed, enorm, hnorm, eh_proj
        self.block, self.norm, self.head = block, norm, head

    def new_cache(self):
        """The head's own KV cache (entry t holds the pair (h_t, token t+1)), on its device."""
        return self.block.new_cache()

    def __call__(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 cache: KVCache, *, logits: str = "all") -> tuple[torch.Tensor | None, torch.Tensor]:
        """tokens: (T,) ids of t+1; hidden: (T, n_embd) trunk states at t; positions: (T,)
        RoPE positions (those of the tokens, t+1) → logits ((T, n_vocab) for "all", (1, n_vocab)
        for "last", None for "none") and h_mtp (T, n_embd), the pre-norm state that chains."""
        dev = self.block.device
        e = self.enorm(self.embed(tokens).to(dev))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden.to(dev))], dim=-1))
        h = self.block(x, positions, cache)
        if logits == "none":
            return None, h
        return self.head(self.norm(h if logits == "all" else h[-1:])).float(), h


@dataclass
class BuildContext:
    """What every builder needs besides the weights: one RoPE table per device, the
    profile, and the worker thread that drives CPU experts."""
    profile: Profile
    pool: ThreadPoolExecutor
    kv_dtype: CacheType = torch.float32       # a torch float dtype or a quantized GGUF type (gpu.kv_cache)
    kv_dtype_v: CacheType | None = None       # V's, where it differs (-ctv); None: kv_dtype
    # block index → its cache's cells, the planner's own per-layer cache spec
    # (placement.memory.kv_cells: the context padded to 256, less for a sliding-window block)
    kv_cells: Callable[[int], int] | None = None
    # deepseek4: block index → the rows of its window, compressed and indexer caches and
    # compressor state as the plan counted them (placement.memory.dsv4_cache)
    dsv4_cache: Callable[[int], object] | None = None
    ropes: dict = field(default_factory=dict)

    def cells(self, layer: int) -> int | None:
        """Cells of block ``layer``'s cache as the plan counted them (None: grow on demand)."""
        return None if self.kv_cells is None else self.kv_cells(layer)

    def cache(self, cfg: ModelConfig, layer: int) -> Callable[[torch.device], KVCache]:
        """A new GQA KV cache for block ``layer`` on a device, as the plan sized it."""
        cells = self.cells(layer)
        return lambda dev: KVCache(cfg.n_head_kv, cfg.head_dim, device=dev, dtype=self.kv_dtype,
                                     dtype_v=self.kv_dtype_v, max_cells=cells)

    def rope(self, cfg: ModelConfig, device: torch.device) -> Rope:
        key = (cfg.rope_spec, device)
        if key not in self.ropes:
            self.ropes[key] = rope_for(cfg.rope_spec, device)
        return self.ropes[key]
