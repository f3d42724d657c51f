"""The shipped model (models/tiny-glm4moe-mtp.gguf) through the runtime: greedy text is
reproducible, the NextN head is wired, and a split plan agrees with the all-CPU plan.
Skips only while the file is absent (it lands from the model branch)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import offload.runtime as rt

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
pytestmark = pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present yet")


@pytest.fixture(scope="module")
def session():
    with rt.load(SHIPPED, devices="CPU=16GiB", quiet=True) as s:
        yield s


def test_greedy_text_is_reproducible(session):
    a = session.detokenize(session.generate("def ", max_tokens=40, stop_at_eos=False))
    b = session.detokenize(session.generate("def ", max_tokens=40, stop_at_eos=False))
    assert a == b and len(a) > 0


def test_tokenizer_round_trips_python_source(session):
    text = Path(np.__file__).read_text()[:2000]
    assert session.detokenize(session.tokenize(text)) == text


def test_nextn_head_runs_and_split_plan_agrees(session):
    ids = session.tokenize("import os\nimport sys\n\ndef main(argv):\n    return 0\n")
    cfg = session.config
    assert cfg.n_nextn == 1
    with torch.inference_mode():
        state = session.model.new_state()
        logits, hidden = session.model.forward(torch.tensor(ids), state)
        draft, h_mtp = session.model.nextn(torch.tensor(ids[1:]), hidden[:-1],
                                           torch.arange(1, len(ids)), state.nextn_cache)
    assert draft.shape == (len(ids) - 1, cfg.n_vocab) and h_mtp.shape == (len(ids) - 1, cfg.n_embd)
    assert torch.isfinite(draft).all()
    with rt.load(SHIPPED, devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True, virtual_gpus=True,
                 quiet=True) as split:
        got = split.logits(ids)
    ref = logits.numpy()
    assert np.abs(got - ref).max() < 1e-4 * np.abs(ref).max()


def test_matches_llama_cpp_on_the_shipped_model():
    """Where llama-cpp-python is installed (skipped otherwise): the same token ids from
    both tokenizers, and logits within llama.cpp's 8-bit-activation rounding, same argmax."""
    llama_cpp = pytest.importorskip("llama_cpp")
    text = "import os\nimport sys\n\ndef main(argv):\n    return 0\n"
    with rt.load(SHIPPED, devices="CPU=16GiB", cache_type="f32", quiet=True) as s:
        ids = s.tokenize(text)
        ours = s.logits(ids)
    llm = llama_cpp.Llama(model_path=str(SHIPPED), n_ctx=128, logits_all=True, verbose=False, n_threads=1)
    assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids
    llm.eval(ids)
    ref = np.array(llm.scores[:len(ids)], dtype=np.float32)
    assert np.abs(ours - ref).max() < 2e-2 * np.abs(ref).max()
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def test_cpu_experts_thread_hand_off_matches_inline(session):
    """The worker-thread path (taken when the shared expert runs on a GPU, so untaken on a
    CUDA-less box) against the inline path the all-CPU plan uses: the same kernels on the
    same inputs, so the logits must be identical, not just close."""
    from offload.moe import MoE
    moes = [b.ffn for b in session.model.blocks if isinstance(b.ffn, MoE)]
    assert moes and not any(m.overlap for m in moes)   # all-CPU: inline
    ids = session.tokenize("def quicksort(xs):\n    ")
    inline = session.logits(ids)
    try:
        for m in moes:
            m.overlap = True
        threaded = session.logits(ids)
    finally:
        for m in moes:
            m.overlap = False
    np.testing.assert_array_equal(threaded, inline)
