"""DeepSeek-V4 (``deepseek4``), as llama.cpp lays the GGUF out (docs: ../shared/deepseek4.md).

* The residual is ``hyper_connection.count`` streams (T, n, d): the embedding repeated, then
  each sublayer is wrapped by its own mHC (``gpu.hyper``): ``pre`` collapses the streams into
  the sublayer's input, ``post`` and ``comb`` put its output back. The ``output_hc_*`` head
  collapses them once more before ``output_norm`` and ``output``.
* Attention (``gpu.compressed_attention``): q LoRA, one shared K = V head, rope on the last
  ``rope.dimension_count`` dims (interleaved), sinks, the inverse rotation of the output, the
  grouped low-rank output projection. Per block by ``attention.compress_ratios``: 0 the window
  only, 128 (HCA) the window plus every compressed entry, 4 (CSA) the window plus the top-k
  entries the lightning indexer picks. Window-only blocks rotate with ``rope.freq_base``;
  compressed blocks with ``attention.compress_rope_freq_base`` and YaRN (``rope.scaling.*``),
  without any YaRN magnitude scaling (llama.cpp cancels ggml's; transformers sets it to 1).
* MoE: √softplus scores; the first ``hash_layer_count`` blocks take their experts from the
  token id (``ffn_gate_tid2eid``), the others the top k of score + ``exp_probs_b``; weights
  normalised over the k, × ``expert_weights_scale``. Routed and shared experts use the clamped
  SwiGLU (``swiglu_clamp_exp`` / ``swiglu_clamp_shexp`` per block).
* Caches (``gpu.dsv4_cache``): the window ring, compressed entries, indexer keys and the
  compressors' state, as ``placement.memory.dsv4_cache`` sizes them, all rolled back exactly.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import Keys

from gpu.compressed_attention import CompressedAttention, Compressor, Indexer
from gpu.dsv4_cache import CompressedRows, CompressorState, Dsv4Cache
from gpu.ffn import SwiGLU, glu
from gpu.hyper import HyperConnection, HyperHead
from gpu.kv_cache import WindowKVCache
from gpu.norm import RMSNorm
from gpu.rope import RopeSpec, YaRN, rope_for
from gpu.router import HashRouter, SqrtSoftplusRouter
from offload.compiled_block import HANDOFF_ONLY
from offload.compiled_v4 import compile_v4_block
from offload.cpu_ops import CpuHyperConnection
from offload.errors import OffloadError
from offload.gguf_model import NewerKeys, dsv4_config_problem
from offload.models.shared import parts
from offload.models.shared.base import BuildContext, CausalLM, DecoderBlock, State
from offload.models.shared.config import ModelConfig, config_fields, meta_value, yarn_scaling
from offload.moe import MoE
from placement.tensors import ModelSpec

# CPU-resident blocks run decode steps compiled (offload.compiled_v4); the others keep the
# reference path, their RAM-resident experts handed to the compiled routed_ffn (the hand-off)
COMPILED = HANDOFF_ONLY
ACTIVATION = "swiglu_clamp"
CSA, HCA = 4, 128          # compress ratios: CSA overlaps its windows and has the indexer
# drafters of an architecture of their own, as --draft files: arch → builder(draft weights, cfg,
# ctx, embed=, output=, trunk= the trunk's ModelSpec); offload.dspark registers dflash (the runtime imports it)
DRAFTERS: dict[str, Callable] = {}


@dataclass(frozen=True)
class Deepseek4Config(ModelConfig):
    q_lora_rank: int
    window: int                            # attention.sliding_window
    compress_ratios: tuple[int, ...]       # per block: 0, 4 (CSA) or 128 (HCA)
    compress_rope_base: float
    yarn: YaRN | None                      # compressed blocks only
    hc_mult: int
    hc_iters: int
    hc_eps: float
    n_hash_layers: int
    indexer_n_head: int
    indexer_head_dim: int
    indexer_top_k: int
    o_groups: int
    o_lora_rank: int
    clamp_exp: tuple[float, ...]           # per block (the MTP block's too, where the file lists it)
    clamp_shexp: tuple[float, ...]

    def ratio(self, i: int) -> int:
        """Block i's compress ratio (0 past the list: the MTP block of a sidecar)."""
        return self.compress_ratios[i] if i < len(self.compress_ratios) else 0

    def clamps(self, i: int) -> tuple[float, float]:
        """(routed, shared) SwiGLU limits of block i (a sidecar's MTP block: the last listed)."""
        return self.clamp_exp[min(i, len(self.clamp_exp) - 1)], self.clamp_shexp[min(i, len(self.clamp_shexp) - 1)]

    @property
    def rope_spec(self) -> RopeSpec:
        """Window-only blocks' rotary table."""
        return RopeSpec(self.n_rot, self.rope_base, interleaved=True)

    @property
    def compress_rope_spec(self) -> RopeSpec:
        """Compressed blocks' (their queries, keys, entries and indexer)."""
        return RopeSpec(self.n_rot, self.compress_rope_base, interleaved=True, yarn=self.yarn)


