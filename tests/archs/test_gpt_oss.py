"""gpt-oss beyond logit parity (that is tests/archs/test_runtime_hf.py): the CPU expert kernel's
clamped GLU with per-expert biases against float64 numpy; attention sinks and the sliding
window against an explicit float64 softmax; the window cache's rows and bytes are the
planner's; ``offload run`` end to end. KV per device equals the plan with virtual GPUs in
tests/archs/test_every_arch.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from cpu_kernels import ExpertWeights
from cpu_kernels.moe import moe_ffn
from tests.tiny_models import random_tensor


def reference_swiglu_oai_moe(x, ids, wts, gate, up, down, gb, ub, db):
    """float64: Σ_k w · (down_e · ((clamp(u)+1) · g·σ(1.702 g)) + db_e), g = gate_e·x + gb_e."""
    y = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], wts[t]):
            g = gate[e] @ x[t] + gb[e]
            u = up[e] @ x[t] + ub[e]
            g = np.minimum(g, 7.0)
            u = np.clip(u, -7.0, 7.0)
            h = (u + 1) * g / (1 + np.exp(-1.702 * g))
            y[t] += wt * (down[e] @ h + db[e])
    return y


# F32: only summation order differs (1e-5 of the output scale). MXFP4: the kernels quantize
# activations to 8 bits for the integer dot products (llama.cpp's q8 path), ~1e-2.
@pytest.mark.parametrize("qtype,tol", [(Q.F32, 1e-5), (Q.MXFP4, 3e-2)])
def test_moe_ffn_swiglu_oai_with_biases_matches_float64(qtype, tol):
    rng = np.random.default_rng(0)
    n_exp, d, f, b, k = 6, 64, 96, 5, 2
    raws, deq = {}, {}
    for name, shape, std in (("gate", (n_exp, f, d), 0.6), ("up", (n_exp, f, d), 0.6), ("down", (n_exp, d, f), 0.2)):
        raws[name], _, deq[name] = random_tensor(rng, shape, qtype, std)
    gb = rng.standard_normal((n_exp, f)).astype(np.float32)
    ub = rng.standard_normal((n_exp, f)).astype(np.float32)
    db = rng.standard_normal((n_exp, d)).astype(np.float32)
    x = (rng.standard_normal((b, d)) * 2).astype(np.float32)       # large enough to hit both clamps
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(b)])
    wts = rng.uniform(0.1, 1, (b, k)).astype(np.float32)
    raw = lambda a: a if qtype == Q.F32 else a.view(np.uint8)  # noqa: E731
    w = ExpertWeights(gate=raw(raws["gate"]), up=raw(raws["up"]), down=raw(raws["down"]),
                      gate_type=qtype, up_type=qtype, down_type=qtype, name="blk.0")
    ref = reference_swiglu_oai_moe(x.astype(np.float64), ids, wts, *(deq[n].astype(np.float64) for n in
                                   ("gate", "up", "down")), gb, ub, db)
    g = np.einsum("tkfd,td->tkf", deq["gate"][ids].astype(np.float64), x)
    assert (g + gb[ids] > 7).any() and (np.abs(np.einsum("tkfd,td->tkf", deq["up"][ids], x) + ub[ids]) > 7).any()
    got = moe_ffn(x, ids, wts, w, act="swiglu_oai", gate_bias=gb, up_bias=ub, down_bias=db)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < tol, err
    # the default stays SiLU without biases
    plain = moe_ffn(x, ids, wts, w)
    assert np.abs(plain - got).max() > 0.1


IDS_LONG = list(np.random.default_rng(5).integers(1, 290, 300))


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_window_cache_keeps_the_window_and_decodes_like_transformers(tmp_path, cache_type):
    """300 tokens in 16-token micro-batches with a 4-token window: the windowed blocks' caches
    stop at the planner's min(pad256(ctx), pad256(window + ubatch)) = 256 cells (rows older
    than the window dropped), the full blocks' at pad256(300) = 512, each cache's bytes are
    ``kv_bytes``, and every logit matches transformers over the whole sequence (f32 cache:
    float rounding, 1e-4 of the logit scale; f16 cache: 1e-2)."""
    import offload.runtime as rt
    from offload.gguf_model import open_model
    from placement.memory import MemorySettings, kv_bytes
    from tests.hf_reference import hf_causal_lm
    from tests.tiny_models import TinySpec, write_tiny_model

    spec = TinySpec(arch="gpt-oss", expert_type=Q.MXFP4, window=4, n_layer=2, seed=33)
    tiny = write_tiny_model(tmp_path / "oss.gguf", spec)
    with torch.no_grad():
        ref = hf_causal_lm(tiny)(torch.tensor([IDS_LONG])).logits[0].numpy()
    ctx, ubatch = 300, 16
    settings = MemorySettings(ctx=ctx, cache_type=cache_type, ubatch=ubatch)
    # float activations: transformers' math. The 16-token micro-batches are decode-sized, where
    # MXFP4 experts take int8 activations by default; on this random model int8 moves the
    # logits by 0.23 of the largest (the same 0.23 as int8 prefill in 64-token batches: the
    # activations' rounding, not the decode path)
    with rt.load(tiny.path, cache_type=cache_type, ctx=ctx, ubatch=ubatch, quiet=True,
                 decode_activations="float") as s, torch.inference_mode():
        state = s.model.new_state()
        ids = torch.tensor(IDS_LONG)
        ours = np.concatenate([s.model.forward(ids[i:i + ubatch], state)[0].numpy()
                               for i in range(0, len(IDS_LONG), ubatch)])
        model = open_model(tiny.path)
        for i, cache in enumerate(state.caches):
            windowed = model.spec.is_swa_layer(i)
            assert cache.k.shape[1] == (256 if windowed else 512)
            assert (cache.start > 0) == windowed and cache.length == len(IDS_LONG)
            assert cache.nbytes == kv_bytes(model.spec, i, settings)
        # rolling back inside the last micro-batch and running it again gives the same logits
        state.truncate(len(IDS_LONG) - 3)
        again = s.model.forward(ids[-3:], state)[0].numpy()
        assert np.abs(again - ours[-3:]).max() < 1e-5
        with pytest.raises(ValueError, match="cannot roll back"):
            state.truncate(10)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < (1e-4 if cache_type == "f32" else 1e-2), err
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.99


def test_prompt_cache_falls_back_to_a_fresh_state_past_the_window(tmp_path):
    """A second prompt that shares only an early prefix with the first: the windowed caches
    have dropped the rows that prefix needs, so the prompt cache starts fresh (n_cached 0)
    and the answer equals a fresh run; a prompt that extends the last one is still reused."""
    import offload.runtime as rt
    from offload.session import PromptCache
    from tests.tiny_models import TinySpec, write_tiny_model

    tiny = write_tiny_model(tmp_path / "oss.gguf", TinySpec(arch="gpt-oss", n_layer=2, window=4, seed=34))
    first = IDS_LONG[:290]
    branch = IDS_LONG[:20] + [7, 8, 9]
    with rt.load(tiny.path, ctx=400, ubatch=16, quiet=True) as s:
        s.prompt_cache = PromptCache()
        out = list(s.generate(first, max_tokens=4, stop_at_eos=False, cache_prompt=True))
        more = first + out + [11]
        got = list(s.generate(more, max_tokens=4, stop_at_eos=False, cache_prompt=True))
        assert s.stats.n_prompt_cached >= len(first)
        assert got == list(s.generate(more, max_tokens=4, stop_at_eos=False))
        got = list(s.generate(branch, max_tokens=4, stop_at_eos=False, cache_prompt=True))
        assert s.stats.n_prompt_cached == 0
        assert got == list(s.generate(branch, max_tokens=4, stop_at_eos=False))


SPLIT_TEXTS = ["def the(self):\n    return x", "Don'T STOP the def; x/y\n\n  12345 HelloWorld",
               "héllo wörld 日本語 🙂\t\n", "THE the The'S i'M  \n\n\n x123 4567"]


def test_gpt4o_pre_tokenizer_splits_as_llama_cpp(tmp_path):
    """gpt-oss files name the "gpt-4o" pre-tokenizer: our token ids equal llama.cpp's on text
    where its case-aware split and the other splits differ (skipped without llama-cpp-python).
    The extra merges make the split visible: "n'T" (a contraction kept with its word, any
    case) and "oW" (only when "HelloWorld" is not split at the case change) — GPT-2's split
    gives the first never and the second always."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from offload.gguf_model import open_model
    from offload.tokenizer import Tokenizer
    from tests.tiny_models import TinySpec, write_tiny_model

    tiny = write_tiny_model(tmp_path / "oss.gguf", TinySpec(arch="gpt-oss", n_layer=2, tokenizer_pre="gpt-4o",
                                                                    extra_merges=("n '", "n' T", "o W")))
    ours = Tokenizer.from_gguf(open_model(tiny.path).metadata)
    llm = llama_cpp.Llama(model_path=str(tiny.path), vocab_only=True, verbose=False)
    for text in SPLIT_TEXTS:
        assert ours.encode(text, add_bos=False) == llm.tokenize(text.encode(), add_bos=False, special=False), text
    vocab = open_model(tiny.path).metadata["tokenizer.ggml.tokens"]
    vocab = list(vocab.values()) if hasattr(vocab, "values") else list(vocab)
    ids = ours.encode(SPLIT_TEXTS[1], add_bos=False)
    assert vocab.index("n'T") in ids and vocab.index("oW") not in ids


