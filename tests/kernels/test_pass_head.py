"""The two ends of a pass as compiled calls (``cpu_kernels.head``): the embedding row lookup
against gguf's ``dequantize``, and the output norm + lm_head (``offload.compiled_head``)
against the torch reference (``gpu.norm.RMSNorm`` + ``RawLinear``), alone and inside whole
passes — the shipped model and transformers-checked tiny models, T = 1…8 after a prefill and
the prefill itself — plus greedy and seeded sampling output equal to the reference path's.

Tolerances: the embedding rows are the decoders' ``d · v + m`` in float32 against gguf's
numpy float32 (one rounding, possibly fused): 1e-6 of the largest value. Logits: both paths
compute in float32 from the same weights, only the order of sums differs (the compiled
norm's sum of squares, 4-row register blocking vs ``matmul``'s): REL_TOL 1e-5 of the largest
logit, as tests/kernels/test_compiled_block.py (observed ~3e-7); a real mistake (a missing norm
weight, the wrong row, eps) shows at 1e-3 or more.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

import offload.runtime as rt
from cpu_kernels import supported_types
from gpu.norm import RMSNorm
from offload.compiled_block import CompiledBlock
from offload.compiled_head import CompiledHead
from offload.cpu_ops import RawEmbedding, RawLinear
from offload.sampling import Sampler
from offload.speculative import generate_step
from placement.limits import DECODE_TOKENS
from tests.kernels.test_compiled_block import PROMPT, REL_TOL, batches_after_prefill, reference_blocks, rel_err
from tests.kernels.test_compiled_block import TINY as HF_TINY
from tests.kernels.test_compiled_block import shipped  # noqa: F401  (the shipped model, all CPU, f32 cache: a fixture)
from tests.tiny_models import TinySpec, random_tensor, write_tiny_model

@pytest.mark.parametrize("qtype", supported_types(), ids=lambda q: q.name)
def test_embedding_rows_match_gguf_dequantize(qtype):
    rng = np.random.default_rng(int(qtype))
    cols = 512 if qtype not in (Q.F32, Q.F16, Q.BF16) else 200      # float types: a tail past 32·6
    raw, _, ref = random_tensor(rng, (40, cols), qtype, 0.05)
    lookup = RawEmbedding(np.ascontiguousarray(raw), qtype, cols)
    for ids in ([7], [0, 39, 7, 7], list(range(3, 19))):          # 1, a few (repeated), the most compiled
        got = lookup(torch.tensor(ids)).numpy()
        want = ref[ids]
        assert got.shape == (len(ids), cols)
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), (qtype.name, ids)


def test_embedding_refuses_an_id_outside_the_vocabulary():
    raw, _, _ = random_tensor(np.random.default_rng(0), (10, 64), Q.Q8_0, 0.1)
    lookup = RawEmbedding(raw, Q.Q8_0, 64)
    with pytest.raises(IndexError, match="token id 10 is outside the vocabulary"):
        lookup(torch.tensor([3, 10]))


def reference_head(norm, lin, x, logits):
    h = norm(x)
    return (None if logits == "none" else lin(h if logits == "all" else h[-1:])), h


# F16 and Q6_K (the usual head types) by default; F32, Q8_0, Q4_0, Q4_K (the same row routines as
# matmul's, checked per type in tests/kernels/test_cpu_kernels.py) are the full tier
@pytest.mark.parametrize("qtype", [Q.F16, Q.Q6_K, *(pytest.param(t, marks=pytest.mark.full)
                                                   for t in (Q.F32, Q.Q8_0, Q.Q4_0, Q.Q4_K))],
                         ids=lambda q: q.name)
def test_output_head_matches_norm_then_lm_head(qtype):
    rng = np.random.default_rng(50 + int(qtype))
    n_embd, n_vocab = 256, 301                     # a vocabulary that is not a multiple of 4 rows
    raw, _, _ = random_tensor(rng, (n_vocab, n_embd), qtype, 0.05)
    lin = RawLinear(np.ascontiguousarray(raw), qtype, name="output.weight")
    norm = RMSNorm(torch.from_numpy(rng.uniform(0.5, 1.5, n_embd).astype(np.float32)), 1e-5)
    head = CompiledHead.bind(norm, lin)
    assert head is not None
    for t in (1, 2, 3, 5, 8, DECODE_TOKENS, 40):
        x = torch.from_numpy((rng.standard_normal((t, n_embd)) * 3).astype(np.float32))
        for mode in ("all", "last", "none"):
            if not head.takes(t, mode):
                assert t > DECODE_TOKENS and mode == "all"
                continue
            got, h = head(x, mode)
            want, h_ref = reference_head(norm, lin, x, mode)
            assert rel_err(h.numpy(), h_ref.numpy()) < REL_TOL, (t, mode)
            if mode == "none":
                assert got is None
            else:
                assert got.shape == want.shape, (t, mode)
                assert rel_err(got.numpy(), want.numpy()) < REL_TOL, (qtype.name, t, mode)


def test_head_is_not_bound_where_it_does_not_apply():
    raw = np.ones((8, 32), np.float32)
    norm = RMSNorm(torch.ones(32), 1e-5)
    assert CompiledHead.bind(norm, RawLinear(raw, Q.F32, bias=torch.ones(8))) is None
    assert CompiledHead.bind(norm, lambda x: x) is None


@contextmanager
def reference_pass(model):
    """The whole torch reference pass meanwhile: reference blocks, the eager output norm +
    lm_head (a plain callable head binds no compiled head), gguf's numpy embedding."""
    output, embed = model.output, model.embed
    model.output = lambda h: output(h)
    compiled = getattr(embed, "compiled", False)
    if compiled:
        embed.compiled = False
    try:
        with reference_blocks(model):
            assert model.output_head is None
            yield
    finally:
        model.output = output
        if compiled:
            embed.compiled = True


