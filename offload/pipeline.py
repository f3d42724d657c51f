"""A model split across hosts, run as a pipeline over ``torch.distributed``: one process
(rank) per host of a plan across hosts (``placement.multihost``), in pipeline order, gloo
moving CPU tensors over TCP (``torchrun`` or ``--rank/--world-size`` with env:// rendezvous:
``MASTER_ADDR``, ``MASTER_PORT``).

Each rank loads only its part (``load_stage``): the blocks of its host's range, the
embedding on the first rank, the output layer on the last. The last rank drives: it runs the
generation loop of one process (``offload.speculative.generate_step``: drafting, verifying,
judging, sampling, stopping) and each target pass of that loop is a pass through every rank.
Before a pass it broadcasts a command (``_command``): the position the pass starts at — every
rank truncates its caches to it first, which is the rollback of rejected drafts — the pass's
tokens (the pending token and the drafts of a verify batch; the first rank embeds them) and
the tokens it has yielded since its last command (so every rank yields the same tokens).
Each rank runs its blocks at the same positions (every rank keeps the caches of its own
blocks) and sends the hidden state to the next — (T, n_embd) float32, deepseek4's (T, n,
n_embd) streams (``CausalLM.stage_shape``) — with the pass's tokens known to every rank (the
blocks that route by token id read them); the last rank computes the logits. A last command (stop, or abort when the last rank failed) ends every rank. A rank
that dies or stops answering for ``timeout_s`` ends the others with a one-line error naming
the rank waited on and the step.

Built: plain decoding and speculative decoding with the n-gram drafter (it needs only the
tokens) or the model's own MTP head (loaded on the last rank, which holds the trunk's last
hidden state; ``placement.multihost`` gives that host a copy of ``token_embd`` when the head
embeds with it), greedy or sampled on the last rank, batched or exact verification, for
architectures whose forward is a stage's in → steps → out (``PIPELINE_ARCHS``; an
architecture file may build its own stage, ``build_stage``: deepseek4 with its hc head and MTP
head on the last rank). Not built, refused in one line: a ``--draft`` head and DSpark across
hosts, GPU devices backed by the CPU (``--virtual-gpus``).
"""
from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from cpu_kernels import set_num_threads
from offload.cpu_ops import install_cpu_attention
from offload.decode_int8 import choose_decode_int8
from offload.devices import resolve
from offload.errors import OffloadError
from offload.gguf_model import ModelFile, check_shapes
from offload.models import architecture
from offload.models.shared import parts
from offload.models.shared.base import BuildContext, CausalLM, State
from offload.profile import Profile
from offload.runtime import compute_dtypes, kv_cache_type
from offload.sampling import Sampler
from offload.speculative import SpecOptions, drafter_uses_hidden, generate_step
from offload.stats import RunStats
from offload.weights import WeightStore
from placement.limits import INT8_FROM
from placement.memory import kv_cells
from placement.multihost import MultiHostPlan, shard

# architectures whose forward is CausalLM's stage_in -> stage_steps -> stage_out (their files say so)
PIPELINE_ARCHS = ("deepseek2", "deepseek4", "glm4moe", "qwen3moe", "gpt-oss")
TOKEN = torch.int64


def check_launch(mplan: MultiHostPlan, arch: str, rank: int, world_size: int, source: str) -> None:
    """The launch agrees with the plan: one rank per host, this rank among them, an
    architecture the pipeline runs. Checked before any weight is read."""
    names = mplan.host_names
    if world_size != len(names):
        raise OffloadError(f"{source}: the plan has {len(names)} hosts ({', '.join(names)}) but the launch has "
                           f"world size {world_size}")
    if not 0 <= rank < world_size:
        raise OffloadError(f"--rank must be 0..{world_size - 1}, got {rank}")
    if arch not in PIPELINE_ARCHS:
        raise OffloadError(f"{arch} across hosts is not built yet (running across hosts takes "
                           f"{', '.join(PIPELINE_ARCHS)})")


