"""Qwen3-MoE (``qwen3moe``): unbiased GQA attention with per-head q/k RMSNorm and full NeoX
rotary, every block MoE with softmax top-k routing (renormalised, as llama.cpp does for
this architecture unless ``expert_weights_norm`` says otherwise), no shared expert, no
draft head."""
from __future__ import annotations

from gguf import ExpertGatingFuncType, Keys

from gpu.router import SoftmaxRouter
from offload.compiled_block import GQA_BLOCK, compile_block
from offload.errors import OffloadError
from offload.models.shared import parts
from offload.models.shared.base import BuildContext, CausalLM, DecoderBlock, State
from offload.models.shared.config import ModelConfig, common_config, meta_value
from placement.tensors import ModelSpec


def config_from_gguf(spec: ModelSpec, meta) -> ModelConfig:
    gating = int(meta_value(meta, Keys.LLM.EXPERT_GATING_FUNC, spec.arch, ExpertGatingFuncType.SOFTMAX))
    if gating != ExpertGatingFuncType.SOFTMAX:
        raise OffloadError(f"qwen3moe with expert_gating_func={gating} is not supported (softmax only)")
    return common_config(spec, meta, expert_weights_norm_default=True)


class Qwen3MoeBlock(DecoderBlock):
    """Attention, then the MoE, each on its pre-norm input and added to the residual."""

    def __call__(self, x, positions, cache):
        x = self.arrive(x)
        h = x + self.attn(self.attn_norm(x), positions, cache)
        return h + self.ffn(self.ffn_norm(h))


class Qwen3Moe(CausalLM):
    def forward(self, ids, state: State, *, logits: str = "all"):
        positions = state.positions(ids.shape[0])
        x = self.embed(ids)
        for step, lo, hi in self.block_runs():    # consecutive compiled blocks: one call each
            x = step(x, positions, state.caches[lo:hi])
        return self.final(x, logits)


def block(w, cfg: ModelConfig, i: int, ctx: BuildContext):
    p = f"blk.{i}"
    a = parts.gqa_attention(w, cfg, i, ctx)
    router = SoftmaxRouter(w.linear(f"{p}.ffn_gate_inp.weight", float32=True), k=cfg.n_expert_used,
                           norm=cfg.expert_weights_norm, scale=cfg.expert_weights_scale)
    return compile_block(Qwen3MoeBlock(
        attn_norm=a.norm(w, f"{p}.attn_norm", cfg.rms_eps), attn=a.attn,
        ffn_norm=a.norm(w, f"{p}.ffn_norm", cfg.rms_eps), ffn=parts.moe(w, p, router, ctx),
        **a.where(ctx.profile)), GQA_BLOCK)


def build(cfg: ModelConfig, w, ctx: BuildContext, draft=None) -> Qwen3Moe:
    parts.refuse_draft("qwen3moe", draft)
    embed = w.embedding("token_embd.weight")
    blocks = [block(w, cfg, i, ctx) for i in range(cfg.n_layer)]
    output_norm, output = parts.output_ends(w, cfg)
    return Qwen3Moe(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output, nextn=None)
