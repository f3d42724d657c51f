"""DSpark: deepseek4's block drafter, a ``dflash`` GGUF given as ``--draft`` (docs:
../shared/deepseek4.md §2.11; llama.cpp ``dflash.cpp::graph_dsv4`` + ``common/speculative.cpp``).

* Taps: the trunk (``Deepseek4.forward`` with ``model.dspark`` set) returns as its hidden
  states the mean over the hc streams of the inputs of ``dflash.target_layers`` (n_layer: the
  last block's output), concatenated (T, k·d).
* Context: ``main_x = rms(fc · taps, enc.output_norm)``; each stage s stores
  ``K_s(p) = rope(rms(attn_kv_s · main_x, attn_kv_a_norm_s))`` (K = V) in its window ring at
  the trunk's position p. That is the only way the target's context enters the drafter.
* A draft block ``[x_Q, MASK × (n−1)]`` at positions Q … Q+n−1 (MASK =
  ``tokenizer.ggml.mask_token_id``) runs through the stages — full window-only V4 blocks, the
  block attending to all of itself (non-causal) and the ring — then the hc head (``h``, the
  confidence head's input), ``output_norm`` and the trunk's ``output``: ``base_i``.
* Markov head, chained greedily: ``prev_0 = x_Q``; ``logit_i = base_i + W2 · W1[prev_i]``;
  ``prev_{i+1} = argmax(logit_i)``. Draft i comes from ``logit_i`` (so n drafts per block).
  With ``dflash.sample_from_anchor`` false (SpecForge's bonus-anchor exports; llama.cpp's
  ``i_draft_beg = 1``) the block is ``[x_Q, MASK × n]``: row 0 is no draft, the chain starts at
  row 1 (``prev_1 = x_Q``) and drafts come from rows 1..n, so a block drafts one token fewer
  than its size.
* Confidence: ``c_i = sigmoid(conf_proj · [h_i; W1[prev_i]] + b)``; the block stops at the
  first ``c_i < p_min`` (p_min 0: never).

Cache bookkeeping (the drafter's cache is ``state.nextn_cache``): it holds the injected keys of
trunk positions 0 … Q−1 exactly — prime injects the prompt's, accept those of x_Q and the
accepted drafts; a draft block's own keys are always rolled back (to Q). So after any step the
cache equals a fresh injection of the kept tokens' taps.

Torch path only: the compiled CPU block of deepseek4 (``offload.compiled_v4``) attends
causally over a growing cache; a stage attends to all of itself, so it keeps the reference block.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from gpu.dsv4_cache import Dsv4Cache
from gpu.norm import RMSNorm
from offload.errors import OffloadError
from offload.dspark_header import DSparkHeader, dspark_header
from offload.models.deepseek4 import DRAFTERS, Deepseek4Config, block, config_from_gguf, hc_head
from offload.models.shared.base import BuildContext
from offload.sampling import Sampler
from offload.speculative import Guide, SpecOptions, _rows, register_drafter
from placement.tensors import ModelSpec


class DSparkCache:
    """The stages' window rings; ``length`` = trunk positions injected."""

    def __init__(self, caches: list[Dsv4Cache]):
        self.caches = caches

    @property
    def length(self) -> int:
        return self.caches[0].length

    def __len__(self) -> int:
        return self.length

    def truncate(self, n: int) -> None:
        for c in self.caches:
            c.truncate(n)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)