def both(model, fn):
    with torch.inference_mode():
        assert model.output_head is not None
        fast = fn(model)
        with reference_pass(model):
            ref = fn(model)
        assert model.output_head is not None           # bound again once the parts are back
    return fast, ref


def prefill_logits(model, prompt):
    """The prompt's logits of every row (T > DECODE_TOKENS: the reference head runs) and of the
    last one (the compiled head after reference blocks), and the final hidden states."""
    out = []
    for mode in ("all", "last"):
        logits, h = model.forward(torch.tensor(prompt), model.new_state(None), logits=mode)
        out += [logits.numpy(), h.numpy()]
    return out


def generated(model, sampler_args, n=24):
    state = model.new_state(None)
    return list(generate_step(model, PROMPT[:5], state=state, sampler=Sampler(**sampler_args), max_tokens=n))


def test_shipped_passes_match_reference(shipped):
    fast, ref = both(shipped.model, lambda m: batches_after_prefill(m, PROMPT[:6], range(1, 9))
                     + prefill_logits(m, PROMPT))
    for i, (a, b) in enumerate(zip(fast, ref)):
        assert a.shape == b.shape and rel_err(a, b) < REL_TOL, i


@pytest.mark.parametrize("sampler_args", [{}, {"temperature": 0.8, "seed": 3}, {"temperature": 1.0, "top_k": 20,
                                                                                "top_p": 0.9, "seed": 11}],
                         ids=["greedy", "temp0.8", "topk-topp"])
def test_shipped_generation_equals_reference(shipped, sampler_args):
    """Same tokens as the reference path: greedy, and with temperature under a fixed seed
    (the sampler draws from the same RNG the same way; the logits differ by ~1e-7)."""
    fast, ref = both(shipped.model, lambda m: generated(m, sampler_args))
    assert fast == ref


# the transformers-checked tiny models (F32 head and embedding), and quantized heads/embeddings
TINY = {
    **HF_TINY,
    "qwen3moe-Q8_0-head-Q4_K-embd": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, dense_type=Q.Q8_0,
                                             embd_type=Q.Q4_K, expert_type=Q.Q4_0, seed=7),
    "glm4moe-tied-Q6_K": TinySpec(embd_type=Q.Q6_K, tied_output=True, seed=9),
}


# qwen3moe-Q5_K is the full tier: one more expert type (one more compile of the pass); the
# architecture stays in the default tier through qwen3moe-Q8_0-head-Q4_K-embd
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.full) if c == "qwen3moe-Q5_K" else c
                                  for c in TINY])
def test_tiny_models_match_reference(case, tmp_path):
    """Float activations in both paths, pinned: under the default ``auto`` a VNNI or AVX2 CPU decodes
    the Q5_K experts with int8 activations, where the compiled block and the reference
    ``moe_ffn`` may round one activation to neighbouring codes (6e-5 of the largest logit
    seen on a Zen 5 and a Sapphire Rapids Xeon), which is not the float rounding this file
    holds to REL_TOL; on a CPU without either both run float anyway. The int8 modes have their
    own bound in tests/kernels/test_decode_activations.py (int8 against float, per type)."""
    tiny = write_tiny_model(tmp_path / f"{case}.gguf", TINY[case])
    with rt.load(tiny.path, cache_type="f32", quiet=True, decode_activations="float", int8_prefill=False) as s:
        assert all(isinstance(b, CompiledBlock) for b in s.model.blocks)     # the whole pass compiled
        fast, ref = both(s.model, lambda m: batches_after_prefill(m, PROMPT[:8], range(1, 9))
                         + prefill_logits(m, PROMPT))
    for i, (a, b) in enumerate(zip(fast, ref)):
        assert a.shape == b.shape and rel_err(a, b) < REL_TOL, (case, i)
