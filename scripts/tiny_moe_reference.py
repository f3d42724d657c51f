"""Float reference forward of a glm4moe GGUF (trunk + NextN block), numpy only.

Reads everything from the file: config from the ``glm4moe.*`` keys, weights dequantized with
``gguf.quants.dequantize`` (so Q8_0 rounding is part of what is measured). Written from the
GLM-4.5 / llama.cpp conventions, not from the training code, so that an export mistake
shows up as a loss gap between the torch model and this one.

Besides plain causal forwards over a window it does *continuation steps*: for every row i of
a window, one extra token at position i+1+s that attends to the window's keys 0..i (or 0..i-1
for the MTP chain, whose row i itself is replaced) plus the row's own earlier extra tokens.
That is a KV-cached decode of many hypothetical futures at once, used to measure chained
MTP drafts against greedy verification.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from gguf import GGUFReader, Keys
from gguf.quants import dequantize

F = np.float32


def _key(reader: GGUFReader, key: str):
    field_ = reader.fields.get(key)
    if field_ is None:
        raise KeyError(f"missing GGUF key {key}")
    return field_.contents()


@dataclass(frozen=True)
class RefConfig:
    arch: str
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    n_blocks: int          # block_count, NextN included
    n_nextn: int
    n_dense_lead: int
    n_expert: int
    n_expert_used: int
    weights_scale: float
    weights_norm: bool
    gating_func: int
    eps: float
    n_ctx: int

    @property
    def n_layer(self) -> int:
        """Trunk layers."""
        return self.n_blocks - self.n_nextn

    @classmethod
    def from_reader(cls, r: GGUFReader) -> "RefConfig":
        arch = _key(r, Keys.General.ARCHITECTURE)
        L = Keys.LLM
        A = Keys.Attention
        k = lambda t, default=None: (_key(r, t.format(arch=arch)) if t.format(arch=arch) in r.fields  # noqa: E731
                                     else default)
        n_embd, n_head = k(L.EMBEDDING_LENGTH), k(A.HEAD_COUNT)
        head_dim = k(A.KEY_LENGTH, n_embd // n_head)
        return cls(arch=arch, n_embd=n_embd, n_head=n_head, n_head_kv=k(A.HEAD_COUNT_KV),
                   head_dim=head_dim, n_rot=k(Keys.Rope.DIMENSION_COUNT, head_dim),
                   rope_base=k(Keys.Rope.FREQ_BASE, 10000.0), n_blocks=k(L.BLOCK_COUNT),
                   n_nextn=k(L.NEXTN_PREDICT_LAYERS, 0), n_dense_lead=k(L.LEADING_DENSE_BLOCK_COUNT, 0),
                   n_expert=k(L.EXPERT_COUNT), n_expert_used=k(L.EXPERT_USED_COUNT),
                   weights_scale=k(L.EXPERT_WEIGHTS_SCALE, 1.0), weights_norm=k(L.EXPERT_WEIGHTS_NORM, False),
                   gating_func=k(L.EXPERT_GATING_FUNC, 2), eps=k(A.LAYERNORM_RMS_EPS),
                   n_ctx=k(L.CONTEXT_LENGTH))


@dataclass
class KV:
    """Keys (after RoPE) and values of one block over a window: (Hkv, T, hd)."""
    k: np.ndarray
    v: np.ndarray


@dataclass
class Routing:
    """Per MoE block, appended per forward: expert ids chosen (T, k) and the selection gap
    (T,) = k-th minus (k+1)-th biased score. A tiny gap is a near-tie that another
    implementation's rounding may resolve the other way (a different expert)."""
    ids: dict[int, list[np.ndarray]] = field(default_factory=dict)
    gaps: dict[int, list[np.ndarray]] = field(default_factory=dict)

    def add(self, blk: int, ids: np.ndarray, gap: np.ndarray) -> None:
        self.ids.setdefault(blk, []).append(ids)
        self.gaps.setdefault(blk, []).append(gap)


