"""DeepSeek-V2/V3/R1 and Kimi-K2 (``deepseek2``), as llama.cpp lays the GGUF out.

* Attention: multi-head latent attention (``gpu.mla``). q comes through a low-rank pair
  (``attn_q_a`` → ``attn_q_a_norm`` → ``attn_q_b``) or, without q LoRA (V2-Lite), straight from
  ``attn_q``; ``attn_kv_a_mqa`` gives the compressed latent (normed by ``attn_kv_a_norm``) and
  one shared rope key. Files with ``attention.key_length_mla`` carry ``attn_k_b`` / ``attn_v_b``
  and cache only the latent (``kv_lora_rank + rope dims`` per token); older files carry
  ``attn_kv_b`` and cache full per-head keys and values.
* Rotary: interleaved pairs on the rope dims only, YaRN when ``rope.scaling.type`` is yarn;
  the attention scale is ``mscale² / √(nope + rope)`` with ``mscale = 1 + yarn_log_multiplier ·
  ln(factor)`` (llama.cpp's deepseek2 graph; HF's ``yarn_get_mscale(factor, mscale_all_dim)²``).
* FFN: the first ``leading_dense_block_count`` blocks dense, then MoE with shared experts.
  Router by ``expert_gating_func``: softmax (V2) or sigmoid with the ``exp_probs_b`` selection
  bias and group-limited top-k (``expert_group_count`` / ``expert_group_used_count``, V3);
  weights optionally normalised (``expert_weights_norm``), then scaled (``expert_weights_scale``).
* A NextN block (``nextn_predict_layers`` 1, V3's MTP head) drafts, as glm4moe's does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gguf import ExpertGatingFuncType, Keys

from gpu.kv_cache import KVCache
from gpu.mla import LatentAttention
from gpu.norm import RMSNorm
from gpu.rope import RopeSpec, YaRN
from gpu.router import SigmoidRouter, SoftmaxRouter
from offload.compiled_block import HANDOFF_ONLY, compile_block
from offload.errors import OffloadError
from offload.models.shared import parts
from offload.models.shared.base import BuildContext, CausalLM, DecoderBlock, State
from offload.models.shared.config import ModelConfig, config_fields, meta_value, yarn_scaling
from offload.models.shared.parts import BuiltAttention
from placement.tensors import ModelSpec

# the compiled CPU parts its blocks take: the MoE hand-off of RAM-resident experts only
COMPILED = HANDOFF_ONLY.because("MLA attention has no compiled half")


@dataclass(frozen=True)
class Deepseek2Config(ModelConfig):
    """``head_dim`` is the per-head query/key width nope + rope, ``n_rot`` the rope dims."""
    kv_lora_rank: int
    v_dim: int                # per-head value width
    absorbed: bool            # attn_k_b/attn_v_b with the latent cache (else attn_kv_b, full cache)
    yarn: YaRN | None
    kq_scale: float
    gating: int               # ExpertGatingFuncType
    n_group: int
    n_group_used: int

    @property
    def nope(self) -> int:
        return self.head_dim - self.n_rot

    @property
    def rope_spec(self) -> RopeSpec:
        return RopeSpec(self.n_rot, self.rope_base, interleaved=True, yarn=self.yarn)


def config_from_gguf(spec: ModelSpec, meta) -> Deepseek2Config:
    get = lambda t, d=None: meta_value(meta, t, spec.arch, d)  # noqa: E731
    fields = config_fields(spec, meta)
    if spec.is_mla:       # latent cache: key_length = kv_lora + rope, one KV head
        if spec.head_dim_k != spec.kv_lora_rank + spec.n_rot:
            raise OffloadError(f"deepseek2: key_length {spec.head_dim_k} != kv_lora_rank {spec.kv_lora_rank} "
                               f"+ rope dims {spec.n_rot}")
        head_dim, v_dim = spec.head_dim_k_mla, spec.head_dim_v_mla
    else:                 # attn_kv_b layout: full per-head keys/values
        if fields["n_head_kv"] != spec.n_head:
            raise OffloadError(f"deepseek2 without key_length_mla: head_count_kv {fields['n_head_kv']} "
                               f"!= head_count {spec.n_head}")
        head_dim, v_dim = spec.head_dim_k, spec.head_dim_v
    if not spec.kv_lora_rank or not 0 < spec.n_rot < head_dim:
        raise OffloadError(f"deepseek2: kv_lora_rank {spec.kv_lora_rank} / rope dims {spec.n_rot} "
                           f"do not describe MLA with {head_dim}-wide heads")
    yarn = yarn_scaling(spec, meta)
    mscale = 1.0 if yarn is None else 1.0 + float(get(Keys.Rope.SCALING_YARN_LOG_MUL, 0.0)) * math.log(yarn.factor)
    gating = int(get(Keys.LLM.EXPERT_GATING_FUNC, ExpertGatingFuncType.SOFTMAX))
    n_group = int(get(Keys.LLM.EXPERT_GROUP_COUNT, 1) or 1)
    if gating not in (ExpertGatingFuncType.SOFTMAX, ExpertGatingFuncType.SIGMOID):
        raise OffloadError(f"deepseek2 with expert_gating_func={gating} is not supported (softmax or sigmoid)")
    if gating == ExpertGatingFuncType.SOFTMAX and n_group > 1:
        raise OffloadError("deepseek2: group-limited routing with softmax gating is not supported")
    if spec.n_expert and spec.n_expert % n_group:
        raise OffloadError(f"deepseek2: {spec.n_expert} experts do not split into {n_group} groups")
    fields.update(head_dim=head_dim, n_rot=spec.n_rot)
    return Deepseek2Config(
        **fields, kv_lora_rank=spec.kv_lora_rank, v_dim=v_dim, absorbed=spec.is_mla, yarn=yarn,
        kq_scale=mscale * mscale / math.sqrt(head_dim), gating=gating, n_group=n_group,
        n_group_used=int(get(Keys.LLM.EXPERT_GROUP_USED_COUNT, n_group) or n_group))


def mla_attention(w, cfg: Deepseek2Config, i: int, ctx: BuildContext) -> BuiltAttention:
    """Block i's latent attention, on the device of its largest attention tensor, with the
    cache its layout needs (the latent row, or full keys and values)."""
    p = f"blk.{i}"
    home_name = w.home(i)
    home = w.devices[home_name]
    norm = lambda n: RMSNorm(w.vector(f"{p}.{n}.weight").to(home), cfg.rms_eps)  # noqa: E731
    if w.has(f"{p}.attn_q_a.weight"):          # q LoRA: q_b(norm(q_a(x)))
        q_a, q_a_norm, q_b = w.linear(f"{p}.attn_q_a.weight"), norm("attn_q_a_norm"), w.linear(f"{p}.attn_q_b.weight")
        q = lambda x: q_b(q_a_norm(q_a(x)))  # noqa: E731
    else:
        q = w.linear(f"{p}.attn_q.weight")
    if cfg.absorbed:
        if not w.has(f"{p}.attn_k_b.weight"):
            raise OffloadError(f"{p}: an MLA-layout deepseek2 file (key_length_mla set) needs attn_k_b/attn_v_b")
        heads = dict(k_b=w.per_head(f"{p}.attn_k_b.weight"), v_b=w.per_head(f"{p}.attn_v_b.weight"))
        cache = lambda dev: KVCache(1, cfg.kv_lora_rank + cfg.n_rot, head_dim_v=0, device=dev,  # noqa: E731
                                    dtype=ctx.kv_dtype, max_cells=ctx.cells(i))
    else:
        heads = dict(kv_b=w.linear(f"{p}.attn_kv_b.weight"))
        cache = lambda dev: KVCache(cfg.n_head, cfg.head_dim, head_dim_v=cfg.v_dim, device=dev,  # noqa: E731
                                    dtype=ctx.kv_dtype, dtype_v=ctx.kv_dtype_v, max_cells=ctx.cells(i))
    attn = LatentAttention(
        q=q, kv_a=w.linear(f"{p}.attn_kv_a_mqa.weight"), kv_a_norm=norm("attn_kv_a_norm"),
        o=w.linear(f"{p}.attn_output.weight"), n_head=cfg.n_head, nope=cfg.nope, rope_dims=cfg.n_rot,
        kv_lora=cfg.kv_lora_rank, v_dim=cfg.v_dim, rope=ctx.rope(cfg, home), scale=cfg.kq_scale, **heads)
    return BuiltAttention(home_name, home, attn, cache)


class Deepseek2Block(DecoderBlock):
    """x + latent attention(attn_norm(x)); then h + ffn(ffn_norm(h)), the FFN dense in the
    leading blocks and MoE with shared experts after them."""

    def __call__(self, x, positions, cache):
        x = self.arrive(x)
        h = x + self.attn(self.attn_norm(x), positions, cache)
        return h + self.ffn(self.ffn_norm(h))


class Deepseek2(CausalLM):
    def forward(self, ids, state: State, *, logits: str = "all"):
        positions = state.positions(ids.shape[0])
        x = self.embed(ids)
        for step, lo, hi in self.block_runs():    # consecutive compiled blocks: one call each
            x = step(x, positions, state.caches[lo:hi])
        return self.final(x, logits)


def router(w, cfg: Deepseek2Config, p: str, home):
    """Softmax top-k (V2), or sigmoid with the selection bias and group-limited top-k (V3)."""
    gate = w.linear(f"{p}.ffn_gate_inp.weight", float32=True)
    if cfg.gating == ExpertGatingFuncType.SOFTMAX:
        return SoftmaxRouter(gate, k=cfg.n_expert_used, norm=cfg.expert_weights_norm,
                             scale=cfg.expert_weights_scale)
    bias = f"{p}.exp_probs_b.bias"
    return SigmoidRouter(gate, w.vector(bias).to(home) if w.has(bias) else None,
                         k=cfg.n_expert_used, norm=cfg.expert_weights_norm,
                         scale=cfg.expert_weights_scale, n_group=cfg.n_group,
                         n_group_used=cfg.n_group_used)


def block(w, cfg: Deepseek2Config, i: int, ctx: BuildContext):
    """Block i of ``w`` (the model's, or a ``--draft`` file's NextN block)."""
    p = f"blk.{i}"
    a = mla_attention(w, cfg, i, ctx)
    ffn = parts.moe_or_dense(w, p, lambda: router(w, cfg, p, a.device), ctx)
    return compile_block(Deepseek2Block(
        attn_norm=a.norm(w, f"{p}.attn_norm", cfg.rms_eps), attn=a.attn,
        ffn_norm=a.norm(w, f"{p}.ffn_norm", cfg.rms_eps), ffn=ffn, **a.where(ctx.profile)), COMPILED)


def build(cfg: Deepseek2Config, w, ctx: BuildContext, draft=None) -> Deepseek2:
    """The trunk from ``w``; the draft head from ``draft`` (a ``--draft`` file's weights)
    when given, else the model's own NextN block if it has one."""
    embed = w.embedding("token_embd.weight")
    blocks = [block(w, cfg, i, ctx) for i in range(cfg.n_layer)]
    output_norm, output = parts.output_ends(w, cfg)
    nextn = parts.draft_head(w, draft, cfg, lambda store, i: block(store, cfg, i, ctx), embed=embed, output=output)
    return Deepseek2(config=cfg, embed=embed, blocks=blocks, output_norm=output_norm, output=output, nextn=nextn)
