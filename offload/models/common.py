"""What the MoE architectures share: the frozen config, the decoder block, the causal LM
with its per-layer KV caches, the NextN (MTP) head, and the builders that assemble them
from a WeightStore using GGUF tensor names.
"""
from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch
from gguf import Keys

from gpu.attention import Attention
from gpu.ffn import SwiGLU
from gpu.kv_cache import KVCache
from gpu.norm import RMSNorm
from gpu.rope import Rope, RopeSpec, YaRN, rope_for
from offload.compiled_block import CompiledParts, block_runs, compile_block
from offload.compiled_head import CompiledHead
from offload.errors import OffloadError
from offload.gguf_header import LazyArray
from offload.moe import MoE
from offload.profile import Profile
from placement.tensors import ModelSpec

@dataclass(frozen=True)
class ModelConfig:
    """The numbers the model math needs: the planner's ``ModelSpec`` fields (parsed once by
    ``offload.gguf_model``) plus the keys only the runtime reads (RoPE base, norm eps,
    routing weights)."""
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int              # trunk blocks (block_count minus the NextN blocks)
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int                # rotary dims per head (partial rotary when < head_dim)
    rope_base: float
    rms_eps: float
    n_expert: int
    n_expert_used: int
    expert_weights_norm: bool
    expert_weights_scale: float
    n_nextn: int              # NextN/MTP blocks after the trunk (0 or 1 supported)
    context_length: int

    @property
    def rope_spec(self) -> RopeSpec:
        """The rotary table the blocks share (an architecture with YaRN or interleaved
        rotary overrides this)."""
        return RopeSpec(self.n_rot, self.rope_base)


def meta_value(meta: Mapping, template: str, arch: str, default=None):
    """A metadata value by ``gguf.Keys`` template (long arrays decoded on demand)."""
    v = meta.get(template.format(arch=arch), default)
    return v.values() if isinstance(v, LazyArray) else v


def config_fields(spec: ModelSpec, meta: Mapping, *, expert_weights_norm_default: bool = False) -> dict:
    """The ``ModelConfig`` fields every architecture reads the same way, from ModelSpec and
    the runtime-only keys (an architecture replaces what it reads differently)."""
    get = lambda t, d=None: meta_value(meta, t, spec.arch, d)  # noqa: E731
    if spec.n_nextn > 1:
        raise OffloadError(f"{spec.n_nextn} NextN layers: only one is supported")
    eps = get(Keys.Attention.LAYERNORM_RMS_EPS)
    if eps is None:
        raise OffloadError(f"missing metadata key {Keys.Attention.LAYERNORM_RMS_EPS.format(arch=spec.arch)}")
    return dict(
        arch=spec.arch, n_vocab=spec.n_vocab, n_embd=spec.n_embd, n_layer=spec.n_layer_trunk,
        n_head=spec.n_head, n_head_kv=spec.n_head_kv[0], head_dim=spec.head_dim_k,
        n_rot=spec.n_rot or spec.head_dim_k,
        rope_base=float(get(Keys.Rope.FREQ_BASE, 10000.0)), rms_eps=float(eps),
        n_expert=spec.n_expert, n_expert_used=spec.n_expert_used,
        expert_weights_norm=bool(get(Keys.LLM.EXPERT_WEIGHTS_NORM, expert_weights_norm_default)),
        expert_weights_scale=float(get(Keys.LLM.EXPERT_WEIGHTS_SCALE, 1.0)),
        n_nextn=spec.n_nextn, context_length=spec.n_ctx_train)


def yarn_scaling(spec: ModelSpec, meta: Mapping) -> YaRN | None:
    """``rope.scaling.*`` → YaRN (None without scaling); any other scaling is refused."""
    get = lambda t, d=None: meta_value(meta, t, spec.arch, d)  # noqa: E731
    scaling = get(Keys.Rope.SCALING_TYPE, "none")
    factor = float(get(Keys.Rope.SCALING_FACTOR, 1.0) or 1.0)
    if scaling == "yarn" and factor > 1.0:
        return YaRN(factor, int(get(Keys.Rope.SCALING_ORIG_CTX_LEN, spec.n_ctx_train)),
                    beta_fast=float(get(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0)),
                    beta_slow=float(get(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0)))
    if scaling not in ("none", "yarn") or factor != 1.0:
        raise OffloadError(f"{spec.arch}: RoPE scaling {scaling!r} (factor {factor}) is not supported (yarn only)")
    return None