def test_offload_run_end_to_end(tmp_path, capsys):
    """A small gpt-oss (MXFP4 experts, YaRN, a 16-token window, the gpt-4o tokenizer) through
    ``offload run`` on a plan with a virtual GPU and two blocks' experts on the CPU: exits 0
    and prints what greedy generation through the API gives; ``offload bench`` runs its
    baseline (plain decoding) only and says why — gpt-oss has no draft head."""
    import offload.runtime as rt
    from offload.cli import main
    from tests.tiny_models import TinySpec, write_tiny_model

    tiny = write_tiny_model(tmp_path / "oss.gguf", TinySpec(
        arch="gpt-oss", expert_type=Q.MXFP4, n_layer=4, n_embd=512, n_head=8, n_head_kv=2, head_dim=64,
        n_expert=16, n_expert_used=4, window=16, yarn_factor=32.0, yarn_orig_ctx=64, tokenizer_pre="gpt-4o",
        seed=36))
    prompt = "def main(argv):\n    return"
    plan = ["--devices", "CUDA0=4GiB,CPU=8GiB", "--n-cpu-moe", "2", "-c", "1024"]
    assert main(["run", str(tiny.path), "-p", prompt, "-n", "24", "--ignore-eos", "--temp", "0", "--virtual-gpus", *plan]) == 0
    out = capsys.readouterr().out
    with rt.load(tiny.path, devices="CUDA0=4GiB,CPU=8GiB", n_cpu_moe=2, ctx=1024, virtual_gpus=True,
                 quiet=True) as s:
        ids = list(s.generate(prompt, max_tokens=24, stop_at_eos=False))
        text = s.detokenize(ids)
    assert len(ids) == 24 and text in out
    assert main(["bench", str(tiny.path), "--virtual-gpus", "--tasks", "code", "--repeat", "1", "-n", "6",
                 *plan]) == 0
    out, err = capsys.readouterr()
    assert "no draft head" in err and "baseline" in out and "mtp n=" not in out


