"""Tiny random glm4moe / qwen3moe GGUFs written with ``gguf.GGUFWriter``, exactly as
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
from gguf import GGML_QUANT_SIZES, ExpertGatingFuncType, GGMLQuantizationType as Q, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

# byte offsets of the fp16 scale fields in one block of each type, and a divisor that keeps
# the dequantized values near the wanted std (block layouts as ggml's block_q4_0 … block_q6_K)
_F16_FIELDS = {
    Q.Q4_0: ((0,), 8.0), Q.Q4_1: ((0, 2), 8.0), Q.Q5_0: ((0,), 16.0), Q.Q5_1: ((0, 2), 16.0),
    Q.Q8_0: ((0,), 64.0), Q.IQ4_NL: ((0,), 64.0), Q.IQ4_XS: ((0,), 1024.0),
    Q.Q2_K: ((80, 82), 20.0), Q.Q3_K: ((108,), 64.0), Q.Q4_K: ((0, 2), 256.0),
    Q.Q5_K: ((0, 2), 512.0), Q.Q6_K: ((208,), 1024.0),
    Q.IQ2_XXS: ((0,), 4.0),      # no CPU kernel: for the tests that such a file is refused
}


def random_blocks(rng: np.random.Generator, n_blocks: int, qtype: Q, std: float) -> np.ndarray:
    """Random raw blocks ``(n_blocks, type_size)`` uint8 with finite, sane scales: whatever
    they dequantize to is the weight. Covers types gguf-py cannot quantize (K, IQ4)."""
    _, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    if qtype == Q.MXFP4:       # E8M0 block exponent: 2^(e-128) near std/6
        raw[:, 0] = np.clip(np.round(np.log2(std / 6) + 128 + rng.integers(-1, 2, n_blocks)), 1, 254)
        return raw
    offsets, div = _F16_FIELDS[qtype]
    for off in offsets:
        d = (std / div * rng.uniform(0.5, 1.5, n_blocks)).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return raw


def random_tensor(rng: np.random.Generator, shape: tuple[int, ...], qtype: Q, std: float):
    """→ (data to write, raw dtype or None, dequantized float32 values). ``shape`` numpy order.
    Legacy types are quantized from normal values by gguf-py; the others are random blocks."""
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
    return raw, qtype, dequantize(raw, qtype).astype(np.float32)


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


def tiny_vocab() -> tuple[list[str], list[str], list[int]]:
    """Byte-level BPE vocabulary: 256 byte tokens, merges building a few words, one control
    token. Returns (tokens, merges "a b", token types)."""
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
    types = [TokenType.NORMAL] * len(tokens)
    tokens.append("<|endoftext|>")
    types.append(TokenType.CONTROL)
    return tokens, merges, [int(t) for t in types]


def add_tiny_vocab(w: GGUFWriter) -> int:
    """Write ``tiny_vocab`` as a GPT-2 style BPE tokenizer (BOS = EOS = its control token);
    returns the vocabulary size."""
    tokens, merges, types = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
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

    @property
    def n_vocab(self) -> int:
        return len(tiny_vocab()[0])


@dataclass
class TinyModel:
    path: Path
    spec: TinySpec
    weights: dict[str, np.ndarray] = field(repr=False)   # dequantized float32, numpy order


def write_tiny_model(path: str | Path, spec: TinySpec = TinySpec()) -> TinyModel:
    path = Path(path)
    rng = np.random.default_rng(spec.seed)
    glm = spec.arch == "glm4moe"
    arch = spec.arch
    w = GGUFWriter(str(path), arch)
    n_blocks = spec.n_layer + (1 if glm and spec.nextn else 0)
    w.add_block_count(n_blocks)
    w.add_context_length(4096)
    w.add_embedding_length(spec.n_embd)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_key_length(spec.head_dim)
    w.add_value_length(spec.head_dim)
    w.add_rope_dimension_count(spec.n_rot if glm else spec.head_dim)
    w.add_rope_freq_base(spec.rope_base)
    w.add_layer_norm_rms_eps(spec.rms_eps)
    w.add_expert_count(spec.n_expert)
    w.add_expert_used_count(spec.n_expert_used)
    w.add_expert_feed_forward_length(spec.n_ff_exp)
    w.add_expert_weights_norm(spec.weights_norm)
    if glm:
        w.add_leading_dense_block_count(spec.n_dense)
        w.add_expert_shared_count(spec.n_shared)
        w.add_expert_weights_scale(spec.weights_scale)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_nextn_predict_layers(1 if spec.nextn else 0)
    add_tiny_vocab(w)

    weights = {}

    def put(name, shape, qtype, std, mean=0.0):
        data, raw_dtype, deq = random_tensor(rng, shape, qtype, std)
        if mean:
            data = data + np.float32(mean)
            deq = data
        w.add_tensor(name, data, raw_dtype=raw_dtype)
        weights[name] = deq

    d, hd = spec.n_embd, spec.head_dim
    lin = lambda name, out, inp, qt=spec.dense_type: put(name, (out, inp), qt, inp ** -0.5)  # noqa: E731
    norm = lambda name, n: put(name, (n,), Q.F32, 0.1, mean=1.0)  # noqa: E731

    put("token_embd.weight", (spec.n_vocab, d), spec.embd_type, 1.0)
    for i in range(n_blocks):
        p = f"blk.{i}"
        norm(f"{p}.attn_norm.weight", d)
        lin(f"{p}.attn_q.weight", spec.n_head * hd, d)
        lin(f"{p}.attn_k.weight", spec.n_head_kv * hd, d)
        lin(f"{p}.attn_v.weight", spec.n_head_kv * hd, d)
        if glm:
            put(f"{p}.attn_q.bias", (spec.n_head * hd,), Q.F32, 0.1)
            put(f"{p}.attn_k.bias", (spec.n_head_kv * hd,), Q.F32, 0.1)
            put(f"{p}.attn_v.bias", (spec.n_head_kv * hd,), Q.F32, 0.1)
        if not glm or spec.qk_norm:
            norm(f"{p}.attn_q_norm.weight", hd)
            norm(f"{p}.attn_k_norm.weight", hd)
        lin(f"{p}.attn_output.weight", d, spec.n_head * hd)
        norm(f"{p}.{'post_attention_norm' if glm else 'ffn_norm'}.weight", d)
        if glm and i < spec.n_dense:
            lin(f"{p}.ffn_gate.weight", spec.n_ff, d)
            lin(f"{p}.ffn_up.weight", spec.n_ff, d)
            lin(f"{p}.ffn_down.weight", d, spec.n_ff)
            continue
        put(f"{p}.ffn_gate_inp.weight", (spec.n_expert, d), Q.F32, d ** -0.5)
        if glm:
            put(f"{p}.exp_probs_b.bias", (spec.n_expert,), Q.F32, 0.1)
        e, f = spec.n_expert, spec.n_ff_exp
        put(f"{p}.ffn_gate_exps.weight", (e, f, d), spec.expert_type, d ** -0.5)
        put(f"{p}.ffn_up_exps.weight", (e, f, d), spec.expert_type, d ** -0.5)
        put(f"{p}.ffn_down_exps.weight", (e, d, f), spec.expert_type, f ** -0.5)
        if glm:
            fs = spec.n_ff_exp * spec.n_shared
            lin(f"{p}.ffn_gate_shexp.weight", fs, d)
            lin(f"{p}.ffn_up_shexp.weight", fs, d)
            lin(f"{p}.ffn_down_shexp.weight", d, fs)
        if glm and i == spec.n_layer:   # the NextN block's glue (embedding/head shared)
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
