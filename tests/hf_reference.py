"""Hugging Face ``transformers`` models built from a tiny GGUF's dequantized weights — the
independent reference the runtime's logits are checked against (test-only dependency).

GGUF → HF names live in one declared table per architecture. No Q/K permutation is needed:
llama.cpp's converter permutes Q/K only for its llama-style archs; glm4moe/qwen3moe use NeoX
RoPE and deepseek2 keeps DeepSeek's interleaved rope dims as they are (HF ``rope_interleave``),
so ``attn_q`` is ``q_proj`` as is. deepseek2's ``attn_k_b``/``attn_v_b`` are put back together
into ``kv_b_proj`` (the converter's split, undone).
"""
from __future__ import annotations

import numpy as np
import torch

from tests.tiny_models import TinyModel

# per block: GGUF suffix → HF suffix under model.layers.{i}.   (fused gate_up handled below)
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",   # glm4moe
    "ffn_norm.weight": "post_attention_layernorm.weight",              # qwen3moe
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    # deepseek2 (MLA)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
}
# (GGUF suffixes) → (HF suffix, how the parts combine) where one HF tensor is several GGUF ones
_COMBINED = {
    ("ffn_gate_exps.weight", "ffn_up_exps.weight"):                 # cat on the n_ff dim
        ("mlp.experts.gate_up_proj", lambda g, u: np.concatenate((g, u), axis=1)),
    # k_b (H, kv_lora, nope) and v_b (H, v, kv_lora) → kv_b_proj (H·(nope + v), kv_lora)
    ("attn_k_b.weight", "attn_v_b.weight"):
        ("self_attn.kv_b_proj.weight",
         lambda k, v: np.concatenate((k.transpose(0, 2, 1), v), axis=1).reshape(-1, k.shape[1])),
}
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# the NextN glue → transformers' generic MtpLayer (its decoder block is ``mtp_block``)
_NEXTN = {
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "post_norm.weight",
}


def _block_state(weights, i: int, prefix: str) -> dict[str, torch.Tensor]:
    out = {prefix + dst: torch.from_numpy(weights[f"blk.{i}.{src}"]) for src, dst in _BLOCK.items()
           if f"blk.{i}.{src}" in weights}
    for srcs, (dst, combine) in _COMBINED.items():
        names = [f"blk.{i}.{s}" for s in srcs]
        if all(n in weights for n in names):
            out[prefix + dst] = torch.from_numpy(np.ascontiguousarray(combine(*(weights[n] for n in names))))
    return out


# gpt-oss: its own names, and experts stored transposed (x @ W) with gate/up interleaved
_GPT_OSS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
} | {f"attn_{a}.{t}": f"self_attn.{b}_proj.{t}" for a, b in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
     for t in ("weight", "bias")}


def _interleave(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """(…, n) gate and up → (…, 2n) with gate at even, up at odd positions (HF's gate_up)."""
    out = np.empty(g.shape[:-1] + (2 * g.shape[-1],), np.float32)
    out[..., 0::2], out[..., 1::2] = g, u
    return out


def _gpt_oss_block_state(weights, i: int, prefix: str) -> dict[str, torch.Tensor]:
    b = lambda n: weights[f"blk.{i}.{n}"]  # noqa: E731
    out = {prefix + dst: b(src) for src, dst in _GPT_OSS.items()}
    out[prefix + "mlp.experts.gate_up_proj"] = _interleave(b("ffn_gate_exps.weight").transpose(0, 2, 1),
                                                           b("ffn_up_exps.weight").transpose(0, 2, 1))
    out[prefix + "mlp.experts.gate_up_proj_bias"] = _interleave(b("ffn_gate_exps.bias"), b("ffn_up_exps.bias"))
    out[prefix + "mlp.experts.down_proj"] = b("ffn_down_exps.weight").transpose(0, 2, 1)
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}


