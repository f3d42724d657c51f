"""The torch training model: a small glm4moe (GLM-4.5 layout) with one NextN/MTP block.

Attribute names are the GGUF tensor names (``attn_q``, ``ffn_gate_exps``, ``exp_probs_b``,
``nextn.eh_proj``...) so the exporter needs no mapping table. Conventions (GLM-4.5 /
llama.cpp ``glm4moe``, as agreed for offload's runtime): RMSNorm; q/k/v with bias, o
without; GQA; partial rotary, NeoX style (rotate-half on the first ``n_rot`` dims of each
head); layer =
attn_norm -> attention -> residual -> post_attention_norm -> FFN -> residual; MoE routing =
sigmoid scores, top-k of (scores + exp_probs_b), weights = selected scores normalized to
sum 1 and times ``expert_weights_scale``, plus the shared expert added unweighted.
MTP at position t: x = eh_proj(cat[enorm(emb(tok[t+1])), hnorm(h_t)]) with h_t the trunk's
hidden state after ``output_norm``; x -> one decoder block -> shared_head_norm -> output,
predicting tok[t+2]. The MTP head shares ``token_embd`` and ``output`` with the trunk.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class TinyConfig:
    n_vocab: int = 4096
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int = 32                 # partial rotary: head_dim / 2, as GLM-4.5
    rope_base: float = 10000.0
    n_layer: int = 4                # trunk layers (the NextN block comes on top)
    n_dense_lead: int = 1           # leading dense layers
    n_ff: int = 512                 # dense FFN width
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 128             # routed expert width; the shared expert has the same
    n_expert_shared: int = 1
    expert_weights_scale: float = 2.5   # GLM-4.5's routed_scaling_factor
    norm_eps: float = 1e-5
    n_ctx: int = 512

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cos_sin(cfg: TinyConfig, n_pos: int):
    # theta_i = pos * base^(-2i / n_rot), i < n_rot/2 (ggml's rope with n_dims = n_rot)
    inv = cfg.rope_base ** (-torch.arange(0, cfg.n_rot, 2, dtype=torch.float64) / cfg.n_rot)
    ang = torch.arange(n_pos, dtype=torch.float64)[:, None] * inv[None, :]   # (T, n_rot/2)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin, n_rot: int):
    # x: (B, H, T, hd). NeoX: pairs (i, i + n_rot/2) inside the first n_rot dims.
    half = n_rot // 2
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class Block(nn.Module):
    """One decoder block; dense FFN or MoE FFN. Names follow GGUF."""

    def __init__(self, cfg: TinyConfig, moe: bool):
        super().__init__()
        self.cfg, self.moe = cfg, moe
        d, hd = cfg.n_embd, cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.attn_q = nn.Linear(d, cfg.n_head * hd, bias=True)
        self.attn_k = nn.Linear(d, cfg.n_head_kv * hd, bias=True)
        self.attn_v = nn.Linear(d, cfg.n_head_kv * hd, bias=True)
        self.attn_output = nn.Linear(cfg.n_head * hd, d, bias=False)
        self.post_attention_norm = RMSNorm(d, cfg.norm_eps)
        if moe:
            E, f = cfg.n_expert, cfg.n_ff_exp
            self.ffn_gate_inp = nn.Linear(d, E, bias=False)
            # correction bias: not trained by gradients, moved by the balance update
            self.register_buffer("exp_probs_b", torch.zeros(E))
            self.ffn_gate_exps = nn.Parameter(torch.empty(E, f, d))   # (E, n_ff_exp, n_embd)
            self.ffn_up_exps = nn.Parameter(torch.empty(E, f, d))
            self.ffn_down_exps = nn.Parameter(torch.empty(E, d, f))   # (E, n_embd, n_ff_exp)
            fs = f * cfg.n_expert_shared
            self.ffn_gate_shexp = nn.Linear(d, fs, bias=False)
            self.ffn_up_shexp = nn.Linear(d, fs, bias=False)
            self.ffn_down_shexp = nn.Linear(fs, d, bias=False)
        else:
            self.ffn_gate = nn.Linear(d, cfg.n_ff, bias=False)
            self.ffn_up = nn.Linear(d, cfg.n_ff, bias=False)
            self.ffn_down = nn.Linear(cfg.n_ff, d, bias=False)
        self.last_load = None   # tokens per expert of the last forward (for the balance update)

    def attention(self, x, cos, sin):
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.attn_q(x).view(B, T, cfg.n_head, cfg.head_dim).transpose(1, 2)     # (B, H, T, hd)
        k = self.attn_k(x).view(B, T, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.attn_v(x).view(B, T, cfg.n_head_kv, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, cfg.n_rot), apply_rope(k, cos, sin, cfg.n_rot)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.attn_output(y.transpose(1, 2).reshape(B, T, -1))

    def route(self, x):
        """x: (N, d) -> expert ids (N, k), weights (N, k), scores (N, E)."""
        cfg = self.cfg
        scores = torch.sigmoid(self.ffn_gate_inp(x).float())                     # (N, E)
        ids = torch.topk(scores.detach() + self.exp_probs_b, cfg.n_expert_used, dim=-1).indices
        w = scores.gather(1, ids)
        w = w / w.sum(-1, keepdim=True).clamp_min(6.103515625e-5) * cfg.expert_weights_scale
        return ids, w, scores

    def moe_ffn(self, x):
        """x: (N, d). Tokens grouped by expert: each expert runs once on its tokens."""
        cfg = self.cfg
        N = x.shape[0]
        ids, w, scores = self.route(x)
        flat = ids.reshape(-1)                                                   # (N*k,)
        order = torch.argsort(flat, stable=True)                                 # slots by expert
        counts = torch.bincount(flat, minlength=cfg.n_expert)
        self.last_load = counts
        xs = x[order // cfg.n_expert_used]                                       # (N*k, d) grouped
        # unbind once: indexing a Parameter per expert would make a full-size grad per expert
        gate, up, down = (t.unbind(0) for t in
                          (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps))
        ys = []
        for e, xe in enumerate(xs.split(counts.tolist())):
            if xe.shape[0]:
                ys.append(F.linear(F.silu(F.linear(xe, gate[e])) * F.linear(xe, up[e]), down[e]))
        ys = torch.cat(ys) * w.reshape(-1)[order, None]                          # (N*k, d)
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel())
        out = ys[inv].view(N, cfg.n_expert_used, -1).sum(1)                      # (N, d)
        shared = self.ffn_down_shexp(F.silu(self.ffn_gate_shexp(x)) * self.ffn_up_shexp(x))
        # DeepSeek-V3's sequence-free balance loss term: E * sum_e f_e * P_e (f: load share,
        # P: mean normalized score); tiny weight, the bias update does most of the balancing.
        f = counts.float() / (N * cfg.n_expert_used)
        p = (scores / scores.sum(-1, keepdim=True)).mean(0)
        aux = cfg.n_expert * (f * p).sum()
        return out + shared, aux

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attn_norm(x), cos, sin)
        h = self.post_attention_norm(x)
        if self.moe:
            B, T, d = h.shape
            y, aux = self.moe_ffn(h.reshape(B * T, d))
            return x + y.view(B, T, d), aux
        y = self.ffn_down(F.silu(self.ffn_gate(h)) * self.ffn_up(h))
        return x + y, x.new_zeros(())


class NextN(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        d = cfg.n_embd
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.enorm = RMSNorm(d, cfg.norm_eps)
        self.hnorm = RMSNorm(d, cfg.norm_eps)
        self.shared_head_norm = RMSNorm(d, cfg.norm_eps)


class TinyGlm4Moe(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.token_embd = nn.Embedding(cfg.n_vocab, cfg.n_embd)
        self.blk = nn.ModuleList(
            [Block(cfg, moe=i >= cfg.n_dense_lead) for i in range(cfg.n_layer)]
            + [Block(cfg, moe=True)])                                             # NextN block last
        self.nextn = NextN(cfg)
        self.output_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.output = nn.Linear(cfg.n_embd, cfg.n_vocab, bias=False)
        cos, sin = rope_cos_sin(cfg, cfg.n_ctx)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init()

    def _init(self):
        std = 0.02
        resid_std = std / math.sqrt(2 * (self.cfg.n_layer + 1))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                continue
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(("attn_output.weight", "ffn_down.weight", "ffn_down_shexp.weight",
                                "ffn_down_exps")):
                nn.init.normal_(p, std=resid_std)
            else:
                nn.init.normal_(p, std=std)

    def moe_blocks(self):
        return [b for b in self.blk if b.moe]

    def forward(self, tokens):
        """tokens: (B, T) -> trunk logits (B, T, V), MTP logits (B, T-1, V) for positions
        0..T-2 (predicting tokens[t+2] from h_t and tokens[t+1]), summed balance loss."""
        cfg = self.cfg
        B, T = tokens.shape
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.token_embd(tokens)                                              # (B, T, d)
        aux = x.new_zeros(())
        for blk in self.blk[:cfg.n_layer]:
            x, a = blk(x, cos, sin)
            aux = aux + a
        h = self.output_norm(x)                                                  # (B, T, d)
        logits = self.output(h)
        # MTP: h_t with emb(tok[t+1]); its own causal attention over positions 0..T-2
        e = self.token_embd(tokens[:, 1:])
        m = self.nextn.eh_proj(torch.cat([self.nextn.enorm(e), self.nextn.hnorm(h[:, :-1])], -1))
        m, a = self.blk[cfg.n_layer](m, cos[:T - 1], sin[:T - 1])
        aux = aux + a
        mtp_logits = self.output(self.nextn.shared_head_norm(m))
        return logits, mtp_logits, aux
