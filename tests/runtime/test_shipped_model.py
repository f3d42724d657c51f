"""The shipped model file is a glm4moe GGUF exactly as llama.cpp expects it.

Cheap checks only (header, tensor table, tokenizer; no forward pass): the expected tensor
list and shapes are derived here from the file's own metadata with llama.cpp's glm4moe
loader rules (src/models/glm4-moe.cpp: create_tensor dims, reversed to numpy order), not
from the exporter, so a naming or transposition slip in the exporter fails here.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import (GGMLQuantizationType, GGUFReader, Keys, MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES,
                  ExpertGatingFuncType, TokenType)
from gguf.quants import dequantize

MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
ARCH = "glm4moe"
F32, F16 = GGMLQuantizationType.F32, GGMLQuantizationType.F16
EXPERT_TYPES = {GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0}


@pytest.fixture(scope="module")
def reader() -> GGUFReader:
    assert MODEL.is_file(), f"{MODEL} is missing (it is committed with the project)"
    return GGUFReader(MODEL)


def kv(reader: GGUFReader, template: str):
    key = template.format(arch=ARCH)
    assert key in reader.fields, f"missing key {key}"
    return reader.fields[key].contents()


@pytest.fixture(scope="module")
def hp(reader):
    L, A = Keys.LLM, Keys.Attention
    n_embd, n_head = kv(reader, L.EMBEDDING_LENGTH), kv(reader, A.HEAD_COUNT)
    return {
        "n_embd": n_embd, "n_head": n_head, "n_head_kv": kv(reader, A.HEAD_COUNT_KV),
        "head_dim": kv(reader, A.KEY_LENGTH), "v_dim": kv(reader, A.VALUE_LENGTH),
        "n_blocks": kv(reader, L.BLOCK_COUNT), "n_nextn": kv(reader, L.NEXTN_PREDICT_LAYERS),
        "n_lead": kv(reader, L.LEADING_DENSE_BLOCK_COUNT), "n_ff": kv(reader, L.FEED_FORWARD_LENGTH),
        "n_expert": kv(reader, L.EXPERT_COUNT), "n_used": kv(reader, L.EXPERT_USED_COUNT),
        "n_ff_exp": kv(reader, L.EXPERT_FEED_FORWARD_LENGTH), "n_shared": kv(reader, L.EXPERT_SHARED_COUNT),
        "n_rot": kv(reader, Keys.Rope.DIMENSION_COUNT),
        "n_vocab": len(reader.fields[Keys.Tokenizer.LIST].data),
    }


def expected_tensors(hp) -> dict[str, tuple[int, ...]]:
    """name -> numpy shape, as llama.cpp's glm4moe loader creates them (output untied)."""
    d, V, E = hp["n_embd"], hp["n_vocab"], hp["n_expert"]
    q, kvd = hp["n_head"] * hp["head_dim"], hp["n_head_kv"] * hp["head_dim"]
    f, fs = hp["n_ff_exp"], hp["n_ff_exp"] * hp["n_shared"]
    out = {"token_embd.weight": (V, d), "output_norm.weight": (d,), "output.weight": (V, d)}
    n_trunk = hp["n_blocks"] - hp["n_nextn"]
    for i in range(hp["n_blocks"]):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": (d,), p + "attn_q.weight": (q, d), p + "attn_q.bias": (q,),
                p + "attn_k.weight": (kvd, d), p + "attn_k.bias": (kvd,),
                p + "attn_v.weight": (kvd, d), p + "attn_v.bias": (kvd,),
                p + "attn_output.weight": (d, q), p + "post_attention_norm.weight": (d,)}
        if i < hp["n_lead"]:
            out |= {p + "ffn_gate.weight": (hp["n_ff"], d), p + "ffn_up.weight": (hp["n_ff"], d),
                    p + "ffn_down.weight": (d, hp["n_ff"])}
        else:
            out |= {p + "ffn_gate_inp.weight": (E, d), p + "exp_probs_b.bias": (E,),
                    p + "ffn_gate_exps.weight": (E, f, d), p + "ffn_up_exps.weight": (E, f, d),
                    p + "ffn_down_exps.weight": (E, d, f),
                    p + "ffn_gate_shexp.weight": (fs, d), p + "ffn_up_shexp.weight": (fs, d),
                    p + "ffn_down_shexp.weight": (d, fs)}
        if i >= n_trunk:   # NextN block: shares token_embd / output, so no embed_tokens / head
            out |= {p + "nextn.eh_proj.weight": (d, 2 * d), p + "nextn.enorm.weight": (d,),
                    p + "nextn.hnorm.weight": (d,), p + "nextn.shared_head_norm.weight": (d,)}
    return out


def test_file_is_small_enough():
    assert MODEL.stat().st_size <= 30 * 1024 * 1024


