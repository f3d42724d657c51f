"""GGUF inventory: header reading (checked against gguf.GGUFReader), ModelSpec, roles, splits."""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from offload.errors import OffloadError
from offload.gguf_header import LazyArray, read_header
from offload.gguf_model import UnknownMetadataWarning, open_model
from placement.tensors import Role
from tests.fixtures.real_models import ALL, write_fixture

Q = GGMLQuantizationType


@pytest.mark.parametrize("name,count,gib", [
    # tensor counts from llama.cpp loader logs of the published GGUFs; sizes from their
    # "file size" lines where the recipe matches (gpt-oss-120b mxfp4: 59.02 GiB); deepseek4
    # sizes from the shapes and the mainline types of ../shared/deepseek4.md §5
    ("qwen3-30b-a3b", 579, None), ("glm-4.5-air", 803, None), ("deepseek-v3", 1086, None),
    ("gpt-oss-120b", 687, 59.02), ("deepseek-v3-mtp", 22, None),
    ("deepseek-r1-ud-iq1_s", 1025, 130.60), ("deepseek-v4-flash", 1328, 145.17),
    ("deepseek-v4-flash-mtp", 34, 4.87)])
def test_inventory_counts(models, name, count, gib):
    m = models[name]
    assert len(m.tensors) == count
    if gib is not None:
        assert round(sum(t.n_bytes for t in m.tensors) / 2**30, 2) == gib


@pytest.mark.parametrize("name", ["glm-4.5-air", "gpt-oss-120b"])
def test_header_matches_gguf_reader(tmp_path, name):
    """Our header walk agrees with gguf's own reader on every tensor and scalar key."""
    path = write_fixture(ALL[name](), tmp_path, tokenizer="none")
    m = open_model(path)
    for shard in m.shards:
        reader = GGUFReader(shard)
        for rt in reader.tensors:
            loc, info = m.locations[rt.name], m.tensor(rt.name)
            assert loc.path == shard
            assert loc.offset == rt.data_offset
            assert info.shape == tuple(int(d) for d in reversed(rt.shape.tolist()))
            assert info.ggml_type == rt.tensor_type
            assert info.n_bytes == rt.n_bytes
        header = read_header(shard)
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            assert header.metadata[key] == field.contents(), key


