"""Tiny random GGUFs of every architecture in ``ARCHS`` (glm4moe, qwen3moe, deepseek2, gpt-oss,
deepseek4)
written with ``gguf.GGUFWriter``, exactly as llama.cpp names and lays them out, with routed
experts in a chosen quant type. An architecture is one ``TinyArch`` entry: its metadata keys
and its per-block tensor list (name, shape from the spec, quant role, std).

``write_tiny_model`` returns the file path and the dequantized float32 weights by GGUF
name (``gguf.quants.dequantize`` of what was written), which the reference models load.
K-quant blocks (which gguf-py cannot quantize) are random bytes with sane fp16 scales:
whatever they dequantize to *is* the weight.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import (GGML_QUANT_SIZES, ExpertGatingFuncType, GGMLQuantizationType as Q, GGUFWriter,
                  RopeScalingType, TokenType)
from gguf.quants import dequantize, quantize

from cpu_kernels.synth import set_scales

# byte offsets of the fp16 scale fields in one block of each type, and a divisor that keeps
# the dequantized values near the wanted std (block layouts as ggml's block_q4_0 … block_q6_K)
_F16_FIELDS = {
    Q.Q4_0: ((0,), 8.0), Q.Q4_1: ((0, 2), 8.0), Q.Q5_0: ((0,), 16.0), Q.Q5_1: ((0, 2), 16.0),
    Q.Q8_0: ((0,), 64.0), Q.IQ4_NL: ((0,), 64.0), Q.IQ4_XS: ((0,), 1024.0),
    Q.Q2_K: ((80, 82), 20.0), Q.Q3_K: ((108,), 64.0), Q.Q4_K: ((0, 2), 256.0),
    Q.Q5_K: ((0, 2), 512.0), Q.Q6_K: ((208,), 1024.0),
    Q.IQ2_XXS: ((0,), 64.0), Q.IQ2_XS: ((0,), 64.0), Q.IQ2_S: ((0,), 64.0),
    Q.IQ3_XXS: ((0,), 64.0), Q.IQ3_S: ((0,), 16.0), Q.IQ1_S: ((0,), 8.0),
    Q.TQ2_0: ((64,), 1.0),       # no CPU kernel: for the tests that such a file is refused
}


def random_blocks(rng: np.random.Generator, n_blocks: int, qtype: Q, std: float) -> np.ndarray:
    """Random raw blocks ``(n_blocks, type_size)`` uint8 with finite, sane scales: whatever
    they dequantize to is the weight. Covers types gguf-py cannot quantize (K, IQ4)."""
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == Q.MXFP4:       # E8M0 block exponent: 2^(e-128) near std/6
        raw[:, 0] = np.clip(np.round(np.log2(std / 6) + 128 + rng.integers(-1, 2, n_blocks)), 1, 254)
        return raw
    if qtype not in _F16_FIELDS:  # IQ1_M: its scale is split over nibbles (synth knows where)
        set_scales(raw, qtype, rng, std / 8)
        return raw
    offsets, div = _F16_FIELDS[qtype]
    for off in offsets:
        d = (std / div * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return raw


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q, std: float, *,
                  dequantized: bool = True):
    """→ (data to write, raw dtype or None, dequantized float32 values — None with
    ``dequantized=False``). ``shape`` numpy order. Legacy types are quantized from normal
    values by gguf-py; the others are random blocks."""
    x = (rng.standard_normal(shape) * std).astype(np.float32)
    if qtype == Q.F32:
        return x, None, x
    if qtype == Q.F16:
        h = x.astype(np.float16)
        return h, None, h.astype(np.float32)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.BF16):
        raw = quantize(x, qtype)
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = random_blocks(rng, x.size // block, qtype, std).reshape(*shape[:-1], shape[-1] // block * size)
    return raw, qtype, dequantize(raw, qtype).astype(np.float32) if dequantized else None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (used by byte-level BPE vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


_WORDS = ["the", " the", " def", "def", " return", " self", " import", " in", " is", "ing",
          " for", "   ", "    ", " x", " =", "()", "):", "\n\n", "\n    "]


def tiny_vocab(extra_merges: tuple[str, ...] = ()) -> tuple[list[str], list[str], list[int]]:
    """Byte-level BPE vocabulary: 256 byte tokens, merges building a few words (and
    ``extra_merges``, "a b" in byte-level characters), one control token. Returns (tokens,
    merges "a b", token types)."""
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    for word in _WORDS:
        chars = [b2u[b] for b in word.encode()]
        cur = chars[0]
        for c in chars[1:]:
            if cur + c not in tokens:
                merges.append(f"{cur} {c}")
                tokens.append(cur + c)
            cur = cur + c
    for m in extra_merges:
        merges.append(m)
        tokens.append(m.replace(" ", ""))
    types = [TokenType.NORMAL] * len(tokens)
    tokens.append("<|endoftext|>")
    types.append(TokenType.CONTROL)
    return tokens, merges, [int(t) for t in types]


def add_tiny_vocab(w: GGUFWriter, extra_merges: tuple[str, ...] = (), pre: str = "gpt-2") -> int:
    """Write ``tiny_vocab`` as a GPT-2 style BPE tokenizer (BOS = EOS = its control token) with
    pre-tokenizer ``pre``; returns the vocabulary size."""
    tokens, merges, types = tiny_vocab(extra_merges)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 1)
    w.add_eos_token_id(len(tokens) - 1)
    return len(tokens)


@dataclass(frozen=True)
class TinySpec:
    arch: str = "glm4moe"
    expert_type: Q = Q.Q8_0
    dense_type: Q = Q.F32        # attention / dense FFN / shared expert / output matrices
    embd_type: Q = Q.F32
    n_embd: int = 256            # K-quants need rows that are a multiple of 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 32
    n_rot: int = 16              # partial rotary (glm4moe); qwen3moe uses head_dim
    n_layer: int = 3             # trunk blocks
    n_dense: int = 1             # leading dense blocks (glm4moe)
    n_ff: int = 128              # dense FFN
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 256
    n_shared: int = 1            # glm4moe shared experts
    nextn: bool = True           # glm4moe NextN block
    qk_norm: bool = False        # glm4moe optional q/k norm (qwen3moe always has it)
    tied_output: bool = False
    weights_norm: bool = True
    weights_scale: float = 1.5
    rope_base: float = 10000.0
    rms_eps: float = 1e-5
    seed: int = 0
    # deepseek2 (MLA): head width is qk_nope + n_rot; n_head_kv and head_dim are not used
    q_lora_rank: int = 64        # 0: attn_q straight from x (V2-Lite)
    kv_lora_rank: int = 64
    qk_nope: int = 32
    v_head_dim: int = 32
    mla: bool = True             # attn_k_b/attn_v_b + key_length_mla (else the older attn_kv_b)
    gating: str = "sigmoid"      # or "softmax" (V2)
    n_group: int = 1             # expert groups (sigmoid routing)
    n_group_used: int = 1
    yarn_factor: float = 0.0     # > 1: YaRN with yarn_orig_ctx and yarn_log_mul
    yarn_orig_ctx: int = 64
    yarn_log_mul: float = 0.1
    yarn_beta_fast: float = 32.0  # written only when not ggml's default
    embd_std: float = 1.0
    nextn_echo: float = 0.0      # > 0: eh_proj = [echo·I, 0], a head that passes token t+1 on
    experts_as_f32: bool = False  # write the routed experts' dequantized values as F32 (same draws)
    # gpt-oss: sliding window of the even blocks; yarn_factor / yarn_orig_ctx as above
    window: int = 4
    tokenizer_pre: str = "gpt-2"
    extra_merges: tuple[str, ...] = ()
    # deepseek4 (also: head_dim, n_rot, q_lora_rank, window, yarn_factor / yarn_orig_ctx)
    compress_ratios: tuple[int, ...] = (0, 0, 4, 128, 4, 128)   # per block: window, CSA, HCA
    n_hash: int = 2              # leading blocks routed by token id (ffn_gate_tid2eid)
    hc_mult: int = 4             # hyper-connection streams
    hc_iters: int = 20           # Sinkhorn iterations
    indexer_n_head: int = 4
    indexer_head_dim: int = 64
    indexer_top_k: int = 128
    o_groups: int = 2
    o_lora_rank: int = 32
    compress_rope_base: float = 160000.0
    swiglu_limit: float = 10.0
    # deepseek4 bad-input files: (key template, value) written instead of the spec's (None: omitted)
    meta_overrides: tuple[tuple[str, object], ...] = ()

    @property
    def n_vocab(self) -> int:
        return len(tiny_vocab(self.extra_merges)[0])


@dataclass
class TinyModel:
    path: Path
    spec: TinySpec
    weights: dict[str, np.ndarray] = field(repr=False)   # dequantized float32, numpy order


# --- the architectures: each one's metadata keys and per-block tensor list, in file order ---

# which of the spec's types a tensor takes, by its quant role
_ROLE_TYPE = {"dense": "dense_type", "experts": "expert_type", "embd": "embd_type"}


@dataclass(frozen=True)
class TinyTensor:
    """One tensor to write: GGUF name (within a block: after ``blk.N.``), numpy shape, quant
    role (``dense``, ``experts``, ``embd``: the spec's type for it; ``f32``), the std of its
    random values (``mean`` added after), or a fixed ``value`` written as is (no draw)."""
    name: str
    shape: tuple[int, ...]
    role: str
    std: float
    mean: float = 0.0
    value: np.ndarray | None = field(default=None, compare=False, repr=False)

    def qtype(self, spec: TinySpec) -> Q:
        return Q.F32 if self.role == "f32" else getattr(spec, _ROLE_TYPE[self.role])


def lin(name: str, out: int, inp: int) -> TinyTensor:
    """A matrix (out, inp) in the spec's dense type, std 1/√inp."""
    return TinyTensor(f"{name}.weight", (out, inp), "dense", inp ** -0.5)


def norm(name: str, n: int) -> TinyTensor:
    """An RMSNorm weight near 1."""
    return TinyTensor(f"{name}.weight", (n,), "f32", 0.1, mean=1.0)


def f32(name: str, shape: tuple[int, ...], std: float) -> TinyTensor:
    return TinyTensor(name, shape, "f32", std)


@dataclass(frozen=True)
class TinyArch:
    """What one architecture writes beyond the common keys and tensors (``token_embd``, the
    blocks, ``output_norm``, ``output`` unless tied): ``metadata(w, spec)`` writes its keys after
    ``head_count`` and before the vocabulary; ``block(spec, i)`` lists block i's tensors;
    ``nextn``: ``spec.nextn`` adds block ``n_layer``, the NextN (MTP) head; ``head(spec)``: root
    tensors written after the blocks, before ``output_norm`` (deepseek4's ``output_hc_*``)."""
    metadata: Callable[[GGUFWriter, TinySpec], None]
    block: Callable[[TinySpec, int], list[TinyTensor]]
    nextn: bool = False
    head: Callable[[TinySpec], list[TinyTensor]] | None = None   # root tensors before output_norm


def _gqa_keys(w: GGUFWriter, spec: TinySpec, n_rot: int | None) -> None:
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    if n_rot is not None:
        w.add_rope_dimension_count(n_rot)


def _rope_norm_expert_keys(w: GGUFWriter, spec: TinySpec) -> None:
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)