def test_metadata(reader, hp):
    assert kv(reader, Keys.General.ARCHITECTURE) == ARCH
    assert hp["n_nextn"] == 1
    assert hp["n_blocks"] - hp["n_nextn"] > hp["n_lead"] >= 1      # dense lead, then MoE layers
    assert hp["n_expert"] >= 16 and 1 <= hp["n_used"] < hp["n_expert"]
    assert hp["n_shared"] == 1
    assert kv(reader, Keys.LLM.EXPERT_GATING_FUNC) == ExpertGatingFuncType.SIGMOID
    assert kv(reader, Keys.LLM.EXPERT_WEIGHTS_NORM) is True
    assert kv(reader, Keys.LLM.EXPERT_WEIGHTS_SCALE) > 0
    assert hp["n_head"] % hp["n_head_kv"] == 0 and hp["head_dim"] == hp["v_dim"]
    assert 0 < hp["n_rot"] < hp["head_dim"] and hp["n_rot"] % 2 == 0       # partial rotary
    assert kv(reader, Keys.LLM.CONTEXT_LENGTH) >= 256
    assert 0 < kv(reader, Keys.Attention.LAYERNORM_RMS_EPS) < 1e-3
    assert kv(reader, Keys.Rope.FREQ_BASE) > 0


def test_tensor_names_and_shapes(reader, hp):
    got = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in reader.tensors}
    want = expected_tensors(hp)
    assert sorted(set(got) - set(want)) == [] and sorted(set(want) - set(got)) == []
    assert {n: s for n, s in got.items() if want[n] != s} == {}
    # every name is one gguf-py lists for glm4moe
    known = {TENSOR_NAMES[t].format(bid=i) for t in MODEL_TENSORS[MODEL_ARCH.GLM4_MOE]
             for i in range(hp["n_blocks"])}
    assert all(n.rsplit(".", 1)[0] in known for n in got)


def test_tensor_types(reader):
    for t in reader.tensors:
        if "_exps." in t.name:
            assert t.tensor_type in EXPERT_TYPES, t.name
            # Q8_0/Q4_0 blocks hold 32 values: the row length must be a multiple of 32
            assert int(t.shape[0]) % 32 == 0, t.name
        elif t.name.endswith((".bias", "norm.weight")) or "ffn_gate_inp" in t.name:
            assert t.tensor_type == F32, t.name
        else:
            assert t.tensor_type in (F16, F32), t.name


def test_weights_are_trained_not_placeholder(reader, hp):
    """Finite everywhere; the experts of one layer differ; the correction bias was moved."""
    by_name = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.tensor_type in (F16, F32):
            assert np.isfinite(np.asarray(t.data, dtype=np.float32)).all(), t.name
    t = by_name[f"blk.{hp['n_lead']}.ffn_up_exps.weight"]
    w = dequantize(t.data[:2], t.tensor_type)                       # two experts
    assert np.isfinite(w).all() and not np.allclose(w[0], w[1])
    b = np.asarray(by_name[f"blk.{hp['n_lead']}.exp_probs_b.bias"].data)
    assert np.isfinite(b).all() and np.ptp(b) > 0


def test_tokenizer_keys(reader, hp):
    T = Keys.Tokenizer
    assert reader.fields[T.MODEL].contents() == "gpt2"
    assert reader.fields[T.PRE].contents() == "gpt-2"
    tokens = reader.fields[T.LIST].contents()
    types = reader.fields[T.TOKEN_TYPE].contents()
    merges = reader.fields[T.MERGES].contents()
    assert len(types) == len(tokens) == hp["n_vocab"] and len(set(tokens)) == len(tokens)
    for key in (T.BOS_ID, T.EOS_ID):
        i = reader.fields[key].contents()
        assert 0 <= i < len(tokens) and types[i] == TokenType.CONTROL
    # byte-level BPE: all 256 byte symbols present, every merge joins two existing tokens
    vocab = set(tokens)
    byte_syms = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]
    assert all(s in vocab for s in byte_syms)
    assert merges and all(len(m.split(" ")) == 2 and m.replace(" ", "") in vocab
                          and all(p in vocab for p in m.split(" ")) for m in merges)


def test_tokenizer_rebuilds_and_round_trips(reader):
    tokenizers = pytest.importorskip("tokenizers")
    T = Keys.Tokenizer
    tokens = reader.fields[T.LIST].contents()
    merges = [tuple(m.split(" ")) for m in reader.fields[T.MERGES].contents()]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                                     merges=merges))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tokenizers.decoders.ByteLevel()
    src = "def f(x):\n    return {'a': x ** 2}  # ünïcode\n\n\nclass C:\n\tpass\n"
    ids = tok.encode(src).ids
    assert tok.decode(ids) == src
    assert len(ids) < len(src.encode()) / 2      # merges are real: code compresses


def test_llama_cpp_loads_it(hp):
    """Only where llama-cpp-python is installed (not a project dependency)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_default_params()
    params.load_mtp = True
    model = llama_cpp.llama_model_load_from_file(str(MODEL).encode(), params)
    assert model, "llama.cpp refused the file"
    try:
        assert llama_cpp.llama_model_n_layer_nextn(model) == 1
        assert llama_cpp.llama_model_n_embd(model) == hp["n_embd"]
        vocab = llama_cpp.llama_model_get_vocab(model)
        assert llama_cpp.llama_vocab_n_tokens(vocab) == hp["n_vocab"]
    finally:
        llama_cpp.llama_model_free(model)