def test_tensor_data_matches_gguf_reader(tmp_path):
    """tensor_data() gives the same array (dtype, shape, bytes) as ReaderTensor.data."""
    rng = np.random.default_rng(0)
    path = tmp_path / "small.gguf"
    w = GGUFWriter(path, "qwen3moe")
    w.add_tensor("token_embd.weight", rng.standard_normal((3, 64)).astype(np.float32))
    w.add_tensor("output.weight", rng.standard_normal((5, 32)).astype(np.float16))
    w.add_tensor("blk.0.ffn_up_exps.weight", quantize(rng.standard_normal((4, 8, 64)).astype(np.float32), Q.Q8_0),
                 raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", quantize(rng.standard_normal((6, 96)).astype(np.float32), Q.Q4_0), raw_dtype=Q.Q4_0)
    for key, value in (("qwen3moe.block_count", 1), ("qwen3moe.embedding_length", 64),
                       ("qwen3moe.attention.head_count", 1), ("qwen3moe.context_length", 128)):
        w.add_uint32(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    m = open_model(path)
    for rt in GGUFReader(path).tensors:
        ours = m.tensor_data(rt.name)
        assert ours.dtype == rt.data.dtype and ours.shape == rt.data.shape
        assert np.array_equal(np.asarray(ours), np.asarray(rt.data)), rt.name


def test_spec_deepseek_mla(models):
    s = models["deepseek-v3"].spec
    assert (s.arch, s.n_layer, s.n_nextn, s.n_embd, s.n_vocab, s.n_ctx_train) == ("deepseek2", 61, 0, 7168, 129280, 163840)
    assert (s.n_head, s.n_head_kv[0], s.head_dim_k, s.head_dim_v) == (128, 1, 576, 512)
    assert s.is_mla and (s.q_lora_rank, s.kv_lora_rank, s.head_dim_k_mla, s.head_dim_v_mla) == (1536, 512, 192, 128)
    assert (s.n_expert, s.n_expert_used, s.n_expert_shared, s.n_ff_exp, s.n_leading_dense) == (256, 8, 1, 2048, 3)
    assert not s.is_moe_layer(2) and s.is_moe_layer(3)


def test_spec_glm_nextn_and_roles(models):
    m = models["glm-4.5-air"]
    assert (m.spec.n_layer, m.spec.n_nextn, m.spec.n_layer_trunk) == (47, 1, 46)
    by_name = {t.name: t for t in m.tensors}
    assert by_name["blk.46.nextn.eh_proj.weight"].role is Role.NEXTN
    assert by_name["blk.46.ffn_up_exps.weight"].role is Role.ROUTED_EXPERTS and by_name["blk.46.ffn_up_exps.weight"].nextn
    assert not by_name["blk.45.ffn_up_exps.weight"].nextn
    assert by_name["blk.46.ffn_up_exps.weight"].n_experts == 128
    expected = {"blk.3.exp_probs_b.bias": Role.ROUTER, "blk.3.ffn_gate_inp.weight": Role.ROUTER,
                "blk.3.ffn_down_shexp.weight": Role.SHARED_EXPERTS, "blk.0.ffn_down.weight": Role.DENSE_FFN,
                "blk.3.attn_q.bias": Role.ATTENTION, "blk.3.post_attention_norm.weight": Role.NORM,
                "token_embd.weight": Role.EMBEDDING, "output.weight": Role.OUTPUT, "output_norm.weight": Role.NORM}
    assert {n: by_name[n].role for n in expected} == expected
    # 1408-wide rows are not whole Q4_K/Q6_K super-blocks: llama.cpp's fallback types
    assert by_name["blk.6.ffn_down_exps.weight"].ggml_type is Q.Q5_0
    assert by_name["blk.3.ffn_down_exps.weight"].ggml_type is Q.Q8_0


def test_spec_gpt_oss_sliding_window(models):
    s = models["gpt-oss-120b"].spec
    assert s.sliding_window == 128 and s.swa_layers[:4] == (True, False, True, False)
    assert models["gpt-oss-120b"].tensor("blk.0.ffn_down_exps.bias").role is Role.ROUTED_EXPERTS


def test_split_model_found_from_any_shard(fixture_paths, models):
    first = fixture_paths["gpt-oss-120b"]
    second = first.replace("-00001-of-", "-00002-of-")
    m2 = open_model(second)
    assert len(m2.shards) == 2 and {t.name for t in m2.tensors} == {t.name for t in models["gpt-oss-120b"].tensors}


def test_split_model_missing_shard(tmp_path, fixture_paths):
    first = Path(fixture_paths["gpt-oss-120b"])
    (tmp_path / first.name).symlink_to(first)     # shard 1 alone (a copy would fill the sparse hole)
    with pytest.raises(OffloadError, match="shard .*00002-of-00002.gguf is missing"):
        open_model(tmp_path / first.name)


def test_tokenizer_arrays_are_lazy(models):
    tokens = models["qwen3-30b-a3b"].metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, LazyArray) and len(tokens) == 151936
    values = tokens.values()
    assert values[:2] == ["tok0", "tok1"] and values[-1] == "tok151935"
    assert models["qwen3-30b-a3b"].spec.n_vocab == 151936


def _tiny(path, extra_keys=(), tensors=(("blk.0.attn_q.weight", (64, 64), Q.F32),)):
    w = GGUFWriter(path, "qwen3moe")
    for key, value in (("qwen3moe.block_count", 1), ("qwen3moe.embedding_length", 64),
                       ("qwen3moe.attention.head_count", 1), ("qwen3moe.context_length", 128), *extra_keys):
        w.add_uint32(key, value)
    sizes = []
    for name, shape, qtype in tensors:
        n = int(np.prod(shape)) * 4
        w.add_tensor_info(name, shape, np.dtype(np.float32), n, raw_dtype=qtype)
        sizes.append(n)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    end = w.fout[0].tell()
    w.close()
    os.truncate(path, -(-end // 32) * 32 + sum(-(-n // 32) * 32 for n in sizes))
    return path


def test_unknown_keys_and_tensor_kinds_warn_once_each(tmp_path):
    path = _tiny(tmp_path / "x.gguf", extra_keys=[("qwen3moe.frobnicate_count", 3)],
                 tensors=[("blk.0.mystery.weight", (64, 64), Q.F32), ("blk.0.mystery.bias", (64,), Q.F32)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = open_model(path)
    messages = [str(w.message) for w in caught if issubclass(w.category, UnknownMetadataWarning)]
    assert sum("qwen3moe.frobnicate_count" in msg for msg in messages) == 1
    assert sum("'mystery'" in msg for msg in messages) == 1
    assert len(messages) == 2
    assert m.tensor("blk.0.mystery.weight").role is Role.OTHER


@pytest.mark.parametrize("mutate,match", [
    (lambda b: b"NOPE" + b[4:], "not a GGUF file"),
    (lambda b: b[:40], "truncated or corrupt GGUF header"),
    (lambda b: b[:-10], "truncated: tensor blk.0.attn_q.weight ends at byte"),
])
def test_corrupt_files(tmp_path, mutate, match):
    good = _tiny(tmp_path / "good.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(mutate(good))
    with pytest.raises(OffloadError, match=match):
        open_model(bad)


def test_unknown_quant_type_and_missing_keys(tmp_path):
    with pytest.raises(OffloadError, match="unknown quant type id 99"):
        open_model(_tiny(tmp_path / "q.gguf", tensors=[("blk.0.attn_q.weight", (64, 64), 99)]))
    w = GGUFWriter(tmp_path / "k.gguf", "qwen3moe")
    w.add_uint32("qwen3moe.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(OffloadError, match="missing metadata key qwen3moe.embedding_length"):
        open_model(tmp_path / "k.gguf")
    with pytest.raises(OffloadError, match="cannot open"):
        open_model(tmp_path / "nope.gguf")
