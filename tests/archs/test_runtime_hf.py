"""Layer 3: each architecture's forward vs the independent Hugging Face implementation
(``Glm4MoeForCausalLM`` / ``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM`` /
``DeepseekV2ForCausalLM`` / ``GptOssForCausalLM`` / transformers' ``MtpLayer``), built in float64 from the same
dequantized weights, over several expert quant types."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import offload.runtime as rt
from tests.hf_reference import hf_causal_lm, hf_mtp_layer
from tests.tiny_models import ARCHS, TinySpec, write_tiny_model

# Same weights on both sides, so the only differences are float32 (ours) vs float64 (HF)
# rounding and summation order: observed ~1e-6 of the logit scale. A real mistake (rotary
# layout, routing, a missing bias or norm) shows up at order 1e-1..1.
REL_TOL = 1e-4
IDS = [3, 17, 257, 101, 46, 290, 5, 77, 200, 12, 64, 128]

CASES = {
    "glm4moe-Q8_0": TinySpec(),
    "glm4moe-Q4_0-qknorm": TinySpec(expert_type=Q.Q4_0, qk_norm=True, seed=1),
    "glm4moe-Q4_K-tied": TinySpec(expert_type=Q.Q4_K, tied_output=True, seed=2),
    "glm4moe-Q4_K-densequant": TinySpec(expert_type=Q.Q4_K, dense_type=Q.Q8_0, embd_type=Q.Q8_0, seed=3),
    "glm4moe-F16-nonorm": TinySpec(expert_type=Q.F16, weights_norm=False, weights_scale=1.0, seed=4),
    "qwen3moe-Q8_0": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, seed=5),
    "qwen3moe-Q4_0-nonorm": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, expert_type=Q.Q4_0,
                                     weights_norm=False, seed=7),
    # the full tier: the same modes with one more expert type each (see FULL_CASES)
    "glm4moe-Q6_K-densequant": TinySpec(expert_type=Q.Q6_K, dense_type=Q.Q8_0, embd_type=Q.Q8_0, seed=3),
    "qwen3moe-Q5_K": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, expert_type=Q.Q5_K, seed=6),
    "qwen3moe-Q4_1-nonorm": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, expert_type=Q.Q4_1,
                                     weights_norm=False, seed=7),
    # deepseek2: HF's q_a/kv_a norms use eps 1e-6 whatever rms_norm_eps says, so the tiny
    # models use 1e-6 throughout. YaRN with a 4-token original context so the ramp between
    # interpolated and original frequencies covers the rope dims; 8 experts in 2 groups, 1 used.
    "deepseek2-v3-F32-yarn-groups": TinySpec(arch="deepseek2", expert_type=Q.F32, rms_eps=1e-6, nextn=False,
                                             n_group=2, n_group_used=1, yarn_factor=4.0, yarn_orig_ctx=4,
                                             seed=20),
    "deepseek2-v3-Q4_K-noqlora": TinySpec(arch="deepseek2", expert_type=Q.Q4_K, rms_eps=1e-6, nextn=False,
                                          q_lora_rank=0, n_group=4, n_group_used=2, seed=21),
    "deepseek2-v3-Q8_0-densequant-tied": TinySpec(arch="deepseek2", dense_type=Q.Q8_0, embd_type=Q.Q8_0,
                                                  rms_eps=1e-6, nextn=False, tied_output=True,
                                                  yarn_factor=8.0, yarn_orig_ctx=8, yarn_log_mul=0.0707,
                                                  yarn_beta_fast=1.0, seed=22),   # Kimi-K2's beta_fast
    "deepseek2-v2-Q5_K-softmax": TinySpec(arch="deepseek2", expert_type=Q.Q5_K, rms_eps=1e-6, nextn=False,
                                          q_lora_rank=0, gating="softmax", weights_norm=False, seed=23),
    "deepseek2-kv_b-Q6_K": TinySpec(arch="deepseek2", expert_type=Q.Q6_K, rms_eps=1e-6, nextn=False,
                                    mla=False, yarn_factor=4.0, yarn_orig_ctx=4, seed=24),
    # gpt-oss: a 4-token window so the 12-token prompt crosses it in the even blocks; YaRN
    # with a 4-token original context (the ramp covers the head); sinks, biases and the ±7
    # clamps of swiglu_oai all active (tests.tiny_models.gpt_oss_block)
    "gpt-oss-F32-yarn": TinySpec(arch="gpt-oss", expert_type=Q.F32, n_head=4, n_head_kv=2, window=4,
                                 yarn_factor=4.0, yarn_orig_ctx=4, seed=30),
    "gpt-oss-MXFP4-yarn": TinySpec(arch="gpt-oss", expert_type=Q.MXFP4, window=4, yarn_factor=32.0,
                                   yarn_orig_ctx=4, seed=31),
    "gpt-oss-MXFP4-Q8_0-tied": TinySpec(arch="gpt-oss", expert_type=Q.MXFP4, dense_type=Q.Q8_0, embd_type=Q.Q8_0,
                                        tied_output=True, n_head_kv=1, window=3, seed=32),
}


# Each further expert type is one more compile of the whole compiled pass (10-25 s on two cores);
# the default tier runs each mode with a type the other cases already compile. Q6_K and Q5_K
# experts stay in the default tier through the deepseek2 cases, Q4_1 through tests/kernels.
FULL_CASES = {"glm4moe-Q6_K-densequant", "qwen3moe-Q5_K", "qwen3moe-Q4_1-nonorm"}


def tiered(cases) -> list:
    """``cases``' names as parameters, those in FULL_CASES marked for the full tier."""
    return [pytest.param(c, marks=pytest.mark.full) if c in FULL_CASES else c for c in cases]


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("case", tiered(CASES))
def test_logits_match_transformers(case, tmp_path):
    tiny = write_tiny_model(tmp_path / f"{case}.gguf", CASES[case])
    with torch.no_grad():
        ref = hf_causal_lm(tiny)(torch.tensor([IDS])).logits[0].numpy()
    # float activations: transformers' math (the 12-token prompt is a decode-sized batch, which
    # by default quantizes the activations of Q4_K / Q5_K / MXFP4 experts to int8: ~1e-2 off;
    # that mode is held to the float path in tests/kernels/test_decode_activations.py)
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True, decode_activations="float") as session:
        ours = session.logits(IDS)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < REL_TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.99