class DSpark:
    """The drafter's weights and its two passes: ``inject`` (context) and ``block`` (a draft)."""

    def __init__(self, *, fc, enc_norm: RMSNorm, stages: list, hc_head, norm: RMSNorm, embed, output,
                 markov_w1, markov_w2, conf_proj, conf_bias, header: DSparkHeader, hc_mult: int):
        self.fc, self.enc_norm, self.stages, self.hc_head, self.norm = fc, enc_norm, stages, hc_head, norm
        self.embed, self.output, self.w1, self.w2 = embed, output, markov_w1, markov_w2
        self.conf_proj, self.conf_bias = conf_proj, conf_bias
        self.header, self.hc_mult = header, hc_mult
        self.target_layers, self.block_size, self.mask_id = header.target_layers, header.block_size, header.mask_id
        self.sample_from_anchor = header.sample_from_anchor

    def new_cache(self) -> DSparkCache:
        return DSparkCache([s.new_cache() for s in self.stages])

    def inject(self, taps: torch.Tensor, positions: torch.Tensor, cache: DSparkCache) -> None:
        """taps (T, k·d) of trunk positions ``positions`` → each stage's ring."""
        x = self.enc_norm(self.fc(taps.to(self.enc_norm.weight.device).float()).float())
        for stage, c in zip(self.stages, cache.caches):
            stage.attn.inject(x.to(stage.device), positions, c)

    def block(self, tokens: list[int], pos0: int, cache: DSparkCache):
        """The draft block through the stages → (base logits (n, V), h (n, d) pre-norm); the
        block's keys are left in the rings (the caller rolls them back)."""
        ids = torch.as_tensor(tokens)
        n = len(tokens)
        positions = torch.arange(pos0, pos0 + n)
        x = self.embed(ids).float()
        x = x[:, None].expand(-1, self.hc_mult, -1).contiguous()
        for stage, c in zip(self.stages, cache.caches):
            x = stage(x.to(stage.device), positions, c, tokens=ids)
        h = self.hc_head(x.to(self.hc_head.fn.device))
        base = self.output(self.norm(h.to(self.norm.weight.device)).to(self.output.device)).float()
        return base, h.float()

    def markov(self, prev: int) -> tuple[torch.Tensor, torch.Tensor]:
        """W1[prev] (rank,) and the bias W2 · W1[prev] (V,)."""
        e = self.w1(torch.as_tensor([prev])).float()
        return e[0], self.w2(e.to(self.w2.device)).float()[0]

    def confidence(self, h: torch.Tensor, e: torch.Tensor) -> float:
        z = self.conf_proj(torch.cat((h, e.to(h.device)))[None].to(self.conf_proj.device)).float()[0, 0]
        if self.conf_bias is not None:
            z = z + self.conf_bias.to(z.device)[0]
        return float(torch.sigmoid(z))


class DSparkDrafter:
    """DSpark's side of the generation loop (``offload.speculative.Drafter``)."""

    uses_hidden = True
    passes = frozenset({"prime", "draft", "accept"})     # accept injects taps: the head's pass

    def __init__(self, head: DSpark, cache: DSparkCache, sampler: Sampler, options: SpecOptions, ubatch: int,
                 guide: Guide | None = None):
        if options.p_min > 0 and head.conf_proj is None:
            # as llama.cpp: without a confidence head p_min has nothing to cut on
            raise OffloadError("the DSpark drafter has no confidence head (conf_proj): give --spec-p-min 0")
        self.head, self.cache, self.sampler, self.options, self.ubatch = head, cache, sampler, options, ubatch
        self.guide = guide

    def _inject(self, taps: torch.Tensor, pos0: int) -> None:
        for s in range(0, taps.shape[0], self.ubatch):
            chunk = taps[s:s + self.ubatch]
            self.head.inject(chunk, torch.arange(pos0 + s, pos0 + s + chunk.shape[0]), self.cache)

    def prime(self, hidden: torch.Tensor, ids, start: int = 0) -> None:
        """The prompt's taps (positions start..P−1) into the rings."""
        assert self.cache.length == start, (self.cache.length, start)
        self._inject(hidden, start)

    def draft(self, x_q: int, q_len: int, n_cap: int) -> tuple[list[int], list[np.ndarray | None]]:
        assert self.cache.length == q_len, (self.cache.length, q_len)
        n = min(n_cap, self.head.header.max_drafts)
        if n <= 0:
            return [], []
        # sample_from_anchor off: the anchor's row is no draft, drafts come from rows 1..n
        off = 0 if self.head.sample_from_anchor else 1
        base, h = self.head.block([x_q] + [self.head.mask_id] * (n - 1 + off), q_len, self.cache)
        self.cache.truncate(q_len)             # the block's own keys: never context
        drafts: list[int] = []
        qs: list[np.ndarray | None] = []
        guide = self.guide.fork() if self.guide is not None else None
        prev = x_q
        for i in range(off, n + off):
            e, bias = self.head.markov(prev)
            col = base[i] + bias.to(base.device)
            if self.options.p_min > 0 and self.head.confidence(h[i], e) < self.options.p_min:
                break
            z = _rows(col)
            if guide is not None:
                z = guide.mask(z)
            q = None if self.sampler.greedy else self.sampler.probs(z)
            d = int(np.argmax(z)) if q is None else self.sampler.draw(q)
            if guide is not None and not guide.accept(d):
                break
            drafts.append(d)
            qs.append(q)
            prev = int(torch.argmax(col))      # the chain is greedy on the unmasked column, as llama.cpp's
        return drafts, qs

    def accept(self, q_len: int, x_q: int, hidden: torch.Tensor, accepted: list[int]) -> None:
        """x_Q and the accepted drafts are in the trunk: their taps (``hidden``) into the rings."""
        assert self.cache.length == q_len, (self.cache.length, q_len)
        self._inject(hidden[:1 + len(accepted)], q_len)

    def rollback(self, keep: int) -> None:
        self.cache.truncate(min(self.cache.length, keep))