@dataclass
class Stage:
    """One rank's part: a ``CausalLM`` holding its blocks (the embedding on the first rank,
    the output layer and the NextN head, if the model has one, on the last) and their caches."""

    lm: CausalLM
    first: bool
    last: bool
    caches: list
    profile: Profile = field(default_factory=Profile)    # this rank's timers (its blocks, the hops' waits)

    @property
    def n_past(self) -> int:
        return self.caches[0].length

    @torch.inference_mode()
    def warmup(self) -> None:
        """Throw-away passes of this rank's part (one token, then a 2-token batch) on fresh
        caches, as ``Session.warmup`` does, so kernel loading stays out of the timings. Local:
        no other rank takes part."""
        caches = [b.new_cache() for b in self.lm.blocks]
        head_cache = self.lm.nextn.new_cache() if self.lm.nextn is not None else None
        for t in (1, 2):
            pos = torch.arange(caches[0].length, caches[0].length + t)
            ids = torch.zeros(t, dtype=TOKEN)
            x = self.lm.stage_in(ids) if self.first else torch.zeros(self.lm.stage_shape(t))
            for step in self.lm.stage_steps(pos, caches, ids):
                x = step(x)
            if self.last:
                _, h = self.lm.stage_out(x, "last" if t == 1 else "all")
                if self.lm.nextn is not None:
                    self.lm.nextn(torch.zeros(t, dtype=TOKEN), h, pos + 1, head_cache)


def load_stage(model: ModelFile, mplan: MultiHostPlan, rank: int, *, threads: int | None = None) -> Stage:
    """Rank ``rank``'s part of ``model`` under ``mplan``: only the tensors of its host, loaded
    with ``offload.runtime.load_plan``'s defaults (int8 activations for prompt batches from
    ``INT8_FROM`` tokens, decode activations ``auto``), so a rank computes what one process
    does. ``threads``: CPU kernel threads (None: the kernels' default)."""
    if threads is not None:
        if threads < 1:
            raise OffloadError(f"threads must be >= 1, got {threads}")
        set_num_threads(threads)
    host = mplan.hosts[rank]
    first, last = rank == 0, rank == len(mplan.hosts) - 1
    plan = host.plan
    check_shapes(model)
    part = shard(model, host.blocks, first=first, last=last)
    sub = dataclasses.replace(model, tensors=part.tensors)      # the weight store sees this host's tensors
    install_cpu_attention()
    choose_decode_int8(part.tensors, plan.tensors, model.spec.n_expert_used, quiet=True)     # as one process's load does
    arch = architecture(model.spec.arch)
    devices = resolve(set(plan.tensors.values()))
    profile = Profile()
    weights = WeightStore(sub, plan.tensors, devices, compute_dtype=compute_dtypes(devices, "auto"), profile=profile,
                          hot_experts=plan.hot_experts, int8_batch=INT8_FROM, decode_activations="auto")
    ctx = BuildContext(profile=profile, pool=ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts"),
                       kv_dtype=kv_cache_type(plan.settings.cache_type),
                       kv_dtype_v=kv_cache_type(plan.settings.v_type),
                       kv_cells=lambda layer: kv_cells(model.spec, layer, plan.settings))
    cfg = arch.config_from_gguf(model.spec, model.metadata)
    with torch.inference_mode():
        if hasattr(arch, "build_stage"):       # an architecture with more than these ends (deepseek4)
            lm = arch.build_stage(weights, cfg, ctx, host.blocks, first=first, last=last)
            return Stage(lm, first, last, [b.new_cache() for b in lm.blocks], profile)
        embed = weights.embedding("token_embd.weight") if first else None
        blocks = [arch.block(weights, cfg, i, ctx) for i in host.blocks]
        output_norm, output = parts.output_ends(weights, cfg) if last else (None, None)
        nextn = None
        if last:       # the NextN head drafts where the trunk's last hidden state is
            head_embed = embed
            if head_embed is None and weights.has("token_embd.weight"):     # placement.multihost.nextn_embedding
                head_embed = weights.embedding("token_embd.weight")
            nextn = parts.draft_head(weights, None, cfg, lambda store, i: arch.block(store, cfg, i, ctx),
                                     embed=head_embed, output=output)
    lm = CausalLM(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output, nextn=nextn)
    return Stage(lm, first, last, [b.new_cache() for b in blocks], profile)


class PipelineError(OffloadError):
    """A rank died or stopped answering (one line: this rank, the rank waited on, the step)."""