def _leading_dense_keys(w: GGUFWriter, spec: TinySpec) -> None:
    """glm4moe's and deepseek2's: leading dense blocks, shared experts, gating, NextN."""
    w.add_leading_dense_block_count(spec.n_dense)
    w.add_expert_shared_count(spec.n_shared)
    w.add_expert_weights_scale(spec.weights_scale)
    w.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX if spec.gating == "softmax"
                             else ExpertGatingFuncType.SIGMOID)
    w.add_nextn_predict_layers(1 if spec.nextn else 0)


def glm4moe_metadata(w: GGUFWriter, spec: TinySpec) -> None:
    _gqa_keys(w, spec, spec.n_rot)
    _rope_norm_expert_keys(w, spec)
    w.add_expert_weights_norm(spec.weights_norm)
    _leading_dense_keys(w, spec)


def qwen3moe_metadata(w: GGUFWriter, spec: TinySpec) -> None:
    _gqa_keys(w, spec, spec.head_dim)
    _rope_norm_expert_keys(w, spec)
    w.add_expert_weights_norm(spec.weights_norm)


def deepseek2_metadata(w: GGUFWriter, spec: TinySpec) -> None:
    """deepseek2's attention keys as llama.cpp's converter writes them: with the MLA layout
    the cache row is the latent (key_length = kv_lora + rope, value_length = kv_lora, one KV
    head) and the real head widths go to key/value_length_mla."""
    head_k = spec.qk_nope + spec.n_rot
    if spec.q_lora_rank:
        w.add_q_lora_rank(spec.q_lora_rank)
    w.add_kv_lora_rank(spec.kv_lora_rank)
    if spec.mla:
        w.add_head_count_kv(1)
        w.add_key_length(spec.kv_lora_rank + spec.n_rot)
        w.add_value_length(spec.kv_lora_rank)
        w.add_key_length_mla(head_k)
        w.add_value_length_mla(spec.v_head_dim)
    else:
        w.add_head_count_kv(spec.n_head)
        w.add_key_length(head_k)
        w.add_value_length(spec.v_head_dim)
    w.add_rope_dimension_count(spec.n_rot)
    if spec.n_group > 1:
        w.add_expert_group_count(spec.n_group)
        w.add_expert_group_used_count(spec.n_group_used)
    if spec.yarn_factor > 1:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(spec.yarn_orig_ctx)
        w.add_rope_scaling_yarn_log_mul(spec.yarn_log_mul)
        if spec.yarn_beta_fast != 32.0:
            w.add_rope_scaling_yarn_beta_fast(spec.yarn_beta_fast)
    _rope_norm_expert_keys(w, spec)
    w.add_expert_weights_norm(spec.weights_norm)
    _leading_dense_keys(w, spec)


