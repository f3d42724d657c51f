"""The compiled deepseek4 block (``offload.compiled_v4``) against the torch reference block it
was bound from: logits of decode and verify batches (T = 1…16) after a reference prefill, from
an empty cache, across compressed-window boundaries of both kinds (every 4 positions for CSA,
128 for HCA), past the window ring's first shift, after rollbacks, with the indexer choosing
(top_k smaller than the entries) and not; the caches both paths leave behind; which blocks
take the path and why the others do not. Exact verify equal to plain greedy with the
compiled path on (the default) is tests/archs/test_deepseek4.py's.

Tolerance: both paths compute in float32 from the same weights; only the order of float32
sums differs, observed ~1.4e-6 of the largest logit. REL_TOL = 1e-5 leaves 7x room; a wrong
rope pair, slot, mask or clamp shows at 1e-2 or more. The top-k model is
tests/archs/test_deepseek4.py's whose indexer scores leave a clear gap at the k-th entry (no
tie or float-noise near-tie decides, which would let either path pick)."""
from __future__ import annotations

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

import offload.runtime as rt
from offload.compiled_v4 import CompiledV4Block
from tests.archs.test_deepseek4 import IDS, SPEC
from tests.kernels.test_compiled_block import both
from tests.tiny_models import write_tiny_model

REL_TOL = 1e-5
TOP_K8 = replace(SPEC, indexer_top_k=8, indexer_n_head=16, seed=43)
# (tokens fed, then positions rolled back): 20 prefill (reference), then decode/verify batches;
# 281 positions cross 2 HCA windows and the ring's first shift (256 planned cells: ``load``)
STEPS = [(20, 0), (1, 0), (3, 0), (8, 2), (16, 0), (5, 3), (1, 0)] + [(16, 1), (7, 0)] * 10 + [(16, 4)]


def rel_err(a, ref) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max())


def load(path, **kw):
    """All on the CPU, float activations, an f32 cache; a 16-token ubatch, so the window ring is
    planned at 256 cells and drops rows within the tests' 281 positions."""
    return rt.load(path, devices="CPU=16GiB", cache_type=kw.pop("cache_type", "f32"), quiet=True,
                   decode_activations="float", int8_prefill=False, ubatch=16, ctx=512, **kw)


@pytest.fixture(scope="module", params=["all-entries", "top-k-8"])
def model_file(request, tmp_path_factory):
    spec = SPEC if request.param == "all-entries" else TOP_K8
    return write_tiny_model(tmp_path_factory.mktemp("ds4c") / f"{request.param}.gguf", spec)


def stepped(model, steps):
    """Logits of every step's batch (fed from IDS in order); rolled back after a step as
    ``steps`` says (then the rolled-back tokens are fed again). Returns (logits, state)."""
    state = model.new_state(None)
    outs, i = [], 0
    for n, back in steps:
        out, _ = model.forward(torch.tensor(IDS[i:i + n]), state)
        outs.append(out.numpy())
        i += n - back
        if back:
            state.truncate(state.n_past - back)
    return np.concatenate(outs), state


def test_cpu_blocks_take_the_compiled_path(model_file):
    with load(model_file.path) as s:
        assert all(isinstance(b, CompiledV4Block) and b.path == "compiled" for b in s.model.blocks)


def test_decode_batches_match_the_reference(model_file):
    with load(model_file.path) as s:
        (fast, fstate), (ref, rstate) = both(s.model, lambda m: stepped(m, STEPS))
    err = rel_err(fast, ref)
    print(f"\n  compiled vs reference, {fast.shape[0]} rows: rel err {err:.2e}")
    assert err < REL_TOL
    assert (fast.argmax(-1) == ref.argmax(-1)).all()
    assert fstate.caches[0].window.start > 0                 # the ring dropped rows on the way
    assert fstate.caches[2].index.count > TOP_K8.indexer_top_k
    assert_same_caches(fstate, rstate)


