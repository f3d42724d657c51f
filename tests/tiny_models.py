"""Tiny random glm4moe / qwen3moe / deepseek2 / gpt-oss GGUFs written with ``gguf.GGUFWriter``, exactly as
llama.cpp names and lays them out, with routed experts in a chosen quant type.

``write_tiny_model`` returns the file path and the dequantized float32 weights by GGUF
name (``gguf.quants.dequantize`` of what was written), which the reference models load.
K-quant blocks (which gguf-py cannot quantize) are random bytes with sane fp16 scales:
whatever they dequantize to *is* the weight.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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

    @property
    def n_vocab(self) -> int:
        return len(tiny_vocab(self.extra_merges)[0])


@dataclass
class TinyModel:
    path: Path
    spec: TinySpec
    weights: dict[str, np.ndarray] = field(repr=False)   # dequantized float32, numpy order


def write_tiny_model(path: str | Path, spec: TinySpec = TinySpec(), *, keep_weights: bool = True) -> TinyModel:
    """``keep_weights=False``: skip the float copies (``weights`` stays empty) and the
    dequantization that makes them, the slow part of writing a wide benchmark model."""
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    glm, ds, oss = spec.arch == "glm4moe", spec.arch == "deepseek2", spec.arch == "gpt-oss"
    lead = glm or ds              # leading dense blocks, shared experts, NextN
    arch = spec.arch
    w = GGUFWriter(str(path), arch)
    n_blocks = spec.n_layer + (1 if lead and spec.nextn else 0)
    w.add_block_count(n_blocks)
    w.add_context_length(4096)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    if ds:
        write_mla_metadata(w, spec)
    else:
        w.add_head_count_kv(spec.n_head_kv)
        w.add_key_length(spec.head_dim)
        w.add_value_length(spec.head_dim)
        if not oss:           # gpt-oss files carry no rope dimension count (the whole head)
            w.add_rope_dimension_count(spec.n_rot if glm else spec.head_dim)
    if oss:
        write_gpt_oss_metadata(w, spec)
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    if not oss:
        w.add_expert_weights_norm(spec.weights_norm)
    if lead:
        w.add_leading_dense_block_count(spec.n_dense)
        w.add_expert_shared_count(spec.n_shared)
        w.add_expert_weights_scale(spec.weights_scale)
        w.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX if spec.gating == "softmax"
                                 else ExpertGatingFuncType.SIGMOID)
        w.add_nextn_predict_layers(1 if spec.nextn else 0)
    add_tiny_vocab(w, spec.extra_merges, spec.tokenizer_pre)

    weights = {}

    def put(name, shape, qtype, std, mean=0.0):
        as_f32 = spec.experts_as_f32 and name.endswith("_exps.weight")
        data, raw_dtype, deq = random_tensor(rng, shape, qtype, std, dequantized=keep_weights or as_f32)
        if as_f32:
            data, raw_dtype = deq, None
        if mean:
            data = data + np.float32(mean)
            deq = data
        w.add_tensor(name, data, raw_dtype=raw_dtype)
        if keep_weights:
            weights[name] = deq

    d, hd = spec.n_embd, spec.head_dim
    lin = lambda name, out, inp, qt=spec.dense_type: put(name, (out, inp), qt, inp ** -0.5)  # noqa: E731
    norm = lambda name, n: put(name, (n,), Q.F32, 0.1, mean=1.0)  # noqa: E731

    put("token_embd.weight", (spec.n_vocab, d), spec.embd_type, spec.embd_std)
    for i in range(n_blocks):
        p = f"blk.{i}"
        norm(f"{p}.attn_norm.weight", d)
        if ds:
            write_mla_block(spec, p, put, lin, norm)
        elif oss:
            write_gpt_oss_block(spec, p, put, lin, norm)
            continue
        else:
            lin(f"{p}.attn_q.weight", spec.n_head * hd, d)
            lin(f"{p}.attn_k.weight", spec.n_head_kv * hd, d)
            lin(f"{p}.attn_v.weight", spec.n_head_kv * hd, d)
        if glm:
            put(f"{p}.attn_q.bias", (spec.n_head * hd,), Q.F32, 0.1)
            put(f"{p}.attn_k.bias", (spec.n_head_kv * hd,), Q.F32, 0.1)
            put(f"{p}.attn_v.bias", (spec.n_head_kv * hd,), Q.F32, 0.1)
        if not (glm or ds) or glm and spec.qk_norm:
            norm(f"{p}.attn_q_norm.weight", hd)
            norm(f"{p}.attn_k_norm.weight", hd)
        if not ds:
            lin(f"{p}.attn_output.weight", d, spec.n_head * hd)
        norm(f"{p}.{'post_attention_norm' if glm else 'ffn_norm'}.weight", d)
        if lead and i < spec.n_dense:
            lin(f"{p}.ffn_gate.weight", spec.n_ff, d)
            lin(f"{p}.ffn_up.weight", spec.n_ff, d)
            lin(f"{p}.ffn_down.weight", d, spec.n_ff)
            continue
        put(f"{p}.ffn_gate_inp.weight", (spec.n_expert, d), Q.F32, d ** -0.5)
        if lead and spec.gating == "sigmoid":
            put(f"{p}.exp_probs_b.bias", (spec.n_expert,), Q.F32, 0.1)
        e, f = spec.n_expert, spec.n_ff_exp
        put(f"{p}.ffn_gate_exps.weight", (e, f, d), spec.expert_type, d ** -0.5)
        put(f"{p}.ffn_up_exps.weight", (e, f, d), spec.expert_type, d ** -0.5)
        put(f"{p}.ffn_down_exps.weight", (e, d, f), spec.expert_type, f ** -0.5)
        if lead:
            fs = spec.n_ff_exp * spec.n_shared
            lin(f"{p}.ffn_gate_shexp.weight", fs, d)
            lin(f"{p}.ffn_up_shexp.weight", fs, d)
            lin(f"{p}.ffn_down_shexp.weight", d, fs)
        if lead and i == spec.n_layer:   # the NextN block's glue (embedding/head shared)
            if spec.nextn_echo:
                eh = np.concatenate((spec.nextn_echo * np.eye(d), np.zeros((d, d))), 1).astype(np.float32)
                w.add_tensor(f"{p}.nextn.eh_proj.weight", eh)
                weights[f"{p}.nextn.eh_proj.weight"] = eh
            else:
                lin(f"{p}.nextn.eh_proj.weight", d, 2 * d)
            norm(f"{p}.nextn.enorm.weight", d)
            norm(f"{p}.nextn.hnorm.weight", d)
            norm(f"{p}.nextn.shared_head_norm.weight", d)
    norm("output_norm.weight", d)
    if not spec.tied_output:
        lin("output.weight", spec.n_vocab, d)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return TinyModel(path, spec, weights)


def write_mla_metadata(w: GGUFWriter, spec: TinySpec) -> None:
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


def write_mla_block(spec: TinySpec, p: str, put, lin, norm) -> None:
    """One block's MLA tensors in llama.cpp's layout: ``attn_k_b`` is kv_b_proj's k half per
    head transposed to (H, kv_lora, nope), ``attn_v_b`` its v half (H, v, kv_lora)."""
    d, h, r = spec.n_embd, spec.n_head, spec.kv_lora_rank
    head_k = spec.qk_nope + spec.n_rot
    if spec.q_lora_rank:
        lin(f"{p}.attn_q_a.weight", spec.q_lora_rank, d)
        norm(f"{p}.attn_q_a_norm.weight", spec.q_lora_rank)
        lin(f"{p}.attn_q_b.weight", h * head_k, spec.q_lora_rank)
    else:
        lin(f"{p}.attn_q.weight", h * head_k, d)
    lin(f"{p}.attn_kv_a_mqa.weight", r + spec.n_rot, d)
    norm(f"{p}.attn_kv_a_norm.weight", r)
    if spec.mla:
        put(f"{p}.attn_k_b.weight", (h, r, spec.qk_nope), spec.dense_type, r ** -0.5)
        put(f"{p}.attn_v_b.weight", (h, spec.v_head_dim, r), spec.dense_type, r ** -0.5)
    else:
        lin(f"{p}.attn_kv_b.weight", h * (spec.qk_nope + spec.v_head_dim), r)
    lin(f"{p}.attn_output.weight", d, h * spec.v_head_dim)


def write_gpt_oss_metadata(w: GGUFWriter, spec: TinySpec) -> None:
    """gpt-oss's keys beyond the common ones: the sliding window (the even blocks use it,
    llama.cpp's fixed pattern) and YaRN."""
    w.add_sliding_window(spec.window)
    if spec.yarn_factor > 1:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(spec.yarn_factor)
        w.add_rope_scaling_orig_ctx_len(spec.yarn_orig_ctx)


