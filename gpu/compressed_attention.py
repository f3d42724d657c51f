"""DeepSeek-V4 attention (``deepseek4``): one shared K = V head, a raw sliding window, and on
compressed blocks entries that each summarise r positions — all of them (HCA, r = 128) or the
top k a lightning indexer picks per query (CSA, r = 4).

For queries at positions p (llama.cpp ``deepseek4.cpp``, transformers ``DeepseekV4Attention``)::

    qr = q_a_norm(q_a(x));  q = rms(q_b(qr) per head)            unweighted per-head RMS
    kv = kv_norm(kv(x))                                            one head, K = V
    rope on the LAST n_rot dims of q, kv and every compressed entry (interleaved pairs)
    keys = window rows (p − W, p] ++ compressed entries w < (p + 1) // r  (CSA: ∩ top-k)
    o  = softmax-with-sink(q·keysᵀ/√d) @ keys;  o = rope⁻¹(o at p)  (V carried rope)
    out = o_b(concat_g o_a[g](o_g))                                 grouped low-rank output

A compressor turns each window of r positions into one entry: per channel, a softmax over the
window's gates (``gate(x) + ape[p mod r]``) weighs its ``kv(x)`` rows; then ``norm`` and rope
at position w·r. CSA's windows overlap: each token projects twice (Ca | Cb) and entry w pools
window w−1's Ca with window w's Cb (2r slots; none before window 0). The indexer's keys are a
second such compressor (``indexer_compressor_*``, 128 wide on V4-Flash); its score of entry s
for query t is Σ_h w_h(x_t)·relu(q_h(t)·k_s) with per-head weights ``indexer.proj``.

Everything is float32; caches are ``gpu.dsv4_cache``. Scores live a chunk of queries at a time
(at most ``placement.limits.SCORE_VALUES`` at once), as ``gpu.attention`` does.
"""
from __future__ import annotations

from typing import Callable

import torch

from gpu.dsv4_cache import CompressedRows, CompressorState, Dsv4Cache
from gpu.kv_cache import QuantRows, SequenceBatch, spans
from gpu.norm import RMSNorm
from gpu.rope import Rope
from placement.limits import SCORE_VALUES

Projection = Callable[[torch.Tensor], torch.Tensor]