def gpt_oss_metadata(w: GGUFWriter, spec: TinySpec) -> None:
    """No rope dimension count (the whole head) and no expert weights norm; the sliding window
    (the even blocks use it, llama.cpp's fixed pattern) and YaRN."""
    _gqa_keys(w, spec, None)
    w.add_sliding_window(spec.window)
    if spec.yarn_factor > 1:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(spec.yarn_orig_ctx)
    _rope_norm_expert_keys(w, spec)


SQRT_SOFTPLUS = 4      # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS (gguf 0.19 lacks it)


def deepseek4_metadata(w: GGUFWriter, spec: TinySpec) -> None:
    """deepseek4's keys as llama.cpp's converter writes them: one shared K=V head, q LoRA,
    the grouped output projection, per-block compress ratios (i32) and SwiGLU clamps (f32),
    the indexer, hyper-connections, hash routing, and YaRN for the compressed blocks' rope."""
    from gguf import Keys

    from offload.gguf_model import NewerKeys
    # the MTP block (spec.nextn) is one more, window-only; a dflash drafter's stages are its blocks
    arch, n = spec.arch, n_blocks(spec) if spec.arch in ARCHS else spec.n_layer
    overrides = dict(spec.meta_overrides)

    def put(template: str, value, add) -> None:
        value = overrides.get(template, value)
        if value is not None:
            add(template.format(arch=arch), value)

    w.add_head_count_kv(1)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.n_rot)
    w.add_q_lora_rank(spec.q_lora_rank)
    w.add_sliding_window(spec.window)
    put(NewerKeys.OUTPUT_GROUP_COUNT, spec.o_groups, w.add_uint32)
    put(NewerKeys.OUTPUT_LORA_RANK, spec.o_lora_rank, w.add_uint32)
    ratios = [int(r) for r in spec.compress_ratios]
    put(NewerKeys.COMPRESS_RATIOS, ratios + [0] * (n - len(ratios)), w.add_array)
    put(NewerKeys.COMPRESS_ROPE_FREQ_BASE, spec.compress_rope_base, w.add_float32)
    put(Keys.Attention.Indexer.HEAD_COUNT, spec.indexer_n_head, w.add_uint32)
    put(Keys.Attention.Indexer.KEY_LENGTH, spec.indexer_head_dim, w.add_uint32)
    put(Keys.Attention.Indexer.TOP_K, spec.indexer_top_k, w.add_uint32)
    if spec.yarn_factor > 1:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(spec.yarn_orig_ctx)
        w.add_rope_scaling_yarn_beta_fast(spec.yarn_beta_fast)
        w.add_rope_scaling_yarn_beta_slow(1.0)
    _rope_norm_expert_keys(w, spec)
    w.add_expert_shared_count(spec.n_shared)
    w.add_expert_weights_scale(spec.weights_scale)
    w.add_expert_weights_norm(True)
    put(Keys.LLM.EXPERT_GATING_FUNC, SQRT_SOFTPLUS, w.add_uint32)
    put(Keys.LLM.SWIGLU_CLAMP_EXP, [float(spec.swiglu_limit)] * n, w.add_array)
    put(Keys.LLM.SWIGLU_CLAMP_SHEXP, [float(spec.swiglu_limit)] * n, w.add_array)
    put(NewerKeys.HC_COUNT, spec.hc_mult, w.add_uint32)
    put(NewerKeys.HC_SINKHORN_ITERATIONS, spec.hc_iters, w.add_uint32)
    put(NewerKeys.HC_EPSILON, 1e-6, w.add_float32)
    put(NewerKeys.HASH_LAYER_COUNT, spec.n_hash, w.add_uint32)
    w.add_nextn_predict_layers(1 if spec.nextn else 0)