def config_from_gguf(spec: ModelSpec, meta) -> Deepseek4Config:
    def need(template: str):
        return meta_value(meta, template, spec.arch)

    # the header reader (offload.gguf_model) has refused a gating other than sqrt-softplus, a
    # bad compress ratio, and check_shapes a hyper-connection count or routing table the
    # tensors do not match; dsv4_config_problem a key this reads that is missing (torch-free:
    # a DSpark drafter's header is checked with it before loading)
    problem = dsv4_config_problem(spec, meta)
    if problem is not None:
        raise OffloadError(f"deepseek4: {problem}")

    def per_block(template: str, default=None) -> tuple[float, ...]:     # present, long enough: checked above
        v = meta_value(meta, template, spec.arch, default)
        v = list(v) if isinstance(v, (list, tuple)) else [v] * spec.n_layer
        return tuple(float(x) for x in v[:spec.n_layer])

    clamp_exp = per_block(Keys.LLM.SWIGLU_CLAMP_EXP)
    fields = config_fields(spec, meta, expert_weights_norm_default=True)
    return Deepseek4Config(
        **fields, q_lora_rank=spec.q_lora_rank, window=spec.sliding_window,
        compress_ratios=spec.compress_ratios[:spec.n_layer],
        compress_rope_base=float(need(NewerKeys.COMPRESS_ROPE_FREQ_BASE)), yarn=yarn_scaling(spec, meta),
        hc_mult=spec.hc_mult, hc_iters=int(need(NewerKeys.HC_SINKHORN_ITERATIONS)),
        hc_eps=float(need(NewerKeys.HC_EPSILON)), n_hash_layers=spec.n_hash_layers,
        indexer_n_head=spec.indexer_n_head, indexer_head_dim=spec.indexer_head_dim,
        indexer_top_k=spec.indexer_top_k, o_groups=spec.o_groups, o_lora_rank=spec.o_lora_rank,
        clamp_exp=clamp_exp, clamp_shexp=per_block(Keys.LLM.SWIGLU_CLAMP_SHEXP, list(clamp_exp)))


class Deepseek4Block(DecoderBlock):
    """Streams x (T, n, d): mHC around the attention, then mHC around the MoE."""

    def __call__(self, x, positions, cache, *, tokens=None):
        x = self.arrive(x)
        y, post, comb = self.attn_hc(x)
        x = HyperConnection.combine(self.attn(self.attn_norm(y), positions, cache), x, post, comb)
        y, post, comb = self.ffn_hc(x)
        return HyperConnection.combine(self.ffn(self.ffn_norm(y), tokens), x, post, comb)


class Deepseek4(CausalLM):
    """``forward`` returns, as its hidden states, what V4's MTP head reads: the (T, n·d)
    streams before the hc head (llama.cpp's ``t_h_nextn``, ``embedding_length_out`` wide)."""

    def __init__(self, *, hc_head: HyperHead, dspark=None, **parts):
        super().__init__(**parts)
        self.hc_head = hc_head
        # a DSpark drafter (offload.dspark) reads taps instead of the streams: then the
        # hidden states are the mean over the streams of the inputs of its target layers,
        # concatenated (T, k·d); a model with a DSpark drafter has no MTP head
        self.dspark = dspark

    def forward(self, ids, state: State, *, logits: str = "all"):
        positions = state.positions(ids.shape[0])
        x = self.stage_in(ids)
        taps = self.dspark.target_layers if self.dspark is not None else ()
        tapped = []
        for i, (block, cache) in enumerate(zip(self.blocks, state.caches)):
            if i in taps:
                tapped.append(x.mean(1))
            x = block(x, positions, cache, tokens=ids)
        if not taps:
            return self.stage_out(x, logits)
        x = x.to(self.hc_head.fn.device)
        if len(self.blocks) in taps:                # the last block's output
            tapped.append(x.mean(1))
        hidden = torch.cat([t.to(x.device) for t in tapped], dim=-1)
        return (None if logits == "none" else self.final(self.hc_head(x), logits)[0]), hidden

    # a pipeline stage (offload.pipeline) sends the (T, n, d) streams; every block gets the
    # pass's token ids (the first hash_layer_count route by them)

    def stage_in(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).float()
        return x[:, None].expand(-1, self.config.hc_mult, -1).contiguous()      # (T, n, d): n equal streams

    def stage_shape(self, t: int) -> tuple[int, ...]:
        return (t, self.config.hc_mult, self.config.n_embd)

    def stage_steps(self, positions, caches, ids):
        return [lambda x, b=b, c=c: b(x, positions, c, tokens=ids) for b, c in zip(self.blocks, caches)]

    def stage_out(self, x, logits: str):
        x = x.to(self.hc_head.fn.device)
        if logits == "none":
            return None, x.flatten(1)
        out, _ = self.final(self.hc_head(x), logits)
        return out, x.flatten(1)


