"""A model split across hosts, run as a pipeline over ``torch.distributed``: one process
(rank) per host of a plan across hosts (``placement.multihost``), in pipeline order, gloo
moving CPU tensors over TCP (``torchrun`` or ``--rank/--world-size`` with env:// rendezvous:
``MASTER_ADDR``, ``MASTER_PORT``).

Each rank loads only its part (``load_stage``): the blocks of its host's range, the
embedding on the first rank, the output layer on the last. A pass (``Pipeline.step``): the
first rank embeds the tokens; each rank runs its blocks at the same positions (every rank
keeps the caches of its own blocks) and sends the hidden state, (T, n_embd) float32, to the
next; the last rank computes the logits and picks the token, which it broadcasts to every
rank, so all ranks step in lockstep and stop together. A rank that dies or stops answering
for ``timeout_s`` ends the others with a one-line error naming the rank waited on and the
step.

Built: plain decoding (greedy or sampled on the last rank) for architectures whose forward
is embedding → blocks → output (``PIPELINE_ARCHS``). Not built, refused in one line:
speculative decoding across hosts, deepseek4 (its hyper-connection streams), GPU devices
backed by the CPU (``--virtual-gpus``).
"""
from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from offload.devices import resolve
from offload.errors import OffloadError
from offload.gguf_model import ModelFile, check_shapes
from offload.models import architecture
from offload.models.shared import parts
from offload.models.shared.base import BuildContext, CausalLM
from offload.profile import Profile
from offload.runtime import compute_dtypes, kv_cache_type
from offload.sampling import Sampler
from offload.weights import WeightStore
from placement.memory import kv_cells
from placement.multihost import MultiHostPlan, shard

# architectures whose forward is embed -> blocks -> output_norm/output (their files say so)
PIPELINE_ARCHS = ("deepseek2", "glm4moe", "qwen3moe", "gpt-oss")
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
    the output layer on the last) and their caches."""

    lm: CausalLM
    first: bool
    last: bool
    n_embd: int
    caches: list

    @property
    def n_past(self) -> int:
        return self.caches[0].length


def load_stage(model: ModelFile, mplan: MultiHostPlan, rank: int, *, threads: int | None = None) -> Stage:
    """Rank ``rank``'s part of ``model`` under ``mplan``: only the tensors of its host."""
    host = mplan.hosts[rank]
    first, last = rank == 0, rank == len(mplan.hosts) - 1
    plan = host.plan
    check_shapes(model)
    part = shard(model, host.blocks, first=first, last=last)
    sub = dataclasses.replace(model, tensors=part.tensors)      # the weight store sees this host's tensors
    arch = architecture(model.spec.arch)
    devices = resolve(set(plan.tensors.values()))
    profile = Profile()
    weights = WeightStore(sub, plan.tensors, devices, compute_dtype=compute_dtypes(devices, "auto"), profile=profile)
    ctx = BuildContext(profile=profile, pool=ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts"),
                       kv_dtype=kv_cache_type(plan.settings.cache_type),
                       kv_dtype_v=kv_cache_type(plan.settings.v_type),
                       kv_cells=lambda layer: kv_cells(model.spec, layer, plan.settings))
    cfg = arch.config_from_gguf(model.spec, model.metadata)
    with torch.inference_mode():
        embed = weights.embedding("token_embd.weight") if first else None
        blocks = [arch.block(weights, cfg, i, ctx) for i in host.blocks]
        output_norm, output = parts.output_ends(weights, cfg) if last else (None, None)
    lm = CausalLM(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output, nextn=None)
    return Stage(lm, first, last, model.spec.n_embd, [b.new_cache() for b in blocks])


class PipelineError(OffloadError):
    """A rank died or stopped answering (one line: this rank, the rank waited on, the step)."""


class Pipeline:
    """The lockstep loop of one rank (module docstring). Every rank calls ``generate`` with the
    same arguments; each yields the same tokens."""

    def __init__(self, stage: Stage, rank: int, world_size: int):
        self.stage, self.rank, self.world = stage, rank, world_size
        self.step_no = 0

    def _wait(self, what: str, peer: int, op) -> None:
        try:
            op()
        except RuntimeError as exc:      # gloo: a closed connection or the timeout
            raise PipelineError(f"rank {self.rank}: step {self.step_no}: rank {peer} stopped answering while "
                                f"{what} ({gloo_reason(exc)})") from None

    @torch.inference_mode()
    def step(self, ids: Sequence[int], *, logits: bool) -> np.ndarray | None:
        """One pass of ``ids`` (T tokens; every rank knows T, only the first rank reads them)
        → the last row's logits on the last rank (``logits``), else None."""
        s = self.stage
        t = len(ids)
        positions = torch.arange(s.n_past, s.n_past + t)
        if s.first:
            x = s.lm.embed(torch.as_tensor(list(ids), dtype=TOKEN))
        else:
            x = torch.empty(t, s.n_embd, dtype=torch.float32)
            self._wait("sending the hidden state", self.rank - 1, lambda: dist.recv(x, src=self.rank - 1))
        for run, lo, hi in s.lm.block_runs():
            x = run(x, positions, s.caches[lo:hi])
        if not s.last:
            out = x.to("cpu", torch.float32).contiguous()
            self._wait("taking the hidden state", self.rank + 1, lambda: dist.send(out, dst=self.rank + 1))
            return None
        if not logits:
            return None
        z, _ = s.lm.final(x, "last")
        return z[-1].detach().to("cpu", torch.float32).numpy()

    def _broadcast(self, values: torch.Tensor) -> torch.Tensor:
        src = self.world - 1
        self._wait("sending the sampled token", src, lambda: dist.broadcast(values, src=src))
        return values

    def generate(self, prompt: Sequence[int], *, max_tokens: int, sampler: Sampler, ubatch: int,
                 eos: frozenset[int] = frozenset(),
                 on_token: Callable[[int, np.ndarray], None] | None = None) -> Iterator[int]:
        """Yield the generated tokens (on every rank): the prompt in passes of ``ubatch``
        tokens, then one token a pass; the last rank samples, every rank gets the token.
        ``on_token(token, row)``: on the last rank, each token with the logits row it was
        chosen at (as ``offload.speculative.generate_step`` calls it)."""
        prompt = list(prompt)
        for lo in range(0, len(prompt), ubatch):
            chunk = prompt[lo:lo + ubatch]
            z = self.step(chunk, logits=lo + ubatch >= len(prompt))
            self.step_no += 1
        for _ in range(max_tokens):
            token = torch.tensor([sampler(z) if z is not None else -1], dtype=TOKEN)
            tok = int(self._broadcast(token)[0])
            if on_token is not None and z is not None:
                on_token(tok, z)
            yield tok
            if tok in eos:
                return
            z = self.step([tok], logits=True)
            self.step_no += 1


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
