"""GLM-4.5 family (``glm4moe``): biased GQA attention with partial NeoX rotary and optional
q/k norms, leading dense layers, sigmoid routing with ``exp_probs_b`` (group-free top-k,
normalised and scaled weights), one shared expert, and a NextN block as the MTP head.
"""
from __future__ import annotations

from gguf import ExpertGatingFuncType, Keys

from gpu.router import SigmoidRouter
from offload.compiled_block import GQA_BLOCK, compile_block
from offload.errors import OffloadError
from offload.models.shared import parts
from offload.models.shared.base import BuildContext, CausalLM, DecoderBlock, State
from offload.models.shared.config import ModelConfig, common_config, meta_value
from placement.tensors import ModelSpec


def config_from_gguf(spec: ModelSpec, meta) -> ModelConfig:
    gating = int(meta_value(meta, Keys.LLM.EXPERT_GATING_FUNC, spec.arch, ExpertGatingFuncType.SIGMOID))
    if gating != ExpertGatingFuncType.SIGMOID:
        raise OffloadError(f"glm4moe with expert_gating_func={gating} is not supported (sigmoid only)")
    if int(meta_value(meta, Keys.LLM.EXPERT_GROUP_COUNT, spec.arch, 1)) > 1:
        raise OffloadError("group-limited expert routing (expert_group_count > 1) is not supported")
    return common_config(spec, meta)


class Glm4MoeBlock(DecoderBlock):
    """x + attention(attn_norm(x)); then h + ffn(post_attention_norm(h)), the FFN dense in
    the leading blocks and MoE with a shared expert after them."""

    def __call__(self, x, positions, cache):
        x = self.arrive(x)
        h = x + self.attn(self.attn_norm(x), positions, cache)
        return h + self.ffn(self.ffn_norm(h))


class Glm4Moe(CausalLM):
    def forward(self, ids, state: State, *, logits: str = "all"):
        positions = state.positions(ids.shape[0])
        x = self.embed(ids)
        for step, lo, hi in self.block_runs():    # consecutive compiled blocks: one call each
            x = step(x, positions, state.caches[lo:hi])
        return self.final(x, logits)


def router(w, cfg: ModelConfig, p: str, home) -> SigmoidRouter:
    bias = f"{p}.exp_probs_b.bias"
    return SigmoidRouter(w.linear(f"{p}.ffn_gate_inp.weight", float32=True),
                         w.vector(bias).to(home) if w.has(bias) else None,
                         k=cfg.n_expert_used, norm=cfg.expert_weights_norm, scale=cfg.expert_weights_scale)


def block(w, cfg: ModelConfig, i: int, ctx: BuildContext):
    """Block i of ``w`` (the model's, or a ``--draft`` file's NextN block)."""
    p = f"blk.{i}"
    a = parts.gqa_attention(w, cfg, i, ctx)
    ffn = parts.moe_or_dense(w, p, lambda: router(w, cfg, p, a.device), ctx)
    return compile_block(Glm4MoeBlock(
        attn_norm=a.norm(w, f"{p}.attn_norm", cfg.rms_eps), attn=a.attn,
        ffn_norm=a.norm(w, f"{p}.post_attention_norm", cfg.rms_eps), ffn=ffn, **a.where(ctx.profile)), GQA_BLOCK)


def build(cfg: ModelConfig, w, ctx: BuildContext, draft=None) -> Glm4Moe:
    """The trunk from ``w``; the draft head from ``draft`` (a ``--draft`` file's weights)
    when given, else the model's own NextN block if it has one."""
    embed = w.embedding("token_embd.weight")
    blocks = [block(w, cfg, i, ctx) for i in range(cfg.n_layer)]
    output_norm, output = parts.output_ends(w, cfg)
    nextn = parts.draft_head(w, draft, cfg, lambda store, i: block(store, cfg, i, ctx), embed=embed, output=output)
    return Glm4Moe(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output, nextn=nextn)
