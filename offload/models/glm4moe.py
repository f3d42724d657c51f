"""GLM-4.5 family (``glm4moe``): biased GQA attention with partial NeoX rotary and optional
q/k norms, leading dense layers, sigmoid routing with ``exp_probs_b`` (group-free top-k,
normalised and scaled weights), one shared expert, and a NextN block as the MTP head.
"""
from __future__ import annotations

from gguf import ExpertGatingFuncType, Keys

from gpu.norm import RMSNorm
from gpu.router import SigmoidRouter
from offload.errors import OffloadError
from offload.models.common import (BuildContext, CausalLM, ModelConfig, NextN, build_block,
                                   build_trunk, common_config, meta_value)
from placement.tensors import ModelSpec

FFN_NORM = "post_attention_norm"


def config_from_gguf(spec: ModelSpec, meta) -> ModelConfig:
    gating = int(meta_value(meta, Keys.LLM.EXPERT_GATING_FUNC, spec.arch, ExpertGatingFuncType.SIGMOID))
    if gating != ExpertGatingFuncType.SIGMOID:
        raise OffloadError(f"glm4moe with expert_gating_func={gating} is not supported (sigmoid only)")
    if int(meta_value(meta, Keys.LLM.EXPERT_GROUP_COUNT, spec.arch, 1)) > 1:
        raise OffloadError("group-limited expert routing (expert_group_count > 1) is not supported")
    return common_config(spec, meta)


def build(cfg: ModelConfig, w, ctx: BuildContext) -> CausalLM:
    def router(p, home):
        bias = f"{p}.exp_probs_b.bias"
        return SigmoidRouter(w.linear(f"{p}.ffn_gate_inp.weight", float32=True),
                             w.vector(bias).to(home) if w.has(bias) else None,
                             k=cfg.n_expert_used, norm=cfg.expert_weights_norm,
                             scale=cfg.expert_weights_scale)

    embed, blocks, output_norm, output = build_trunk(w, cfg, ctx, ffn_norm=FFN_NORM, make_router=router)
    nextn = None
    if cfg.n_nextn:
        p = f"blk.{cfg.n_layer}"
        block = build_block(w, cfg, cfg.n_layer, ctx, ffn_norm=FFN_NORM, make_router=router)
        norm = lambda n: RMSNorm(w.vector(f"{p}.nextn.{n}.weight").to(block.device), cfg.rms_eps)  # noqa: E731
        own_embed, own_head = f"{p}.nextn.embed_tokens.weight", f"{p}.nextn.shared_head_head.weight"
        nextn = NextN(embed=w.embedding(own_embed) if w.has(own_embed) else embed,
                      enorm=norm("enorm"), hnorm=norm("hnorm"),
                      eh_proj=w.linear(f"{p}.nextn.eh_proj.weight"), block=block,
                      norm=norm("shared_head_norm"),
                      head=w.linear(own_head) if w.has(own_head) else output)
    return CausalLM(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output,
                    nextn=nextn, kv_dtype=ctx.kv_dtype)