class Deepseek4NextN:
    """V4's MTP head: per stream ``eh_proj([enorm(embed(t+1)); hnorm(h_t)])`` over the trunk's
    streams at t, one window-only V4 block with its own cache, its own hc head, then
    ``shared_head_norm`` and the shared ``output``. Its hidden states are its own streams
    (T, n·d), which the next chained draft step reads (llama.cpp ``graph_mtp``)."""

    def __init__(self, *, embed, enorm: RMSNorm, hnorm: RMSNorm, eh_proj, block: Deepseek4Block,
                 hc_head: HyperHead, norm: RMSNorm, head, hc_mult: int):
        self.embed, self.enorm, self.hnorm, self.eh_proj = embed, enorm, hnorm, eh_proj
        self.block, self.hc_head, self.norm, self.head, self.hc_mult = block, hc_head, norm, head, hc_mult

    def new_cache(self):
        return self.block.new_cache()

    def __call__(self, tokens, hidden, positions, cache, *, logits: str = "all"):
        """tokens (T,) ids of t+1, hidden (T, n·d) streams at t, positions (T,) those of t+1."""
        dev, t, n = self.block.device, tokens.shape[0], self.hc_mult
        e = self.enorm(self.embed(tokens).to(dev).float())                                  # (T, d)
        h = self.hnorm(hidden.to(dev).float().view(t, n, -1))                                # per stream
        x = torch.cat((e[:, None].expand(-1, n, -1), h), dim=-1)                             # (T, n, 2d)
        x = self.eh_proj(x.reshape(t * n, -1)).float().view(t, n, -1)
        x = self.block(x, positions, cache, tokens=tokens)
        if logits == "none":
            return None, x.flatten(1)
        y = self.hc_head((x if logits == "all" else x[-1:]).to(self.hc_head.fn.device))
        y = self.norm(y.to(self.norm.weight.device)).to(self.head.device)
        return self.head(y).float(), x.flatten(1)


def _rope(ctx: BuildContext, spec: RopeSpec, device):
    key = (spec, device)
    if key not in ctx.ropes:
        ctx.ropes[key] = rope_for(spec, device)
    return ctx.ropes[key]


def _cache(cfg: Deepseek4Config, i: int, ctx: BuildContext):
    """Block i's cache factory: the rows the plan counted (``ctx.dsv4_cache``), or grown on
    demand without a plan."""
    # the plan covers the file's blocks (a bundled MTP block too); a --draft sidecar's block grows
    planned = ctx.dsv4_cache is not None and i < cfg.n_layer + cfg.n_nextn
    plan = ctx.dsv4_cache(i) if planned else None
    r, d = cfg.ratio(i), cfg.head_dim
    get = lambda field: getattr(plan, field) if plan is not None else None  # noqa: E731

    def new(dev) -> Dsv4Cache:
        window = WindowKVCache(1, d, window=cfg.window, max_cells=get("window_cells"), device=dev,
                               dtype=ctx.kv_dtype, head_dim_v=0)
        if not r:
            return Dsv4Cache(window)
        coff = 2 if r == CSA else 1
        parts = dict(compressed=CompressedRows(d, max_rows=get("compressed_rows"), device=dev, dtype=ctx.kv_dtype),
                     state=CompressorState(2 * coff * d, ratio=r, overlap=r == CSA, rows=get("state_rows"), device=dev))
        if r == CSA:
            di = cfg.indexer_head_dim
            parts |= dict(index=CompressedRows(di, max_rows=get("indexer_rows"), device=dev, dtype=ctx.kv_dtype),
                          index_state=CompressorState(4 * di, ratio=r, overlap=True, rows=get("indexer_state_rows"),
                                                      device=dev))
        return Dsv4Cache(window, **parts)
    return new