def _gpt_oss_config(tiny: TinyModel, common: dict):
    """YaRN with ``truncate`` on: llama.cpp (and so offload) floors/ceils the correction
    range; the released gpt-oss config says truncate false, which HF alone follows."""
    from transformers import GptOssConfig
    s = tiny.spec
    rope = {"rope_type": "default", "rope_theta": s.rope_base}
    if s.yarn_factor > 1:
        rope = {"rope_type": "yarn", "rope_theta": s.rope_base, "factor": s.yarn_factor, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": True, "original_max_position_embeddings": s.yarn_orig_ctx}
    keep = {k: v for k, v in common.items() if k not in ("moe_intermediate_size", "intermediate_size")}
    return GptOssConfig(**keep, num_hidden_layers=s.n_layer, num_local_experts=s.n_expert,
                        intermediate_size=s.n_ff_exp, sliding_window=s.window, rope_parameters=rope,
                        max_position_embeddings=int(s.yarn_orig_ctx * s.yarn_factor) if s.yarn_factor > 1 else 4096,
                        attention_bias=True)


def hf_config(tiny: TinyModel, *, mtp: bool = False):
    s = tiny.spec
    common = dict(vocab_size=s.n_vocab, hidden_size=s.n_embd, num_attention_heads=s.n_head,
                  num_key_value_heads=s.n_head_kv, head_dim=s.head_dim, rms_norm_eps=s.rms_eps,
                  num_experts_per_tok=s.n_expert_used, moe_intermediate_size=s.n_ff_exp,
                  intermediate_size=s.n_ff, tie_word_embeddings=s.tied_output,
                  attn_implementation="eager", experts_implementation="eager")
    if s.arch == "glm4moe":
        from transformers import Glm4MoeConfig
        return Glm4MoeConfig(**common, num_hidden_layers=1 if mtp else s.n_layer,
                             first_k_dense_replace=0 if mtp else s.n_dense,
                             n_routed_experts=s.n_expert, n_shared_experts=s.n_shared,
                             routed_scaling_factor=s.weights_scale, norm_topk_prob=s.weights_norm,
                             n_group=1, topk_group=1, attention_bias=True, use_qk_norm=s.qk_norm,
                             rope_parameters={"rope_type": "default", "rope_theta": s.rope_base,
                                              "partial_rotary_factor": s.n_rot / s.head_dim})
    if s.arch == "deepseek2":
        return _deepseek_config(tiny, common, mtp=mtp)
    if s.arch == "gpt-oss":
        return _gpt_oss_config(tiny, common)
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**common, num_hidden_layers=s.n_layer, num_experts=s.n_expert,
                          norm_topk_prob=s.weights_norm, decoder_sparse_step=1,
                          rope_parameters={"rope_type": "default", "rope_theta": s.rope_base})


def _deepseek_config(tiny: TinyModel, common: dict, *, mtp: bool):
    """deepseek2 as ``DeepseekV3Config`` (sigmoid routing) or ``DeepseekV2Config`` (softmax).
    GGUF's yarn_log_multiplier is 0.1·mscale_all_dim (the converter's); mscale = mscale_all_dim
    keeps HF's cos/sin amplitude at 1, as llama.cpp's is."""
    from transformers import DeepseekV2Config, DeepseekV3Config
    s = tiny.spec
    rope = {"rope_type": "default", "rope_theta": s.rope_base}
    if s.yarn_factor > 1:
        m = s.yarn_log_mul / 0.1
        rope = {"rope_type": "yarn", "rope_theta": s.rope_base, "factor": s.yarn_factor,
                "original_max_position_embeddings": s.yarn_orig_ctx, "mscale": m, "mscale_all_dim": m,
                "beta_fast": s.yarn_beta_fast, "beta_slow": 1.0}
    common = {k: v for k, v in common.items() if k not in ("head_dim", "num_key_value_heads")}
    ds = dict(common, num_key_value_heads=s.n_head, num_hidden_layers=1 if mtp else s.n_layer,
              first_k_dense_replace=0 if mtp else s.n_dense, n_routed_experts=s.n_expert,
              n_shared_experts=s.n_shared, routed_scaling_factor=s.weights_scale,
              norm_topk_prob=s.weights_norm, kv_lora_rank=s.kv_lora_rank,
              q_lora_rank=s.q_lora_rank or None, qk_rope_head_dim=s.n_rot, qk_nope_head_dim=s.qk_nope,
              v_head_dim=s.v_head_dim, n_group=s.n_group, topk_group=s.n_group_used,
              rope_parameters=rope, attention_bias=False,
              max_position_embeddings=int(s.yarn_orig_ctx * s.yarn_factor) if s.yarn_factor > 1 else 4096)
    if s.gating == "softmax":
        return DeepseekV2Config(**ds, topk_method="greedy")
    return DeepseekV3Config(**ds, rope_interleave=True)


def hf_causal_lm(tiny: TinyModel):
    """The trunk as ``Glm4MoeForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM``
    / ``DeepseekV2ForCausalLM`` / ``GptOssForCausalLM`` in float64."""
    import transformers
    arch, s = tiny.spec.arch, tiny.spec
    cls = {"glm4moe": "Glm4MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
           "deepseek2": "DeepseekV2ForCausalLM" if s.gating == "softmax" else "DeepseekV3ForCausalLM",
           "gpt-oss": "GptOssForCausalLM"}[arch]
    cls = getattr(transformers, cls)
    torch.manual_seed(0)
    model = cls(hf_config(tiny)).eval()
    state = {dst: torch.from_numpy(tiny.weights[src]) for src, dst in _GLOBAL.items() if src in tiny.weights}
    if tiny.spec.tied_output:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    block_state = _gpt_oss_block_state if arch == "gpt-oss" else _block_state
    for i in range(tiny.spec.n_layer):
        state |= block_state(tiny.weights, i, f"model.layers.{i}.")
    _load_exactly(model, state)
    return model.double()