# The last rank's commands, what every rank does next (int64, broadcast from the last rank):
# [op, pos, T, n_emit, payload...]. FORWARD: truncate the caches to ``pos`` (the rollback of
# the rejected drafts), then run the T tokens of the payload; STOP: truncate to ``pos``, the
# generation is over; ABORT: the last rank failed (its own error says why). ``n_emit``: the
# tokens the last rank yielded since its previous command, after the T tokens in the payload.
FORWARD, STOP, ABORT = 1, 2, 3
HEADER = 4


class _Trunk:
    """What ``offload.speculative.generate_step`` sees as the model on the last rank: a
    ``forward`` that is one pass through every rank (the pass's tokens broadcast first).
    It has no ``blocks``, so a non-finite pass is reported without the block search."""

    def __init__(self, pipe: "Pipeline"):
        self.pipe = pipe

    def forward(self, ids: torch.Tensor, state: State, *, logits: str = "last"):
        tokens = [int(i) for i in ids.tolist()]
        self.pipe._command(FORWARD, state.n_past, tokens)
        return self.pipe._pass(tokens, len(tokens), logits)


class Pipeline:
    """The lockstep loop of one rank (module docstring). Every rank calls ``generate`` with the
    same prompt, ``max_tokens`` and ``options``; each yields the same tokens."""

    def __init__(self, stage: Stage, rank: int, world_size: int):
        self.stage, self.rank, self.world = stage, rank, world_size
        self.step_no = 0
        self.broken = False              # a wait failed: no collective may be tried again
        self.slots = 2                   # payload in the command itself; set per generation
        self._emitted: list[int] = []    # last rank: yielded since its previous command

    def _wait(self, what: str, peer: int, op) -> None:
        try:
            with self.stage.profile.time("transfer"):    # the run's split: time spent on the hops
                op()
        except RuntimeError as exc:      # gloo: a closed connection or the timeout
            self.broken = True
            raise PipelineError(f"rank {self.rank}: step {self.step_no}: rank {peer} stopped answering while "
                                f"{what} ({gloo_reason(exc)})") from None

    def _command(self, op: int = 0, pos: int = 0, tokens: Sequence[int] = ()) -> tuple[int, int, list[int], list[int]]:
        """The last rank sends (op, pos, tokens and the tokens it yielded since), every other
        rank receives them: one broadcast, two when the payload outgrows ``slots`` (a prompt
        chunk). Returns (op, pos, tokens, emitted)."""
        src = self.world - 1
        head = torch.zeros(HEADER + self.slots, dtype=TOKEN)
        if self.stage.last:
            emitted, self._emitted = self._emitted, []
            payload = list(tokens) + emitted
            head[:HEADER] = torch.tensor([op, pos, len(tokens), len(emitted)])
            if len(payload) <= self.slots:
                head[HEADER:HEADER + len(payload)] = torch.tensor(payload, dtype=TOKEN)
            if self.world > 1:
                self._broadcast(head, src)
                if len(payload) > self.slots:
                    self._broadcast(torch.tensor(payload, dtype=TOKEN), src)
            self.step_no += 1
            return op, pos, list(tokens), emitted
        self._broadcast(head, src)
        op, pos, t, n_emit = (int(v) for v in head[:HEADER])
        if t + n_emit <= self.slots:
            payload = head[HEADER:HEADER + t + n_emit]
        else:
            payload = torch.empty(t + n_emit, dtype=TOKEN)
            self._broadcast(payload, src)
        self.step_no += 1
        values = payload.tolist()
        return op, pos, values[:t], values[t:]

    def _broadcast(self, values: torch.Tensor, src: int) -> None:
        self._wait("sending the next tokens", src, lambda: dist.broadcast(values, src=src))

    @torch.inference_mode()
    def _pass(self, ids: Sequence[int], t: int, logits: str) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """One pass of T tokens ``ids`` (every rank has them) at the caches' next positions → on
        the last rank ``CausalLM.stage_out``'s (logits, hidden states), else None."""
        s = self.stage
        positions = torch.arange(s.n_past, s.n_past + t)
        tokens = torch.as_tensor(list(ids), dtype=TOKEN)
        if s.first:
            x = s.lm.stage_in(tokens)
        else:
            x = torch.empty(s.lm.stage_shape(t), dtype=torch.float32)
            self._wait("sending the hidden state", self.rank - 1, lambda: dist.recv(x, src=self.rank - 1))
        for step in s.lm.stage_steps(positions, s.caches, tokens):
            x = step(x)
        if not s.last:
            out = x.to("cpu", torch.float32).contiguous()       # stage_shape(T)
            self._wait("taking the hidden state", self.rank + 1, lambda: dist.send(out, dst=self.rank + 1))
            return None
        return s.lm.stage_out(x, logits)

    def generate(self, prompt: Sequence[int], *, max_tokens: int, options: SpecOptions = SpecOptions(),
                 ubatch: int, sampler: Sampler | None = None, eos: frozenset[int] = frozenset(),
                 stats: RunStats | None = None, guide=None,
                 on_token: Callable[[int, np.ndarray], None] | None = None) -> Iterator[int]:
        """Yield the generated tokens of a fresh sequence (on every rank). The last rank runs
        ``offload.speculative.generate_step`` (the prompt in passes of ``ubatch`` tokens, then
        drafting with ``options`` — n_max 0 is plain decoding — verifying, judging, sampling
        with ``sampler``, stopping at ``eos`` or ``max_tokens``); each of its target passes is a
        pass through every rank, and every other rank follows its commands. ``stats``,
        ``guide``, ``on_token``: as ``generate_step`` takes them, on the last rank."""
        self.slots = 2 * (options.n_max + 1)     # a verify batch and the tokens of a step
        # a fresh sequence (no prompt cache across hosts): fresh caches, since not every kind
        # rolls back to 0 (deepseek4's compressor states keep only the rows still needed)
        self.stage.caches[:] = [b.new_cache() for b in self.stage.lm.blocks]
        if self.stage.last:
            yield from self._drive(prompt, max_tokens=max_tokens, options=options, ubatch=ubatch,
                                   sampler=sampler if sampler is not None else Sampler(), eos=eos, stats=stats,
                                   guide=guide, on_token=on_token)
        else:
            yield from self._follow()

    def _drive(self, prompt: Sequence[int], *, options: SpecOptions, **kw) -> Iterator[int]:
        state = State(self.stage.caches)
        self._emitted = []
        steps = None
        op = ABORT
        try:
            head = self._head(options)
            state.nextn_cache = head.new_cache() if head is not None else None
            steps = generate_step(_Trunk(self), prompt, state=state, head=head, options=options,
                                  profile=self.stage.profile, **kw)
            for tok in steps:
                self._emitted.append(tok)
                yield tok
            op = STOP
        except GeneratorExit:             # the caller stopped early: a clean end for everyone
            op = STOP
            raise
        finally:
            if steps is not None:
                steps.close()             # its ``finally`` rewinds the caches to what was yielded
            if not self.broken and self.world > 1:
                try:
                    self._command(op, state.n_past)
                except PipelineError:
                    if op == STOP:
                        raise

    def _head(self, options: SpecOptions):
        """The draft head ``options`` drafts with on this (the last) rank: the model's NextN
        head for ``mtp``, None for a drafter that needs no head (n-gram) or no drafting."""
        if not options.n_max or not drafter_uses_hidden(options.type):
            return None
        if options.type != "mtp" or self.stage.lm.nextn is None:
            raise OffloadError(f"--spec-type {options.type} across hosts: the last rank has no such draft head "
                               "(it drafts with the model's own NextN head, or --spec-type ngram)")
        return self.stage.lm.nextn

    def _follow(self) -> Iterator[int]:
        s = self.stage
        while True:
            op, pos, tokens, emitted = self._command()
            yield from emitted
            if op == ABORT:
                raise PipelineError(f"rank {self.rank}: step {self.step_no}: rank {self.world - 1} ended the run "
                                    "with an error (its own output says which)")
            if s.n_past > pos:            # the drafts the last rank rejected
                State(s.caches).truncate(pos)
            if op == STOP:
                return
            self._pass(tokens, len(tokens), "none")


def init_group(rank: int, world_size: int, timeout_s: float) -> None:
    """gloo over env:// (``MASTER_ADDR``, ``MASTER_PORT``); a peer silent for ``timeout_s`` fails the wait."""
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    except (ValueError, RuntimeError) as exc:
        raise OffloadError(f"rank {rank}: cannot join the pipeline of {world_size} ranks ({gloo_reason(exc)})") from None


def gloo_reason(exc: BaseException) -> str:
    """gloo's own words, short: its first line without the source location and the advice
    (``[.../pair.cc:553] Connection closed by peer [127.0.0.1]:32463. This is typically ...``)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")