def _hyper(w, cfg: Deepseek4Config, p: str, part: str, home) -> HyperConnection:
    n = cfg.hc_mult
    vec = lambda name: w.vector(f"{p}.hc_{part}_{name}.weight").to(home)  # noqa: E731
    kind = CpuHyperConnection if home.type == "cpu" else HyperConnection     # the CPU's: one compiled call
    return kind(vec("fn"), vec("base"), vec("scale"), n_streams=n, sinkhorn_iters=cfg.hc_iters,
                hc_eps=cfg.hc_eps, norm_eps=cfg.rms_eps)


def _compressor(w, p: str, who: str, *, r: int, dim: int, rope, norm) -> Compressor:
    name = lambda part: f"{p}.{who}_compressor_{part}.weight"  # noqa: E731
    return Compressor(kv=w.linear(name("kv")), gate=w.linear(name("gate")), ape=w.vector(name("ape")).to(rope.device),
                      norm=norm(f"{who}_compressor_norm"), ratio=r, dim=dim, overlap=r == CSA, rope=rope)


def attention(w, cfg: Deepseek4Config, i: int, ctx: BuildContext, home) -> CompressedAttention:
    p, r = f"blk.{i}", cfg.ratio(i)
    norm = lambda n: RMSNorm(w.vector(f"{p}.{n}.weight").to(home), cfg.rms_eps)  # noqa: E731
    rope = _rope(ctx, cfg.compress_rope_spec if r else cfg.rope_spec, home)
    compressor = indexer = None
    if r:
        compressor = _compressor(w, p, "attn", r=r, dim=cfg.head_dim, rope=rope, norm=norm)
    if r == CSA:
        indexer = Indexer(q_b=w.linear(f"{p}.indexer.attn_q_b.weight"), proj=w.linear(f"{p}.indexer.proj.weight"),
                          compressor=_compressor(w, p, "indexer", r=r, dim=cfg.indexer_head_dim, rope=rope, norm=norm),
                          n_head=cfg.indexer_n_head, head_dim=cfg.indexer_head_dim, top_k=cfg.indexer_top_k,
                          rope=rope)
    return CompressedAttention(
        q_a=w.linear(f"{p}.attn_q_a.weight"), q_a_norm=norm("attn_q_a_norm"), q_b=w.linear(f"{p}.attn_q_b.weight"),
        kv=w.linear(f"{p}.attn_kv.weight"), kv_norm=norm("attn_kv_a_norm"),
        o_a=w.grouped_linear(f"{p}.attn_output_a.weight", cfg.o_groups),
        o_b=w.linear(f"{p}.attn_output_b.weight"), sinks=w.vector(f"{p}.attn_sinks.weight").to(home),
        n_head=cfg.n_head, head_dim=cfg.head_dim, o_groups=cfg.o_groups, window=cfg.window, rope=rope,
        eps=cfg.rms_eps, compressor=compressor, indexer=indexer)


def moe(w, cfg: Deepseek4Config, i: int, ctx: BuildContext, home) -> MoE:
    p = f"blk.{i}"
    gate = w.linear(f"{p}.ffn_gate_inp.weight", float32=True)
    if i < cfg.n_hash_layers:
        router = HashRouter(gate, w.table(f"{p}.ffn_gate_tid2eid.weight"), scale=cfg.expert_weights_scale)
    else:
        router = SqrtSoftplusRouter(gate, w.vector(f"{p}.exp_probs_b.bias").to(home), k=cfg.n_expert_used,
                                    scale=cfg.expert_weights_scale)
    shared = SwiGLU(w.linear(f"{p}.ffn_gate_shexp.weight"), w.linear(f"{p}.ffn_up_shexp.weight"),
                    w.linear(f"{p}.ffn_down_shexp.weight"), glu=glu(ACTIVATION, cfg.clamps(i)[1]))
    experts = w.experts(p, act=ACTIVATION, limit=cfg.clamps(i)[0])
    hot, owned = w.hot_experts(p)        # after the CPU experts were made resident
    return MoE(router=router, experts=experts, shared=shared, pool=ctx.pool, profile=ctx.profile, hot=hot, owned=owned)


def block(w, cfg: Deepseek4Config, i: int, ctx: BuildContext) -> Deepseek4Block:
    p = f"blk.{i}"
    home_name = w.home(i)
    home = w.devices[home_name]
    norm = lambda n: RMSNorm(w.vector(f"{p}.{n}.weight").to(home), cfg.rms_eps)  # noqa: E731
    return compile_v4_block(Deepseek4Block(
        attn_hc=_hyper(w, cfg, p, "attn", home), attn_norm=norm("attn_norm"), attn=attention(w, cfg, i, ctx, home),
        ffn_hc=_hyper(w, cfg, p, "ffn", home), ffn_norm=norm("ffn_norm"), ffn=moe(w, cfg, i, ctx, home),
        device_name=home_name, device=home, profile=ctx.profile, cache=_cache(cfg, i, ctx)), COMPILED, cfg.clamps(i))