def assert_same_caches(a, b):
    """Every part of every block's cache: the bookkeeping equal, the rows within REL_TOL."""
    for ca, cb in zip(a.caches, b.caches):
        assert (ca.window.start, ca.window.length) == (cb.window.start, cb.window.length)
        n = ca.window.length - ca.window.start
        assert rel_err(ca.window.k[:, :n], cb.window.k[:, :n]) < REL_TOL
        for rows_a, rows_b, st_a, st_b in ((ca.compressed, cb.compressed, ca.state, cb.state),
                                           (ca.index, cb.index, ca.index_state, cb.index_state)):
            if rows_a is None:
                assert rows_b is None
                continue
            assert rows_a.count == rows_b.count and rows_a.count > 0
            assert rel_err(rows_a.values(), rows_b.values()) < REL_TOL
            assert (st_a.start, st_a.length) == (st_b.start, st_b.length)
            held = st_a.length - st_a.start
            assert rel_err(st_a.buf[:held], st_b.buf[:held]) < REL_TOL


def test_steps_from_an_empty_cache_match_the_reference(model_file):
    """A prompt of at most DECODE_TOKENS runs compiled from position 0 (no reference prefill)."""
    steps = [(16, 0), (16, 0), (1, 0), (9, 0)]
    with load(model_file.path) as s:
        (fast, _), (ref, _) = both(s.model, lambda m: stepped(m, steps))
    assert rel_err(fast, ref) < REL_TOL


def test_reference_prefill_is_continued_by_compiled_steps_and_back(model_file):
    """One state, the paths alternating: a reference prefill, compiled steps, a reference batch
    of 17 (past DECODE_TOKENS), compiled again; against the reference alone."""
    steps = [(20, 0), (4, 1), (17, 0), (8, 0), (30, 0), (3, 0)]
    with load(model_file.path) as s:
        (fast, _), (ref, _) = both(s.model, lambda m: stepped(m, steps))
    assert rel_err(fast, ref) < REL_TOL


def test_the_bookkeeping_the_kernel_advances_is_the_cache_parts_own(model_file):
    """After a compiled step the caches' integers equal what the parts' own ``append`` /
    ``extend`` leave (the reference on a copy of the cache), step sizes 1…16."""
    torch.manual_seed(0)
    with load(model_file.path) as s, torch.inference_mode():
        m = s.model
        state = m.new_state(None)
        m.forward(torch.tensor(IDS[:20]), state, logits="none")
        i = 20
        for n in (1, 2, 3, 4, 5, 8, 13, 16):
            ids, pos = torch.tensor(IDS[i:i + n]), state.positions(n)
            x = torch.randn(n, m.config.hc_mult, m.config.n_embd)
            for b, c in zip(m.blocks, state.caches):
                twin = copy.deepcopy(c)
                assert rel_err(b(x, pos, c, tokens=ids), b.reference(x, pos, twin, tokens=ids)) < REL_TOL
                assert (c.window.start, c.window.length) == (twin.window.start, twin.window.length)
                for p, q in ((c.state, twin.state), (c.index_state, twin.index_state)):
                    assert (p is None) == (q is None)
                    if p is not None:
                        assert (p.start, p.length) == (q.start, q.length)
                for p, q in ((c.compressed, twin.compressed), (c.index, twin.index)):
                    if p is not None:
                        assert p.count == q.count
            i += n


@pytest.mark.parametrize("cache_type", ["f16", "bf16", "q8_0", "q4_0"])
def test_every_cache_type_matches_the_reference(tmp_path, cache_type):
    """The window ring and the compressed entries in the cache type (the indexer's keys too),
    written and read through ``kv_rows`` as the compiled GQA block does. Bound: both paths
    round their keys and entries to the type from values a few float32 ulps apart, so a value
    near a rounding boundary lands one step of the type apart (an F16/BF16 step is 2^-11/2^-8
    of the value, a Q8_0 step 1/127 of its block's largest); measured 6.6e-5 (f16), 5.3e-5
    (bf16), 4.8e-4 (q8_0), 8.6e-7 (q4_0, whose coarse steps rarely sit that close); bounds 3e-4
    and 3e-3, still 30x under what a wrong row or offset gives."""
    tiny = write_tiny_model(tmp_path / "t.gguf", SPEC)
    steps = [(20, 0), (1, 0), (3, 0), (8, 2), (16, 0), (5, 3)] + [(16, 1), (7, 0)] * 4
    with load(tiny.path, cache_type=cache_type) as s:
        assert all(isinstance(b, CompiledV4Block) for b in s.model.blocks)
        (fast, _), (ref, _) = both(s.model, lambda m: stepped(m, steps))
    err = rel_err(fast, ref)
    print(f"\n  {cache_type} cache: rel err {err:.2e}")
    assert err < (3e-4 if cache_type in ("f16", "bf16") else 3e-3)