def hf_mtp_layer(tiny: TinyModel):
    """The NextN block as transformers' ``MtpLayer`` (float64) plus the pieces it shares
    with the trunk: returns (mtp_layer, rotary_embedding)."""
    from transformers.modeling_layers import MtpLayer
    if tiny.spec.arch == "deepseek2":
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        layer_cls, norm_cls, rotary_cls = m.DeepseekV3DecoderLayer, m.DeepseekV3RMSNorm, m.DeepseekV3RotaryEmbedding
    else:
        from transformers.models.glm4_moe import modeling_glm4_moe as m
        layer_cls, norm_cls, rotary_cls = m.Glm4MoeDecoderLayer, m.Glm4MoeRMSNorm, m.Glm4MoeRotaryEmbedding
    cfg = hf_config(tiny, mtp=True)
    torch.manual_seed(0)
    layer = MtpLayer(cfg, layer_cls, norm_cls, 0).eval()
    i = tiny.spec.n_layer
    state = _block_state(tiny.weights, i, "mtp_block.")
    state |= {dst: torch.from_numpy(tiny.weights[f"blk.{i}.{src}"]) for src, dst in _NEXTN.items()}
    _load_exactly(layer, state)
    return layer.double(), rotary_cls(cfg)


def _load_exactly(module, state) -> None:
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    assert not missing and not extra, f"reference mapping incomplete: missing {missing} extra {extra}"
    for k, v in state.items():
        assert own[k].shape == v.shape, f"{k}: {tuple(own[k].shape)} vs {tuple(v.shape)}"
    module.load_state_dict(state, strict=True)


# deepseek4 → transformers' DeepseekV4ForCausalLM (the names of deepseek4.md §1.3)
_DEEPSEEK4_GLOBAL = _GLOBAL | {
    "output_hc_fn.weight": "model.hc_head.hc_fn",
    "output_hc_base.weight": "model.hc_head.hc_base",
    "output_hc_scale.weight": "model.hc_head.hc_scale",
}
_DEEPSEEK4_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_norm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv.weight": "self_attn.kv_proj.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_norm.weight",
    "attn_output_a.weight": "self_attn.o_a_proj.weight",
    "attn_output_b.weight": "self_attn.o_b_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_tid2eid.weight": "mlp.gate.tid2eid",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    **{f"hc_{p}_{w}.weight": f"{p}_hc.{w}" for p in ("attn", "ffn") for w in ("fn", "base", "scale")},
    **{f"attn_compressor_{a}.weight": f"self_attn.compressor.{b}" for a, b in (
        ("kv", "kv_proj.weight"), ("gate", "gate_proj.weight"), ("ape", "position_bias"), ("norm", "kv_norm.weight"))},
    **{f"indexer_compressor_{a}.weight": f"self_attn.compressor.indexer.{b}" for a, b in (
        ("kv", "kv_proj.weight"), ("gate", "gate_proj.weight"), ("ape", "position_bias"), ("norm", "kv_norm.weight"))},
    "indexer.proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "indexer.attn_q_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
}


def hf_deepseek4_config(tiny: TinyModel, **override):
    """``DeepseekV4Config`` of a tiny deepseek4: the compressed blocks' rope with YaRN (HF forces
    its attention factor to 1, as llama.cpp cancels ggml's), window-only blocks without."""
    from transformers import DeepseekV4Config
    s = tiny.spec
    rope = {"rope_type": "default"}
    if s.yarn_factor > 1:
        rope = {"rope_type": "yarn", "factor": s.yarn_factor, "original_max_position_embeddings": s.yarn_orig_ctx,
                "beta_fast": s.yarn_beta_fast, "beta_slow": 1.0}
    cfg = dict(vocab_size=s.n_vocab, hidden_size=s.n_embd, moe_intermediate_size=s.n_ff_exp,
               num_hidden_layers=s.n_layer, num_attention_heads=s.n_head, num_key_value_heads=1,
               head_dim=s.head_dim, q_lora_rank=s.q_lora_rank, num_experts_per_tok=s.n_expert_used,
               n_routed_experts=s.n_expert, n_shared_experts=s.n_shared, routed_scaling_factor=s.weights_scale,
               rope_theta=s.rope_base, compress_rope_theta=s.compress_rope_base,
               compress_ratios=list(s.compress_ratios[:s.n_layer]), num_hash_layers=s.n_hash,
               qk_rope_head_dim=s.n_rot, hc_mult=s.hc_mult, hc_sinkhorn_iters=s.hc_iters, hc_eps=1e-6,
               swiglu_limit=s.swiglu_limit, sliding_window=s.window, o_groups=s.o_groups,
               o_lora_rank=s.o_lora_rank, index_n_heads=s.indexer_n_head, index_head_dim=s.indexer_head_dim,
               index_topk=s.indexer_top_k, rms_norm_eps=s.rms_eps, rope_parameters=rope,
               max_position_embeddings=int(s.yarn_orig_ctx * s.yarn_factor) if s.yarn_factor > 1 else 4096,
               tie_word_embeddings=False, attn_implementation="eager", experts_implementation="eager")
    return DeepseekV4Config(**(cfg | override))