def _dspark_drafter(head, state, sampler, options, ubatch, guide) -> DSparkDrafter:
    if head is None:
        raise OffloadError("--spec-type dspark needs a DSpark drafter: give --draft with a dflash GGUF")
    return DSparkDrafter(head, state.nextn_cache, sampler, options, ubatch, guide)


register_drafter("dspark", _dspark_drafter)


def dspark_drafter(w, cfg: Deepseek4Config, ctx: BuildContext, *, embed, output, trunk: ModelSpec) -> DSpark:
    """The DSpark drafter in the ``dflash`` WeightStore ``w`` for the trunk ``cfg`` (its header
    ``trunk``), using the trunk's token embedding and output head. Its stages are window-only V4
    blocks with their own window ring (the plan's window cells), routed by score + bias, with the
    clamped SwiGLU of the drafter's own ``swiglu_clamp_*`` keys (llama.cpp clamps dflash stages
    as deepseek4's). Its header was checked before loading (``dspark_header``); read again here,
    so a library caller gets the same one-line errors."""
    header = dspark_header(w.model, trunk)
    dcfg = config_from_gguf(w.model.spec, w.model.metadata)
    dcfg = replace(dcfg, compress_ratios=(0,) * dcfg.n_layer, n_hash_layers=0)
    stages = []
    for i in range(dcfg.n_layer):
        b = block(w, dcfg, i, ctx)
        b = getattr(b, "reference", b)          # the torch block (see the module's docstring)
        b.attn.causal = False
        b.path = "reference: non-causal DSpark stage"
        stages.append(b)
    dev = w.device("fc.weight")
    norm = lambda n: RMSNorm(w.vector(f"{n}.weight").to(w.device(f"{n}.weight")), cfg.rms_eps)  # noqa: E731
    return DSpark(fc=w.linear("fc.weight"), enc_norm=RMSNorm(w.vector("enc.output_norm.weight").to(dev), cfg.rms_eps),
                  stages=stages, hc_head=hc_head(w, dcfg, "output_hc"), norm=norm("output_norm"), embed=embed,
                  output=output, markov_w1=w.embedding("markov_w1.weight"), markov_w2=w.linear("markov_w2.weight"),
                  conf_proj=w.linear("conf_proj.weight") if w.has("conf_proj.weight") else None,
                  conf_bias=w.vector("conf_proj.bias") if w.has("conf_proj.bias") else None,
                  header=header, hc_mult=cfg.hc_mult)


DRAFTERS["dflash"] = dspark_drafter