def rope_tail(rope: Rope, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``rope.n_rot`` dims of x (T, H, D) at ``positions`` (T,); the rest pass."""
    d, n = x.shape[-1], rope.n_rot
    return torch.cat((x[..., :d - n], rope(x[..., d - n:], positions, inverse=inverse)), dim=-1)


class Compressor:
    """``{attn,indexer}_compressor_{kv,gate,ape,norm}``: one entry per ``ratio`` positions,
    ``dim`` wide (``overlap``: CSA's two projections per token, 2·dim)."""

    def __init__(self, *, kv: Projection, gate: Projection, ape: torch.Tensor, norm: RMSNorm, ratio: int,
                 dim: int, overlap: bool, rope: Rope):
        coff = 2 if overlap else 1
        if ape.shape != (ratio, coff * dim):
            raise ValueError(f"compressor ape of shape {tuple(ape.shape)}, expected {(ratio, coff * dim)}")
        self.kv, self.gate, self.ape, self.norm = kv, gate, ape.float(), norm
        self.ratio, self.dim, self.overlap, self.rope = ratio, dim, overlap, rope

    def __call__(self, x: torch.Tensor, state: CompressorState, rows: CompressedRows) -> torch.Tensor:
        """x: (T, n_embd) of the next T positions → every entry so far (count, dim)."""
        r, d, width = self.ratio, self.dim, self.ape.shape[1]
        pos0 = state.length
        seen, first = state.extend(torch.cat((self.kv(x).float(), self.gate(x).float()), dim=-1))
        done, now = pos0 // r, state.length // r
        if now > done:
            w = torch.arange(done, now)
            at = (w[:, None] * r + torch.arange(r)[None, :] - first).to(seen.device)      # (nw, r) rows
            kv, z = seen[at, :width], seen[at, width:] + self.ape                          # (nw, r, width)
            if self.overlap:    # slots: window w−1's Ca, then window w's Cb
                prev = (at - r).clamp(min=0)
                z_prev = seen[prev, width:width + d] + self.ape[:, :d]
                z_prev[(w == 0).to(z_prev.device)] = float("-inf")      # nothing before window 0
                kv = torch.cat((seen[prev, :d], kv[..., d:]), dim=1)                         # (nw, 2r, d)
                z = torch.cat((z_prev, z[..., d:]), dim=1)
            e = self.norm((kv * torch.softmax(z, dim=1)).sum(1))                             # (nw, d)
            e = rope_tail(self.rope, e[:, None], w * r)[:, 0]
            rows.append(e)
        return rows.values()


def _chunk(heads: int, t: int, n_keys: int) -> int:
    return max(1, min(t, SCORE_VALUES // max(1, heads * n_keys)))


class Indexer:
    """The lightning indexer of a CSA block: ``indexer.{attn_q_b,proj}`` and its compressor.
    ``__call__`` → (T, n_entries) bool, the entries each query attends to (at most ``top_k``
    of those it may see; ties broken as ``torch.topk`` does)."""

    def __init__(self, *, q_b: Projection, proj: Projection, compressor: Compressor, n_head: int,
                 head_dim: int, top_k: int, rope: Rope):
        self.q_b, self.proj, self.compressor = q_b, proj, compressor
        self.n_head, self.head_dim, self.top_k, self.rope = n_head, head_dim, top_k, rope

    def scores(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """(T, n_entries) float32 index scores, −inf where an entry is not yet visible."""
        t, s = x.shape[0], keys.shape[0]
        q = rope_tail(self.rope, self.q_b(qr).float().view(t, self.n_head, self.head_dim), positions)
        wts = self.proj(x).float() * (self.head_dim ** -0.5 * self.n_head ** -0.5)         # (T, H)
        out = torch.empty(t, s, device=x.device)
        step = _chunk(self.n_head, t, s)
        for c0 in range(0, t, step):
            dots = torch.relu(q[c0:c0 + step] @ keys.T)                                    # (c, H, S)
            out[c0:c0 + step] = (dots * wts[c0:c0 + step, :, None]).sum(1)
        bound = (positions.to(x.device) + 1) // self.compressor.ratio                      # entries query t sees
        return out.masked_fill_(torch.arange(s, device=x.device)[None] >= bound[:, None], float("-inf"))

    def __call__(self, x, qr, positions, state: CompressorState, rows: CompressedRows) -> torch.Tensor:
        keys = self.compressor(x, state, rows).float()
        score = self.scores(x, qr, positions, keys)
        chosen = torch.zeros_like(score, dtype=torch.bool)
        if keys.shape[0]:
            chosen.scatter_(1, score.topk(min(self.top_k, keys.shape[0]), dim=-1).indices, True)
        return chosen & torch.isfinite(score)


def attend_with_sink(q: torch.Tensor, keys: torch.Tensor, seen: torch.Tensor, sinks: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """q (T, H, D), keys = values (L, D), seen (T, L) bool, sinks (H,) → (T, H, D): a softmax
    per query and head over the keys it sees plus one sink logit that has no value."""
    t, h, d = q.shape
    out = torch.empty(t, h, d, device=q.device)
    sink = sinks.float()[:, None, None]                                                    # (H, 1, 1)
    step = _chunk(h, t, keys.shape[0])
    for c0 in range(0, t, step):
        # one (H, c, L) score tensor, worked in place: out of place, three were alive at once
        # (the scores, exp's input and its result), which the planner's count does not hold
        s = (q[c0:c0 + step].transpose(0, 1) @ keys.T).mul_(scale)                         # (H, c, L)
        s.masked_fill_(~seen[None, c0:c0 + step], float("-inf"))
        m = torch.maximum(s.amax(-1, keepdim=True), sink)
        s.sub_(m).exp_()
        s.div_(s.sum(-1, keepdim=True) + torch.exp(sink - m))
        out[c0:c0 + step] = (s @ keys).transpose(0, 1)
    return out


class CompressedAttention:
    """One deepseek4 block's attention (any kind: ``compressor`` None for window-only blocks,
    ``indexer`` only on CSA blocks). ``o_a`` is grouped: (T, o_groups, H·d / o_groups) →
    (T, o_groups · rank), group g through its own rows (``gpu.linear.GroupedLinear``)."""

    def __init__(self, *, q_a: Projection, q_a_norm: RMSNorm, q_b: Projection, kv: Projection, kv_norm: RMSNorm,
                 o_a: Projection, o_b: Projection, sinks: torch.Tensor, n_head: int, head_dim: int,
                 o_groups: int, window: int, rope: Rope, eps: float, compressor: Compressor | None = None,
                 indexer: Indexer | None = None):
        self.q_a, self.q_a_norm, self.q_b, self.kv, self.kv_norm = q_a, q_a_norm, q_b, kv, kv_norm
        self.o_a, self.o_b, self.sinks = o_a, o_b, sinks
        self.n_head, self.head_dim, self.o_groups, self.window = n_head, head_dim, o_groups, window
        self.rope, self.eps, self.compressor, self.indexer = rope, eps, compressor, indexer
        self.causal = True      # False: a DSpark stage's draft block sees all of itself

    def keys(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The shared K = V head of x (T, n_embd) at ``positions``: (T, 1, d), roped."""
        t, d = x.shape[0], self.head_dim
        return rope_tail(self.rope, self.kv_norm(self.kv(x)).float().view(t, 1, d), positions)

    def inject(self, x: torch.Tensor, positions: torch.Tensor, cache: Dsv4Cache) -> None:
        """Write the keys of x into the window ring without attending (DSpark's context: the
        target's fused taps enter each stage only as keys)."""
        win = cache.window
        win.append(self.keys(x, positions).transpose(0, 1))           # stored in the ring's type

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: Dsv4Cache | SequenceBatch) -> torch.Tensor:
        """x: (T, n_embd) normalised input at ``positions`` (T,) → (T, n_embd); advances ``cache``
        (several sequences' caches as a ``SequenceBatch``: the projections over every row, the
        window, compressors, indexer and attention per sequence over its own rows)."""
        t, h, d = x.shape[0], self.n_head, self.head_dim
        qr = self.q_a_norm(self.q_a(x))                                                    # (T, q_lora)
        q = self.q_b(qr).float().view(t, h, d)
        q = rope_tail(self.rope, q * torch.rsqrt(q.square().mean(-1, keepdim=True) + self.eps), positions)
        kv = self.keys(x, positions)
        if isinstance(cache, SequenceBatch):
            o = torch.cat([self._attend(x[lo:hi], qr[lo:hi], q[lo:hi], kv[lo:hi], positions[lo:hi], c)
                           for c, (lo, hi) in zip(cache.caches, spans(cache.rows))])
        else:
            o = self._attend(x, qr, q, kv, positions, cache)
        o = rope_tail(self.rope, o, positions, inverse=True)
        return self.o_b(self.o_a(o.reshape(t, self.o_groups, h * d // self.o_groups)))

    def _attend(self, x, qr, q, kv, positions, cache: Dsv4Cache) -> torch.Tensor:
        """One sequence's rows: its keys into the window, its compressed entries and the
        indexer's choice, then attention with the sink → (T, H, d) before the inverse rotation."""
        t, d = x.shape[0], self.head_dim
        win = cache.window
        ring = win.append(kv.transpose(0, 1))[0]                       # stored in the ring's type
        keys = (ring.float() if isinstance(ring, QuantRows) else ring)[0].float()           # (L, d)
        # the window by cache index (the sequence order; an MTP head's entry t sits at position t + 1)
        qi = torch.arange(win.length - t, win.length, device=x.device)[:, None]
        kj = torch.arange(win.start, win.length, device=x.device)[None]
        seen = (kj <= qi if self.causal else kj < win.length) & (qi - kj < self.window)    # (T, L)
        pos = positions.to(x.device)[:, None]
        if self.compressor is not None:
            entries = self.compressor(x, cache.state, cache.compressed).float()           # (S, d)
            if self.indexer is not None:
                chosen = self.indexer(x, qr, positions, cache.index_state, cache.index)
            else:
                chosen = torch.arange(entries.shape[0], device=x.device)[None] < (pos + 1) // self.compressor.ratio
            if t == 1:      # one query: gather the entries it attends to, in order, rather than score all and mask
                take = chosen[0].nonzero().squeeze(1)
                entries, chosen = entries[take], chosen[:, take]
            keys, seen = torch.cat((keys, entries)), torch.cat((seen, chosen), dim=1)
        return attend_with_sink(q, keys, seen, self.sinks, d ** -0.5)