def hf_deepseek4(tiny: TinyModel, **override):
    """The trunk as ``DeepseekV4ForCausalLM`` in float32 (its hyper-connections, indexer
    scores and softmaxes are written for float32), from the same dequantized weights."""
    from transformers import DeepseekV4ForCausalLM
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf_deepseek4_config(tiny, **override)).eval()
    w = tiny.weights
    state = {dst: torch.from_numpy(w[src]) for src, dst in _DEEPSEEK4_GLOBAL.items() if src in w}
    for i in range(tiny.spec.n_layer):
        p = f"model.layers.{i}."
        for src, dst in _DEEPSEEK4_BLOCK.items():
            if f"blk.{i}.{src}" in w:
                v = w[f"blk.{i}.{src}"]
                state[p + dst] = torch.from_numpy(v.astype(np.int64) if v.dtype == np.int32 else v)
        state[p + "mlp.experts.gate_up_proj"] = torch.from_numpy(np.concatenate(
            (w[f"blk.{i}.ffn_gate_exps.weight"], w[f"blk.{i}.ffn_up_exps.weight"]), axis=1))
    _load_exactly(model, state)
    return model.float()


def hf_deepseek4_mtp(tiny: TinyModel):
    """V4's MTP head (deepseek4.md §2.10; transformers ships none) from transformers' parts:
    ``DeepseekV4DecoderLayer`` as a window-only, non-hash block, ``DeepseekV4HyperHead`` (the
    head's own ``nextn.hc_head_*``), RMSNorms and ``eh_proj``, float32. Returns
    ``mtp(tokens (T,), streams (T, n, d), positions (T,)) → (logits (T, V), streams)``."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m
    s, w = tiny.spec, tiny.weights
    i, d = s.n_layer, s.n_embd
    cfg = hf_deepseek4_config(tiny, num_hidden_layers=1, compress_ratios=[0], num_hash_layers=0)
    torch.manual_seed(0)
    layer = m.DeepseekV4DecoderLayer(cfg, 0).eval()
    state = {dst: torch.from_numpy(w[f"blk.{i}.{src}"]) for src, dst in _DEEPSEEK4_BLOCK.items()
             if f"blk.{i}.{src}" in w}
    state["mlp.experts.gate_up_proj"] = torch.from_numpy(np.concatenate(
        (w[f"blk.{i}.ffn_gate_exps.weight"], w[f"blk.{i}.ffn_up_exps.weight"]), axis=1))
    _load_exactly(layer, state)
    head = m.DeepseekV4HyperHead(cfg).eval()
    _load_exactly(head, {f"hc_{n}": torch.from_numpy(w[f"blk.{i}.nextn.hc_head_{n}.weight"])
                         for n in ("fn", "base", "scale")})
    norm = lambda n: m.DeepseekV4RMSNorm(d, s.rms_eps)  # noqa: E731
    enorm, hnorm, out_norm = norm("enorm"), norm("hnorm"), norm("shared_head_norm")
    for mod, n in ((enorm, "enorm"), (hnorm, "hnorm"), (out_norm, "shared_head_norm")):
        mod.weight.data = torch.from_numpy(w[f"blk.{i}.nextn.{n}.weight"])
    eh_proj = torch.from_numpy(w[f"blk.{i}.nextn.eh_proj.weight"])
    embed, output = torch.from_numpy(w["token_embd.weight"]), torch.from_numpy(w["output.weight"])
    rotary = m.DeepseekV4RotaryEmbedding(cfg)

    def mtp(tokens: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor):
        t, n = streams.shape[0], streams.shape[1]
        e = enorm(embed[tokens])[:, None].expand(t, n, d)
        x = torch.cat((e, hnorm(streams)), dim=-1) @ eh_proj.T                   # (T, n, d)
        pos = positions[None]
        q, k = positions[:, None], positions[None, :]
        mask = torch.where((k <= q) & (q - k < s.window), 0.0, float("-inf"))[None, None]
        emb = {kind: rotary(x, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        y = layer(x[None], position_embeddings=emb, position_ids=pos, attention_mask=mask,
                  input_ids=tokens[None], cache=None)[0]
        return out_norm(head(y[None])[0]) @ output.T, y
    return mtp
