"""Leaf builders the architecture files share: each reads one part's tensors from a
``WeightStore`` by their GGUF names and puts it where the plan says. An architecture file
composes them into its own block and model (``offload/models/<arch>.py``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gpu.attention import Attention
from gpu.ffn import SwiGLU
from gpu.norm import RMSNorm
from offload.errors import OffloadError
from offload.models.shared.base import BuildContext, NextN
from offload.models.shared.config import ModelConfig
from offload.moe import MoE


@dataclass
class BuiltAttention:
    """An attention part and where its block computes: the plan device (with the block's
    largest attention tensor), its torch device, and the cache factory of its kind."""
    device_name: str
    device: torch.device
    attn: Callable            # (x, positions, cache) → (T, n_embd)
    cache: Callable[[torch.device], object]

    def norm(self, w, name: str, eps: float) -> RMSNorm:
        """The RMSNorm ``{name}.weight`` on this block's device."""
        return RMSNorm(w.vector(f"{name}.weight").to(self.device), eps)

    def where(self, profile) -> dict:
        """The ``DecoderBlock`` keywords that place a block with this attention."""
        return dict(device_name=self.device_name, device=self.device, profile=profile, cache=self.cache)


def gqa_attention(w, cfg: ModelConfig, i: int, ctx: BuildContext) -> BuiltAttention:
    """GQA: ``blk.{i}.attn_{q,k,v,output}`` with optional biases and per-head q/k norms."""
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
    return BuiltAttention(home_name, home, attn, ctx.cache(cfg, i))


def swiglu(w, p: str, suffix: str = "") -> SwiGLU:
    """``{p}.ffn_{gate,up,down}{suffix}.weight`` (suffix "" for dense, "_shexp" for shared)."""
    return SwiGLU(w.linear(f"{p}.ffn_gate{suffix}.weight"), w.linear(f"{p}.ffn_up{suffix}.weight"),
                  w.linear(f"{p}.ffn_down{suffix}.weight"))


def moe(w, p: str, router: Callable, ctx: BuildContext, *, act: str = "silu") -> MoE:
    """Routed experts ``{p}.ffn_*_exps`` (where the plan put them, hot ones on GPUs) plus the
    shared expert ``{p}.ffn_*_shexp`` when the file has one."""
    shared = swiglu(w, p, "_shexp") if w.has(f"{p}.ffn_gate_shexp.weight") else None
    experts = w.experts(p, act=act)
    hot, owned = w.hot_experts(p)      # after the CPU experts were made resident: drops the hot pages
    return MoE(router=router, experts=experts, shared=shared, pool=ctx.pool, profile=ctx.profile,
               hot=hot, owned=owned)


def moe_or_dense(w, p: str, router: Callable[[], Callable], ctx: BuildContext):
    """MoE when block ``p`` has a router (``ffn_gate_inp``), the dense SwiGLU otherwise
    (leading dense blocks); ``router()`` builds the router."""
    if w.has(f"{p}.ffn_gate_inp.weight"):
        return moe(w, p, router(), ctx)
    return swiglu(w, p)


def output_ends(w, cfg: ModelConfig) -> tuple[RMSNorm, object]:
    """(output_norm, output): ``output.weight``, or the tied ``token_embd`` read again where
    ``output_norm`` lives (a second copy when token_embd is elsewhere, as llama.cpp does and
    the planner counts)."""
    out_dev = w.device_name("output_norm.weight")
    output = (w.linear("output.weight") if w.has("output.weight") else
              w.linear("token_embd.weight", on=out_dev))
    return RMSNorm(w.vector("output_norm.weight").to(output.device), cfg.rms_eps), output


def nextn_layer(w) -> int:
    """The block index of the (first) NextN block among ``w``'s tensors."""
    layers = sorted({t.layer for t in w.tensors.values() if t.nextn and t.layer is not None})
    if not layers:
        raise OffloadError(f"{w.model.path}: no NextN (MTP) block")
    return layers[0]


def nextn_head(w, cfg: ModelConfig, i: int, block, *, embed, output) -> NextN:
    """The NextN head around ``block`` (``blk.{i}`` of ``w``, built by the architecture):
    ``nextn.{eh_proj,enorm,hnorm,shared_head_norm}``, and ``nextn.embed_tokens`` /
    ``nextn.shared_head_head`` when the file has them, else the trunk's ``embed`` / ``output``."""
    p = f"blk.{i}"
    norm = lambda n: RMSNorm(w.vector(f"{p}.nextn.{n}.weight").to(block.device), cfg.rms_eps)  # noqa: E731
    own_embed, own_head = f"{p}.nextn.embed_tokens.weight", f"{p}.nextn.shared_head_head.weight"
    return NextN(embed=w.embedding(own_embed) if w.has(own_embed) else embed,
                 enorm=norm("enorm"), hnorm=norm("hnorm"),
                 eh_proj=w.linear(f"{p}.nextn.eh_proj.weight"), block=block,
                 norm=norm("shared_head_norm"),
                 head=w.linear(own_head) if w.has(own_head) else output)


def draft_head(w, draft, cfg: ModelConfig, make_block: Callable, *, embed, output) -> NextN | None:
    """The model's draft head: the NextN block of ``draft`` (a ``--draft`` file's weights)
    when given, else the model's own (block ``n_layer``) if it has one, else None.
    ``make_block(store, i)`` builds block i of a store as the architecture does."""
    if draft is None and not cfg.n_nextn:
        return None
    store = draft if draft is not None else w
    i = nextn_layer(draft) if draft is not None else cfg.n_layer
    return nextn_head(store, cfg, i, make_block(store, i), embed=embed, output=output)


def refuse_draft(arch: str, draft) -> None:
    """One wording for an architecture without a NextN head given a ``--draft`` file."""
    if draft is not None:
        raise OffloadError(f"{arch} has no NextN (MTP) head: a --draft file cannot be used with it")