def common_config(spec: ModelSpec, meta: Mapping, *,
                  expert_weights_norm_default: bool = False) -> ModelConfig:
    """ModelSpec + the runtime-only keys → ModelConfig for the GQA architectures, refusing
    what their math does not do. Whether a block is dense or MoE is read from its tensors
    (a router means MoE)."""
    get = lambda t, d=None: meta_value(meta, t, spec.arch, d)  # noqa: E731
    if spec.head_dim_k != spec.head_dim_v:
        raise OffloadError(f"{spec.arch}: attention key_length {spec.head_dim_k} != value_length "
                           f"{spec.head_dim_v} is not supported")
    if len(set(spec.n_head_kv)) > 1:
        raise OffloadError(f"{spec.arch}: a per-layer head_count_kv is not supported")
    if get(Keys.Rope.SCALING_TYPE, "none") not in ("none", "linear") or \
            float(get(Keys.Rope.SCALING_FACTOR, 1.0) or 1.0) != 1.0:
        raise OffloadError(f"{spec.arch}: RoPE scaling is not supported")
    return ModelConfig(**config_fields(spec, meta, expert_weights_norm_default=expert_weights_norm_default))


# -- runtime structure ------------------------------------------------------------------

def kv_cache(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_cells: int | None = None) -> KVCache:
    return KVCache(cfg.n_head_kv, cfg.head_dim, device=device, dtype=dtype, max_cells=max_cells)


Attend = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]   # (x, positions, cache) → (T, n_embd)


class Block:
    """Pre-norm decoder block: x + attn(norm(x)); h + ffn(norm(h)). Runs on ``device``;
    the hidden state moves only here, at the block boundary.

    The block interface every architecture (and any compiled block) keeps: ``device_name``,
    ``device``, ``new_cache()`` (a fresh cache of the block's own kind, with ``length`` and
    ``truncate(n)``) and ``__call__(x, positions, cache) -> x`` with x (T, n_embd)."""

    def __init__(self, *, device_name: str, device: torch.device, attn_norm, attn: Attend,
                 ffn_norm, ffn, profile: Profile, cache: Callable[[torch.device], object]):
        self.device_name, self.device, self.attn_norm, self.attn = device_name, device, attn_norm, attn
        self.ffn_norm, self.ffn, self.profile = ffn_norm, ffn, profile
        self._cache = cache
        self.path = "reference"     # offload.compiled_block.compile_block says which path and why

    def new_cache(self):
        """A fresh KV cache for this block, on its device, as the plan sized it."""
        return self._cache(self.device)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x: (T, n_embd) hidden states; positions: (T,) host tensor of RoPE positions."""
        if x.device != self.device:
            with self.profile.time("transfer"):
                x = x.to(self.device)
        h = x + self.attn(self.attn_norm(x), positions, cache)
        return h + self.ffn(self.ffn_norm(h))


class NextN:
    """The NextN/MTP head: from the trunk's post-``output_norm`` hidden state at t and the
    token at t+1, one full decoder block with its own KV cache → logits for t+2 and its own
    pre-norm hidden state (which feeds the next chained draft step)."""

    def __init__(self, *, embed, enorm: RMSNorm, hnorm: RMSNorm, eh_proj, block: Block,
                 norm: RMSNorm, head):
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
class State:
    """One sequence's caches. ``truncate(n)`` rolls the trunk back to n positions; the draft
    head's cache (``nextn_cache``: anything with ``length`` and ``truncate``) is rolled back
    by the speculative loop, which knows how far it is valid."""
    caches: list[KVCache]
    nextn_cache: object | None = None

    @property
    def n_past(self) -> int:
        return self.caches[0].length

    def truncate(self, n: int) -> None:
        for c in self.caches:
            c.truncate(n)


class CausalLM:
    def __init__(self, *, config: ModelConfig, embed, blocks: list[Block], output_norm: RMSNorm,
                 output, nextn: NextN | None):
        self.config, self.embed, self.blocks = config, embed, blocks
        self.output_norm, self.output, self.nextn = output_norm, output, nextn
        self._runs_for, self._runs = None, []
        self._head = None
        self._bound_head()              # bound (and compiled) at load, not in the first pass

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

    def forward(self, ids: torch.Tensor, state: State, *, logits: str = "all"
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run the trunk over ids (T,) at positions n_past.. and advance the caches by T.

        Returns logits ((T, n_vocab) for "all", (1, n_vocab) for "last", None for "none")
        and the final hidden states (T, n_embd) after ``output_norm`` — what the output head
        and the NextN head read.
        """
        pos0 = state.n_past
        positions = torch.arange(pos0, pos0 + ids.shape[0])
        x = self.embed(ids)
        for step, lo, hi in self.block_runs():     # runs of compiled blocks: one call each
            x = step(x, positions, state.caches[lo:hi])
        head = self.output_head
        if head is not None and head.takes(x.shape[0], logits):
            return head(x, logits)
        h = self.output_norm(x)
        if logits == "none":
            return None, h
        return self.output(h if logits == "all" else h[-1:]).float(), h