# architectures whose transformers parity lives in their own file (their reference does not fit
# hf_causal_lm's float64 pattern): arch → that test, which the coverage check asks to exist
OWN_PARITY = {"deepseek4": "tests/archs/test_deepseek4.py::test_logits_match_transformers"}


def test_every_architecture_has_a_case():
    """Every architecture the tiny writer knows is held to transformers here, or in the file
    ``OWN_PARITY`` names (the other generic checks over every architecture are
    tests/archs/test_every_arch.py)."""
    import importlib
    for arch, where in OWN_PARITY.items():
        path, name = where.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert callable(getattr(module, name, None)), where
    assert {spec.arch for spec in CASES.values()} | set(OWN_PARITY) == set(ARCHS)


NEXTN_CASES = {
    "glm4moe": TinySpec(qk_norm=True, seed=11),
    "deepseek2": TinySpec(arch="deepseek2", rms_eps=1e-6, n_group=2, n_group_used=1, yarn_factor=4.0,
                          yarn_orig_ctx=4, seed=12),
}


@pytest.mark.parametrize("case", list(NEXTN_CASES))
def test_nextn_head_matches_transformers_mtp_layer(case, tmp_path):
    """The NextN block, fed the trunk's post-norm hidden states and the next tokens at their
    own positions (t+1), against transformers' generic MtpLayer with the architecture's
    decoder layer (GLM's GQA block, DeepSeek-V3's MLA block)."""
    tiny = write_tiny_model(tmp_path / f"{case}.gguf", NEXTN_CASES[case])
    hf = hf_causal_lm(tiny)
    mtp, rotary = hf_mtp_layer(tiny)
    t = len(IDS)
    with torch.no_grad():
        h = hf.model(torch.tensor([IDS])).last_hidden_state            # (1, T, d) after norm
        e = hf.model.embed_tokens(torch.tensor([IDS[1:]]))
        pos = torch.arange(1, t)[None]
        causal = torch.full((t - 1, t - 1), float("-inf"), dtype=torch.float64).triu(1)[None, None]
        out = mtp(e, h[:, :-1], position_embeddings=rotary(e, pos), attention_mask=causal,
                  position_ids=pos, cache=None)
        ref = hf.lm_head(out)[0].numpy()
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as session, torch.inference_mode():
        model = session.model
        state = model.new_state()
        _, hidden = model.forward(torch.tensor(IDS), state, logits="none")
        logits, h_mtp = model.nextn(torch.tensor(IDS[1:]), hidden[:-1], torch.arange(1, t),
                                    state.nextn_cache)
    assert h_mtp.shape == (t - 1, tiny.spec.n_embd)
    assert len(state.nextn_cache) == t - 1
    assert rel_err(logits.numpy(), ref) < REL_TOL


LLAMA_CPP_CASES = {name: CASES[name] for name in ("glm4moe-Q8_0", "glm4moe-Q4_K-tied", "qwen3moe-Q8_0",
                                                   "deepseek2-v3-F32-yarn-groups", "deepseek2-kv_b-Q6_K")}
LLAMA_CPP_CASES |= {
    "gpt-oss-F32-yarn": CASES["gpt-oss-F32-yarn"],
    "gpt-oss-MXFP4-yarn": CASES["gpt-oss-MXFP4-yarn"],
    "deepseek2-v3-Q8_0-mtp": TinySpec(arch="deepseek2", expert_type=Q.Q8_0, rms_eps=1e-6, seed=25),
    # llama.cpp reads q from attn_q (no q LoRA) only for 26- or 27-block files (its "lite"
    # rule), so the V2-Lite shape is tested at 26 blocks; F32 experts — at this depth one
    # near-tie route flipped by llama.cpp's f16 cache would change every later logit
    "deepseek2-v2lite-F32-26blocks": TinySpec(arch="deepseek2", expert_type=Q.F32, rms_eps=1e-6, nextn=False,
                                              q_lora_rank=0, gating="softmax", weights_norm=False, n_layer=26,
                                              seed=23),
}


@pytest.mark.parametrize("case", list(LLAMA_CPP_CASES))
def test_logits_match_llama_cpp(case, tmp_path):
    """A second independent reference where llama-cpp-python is installed (skipped
    otherwise): llama.cpp reads the same file, which also checks our GGUF conventions (names,
    metadata) are the ones it expects. llama.cpp quantizes activations to 8 bits for quantized
    matmuls, so agreement is ~1e-2 of the logit scale, not float rounding."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tiny = write_tiny_model(tmp_path / f"{case}.gguf", LLAMA_CPP_CASES[case])
    llm = llama_cpp.Llama(model_path=str(tiny.path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(IDS)
    ref = np.array(llm.scores[:len(IDS)], dtype=np.float32)
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as session:
        ours = session.logits(IDS)
    assert rel_err(ours, ref) < 3e-2