def _gqa_attention(spec: TinySpec, *, bias: bool, qk_norm: bool) -> list[TinyTensor]:
    d, hd = spec.n_embd, spec.head_dim
    q, kv = spec.n_head * hd, spec.n_head_kv * hd
    out = [lin("attn_q", q, d), lin("attn_k", kv, d), lin("attn_v", kv, d)]
    if bias:
        out += [f32("attn_q.bias", (q,), 0.1), f32("attn_k.bias", (kv,), 0.1), f32("attn_v.bias", (kv,), 0.1)]
    if qk_norm:
        out += [norm("attn_q_norm", hd), norm("attn_k_norm", hd)]
    return out + [lin("attn_output", d, q)]


def _mla_attention(spec: TinySpec) -> list[TinyTensor]:
    """MLA in llama.cpp's layout: ``attn_k_b`` is kv_b_proj's k half per head transposed to
    (H, kv_lora, nope), ``attn_v_b`` its v half (H, v, kv_lora); or the older ``attn_kv_b``."""
    d, h, r = spec.n_embd, spec.n_head, spec.kv_lora_rank
    head_k = spec.qk_nope + spec.n_rot
    if spec.q_lora_rank:
        out = [lin("attn_q_a", spec.q_lora_rank, d), norm("attn_q_a_norm", spec.q_lora_rank),
               lin("attn_q_b", h * head_k, spec.q_lora_rank)]
    else:
        out = [lin("attn_q", h * head_k, d)]
    out += [lin("attn_kv_a_mqa", r + spec.n_rot, d), norm("attn_kv_a_norm", r)]
    if spec.mla:
        out += [TinyTensor("attn_k_b.weight", (h, r, spec.qk_nope), "dense", r ** -0.5),
                TinyTensor("attn_v_b.weight", (h, spec.v_head_dim, r), "dense", r ** -0.5)]
    else:
        out.append(lin("attn_kv_b", h * (spec.qk_nope + spec.v_head_dim), r))
    return out + [lin("attn_output", d, h * spec.v_head_dim)]


