"""GLM-4.5 family (``glm4moe``): biased GQA attention with partial NeoX rotary and optional
q/k norms, leading dense layers, sigmoid routing with ``exp_probs_b`` (group-free top-k,
normalised and scaled weights), one shared expert, and a NextN block as the MTP head.
"""
from __future__ import annotations

from gguf import ExpertGatingFuncType, Keys

from gpu.router import SigmoidRouter
from offload.errors import OffloadError
from offload.compiled_block import GQA_BLOCK
from offload.models.common import (BuildContext, CausalLM, ModelConfig, build_nextn, build_trunk,
                                   common_config, meta_value, nextn_layer)
from placement.tensors import ModelSpec

FFN_NORM = "post_attention_norm"


def config_from_gguf(spec: ModelSpec, meta) -> ModelConfig:
    gating = int(meta_value(meta, Keys.LLM.EXPERT_GATING_FUNC, spec.arch, ExpertGatingFuncType.SIGMOID))
    if gating != ExpertGatingFuncType.SIGMOID:
        raise OffloadError(f"glm4moe with expert_gating_func={gating} is not supported (sigmoid only)")
    if int(meta_value(meta, Keys.LLM.EXPERT_GROUP_COUNT, spec.arch, 1)) > 1:
        raise OffloadError("group-limited expert routing (expert_group_count > 1) is not supported")
    return common_config(spec, meta)


def build(cfg: ModelConfig, w, ctx: BuildContext, draft=None) -> CausalLM:
    """The trunk from ``w``; the draft head from ``draft`` (a ``--draft`` file's weights)
    when given, else the model's own NextN block if it has one."""
    def router_of(store):
        def router(p, home):
            bias = f"{p}.exp_probs_b.bias"
            return SigmoidRouter(store.linear(f"{p}.ffn_gate_inp.weight", float32=True),
                                 store.vector(bias).to(home) if store.has(bias) else None,
                                 k=cfg.n_expert_used, norm=cfg.expert_weights_norm,
                                 scale=cfg.expert_weights_scale)
        return router

    embed, blocks, output_norm, output = build_trunk(w, cfg, ctx, ffn_norm=FFN_NORM, make_router=router_of(w),
                                                     compiled=GQA_BLOCK)
    nextn = None
    if draft is not None or cfg.n_nextn:
        store = draft if draft is not None else w
        i = nextn_layer(draft) if draft is not None else cfg.n_layer
        nextn = build_nextn(store, cfg, i, ctx, ffn_norm=FFN_NORM, make_router=router_of(store),
                            compiled=GQA_BLOCK, embed=embed, output=output)
    return CausalLM(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output,
                    nextn=nextn)