def test_reference_forced_by_env(tmp_path, monkeypatch):
    tiny = write_tiny_model(tmp_path / "t.gguf", SPEC)
    monkeypatch.setenv("OFFLOAD_BLOCKS", "reference")
    with load(tiny.path) as s:
        assert all(not isinstance(b, CompiledV4Block) and b.path == "reference: OFFLOAD_BLOCKS=reference"
                   for b in s.model.blocks)


def test_a_token_outside_the_hash_table_is_a_one_line_error(tmp_path):
    """The hash-routed blocks read ``ffn_gate_tid2eid`` by token id: an id past the table stops
    with an error naming the block (the kernel reads nothing out of bounds)."""
    from offload.errors import OffloadError
    tiny = write_tiny_model(tmp_path / "t.gguf", SPEC)
    with load(tiny.path) as s, torch.inference_mode():
        state = s.model.new_state(None)
        s.model.forward(torch.tensor(IDS[:3]), state, logits="none")
        with pytest.raises(OffloadError, match=r"^blk\.0: a token id outside ffn_gate_tid2eid"):
            s.model.blocks[0](torch.zeros(1, 4, SPEC.n_embd), state.positions(1), state.caches[0],
                              tokens=torch.tensor([10 ** 6]))


def test_hybrid_blocks_hand_their_clamped_experts_to_the_compiled_step(tmp_path):
    """Blocks on a (virtual) GPU, routed experts in RAM: decode steps hand the experts to the
    compiled ``routed_ffn`` with the block's clamp (``RoutedHandoff``); logits as the all-CPU
    plan's within REL_TOL (the clamp at 2 bites: tests/archs/test_deepseek4.py's SPEC)."""
    from offload.cpu_ops import RoutedHandoff
    from offload.moe import MoE
    tiny = write_tiny_model(tmp_path / "t.gguf", SPEC)
    steps = [(20, 0), (1, 0), (3, 0), (8, 2), (5, 0)]
    with load(tiny.path) as s, torch.inference_mode():
        all_cpu, _ = stepped(s.model, steps)
    with rt.load(tiny.path, devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True, virtual_gpus=True, cache_type="f32",
                 quiet=True, decode_activations="float", int8_prefill=False) as s, torch.inference_mode():
        assert all(b.device_name == "CUDA0" and b.path == "reference: block on CUDA0" for b in s.model.blocks)
        hybrid, _ = stepped(s.model, steps)
        moes = [b.ffn for b in s.model.blocks if isinstance(b.ffn, MoE)]
        assert moes and all(isinstance(m._handoff, RoutedHandoff) for m in moes)
    assert rel_err(hybrid, all_cpu) < REL_TOL


ROWS = ([1, 2, 1], [2, 1, 1], [4, 4, 4], [3, 1, 2])      # rows per sequence in each batched step


def test_several_sequences_match_the_reference(model_file, monkeypatch):
    """Three sequences stepped together (continuous batching, a ``SequenceBatch`` per block):
    each sequence's attention half over its own cache, one FFN half over every row; against
    the reference blocks, over steps of 1–4 rows per sequence at three cache lengths (one
    past a CSA window boundary on the way, one across the ring's planned cells)."""
    def steps(m):
        states = [m.new_state(None) for _ in range(3)]
        for st, n in zip(states, (21, 5, 40)):
            m.forward(torch.tensor(IDS[:n]), st, logits="none")
        out = []
        for rows in ROWS:
            seqs = [(torch.tensor(IDS[50:50 + r]), st, "all") for r, st in zip(rows, states)]
            out += [z.numpy() for z, _ in m.forward_batch(seqs)]
        return np.concatenate(out)

    calls = []
    attend = CompiledV4Block._attend
    monkeypatch.setattr(CompiledV4Block, "_attend", lambda self, xh, *a: calls.append(len(xh)) or attend(self, xh, *a))
    with load(model_file.path) as s:
        fast, ref = both(s.model, steps)
        n_blocks = len(s.model.blocks)
    # compiled: the 5-token prompt; then per step, per block, each sequence's own rows in turn
    assert calls == [5] * n_blocks + [r for rows in ROWS for _ in range(n_blocks) for r in rows]
    assert rel_err(fast, ref) < REL_TOL