def _router(spec: TinySpec) -> TinyTensor:
    return f32("ffn_gate_inp.weight", (spec.n_expert, spec.n_embd), spec.n_embd ** -0.5)


def _experts(spec: TinySpec, gate_up_std: float) -> list[TinyTensor]:
    e, f, d = spec.n_expert, spec.n_ff_exp, spec.n_embd
    return [TinyTensor("ffn_gate_exps.weight", (e, f, d), "experts", gate_up_std),
            TinyTensor("ffn_up_exps.weight", (e, f, d), "experts", gate_up_std),
            TinyTensor("ffn_down_exps.weight", (e, d, f), "experts", f ** -0.5)]


def _leading_dense_ffn(spec: TinySpec, i: int) -> list[TinyTensor]:
    """glm4moe's and deepseek2's FFN: ``n_dense`` leading dense blocks, then the router
    (``exp_probs_b`` with sigmoid gating), routed and shared experts; block ``n_layer`` (the
    NextN block, where written) adds its glue (embedding and head are the trunk's)."""
    d = spec.n_embd
    if i < spec.n_dense:
        return [lin("ffn_gate", spec.n_ff, d), lin("ffn_up", spec.n_ff, d), lin("ffn_down", d, spec.n_ff)]
    out = [_router(spec)]
    if spec.gating == "sigmoid":
        out.append(f32("exp_probs_b.bias", (spec.n_expert,), 0.1))
    fs = spec.n_ff_exp * spec.n_shared
    out += [*_experts(spec, d ** -0.5), lin("ffn_gate_shexp", fs, d), lin("ffn_up_shexp", fs, d),
            lin("ffn_down_shexp", d, fs)]
    if i == spec.n_layer:
        if spec.nextn_echo:     # eh_proj = [echo·I, 0]: the head passes token t+1 on
            eh = np.concatenate((spec.nextn_echo * np.eye(d), np.zeros((d, d))), 1).astype(np.float32)
            out.append(TinyTensor("nextn.eh_proj.weight", eh.shape, "f32", 0.0, value=eh))
        else:
            out.append(lin("nextn.eh_proj", d, 2 * d))
        out += [norm("nextn.enorm", d), norm("nextn.hnorm", d), norm("nextn.shared_head_norm", d)]
    return out


def glm4moe_block(spec: TinySpec, i: int) -> list[TinyTensor]:
    d = spec.n_embd
    return [norm("attn_norm", d), *_gqa_attention(spec, bias=True, qk_norm=spec.qk_norm),
            norm("post_attention_norm", d), *_leading_dense_ffn(spec, i)]


def qwen3moe_block(spec: TinySpec, i: int) -> list[TinyTensor]:
    d = spec.n_embd
    return [norm("attn_norm", d), *_gqa_attention(spec, bias=False, qk_norm=True), norm("ffn_norm", d),
            _router(spec), *_experts(spec, d ** -0.5)]