def write_gpt_oss_block(spec: TinySpec, p: str, put, lin, norm) -> None:
    """One gpt-oss block in llama.cpp's layout (attn_norm written by the caller): biased
    q/k/v/o, ``attn_sinks``, ``post_attention_norm``, a biased router and separate biased
    gate/up/down experts. Biases and sinks are large enough to matter (std 0.5–1)."""
    d, hd, e, f = spec.n_embd, spec.head_dim, spec.n_expert, spec.n_ff_exp
    for name, rows in (("attn_q", spec.n_head * hd), ("attn_k", spec.n_head_kv * hd), ("attn_v", spec.n_head_kv * hd)):
        lin(f"{p}.{name}.weight", rows, d)
        put(f"{p}.{name}.bias", (rows,), Q.F32, 0.5)
    lin(f"{p}.attn_output.weight", d, spec.n_head * hd)
    put(f"{p}.attn_output.bias", (d,), Q.F32, 0.1)
    put(f"{p}.attn_sinks.weight", (spec.n_head,), Q.F32, 1.0)
    norm(f"{p}.post_attention_norm.weight", d)
    put(f"{p}.ffn_gate_inp.weight", (e, d), Q.F32, d ** -0.5)
    put(f"{p}.ffn_gate_inp.bias", (e,), Q.F32, 0.5)
    # std 2/√d: gate and up reach the ±7 clamp now and then
    put(f"{p}.ffn_gate_exps.weight", (e, f, d), spec.expert_type, 2 * d ** -0.5)
    put(f"{p}.ffn_up_exps.weight", (e, f, d), spec.expert_type, 2 * d ** -0.5)
    put(f"{p}.ffn_down_exps.weight", (e, d, f), spec.expert_type, f ** -0.5)
    put(f"{p}.ffn_gate_exps.bias", (e, f), Q.F32, 1.0)
    put(f"{p}.ffn_up_exps.bias", (e, f), Q.F32, 1.0)
    put(f"{p}.ffn_down_exps.bias", (e, d), Q.F32, 0.1)