def test_torch_experts_on_a_virtual_gpu_match_transformers(tmp_path):
    """The torch side of the same math: experts (biased swiglu_oai, gpu.experts.TorchExperts),
    attention with sinks and the router on a virtual GPU, two blocks' experts on the CPU —
    logits within float rounding of transformers (1e-4 of the logit scale)."""
    import offload.runtime as rt
    from tests.hf_reference import hf_causal_lm
    from tests.tiny_models import TinySpec, write_tiny_model

    tiny = write_tiny_model(tmp_path / "oss.gguf", TinySpec(arch="gpt-oss", expert_type=Q.MXFP4, n_layer=4,
                                                            window=4, yarn_factor=4.0, yarn_orig_ctx=4, seed=37))
    ids = IDS_LONG[:40]
    with torch.no_grad():
        ref = hf_causal_lm(tiny)(torch.tensor([ids])).logits[0].numpy()
    with rt.load(tiny.path, devices="CUDA0=4GiB,CPU=8GiB", n_cpu_moe=2, virtual_gpus=True, gpu_dtype="f32",
                 cache_type="f32", int8_prefill=False, quiet=True) as s:     # float: transformers' math
        assert {type(b.ffn.experts).__name__ for b in s.model.blocks} == {"CpuExperts", "TorchExperts"}
        ours = s.logits(ids)
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.99