def deepseek2_block(spec: TinySpec, i: int) -> list[TinyTensor]:
    d = spec.n_embd
    return [norm("attn_norm", d), *_mla_attention(spec), norm("ffn_norm", d), *_leading_dense_ffn(spec, i)]


def gpt_oss_block(spec: TinySpec, i: int) -> list[TinyTensor]:
    """Biased q/k/v/o, ``attn_sinks``, ``post_attention_norm``, a biased router and separate
    biased gate/up/down experts. Biases and sinks are large enough to matter (std 0.5–1)."""
    d, hd, e, f = spec.n_embd, spec.head_dim, spec.n_expert, spec.n_ff_exp
    out = [norm("attn_norm", d)]
    for name, rows in (("attn_q", spec.n_head * hd), ("attn_k", spec.n_head_kv * hd), ("attn_v", spec.n_head_kv * hd)):
        out += [lin(name, rows, d), f32(f"{name}.bias", (rows,), 0.5)]
    return out + [
        lin("attn_output", d, spec.n_head * hd), f32("attn_output.bias", (d,), 0.1),
        f32("attn_sinks.weight", (spec.n_head,), 1.0), norm("post_attention_norm", d),
        _router(spec), f32("ffn_gate_inp.bias", (e,), 0.5),
        *_experts(spec, 2 * d ** -0.5),      # std 2/√d: gate and up reach the ±7 clamp now and then
        f32("ffn_gate_exps.bias", (e, f), 1.0), f32("ffn_up_exps.bias", (e, f), 1.0),
        f32("ffn_down_exps.bias", (e, d), 0.1)]