def hc_head(w, cfg: Deepseek4Config, prefix: str) -> HyperHead:
    """``{prefix}_{fn,base,scale}.weight`` (the trunk's ``output_hc``, an MTP head's own)."""
    dev = w.device(f"{prefix}_fn.weight")
    vec = lambda n: w.vector(f"{prefix}_{n}.weight").to(dev)  # noqa: E731
    return HyperHead(vec("fn"), vec("base"), vec("scale"), hc_eps=cfg.hc_eps, norm_eps=cfg.rms_eps)


def mtp_head(w, cfg: Deepseek4Config, ctx: BuildContext, *, sidecar: bool, embed, output) -> Deepseek4NextN:
    """The MTP head of ``w``: a bundled file's ``blk.{n}.nextn.*`` with its own
    ``nextn.hc_head_*``, or a sidecar (``--draft``) whose root ``output_hc_*`` is the head's."""
    # a trunk that says it has a head but holds none was planned without one (the header
    # reader said so); a --draft file without one is refused
    layers = sorted({t.layer for t in w.tensors.values() if t.nextn and t.layer is not None})
    if not layers or not w.has(f"blk.{layers[0]}.nextn.eh_proj.weight"):
        raise OffloadError(f"{w.model.path}: no MTP head (blk.N.nextn.eh_proj): it cannot draft")
    i = layers[0]
    p = f"blk.{i}"
    b = block(w, cfg, i, ctx)
    norm = lambda n: RMSNorm(w.vector(f"{p}.nextn.{n}.weight").to(b.device), cfg.rms_eps)  # noqa: E731
    head = hc_head(w, cfg, "output_hc" if sidecar else f"{p}.nextn.hc_head")
    return Deepseek4NextN(embed=embed, enorm=norm("enorm"), hnorm=norm("hnorm"),
                          eh_proj=w.linear(f"{p}.nextn.eh_proj.weight"), block=b, hc_head=head,
                          norm=norm("shared_head_norm"), head=output, hc_mult=cfg.hc_mult)


def build_stage(w, cfg: Deepseek4Config, ctx: BuildContext, layers: range, *, first: bool, last: bool) -> Deepseek4:
    """One pipeline stage (``offload.pipeline``): blocks ``layers``, the embedding on the first,
    the hc head, output layer and the bundled MTP head (if any) on the last."""
    embed = w.embedding("token_embd.weight") if first else None
    blocks = [block(w, cfg, i, ctx) for i in layers]
    output = output_norm = head = nextn = None
    if last:
        output_norm, output = parts.output_ends(w, cfg)
        head = hc_head(w, cfg, "output_hc")
        if cfg.n_nextn and w.has("token_embd.weight"):      # the head embeds (placement.multihost gives a copy)
            head_embed = embed if embed is not None else w.embedding("token_embd.weight")
            nextn = mtp_head(w, cfg, ctx, sidecar=False, embed=head_embed, output=output)
    return Deepseek4(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output, nextn=nextn,
                     hc_head=head)


def build(cfg: Deepseek4Config, w, ctx: BuildContext, draft=None) -> Deepseek4:
    """The trunk from ``w``; from ``draft`` (a --draft file) when given the DSpark drafter (a
    ``dflash`` file: ``model.dspark``, and no MTP head) or the MTP head (a sidecar), else the
    model's own bundled MTP head where it has one."""
    embed = w.embedding("token_embd.weight")
    blocks = [block(w, cfg, i, ctx) for i in range(cfg.n_layer)]
    output_norm, output = parts.output_ends(w, cfg)
    nextn = dspark = None
    if draft is not None and draft.model.spec.arch in DRAFTERS:
        dspark = DRAFTERS[draft.model.spec.arch](draft, cfg, ctx, embed=embed, output=output, trunk=w.model.spec)
    elif draft is not None:
        nextn = mtp_head(draft, cfg, ctx, sidecar=True, embed=embed, output=output)
    elif cfg.n_nextn:
        nextn = mtp_head(w, cfg, ctx, sidecar=False, embed=embed, output=output)
    return Deepseek4(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output, nextn=nextn,
                     hc_head=hc_head(w, cfg, "output_hc"), dspark=dspark)