class _NoHead:
    """Remembers that no compiled head applies to these parts (so the check is not redone)."""

    def __init__(self, model: CausalLM):
        self.norm, self.output = model.output_norm, model.output


# -- builders shared by the architectures -----------------------------------------------

@dataclass
class BuildContext:
    """What every builder needs besides the weights: one RoPE table per device, the
    profile, and the worker thread that drives CPU experts."""
    profile: Profile
    pool: ThreadPoolExecutor
    kv_dtype: torch.dtype = torch.float32
    kv_cells: int | None = None       # the planner's cells per cache (context padded to 256)
    ubatch: int = 512                 # the plan's micro-batch (sizes sliding-window caches)
    ropes: dict = field(default_factory=dict)

    def cache(self, cfg: ModelConfig) -> Callable[[torch.device], KVCache]:
        """A new KV cache on a device, as the plan sized it."""
        return lambda dev: kv_cache(cfg, dev, self.kv_dtype, self.kv_cells)

    def rope(self, cfg: ModelConfig, device: torch.device) -> Rope:
        key = (cfg.rope_spec, device)
        if key not in self.ropes:
            self.ropes[key] = rope_for(cfg.rope_spec, device)
        return self.ropes[key]


@dataclass
class BuiltAttention:
    """What an attention builder hands the block builder: where the block computes (plan
    device and torch device), the attention callable and its cache factory."""
    device_name: str
    device: torch.device
    attn: Attend
    cache: Callable[[torch.device], object]


def build_attention(w, cfg: ModelConfig, i: int, ctx: BuildContext) -> BuiltAttention:
    """GQA: ``blk.{i}.attn_{q,k,v,output}`` with optional biases and per-head q/k norms. The
    block computes (and keeps its KV cache) where the planner says: with its largest attention
    tensor."""
    p = f"blk.{i}"
    home_name = w.home(i)
    home = w.devices[home_name]
    norm = lambda n: RMSNorm(w.vector(n).to(home), cfg.rms_eps) if w.has(n) else None  # noqa: E731
    attn = Attention(
        q=w.linear(f"{p}.attn_q.weight", f"{p}.attn_q.bias"),
        k=w.linear(f"{p}.attn_k.weight", f"{p}.attn_k.bias"),
        v=w.linear(f"{p}.attn_v.weight", f"{p}.attn_v.bias"),
        o=w.linear(f"{p}.attn_output.weight"),
        n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
        rope=ctx.rope(cfg, home),
        q_norm=norm(f"{p}.attn_q_norm.weight"), k_norm=norm(f"{p}.attn_k_norm.weight"))
    return BuiltAttention(home_name, home, attn, ctx.cache(cfg))


def build_swiglu(w, p: str, suffix: str = "") -> SwiGLU:
    """``{p}.ffn_{gate,up,down}{suffix}.weight`` (suffix "" for dense, "_shexp" for shared)."""
    return SwiGLU(w.linear(f"{p}.ffn_gate{suffix}.weight"), w.linear(f"{p}.ffn_up{suffix}.weight"),
                  w.linear(f"{p}.ffn_down{suffix}.weight"))


