"""Qwen3-MoE (``qwen3moe``): unbiased GQA attention with per-head q/k RMSNorm and full NeoX
rotary, every block MoE with softmax top-k routing (renormalised, as llama.cpp does for
this architecture unless ``expert_weights_norm`` says otherwise), no shared expert."""
from __future__ import annotations

from gguf import ExpertGatingFuncType, Keys

from gpu.router import SoftmaxRouter
from offload.errors import OffloadError
from offload.compiled_block import GQA_BLOCK
from offload.models.common import (BuildContext, CausalLM, ModelConfig, build_trunk, common_config,
                                   meta_value)
from placement.tensors import ModelSpec


def config_from_gguf(spec: ModelSpec, meta) -> ModelConfig:
    gating = int(meta_value(meta, Keys.LLM.EXPERT_GATING_FUNC, spec.arch, ExpertGatingFuncType.SOFTMAX))
    if gating != ExpertGatingFuncType.SOFTMAX:
        raise OffloadError(f"qwen3moe with expert_gating_func={gating} is not supported (softmax only)")
    return common_config(spec, meta, expert_weights_norm_default=True)


def build(cfg: ModelConfig, w, ctx: BuildContext, draft=None) -> CausalLM:
    if draft is not None:
        raise OffloadError("qwen3moe has no NextN (MTP) head: a --draft file cannot be used with it")
    def router(p, home):
        return SoftmaxRouter(w.linear(f"{p}.ffn_gate_inp.weight", float32=True),
                             k=cfg.n_expert_used, norm=cfg.expert_weights_norm,
                             scale=cfg.expert_weights_scale)

    embed, blocks, output_norm, output = build_trunk(w, cfg, ctx, ffn_norm="ffn_norm", make_router=router,
                                                     compiled=GQA_BLOCK)
    return CausalLM(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output,
                    nextn=None)
