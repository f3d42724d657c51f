"""Layer 3: each architecture's forward vs the independent Hugging Face implementation
(``Glm4MoeForCausalLM`` / ``Qwen3MoeForCausalLM`` / transformers' ``MtpLayer``), built in
float64 from the same dequantized weights, over several expert quant types."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import offload.runtime as rt
from tests.hf_reference import hf_causal_lm, hf_mtp_layer
from tests.tiny_models import TinySpec, write_tiny_model

# Same weights on both sides, so the only differences are float32 (ours) vs float64 (HF)
# rounding and summation order: observed ~1e-6 of the logit scale. A real mistake (rotary
# layout, routing, a missing bias or norm) shows up at order 1e-1..1.
REL_TOL = 1e-4
IDS = [3, 17, 257, 101, 46, 290, 5, 77, 200, 12, 64, 128]

CASES = {
    "glm4moe-Q8_0": TinySpec(),
    "glm4moe-Q4_0-qknorm": TinySpec(expert_type=Q.Q4_0, qk_norm=True, seed=1),
    "glm4moe-Q4_K-tied": TinySpec(expert_type=Q.Q4_K, tied_output=True, seed=2),
    "glm4moe-Q6_K-densequant": TinySpec(expert_type=Q.Q6_K, dense_type=Q.Q8_0, embd_type=Q.Q8_0, seed=3),
    "glm4moe-F16-nonorm": TinySpec(expert_type=Q.F16, weights_norm=False, weights_scale=1.0, seed=4),
    "qwen3moe-Q8_0": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, seed=5),
    "qwen3moe-Q5_K": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, expert_type=Q.Q5_K, seed=6),
    "qwen3moe-Q4_1-nonorm": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, expert_type=Q.Q4_1,
                                     weights_norm=False, seed=7),
}


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    tiny = write_tiny_model(tmp_path / f"{case}.gguf", CASES[case])
    with torch.no_grad():
        ref = hf_causal_lm(tiny)(torch.tensor([IDS])).logits[0].numpy()
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as session:
        ours = session.logits(IDS)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < REL_TOL


def test_nextn_head_matches_transformers_mtp_layer(tmp_path):
    """The NextN block, fed the trunk's post-norm hidden states and the next tokens at their
    own positions (t+1), against transformers' generic MtpLayer with the GLM decoder layer."""
    tiny = write_tiny_model(tmp_path / "glm.gguf", TinySpec(qk_norm=True, seed=11))
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


@pytest.mark.parametrize("case", ["glm4moe-Q8_0", "glm4moe-Q4_K-tied", "qwen3moe-Q8_0"])
def test_logits_match_llama_cpp(case, tmp_path):
    """A second independent reference where llama-cpp-python is installed (skipped
    otherwise): llama.cpp reads the same file, which also checks our GGUF conventions (names,
    metadata) are the ones it expects. llama.cpp quantizes activations to 8 bits for quantized
    matmuls, so agreement is ~1e-2 of the logit scale, not float rounding."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tiny = write_tiny_model(tmp_path / f"{case}.gguf", CASES[case])
    llm = llama_cpp.Llama(model_path=str(tiny.path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(IDS)
    ref = np.array(llm.scores[:len(IDS)], dtype=np.float32)
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as session:
        ours = session.logits(IDS)
    assert rel_err(ours, ref) < 3e-2
