"""gpt-oss (``gpt-oss``), as llama.cpp lays the GGUF out.

* Attention: GQA with biases on q/k/v/o and a learned per-head sink logit
  (``attn_sinks``) in every softmax (``gpu.attention.attend_with_sinks``). Blocks alternate a
  sliding window (``attention.sliding_window``; even blocks, llama.cpp's pattern for this
  architecture, as ``ModelSpec.swa_layers`` reads it) with full attention; a windowed block
  keeps only its window in a ``WindowKVCache`` of the planner's
  ``min(pad256(ctx), pad256(window + ubatch))`` cells.
* Rotary: NeoX halves over the whole head, YaRN when ``rope.scaling.type`` is yarn. YaRN
  scales cos/sin by ``mscale = 1 + 0.1·ln(factor)`` (ggml's rope_yarn, HF's attention
  factor); both q and k carry it, so here it is the attention scale ``mscale² / √head_dim``.
* FFN: every block MoE, no shared expert. Router ``ffn_gate_inp`` with its bias: top-k of
  the logits, softmax over those k. Experts with per-expert biases on gate/up/down and the
  clamped SwiGLU ``swiglu_oai``: (clamp(up, ±7) + 1) · g·σ(1.702·g), g = min(gate, 7).
* The pre-FFN norm is ``post_attention_norm``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gpu.attention import Attention
from gpu.kv_cache import WindowKVCache
from gpu.rope import RopeSpec, YaRN
from gpu.router import TopKSoftmaxRouter
from offload.compiled_block import REFERENCE, compile_block
from offload.errors import OffloadError
from offload.models.shared import parts
from offload.models.shared.base import BuildContext, CausalLM, DecoderBlock, State
from offload.models.shared.config import ModelConfig, config_fields, yarn_scaling
from offload.models.shared.parts import BuiltAttention
from offload.moe import MoE
from placement.tensors import ModelSpec

ACTIVATION = "swiglu_oai"
# no compiled CPU parts: the compiled attention has no sinks or window, the experts are biased
COMPILED = REFERENCE.because("attention sinks and swiglu_oai experts have no compiled half")


@dataclass(frozen=True)
class GptOssConfig(ModelConfig):
    yarn: YaRN | None
    kq_scale: float
    window: int                       # attention.sliding_window (0: none)
    swa_layers: tuple[bool, ...]      # per block: windowed

    @property
    def rope_spec(self) -> RopeSpec:
        return RopeSpec(self.n_rot, self.rope_base, yarn=self.yarn)

    def window_of(self, i: int) -> int:
        return self.window if self.swa_layers and self.swa_layers[i] else 0


def config_from_gguf(spec: ModelSpec, meta) -> GptOssConfig:
    if spec.head_dim_k != spec.head_dim_v:
        raise OffloadError(f"gpt-oss: key_length {spec.head_dim_k} != value_length {spec.head_dim_v}")
    if len(set(spec.n_head_kv)) > 1:
        raise OffloadError("gpt-oss: a per-layer head_count_kv is not supported")
    fields = config_fields(spec, meta)
    yarn = yarn_scaling(spec, meta)
    mscale = 1.0 if yarn is None else 1.0 + 0.1 * math.log(yarn.factor)
    return GptOssConfig(**fields, yarn=yarn, kq_scale=mscale * mscale / math.sqrt(spec.head_dim_k),
                        window=spec.sliding_window, swa_layers=spec.swa_layers)


def attention(w, cfg: GptOssConfig, i: int, ctx: BuildContext) -> BuiltAttention:
    """Block i's attention with sinks (and its window), where the planner put it."""
    p = f"blk.{i}"
    home_name = w.home(i)
    home = w.devices[home_name]
    proj = lambda n: w.linear(f"{p}.{n}.weight", f"{p}.{n}.bias")  # noqa: E731
    window = cfg.window_of(i)
    attn = Attention(q=proj("attn_q"), k=proj("attn_k"), v=proj("attn_v"), o=proj("attn_output"),
                     n_head=cfg.n_head, n_head_kv=cfg.n_head_kv, head_dim=cfg.head_dim,
                     rope=ctx.rope(cfg, home), scale=cfg.kq_scale,
                     sinks=w.vector(f"{p}.attn_sinks.weight").to(home), window=window)
    if not window:
        return BuiltAttention(home_name, home, attn, ctx.cache(cfg, i))
    cells = ctx.cells(i)
    return BuiltAttention(home_name, home, attn, lambda dev: WindowKVCache(
        cfg.n_head_kv, cfg.head_dim, window=window, max_cells=cells, device=dev, dtype=ctx.kv_dtype,
        dtype_v=ctx.kv_dtype_v))


class GptOssBlock(DecoderBlock):
    """x + attention with sinks (windowed or full)(attn_norm(x)); h + moe(post_attention_norm(h))."""

    def __call__(self, x, positions, cache):
        x = self.arrive(x)
        h = x + self.attn(self.attn_norm(x), positions, cache)
        return h + self.ffn(self.ffn_norm(h))


class GptOss(CausalLM):
    def forward(self, ids, state: State, *, logits: str = "all"):
        positions = state.positions(ids.shape[0])
        x = self.embed(ids)
        for step, lo, hi in self.block_runs():    # consecutive compiled blocks: one call each
            x = step(x, positions, state.caches[lo:hi])
        return self.final(x, logits)


def block(w, cfg: GptOssConfig, i: int, ctx: BuildContext) -> GptOssBlock:
    p = f"blk.{i}"
    a = attention(w, cfg, i, ctx)
    router = TopKSoftmaxRouter(w.linear(f"{p}.ffn_gate_inp.weight", f"{p}.ffn_gate_inp.bias", float32=True),
                               k=cfg.n_expert_used)
    moe = MoE(router=router, experts=w.experts(p, act=ACTIVATION), shared=None, pool=ctx.pool,
              profile=ctx.profile)
    return compile_block(GptOssBlock(attn_norm=a.norm(w, f"{p}.attn_norm", cfg.rms_eps), attn=a.attn,
                                     ffn_norm=a.norm(w, f"{p}.post_attention_norm", cfg.rms_eps), ffn=moe,
                                     **a.where(ctx.profile)), COMPILED)


def build(cfg: GptOssConfig, w, ctx: BuildContext, draft=None) -> GptOss:
    parts.refuse_draft("gpt-oss", draft)
    embed = w.embedding("token_embd.weight")
    blocks = [block(w, cfg, i, ctx) for i in range(cfg.n_layer)]
    output_norm, output = parts.output_ends(w, cfg)
    return GptOss(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output, nextn=None)