def deepseek4_block(spec: TinySpec, i: int) -> list[TinyTensor]:
    """llama.cpp's deepseek4 block: mHC mixing around each sublayer (``hc_{attn,ffn}_*``),
    q LoRA, one K=V head, sinks, the grouped output projection (``attn_output_a`` stays 2-D),
    the compressors of CSA/HCA blocks and CSA's indexer, then the router (``ffn_gate_tid2eid``
    I32 on hash blocks, ``exp_probs_b`` on the others), routed and shared experts."""
    d, h, hd, ql = spec.n_embd, spec.n_head, spec.head_dim, spec.q_lora_rank
    nhc, r = spec.hc_mult, spec.compress_ratios[i] if i < spec.n_layer else 0
    mix = (2 + nhc) * nhc
    hc = []
    for part in ("attn", "ffn"):       # fn small enough that the sigmoids and softmax stay soft
        hc += [f32(f"hc_{part}_fn.weight", (mix, nhc * d), (nhc * d) ** -0.5),
               f32(f"hc_{part}_base.weight", (mix,), 0.5), f32(f"hc_{part}_scale.weight", (3,), 0.5)]
    out = [norm("attn_norm", d), f32("attn_sinks.weight", (h,), 1.0), lin("attn_q_a", ql, d),
           norm("attn_q_a_norm", ql), lin("attn_q_b", h * hd, ql), lin("attn_kv", hd, d),
           norm("attn_kv_a_norm", hd),
           lin("attn_output_a", spec.o_groups * spec.o_lora_rank, h * hd // spec.o_groups),
           lin("attn_output_b", d, spec.o_groups * spec.o_lora_rank), *hc[:3]]
    if r:
        coff = 2 if r == 4 else 1
        out += [lin("attn_compressor_kv", coff * hd, d), lin("attn_compressor_gate", coff * hd, d),
                f32("attn_compressor_ape.weight", (r, coff * hd), 1.0), norm("attn_compressor_norm", hd)]
    if r == 4:
        ih, ihd = spec.indexer_n_head, spec.indexer_head_dim
        out += [lin("indexer.proj", ih, d), lin("indexer.attn_q_b", ih * ihd, ql),
                lin("indexer_compressor_kv", 2 * ihd, d), lin("indexer_compressor_gate", 2 * ihd, d),
                f32("indexer_compressor_ape.weight", (4, 2 * ihd), 1.0), norm("indexer_compressor_norm", ihd)]
    out += [*hc[3:], norm("ffn_norm", d), _router(spec)]
    if i < spec.n_hash:
        draw = np.random.default_rng(spec.seed + 1000 + i).random((spec.n_vocab, spec.n_expert))
        table = np.argsort(draw, axis=1)[:, :spec.n_expert_used].astype(np.int32)   # k distinct experts
        out.append(TinyTensor("ffn_gate_tid2eid.weight", table.shape, "f32", 0.0, value=table))
    else:
        out.append(f32("exp_probs_b.bias", (spec.n_expert,), 0.1))
    fs = spec.n_ff_exp * spec.n_shared
    out += [*_experts(spec, 2 * d ** -0.5),       # std 2/√d: gate and up reach the clamp now and then
            lin("ffn_gate_shexp", fs, d), lin("ffn_up_shexp", fs, d), lin("ffn_down_shexp", d, fs)]
    if i == spec.n_layer:      # the MTP head's glue, with its own hc head (the bundled layout)
        out += [lin("nextn.eh_proj", d, 2 * d), norm("nextn.enorm", d), norm("nextn.hnorm", d),
                norm("nextn.shared_head_norm", d),
                *(replace(t, name=f"nextn.hc_head_{t.name.removeprefix('output_hc_')}")
                  for t in deepseek4_head(spec))]
    return out


def deepseek4_head(spec: TinySpec) -> list[TinyTensor]:
    """The hc head that collapses the streams before ``output_norm``."""
    nhc = spec.hc_mult
    return [f32("output_hc_fn.weight", (nhc, nhc * spec.n_embd), (nhc * spec.n_embd) ** -0.5),
            f32("output_hc_base.weight", (nhc,), 0.5), f32("output_hc_scale.weight", (1,), 0.5)]


ARCHS = {
    "glm4moe": TinyArch(glm4moe_metadata, glm4moe_block, nextn=True),
    "qwen3moe": TinyArch(qwen3moe_metadata, qwen3moe_block),
    "deepseek2": TinyArch(deepseek2_metadata, deepseek2_block, nextn=True),
    "gpt-oss": TinyArch(gpt_oss_metadata, gpt_oss_block),
    "deepseek4": TinyArch(deepseek4_metadata, deepseek4_block, nextn=True, head=deepseek4_head),
}


def n_blocks(spec: TinySpec) -> int:
    """Trunk blocks plus the NextN block where the architecture has one and ``spec.nextn``."""
    return spec.n_layer + (1 if ARCHS[spec.arch].nextn and spec.nextn else 0)


def tiny_tensors(spec: TinySpec) -> list[TinyTensor]:
    """Every tensor of ``spec``'s model with its full GGUF name, in file (and draw) order."""
    if spec.arch not in ARCHS:
        raise ValueError(f"no tiny writer for architecture {spec.arch!r} (known: {', '.join(ARCHS)})")
    arch, d = ARCHS[spec.arch], spec.n_embd
    out = [TinyTensor("token_embd.weight", (spec.n_vocab, d), "embd", spec.embd_std)]
    for i in range(n_blocks(spec)):
        out += [replace(t, name=f"blk.{i}.{t.name}") for t in arch.block(spec, i)]
    if arch.head is not None:
        out += arch.head(spec)
    out.append(norm("output_norm", d))
    if not spec.tied_output:
        out.append(lin("output", spec.n_vocab, d))
    return out


def write_tiny_model(path: str | Path, spec: TinySpec = TinySpec(), *, keep_weights: bool = True) -> TinyModel:
    """``keep_weights=False``: skip the float copies (``weights`` stays empty) and the
    dequantization that makes them, the slow part of writing a wide benchmark model."""
    path = Path(path)
    tensors = tiny_tensors(spec)
    rng = np.random.default_rng(spec.seed)
    w = GGUFWriter(str(path), spec.arch)
    write_tiny_keys(w, spec)
    weights = _write_tensors(w, tensors, spec, rng, keep_weights=keep_weights)
    return TinyModel(path, spec, weights)


def write_tiny_keys(w: GGUFWriter, spec: TinySpec) -> int:
    """Every metadata key of ``spec``'s model (the common ones, the architecture's, the
    vocabulary) → the vocabulary size. (bench.depth writes its deepseek4 model's keys so.)"""
    w.add_block_count(n_blocks(spec))
    w.add_context_length(4096)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    ARCHS[spec.arch].metadata(w, spec)
    return add_tiny_vocab(w, spec.extra_merges, spec.tokenizer_pre)


def _write_tensors(w: GGUFWriter, tensors: list[TinyTensor], spec: TinySpec, rng: np.random.Generator, *,
                   keep_weights: bool) -> dict[str, np.ndarray]:
    """Add ``tensors`` (random unless a value is given) to ``w``, write the file and close it;
    the weights as float32 (dequantized) when ``keep_weights``."""
    weights = {}
    for t in tensors:
        if t.value is not None:
            w.add_tensor(t.name, t.value)
            weights[t.name] = t.value
            continue
        as_f32 = spec.experts_as_f32 and t.name.endswith("_exps.weight")
        data, raw_dtype, deq = random_tensor(rng, t.shape, t.qtype(spec), t.std,
                                             dequantized=keep_weights or as_f32)
        if as_f32:
            data, raw_dtype = deq, None
        if t.mean:
            data = data + np.float32(t.mean)
            deq = data
        w.add_tensor(t.name, data, raw_dtype=raw_dtype)
        if keep_weights:
            weights[t.name] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


DSPARK_RANK = 16            # the Markov head's rank (256 in V4-Flash-0731's)


def dspark_spec(trunk: TinySpec, n_stages: int = 3) -> TinySpec:
    """The spec of a DSpark drafter for ``trunk``: ``n_stages`` window-only, non-hash V4 blocks
    of the trunk's shapes, under arch ``dflash``."""
    return replace(trunk, arch="dflash", n_layer=n_stages, compress_ratios=(0,) * n_stages, n_hash=0,
                   nextn=False, meta_overrides=(), seed=trunk.seed + 7)


def write_tiny_dspark(path: str | Path, trunk: TinySpec, *, target_layers: tuple[int, ...] = (),
                      block_size: int | None = 5, n_stages: int = 3, conf_bias: float | None = 2.0,
                      markov_std: float = 0.1, markov: tuple[np.ndarray, np.ndarray] | None = None,
                      mask_id: int | None = -1, sample_from_anchor: bool | None = None,
                      meta_overrides: tuple[tuple[str, object], ...] = ()) -> TinyModel:
    """A DSpark drafter (arch ``dflash``) for the tiny deepseek4 ``trunk``, keys and tensors as
    llama.cpp's converter writes them (deepseek4.md §2.11): the V4 keys under ``dflash.*``,
    ``dflash.block_size``, ``dflash.target_layers`` (block inputs of the trunk; default its last
    three), ``tokenizer.ggml.mask_token_id`` (the vocabulary's last token), ``fc`` over the
    taps, ``enc.output_norm``, stages ``blk.{0..}.*`` (window-only, routed by score + bias),
    the hc head ``output_hc_*``, ``output_norm``, ``markov_w1``/``markov_w2`` (numpy (V, rank):
    ggml ne {rank, V}), ``conf_proj`` (1, d + rank) and its bias (``conf_bias`` None: no bias);
    no ``token_embd``/``output`` (the trunk's are used). ``markov``: (W1, W2) written as given
    (a test's predictive construction; any rank). Bad-input files: ``block_size`` / ``mask_id``
    None omit the key (``mask_id`` -1: the last token), ``sample_from_anchor`` None omits
    ``dflash.sample_from_anchor`` (llama.cpp then takes true), ``meta_overrides`` as TinySpec's
    for the V4 keys."""
    path = Path(path)
    spec = replace(dspark_spec(trunk, n_stages), meta_overrides=meta_overrides)
    taps = tuple(target_layers) or tuple(range(max(1, trunk.n_layer - 2), trunk.n_layer + 1))
    d, v = spec.n_embd, spec.n_vocab
    tensors = [lin("fc", d, len(taps) * d), norm("enc.output_norm", d)]
    for i in range(n_stages):
        tensors += [replace(t, name=f"blk.{i}.{t.name}") for t in deepseek4_block(spec, i)]
    if markov is None:
        rank = DSPARK_RANK
        heads = [f32("markov_w1.weight", (v, rank), markov_std), f32("markov_w2.weight", (v, rank), markov_std)]
    else:
        rank = markov[0].shape[1]
        heads = [TinyTensor(f"markov_w{k + 1}.weight", m.shape, "f32", 0.0, value=m.astype(np.float32))
                 for k, m in enumerate(markov)]
    tensors += [*deepseek4_head(spec), norm("output_norm", d), *heads,
                f32("conf_proj.weight", (1, d + rank), (d + rank) ** -0.5)]
    if conf_bias is not None:
        tensors.append(TinyTensor("conf_proj.bias", (1,), "f32", 0.0,
                                  value=np.array([conf_bias], dtype=np.float32)))
    rng = np.random.default_rng(spec.seed)
    w = GGUFWriter(str(path), "dflash")
    w.add_block_count(n_stages)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    deepseek4_metadata(w, spec)
    if block_size is not None:
        w.add_uint32("dflash.block_size", block_size)
    if sample_from_anchor is not None:
        w.add_bool("dflash.sample_from_anchor", sample_from_anchor)
    w.add_array("dflash.target_layers", [int(t) for t in taps])
    add_tiny_vocab(w, spec.extra_merges, spec.tokenizer_pre)
    if mask_id is not None:
        w.add_uint32("tokenizer.ggml.mask_token_id", v - 1 if mask_id == -1 else mask_id)
    return TinyModel(path, spec, _write_tensors(w, tensors, spec, rng, keep_weights=True))