class RefGlm4Moe:
    def __init__(self, path: str, dtype=F):
        self.reader = GGUFReader(path)
        self.cfg = RefConfig.from_reader(self.reader)
        if self.cfg.gating_func != 2:
            raise ValueError(f"expert_gating_func {self.cfg.gating_func}: only sigmoid (2) here")
        self.dtype = dtype
        self.w: dict[str, np.ndarray] = {}
        for t in self.reader.tensors:
            a = dequantize(t.data, t.tensor_type)
            self.w[t.name] = np.ascontiguousarray(a.reshape(tuple(int(d) for d in reversed(t.shape))),
                                                  dtype=dtype)
        c = self.cfg
        inv = c.rope_base ** (-np.arange(0, c.n_rot, 2, dtype=np.float64) / c.n_rot)   # (n_rot/2,)
        self._inv_freq = inv

    # ---- pieces -------------------------------------------------------------------------
    def W(self, name: str) -> np.ndarray:
        return self.w[name]

    def rms(self, x: np.ndarray, name: str) -> np.ndarray:
        x64 = x.astype(np.float64)
        y = x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + self.cfg.eps)
        return (y * self.w[name]).astype(self.dtype)

    def rope(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """x: (H, R, hd), pos: (R,). NeoX rotate-half inside the first n_rot dims."""
        c = self.cfg
        ang = pos.astype(np.float64)[:, None] * self._inv_freq[None, :]                # (R, n_rot/2)
        cos, sin = np.cos(ang).astype(self.dtype), np.sin(ang).astype(self.dtype)
        half = c.n_rot // 2
        x1, x2 = x[..., :half], x[..., half:c.n_rot]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., c.n_rot:]], -1)

    def qkv(self, b: int, x: np.ndarray, pos: np.ndarray):
        c = self.cfg
        p = f"blk.{b}."
        R = x.shape[0]
        q = x @ self.W(p + "attn_q.weight").T + self.W(p + "attn_q.bias")
        k = x @ self.W(p + "attn_k.weight").T + self.W(p + "attn_k.bias")
        v = x @ self.W(p + "attn_v.weight").T + self.W(p + "attn_v.bias")
        q = q.reshape(R, c.n_head, c.head_dim).transpose(1, 0, 2)                      # (H, R, hd)
        k = k.reshape(R, c.n_head_kv, c.head_dim).transpose(1, 0, 2)                   # (Hkv, R, hd)
        v = v.reshape(R, c.n_head_kv, c.head_dim).transpose(1, 0, 2)
        if p + "attn_q_norm.weight" in self.w:
            q, k = self.rms(q, p + "attn_q_norm.weight"), self.rms(k, p + "attn_k_norm.weight")
        return self.rope(q, pos), self.rope(k, pos), v

    def attend(self, q, k_pre, v_pre, mask_pre, k_ext=None, v_ext=None):
        """q: (H, R, hd); k_pre/v_pre: (Hkv, P, hd) with mask_pre (R, P) True = visible;
        k_ext/v_ext: (Hkv, R, S, hd) per-row extra keys (all visible). Returns (R, H*hd)."""
        c = self.cfg
        g = c.n_head // c.n_head_kv
        scale = 1.0 / np.sqrt(c.head_dim)
        kp = np.repeat(k_pre, g, axis=0)                                               # (H, P, hd)
        vp = np.repeat(v_pre, g, axis=0)
        s = (q @ kp.transpose(0, 2, 1)) * scale                                        # (H, R, P)
        s = np.where(mask_pre[None], s, -np.inf)
        if k_ext is not None:
            ke, ve = np.repeat(k_ext, g, axis=0), np.repeat(v_ext, g, axis=0)          # (H, R, S, hd)
            s = np.concatenate([s, (ke @ q[..., None])[..., 0] * scale], -1)           # + (H, R, S)
        s = s - s.max(-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(-1, keepdims=True)
        P = kp.shape[1]
        o = p[..., :P] @ vp                                                            # (H, R, hd)
        if k_ext is not None:
            o = o + (p[..., None, P:] @ ve)[..., 0, :]
        return o.transpose(1, 0, 2).reshape(q.shape[1], -1).astype(self.dtype)

    @staticmethod
    def _silu(x):
        return x / (1.0 + np.exp(-x))

    def ffn(self, b: int, x: np.ndarray, routing: Routing | None) -> np.ndarray:
        c = self.cfg
        p = f"blk.{b}."
        if b < c.n_dense_lead:
            return (self._silu(x @ self.W(p + "ffn_gate.weight").T) * (x @ self.W(p + "ffn_up.weight").T)
                    ) @ self.W(p + "ffn_down.weight").T
        logits = x.astype(np.float64) @ self.W(p + "ffn_gate_inp.weight").T.astype(np.float64)
        scores = 1.0 / (1.0 + np.exp(-logits))                                        # (R, E)
        biased = scores + self.W(p + "exp_probs_b.bias")
        order = np.argsort(-biased, axis=1, kind="stable")
        sel = order[:, :c.n_expert_used]
        wts = np.take_along_axis(scores, sel, 1)                                       # (R, k)
        if c.weights_norm:
            wts = wts / np.maximum(wts.sum(1, keepdims=True), 6.103515625e-5)
        wts = (wts * c.weights_scale).astype(self.dtype)
        if routing is not None:
            kth = np.take_along_axis(biased, order[:, c.n_expert_used - 1:c.n_expert_used + 1], 1)
            routing.add(b, sel, kth[:, 0] - kth[:, 1])
        gate, up, down = (self.W(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
        out = np.zeros_like(x)
        for e in np.unique(sel):
            rows, slot = np.nonzero(sel == e)                     # a row picks an expert at most once
            xe = x[rows]
            ye = (self._silu(xe @ gate[e].T) * (xe @ up[e].T)) @ down[e].T
            out[rows] += wts[rows, slot, None] * ye
        sh = (self._silu(x @ self.W(p + "ffn_gate_shexp.weight").T) * (x @ self.W(p + "ffn_up_shexp.weight").T)
              ) @ self.W(p + "ffn_down_shexp.weight").T
        return out + sh

    def block(self, b: int, x: np.ndarray, pos: np.ndarray, *, kv_pre: KV | None = None,
              mask_pre: np.ndarray | None = None, ext: list[KV] | None = None,
              routing: Routing | None = None):
        """One decoder block. Without kv_pre: causal self-attention over x (a window).
        With kv_pre: x are continuation rows (see module doc). Returns (out, KV of x)."""
        p = f"blk.{b}."
        q, k, v = self.qkv(b, self.rms(x, p + "attn_norm.weight"), pos)
        if kv_pre is None:
            T = x.shape[0]
            a = self.attend(q, k, v, np.tril(np.ones((T, T), bool)))
        else:
            ks = np.stack([e.k for e in (ext or [])] + [k], axis=2)                    # (Hkv, R, S, hd)
            vs = np.stack([e.v for e in (ext or [])] + [v], axis=2)
            a = self.attend(q, kv_pre.k, kv_pre.v, mask_pre, ks, vs)
        x = x + a @ self.W(p + "attn_output.weight").T
        x = x + self.ffn(b, self.rms(x, p + "post_attention_norm.weight"), routing)
        return x, KV(k, v)

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.W("token_embd.weight")[tokens]

    def logits(self, h_normed: np.ndarray) -> np.ndarray:
        out = self.w.get("output.weight", self.w["token_embd.weight"])
        return h_normed @ out.T

    # ---- trunk ------------------------------------------------------------------------
    def trunk(self, tokens: np.ndarray, routing: Routing | None = None):
        """tokens (T,) at positions 0..T-1 -> h after output_norm (T, d), logits (T, V),
        per-layer KV."""
        pos = np.arange(len(tokens))
        x = self.embed(tokens)
        kvs = []
        for b in range(self.cfg.n_layer):
            x, kv = self.block(b, x, pos, routing=routing)
            kvs.append(kv)
        h = self.rms(x, "output_norm.weight")
        return h, self.logits(h), kvs

    def trunk_continue(self, tokens: np.ndarray, kvs: list[KV], ext: list[list[KV]]):
        """Row i: one more token ``tokens[i]`` at position i+1+len(ext), after window
        tokens 0..i and the row's earlier continuation tokens. Returns h, logits, new KVs."""
        T = len(tokens)
        s = len(ext)
        pos = np.arange(T) + 1 + s
        mask = np.tril(np.ones((T, T), bool))                                          # keys j <= i
        x = self.embed(tokens)
        new = []
        for b in range(self.cfg.n_layer):
            x, kv = self.block(b, x, pos, kv_pre=kvs[b], mask_pre=mask, ext=[e[b] for e in ext])
            new.append(kv)
        h = self.rms(x, "output_norm.weight")
        return h, self.logits(h), new

    # ---- NextN / MTP ------------------------------------------------------------------------
    def mtp_input(self, h_prev: np.ndarray, tokens_next: np.ndarray) -> np.ndarray:
        b = self.cfg.n_layer
        e = self.rms(self.embed(tokens_next), f"blk.{b}.nextn.enorm.weight")
        hn = self.rms(h_prev, f"blk.{b}.nextn.hnorm.weight")
        return np.concatenate([e, hn], -1) @ self.W(f"blk.{b}.nextn.eh_proj.weight").T

    def mtp_head(self, h_mtp: np.ndarray) -> np.ndarray:
        b = self.cfg.n_layer
        name = f"blk.{b}.nextn.shared_head_norm.weight"
        hn = self.rms(h_mtp, name if name in self.w else "output_norm.weight")
        head = self.w.get(f"blk.{b}.nextn.shared_head_head.weight")
        return hn @ head.T if head is not None else self.logits(hn)

    def mtp(self, h: np.ndarray, tokens_next: np.ndarray, routing: Routing | None = None):
        """Teacher-forced MTP over a window: row t sees h[t] (trunk, after output_norm) and
        tokens_next[t] (= token t+1). Returns pre-norm h_mtp (T, d), logits for token t+2, KV."""
        x = self.mtp_input(h, tokens_next)
        h_mtp, kv = self.block(self.cfg.n_layer, x, np.arange(len(x)), routing=routing)
        return h_mtp, self.mtp_head(h_mtp), kv

    def mtp_chain_step(self, h_prev: np.ndarray, tokens_next: np.ndarray, kv_window: KV,
                       ext: list[KV]):
        """Row i: an MTP step at position i+len(ext) whose window rows 0..i-1 come from the
        teacher-forced MTP pass (kv_window) and whose later rows are this chain's (ext)."""
        T = len(tokens_next)
        s = len(ext)
        x = self.mtp_input(h_prev, tokens_next)
        mask = np.tril(np.ones((T, T), bool), k=-1)                                    # keys j < i
        h_mtp, kv = self.block(self.cfg.n_layer, x, np.arange(T) + s, kv_pre=kv_window,
                               mask_pre=mask, ext=ext)
        return h_mtp, self.mtp_head(h_mtp), kv