def build_moe(w, p: str, router: Callable, ctx: BuildContext) -> MoE:
    shared = build_swiglu(w, p, "_shexp") if w.has(f"{p}.ffn_gate_shexp.weight") else None
    experts = w.experts(p)
    hot, owned = w.hot_experts(p)      # after the CPU experts were made resident: drops the hot pages
    return MoE(router=router, experts=experts, shared=shared, pool=ctx.pool, profile=ctx.profile,
               hot=hot, owned=owned)


def build_block(w, cfg: ModelConfig, i: int, ctx: BuildContext, *, ffn_norm: str,
                make_router: Callable, compiled: CompiledParts, attention: Callable = build_attention) -> Block:
    """Block i: MoE when it has a router (``ffn_gate_inp``), dense FFN otherwise.
    ``make_router(prefix, device)`` builds the architecture's router; ``attention(w, cfg, i,
    ctx) -> BuiltAttention`` its attention kind (GQA by default) with its cache; ``compiled``
    the compiled CPU parts the architecture declares for its blocks (``offload.compiled_block``:
    a wholly CPU-resident block runs them, this Block stays its reference)."""
    p = f"blk.{i}"
    a = attention(w, cfg, i, ctx)
    home_name, home = a.device_name, a.device
    norm = lambda n: RMSNorm(w.vector(n).to(home), cfg.rms_eps)  # noqa: E731
    if w.has(f"{p}.ffn_gate_inp.weight"):
        ffn = build_moe(w, p, make_router(p, home), ctx)
    else:
        ffn = build_swiglu(w, p)
    return compile_block(Block(device_name=home_name, device=home, attn_norm=norm(f"{p}.attn_norm.weight"),
                               attn=a.attn, ffn_norm=norm(f"{p}.{ffn_norm}.weight"), ffn=ffn,
                               profile=ctx.profile, cache=a.cache), compiled)


def build_trunk(w, cfg: ModelConfig, ctx: BuildContext, *, build: Callable = build_block, **block) -> tuple:
    """Embedding, trunk blocks, output norm and head (``output`` or tied ``token_embd``).
    ``build(w, cfg, i, ctx, **block)`` makes block i (default ``build_block``, whose keywords
    are ffn_norm, make_router, compiled, attention); an architecture may bring its own."""
    embed = w.embedding("token_embd.weight")
    blocks = [build(w, cfg, i, ctx, **block) for i in range(cfg.n_layer)]
    # the output layer is output_norm's slot; a tied model reads token_embd there (a second
    # copy when token_embd lives elsewhere, as llama.cpp does and the planner counts)
    out_dev = w.device_name("output_norm.weight")
    output = (w.linear("output.weight") if w.has("output.weight") else
              w.linear("token_embd.weight", on=out_dev))
    output_norm = RMSNorm(w.vector("output_norm.weight").to(output.device), cfg.rms_eps)
    return embed, blocks, output_norm, output


def nextn_layer(w) -> int:
    """The block index of the (first) NextN block among ``w``'s tensors."""
    layers = sorted({t.layer for t in w.tensors.values() if t.nextn and t.layer is not None})
    if not layers:
        raise OffloadError(f"{w.model.path}: no NextN (MTP) block")
    return layers[0]


def build_nextn(w, cfg: ModelConfig, i: int, ctx: BuildContext, *, embed, output, **block) -> NextN:
    """The NextN block ``blk.{i}`` of ``w`` (the model's own, or a ``--draft`` file's) as a
    draft head: a full decoder block plus ``nextn.{eh_proj,enorm,hnorm,shared_head_norm}``;
    ``nextn.embed_tokens`` / ``nextn.shared_head_head`` when the file has them, else the
    trunk's ``embed`` / ``output``. ``block``: ``build_block``'s keywords."""
    p = f"blk.{i}"
    block = build_block(w, cfg, i, ctx, **block)
    norm = lambda n: RMSNorm(w.vector(f"{p}.nextn.{n}.weight").to(block.device), cfg.rms_eps)  # noqa: E731
    own_embed, own_head = f"{p}.nextn.embed_tokens.weight", f"{p}.nextn.shared_head_head.weight"
    return NextN(embed=w.embedding(own_embed) if w.has(own_embed) else embed,
                 enorm=norm("enorm"), hnorm=norm("hnorm"),
                 eh_proj=w.linear(f"{p}.nextn.eh_proj.weight"), block=block,
                 norm=norm("shared_head_norm"),
                 head=w.linear(own_head) if w.has(own_head) else output)
