"""bench.gpu_bytes: weight bytes per decode token on a GPU, fused vs per-call dequant, on a
hand-made tensor list whose answer is worked out below."""
from __future__ import annotations

from gguf import GGMLQuantizationType as Q

from bench.gpu_bytes import token_bytes
from placement.tensors import Role, TensorInfo


def _t(name, shape, qtype, n_bytes, role, layer=0):
    return TensorInfo(name=name, shape=shape, ggml_type=qtype, n_bytes=n_bytes, layer=layer, role=role)


def test_token_bytes_by_hand():
    tensors = [
        _t("blk.0.attn_q.weight", (512, 256), Q.Q4_K, 512 * 144, Role.ATTENTION),     # 1 super-block per row
        _t("blk.0.ffn_up_exps.weight", (8, 256, 256), Q.Q8_0, 8 * 256 * 8 * 34, Role.ROUTED_EXPERTS),
        _t("blk.0.attn_norm.weight", (256,), Q.F32, 1024, Role.NORM),
        _t("blk.0.ffn_down.weight", (256, 256), Q.Q2_K, 256 * 84, Role.DENSE_FFN),       # no fused kernel
        _t("blk.0.attn_k.weight", (256, 256), Q.Q4_K, 256 * 144, Role.ATTENTION),       # on the CPU
        _t("token_embd.weight", (1000, 256), Q.Q4_K, 1000 * 144, Role.EMBEDDING, None),
    ]
    device_of = {t.name: "CUDA0" for t in tensors} | {"blk.0.attn_k.weight": "CPU"}
    d = token_bytes(tensors, device_of, n_expert_used=2)["CUDA0"]
    q, experts, norm, q2 = 512 * 144, 2 * 256 * 8 * 34, 1024, 256 * 84   # experts: 2 of 8 read
    assert d["fused"] == q + experts + norm + (q2 + 4 * 256 * 256)
    assert d["today"] == (q + 4 * 512 * 256) + (experts + 4 * 2 * 256 * 256) + norm + (q2 + 4 * 256 * 256)
    assert set(token_bytes(tensors, device_of, 2)) == {"CUDA0"}
