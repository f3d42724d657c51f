"""The hybrid hand-off (block on a GPU, its routed experts in RAM): decode/verify batches go
to the CPU through host buffers bound once and one compiled call (``cpu_kernels.moe``
``routed_ffn_host``), instead of new host arrays and ``moe_ffn``'s Python grouping per call.

Blocks on ``--virtual-gpus`` devices are torch CPU tensors, so this runs the hand-off's CPU
path; its CUDA path (pinned buffers, non-blocking copies, an event) has not run here.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import cpu_kernels as ck
import offload.runtime as rt
from cpu_kernels.moe import routed_ffn_host, routed_int8_scratch, routed_scratch
from cpu_kernels.simd8 import has_int8_dot
from offload.cpu_ops import CpuExperts, RoutedHandoff
from offload.moe import MoE
from offload.profile import Profile
from tests.runtime.test_runtime_placement import IDS, REL_TOL
from tests.tiny_models import TinySpec, random_tensor, write_tiny_model

# routed_ffn and moe_ffn run the same phases on the same grouping, in the same order; only
# the 16-column sums that the decoders' offsets multiply are added in another order (a
# loop here, numpy's pairwise sum there): float32 rounding, ~1e-7 of the output scale.
KERNEL_TOL = 1e-5
HYBRID = dict(devices="CUDA0=8GiB,CPU=16GiB", cpu_moe=True, virtual_gpus=True, cache_type="f32", quiet=True)


def _experts(rng, gt, dt, fused, E=16, n_embd=256, n_ff=64):
    if fused:
        gu = random_tensor(rng, (E, 2 * n_ff, n_embd), gt, 0.05)[0]
        gate = up = None
    else:
        gate, up = (random_tensor(rng, (E, n_ff, n_embd), gt, 0.05)[0] for _ in range(2))
        gu = None
    down = random_tensor(rng, (E, n_embd, n_ff), dt, 0.05)[0]
    return ck.ExpertWeights(gate, up, down, None if fused else gt, None if fused else gt, dt,
                            gate_up=gu, gate_up_type=gt if fused else None, name="blk.3")


def _bound(ew, m, k, int8=False):
    """routed_ffn_host's arguments over buffers for m tokens: (X, bsums, ids, wts, owned=None,
    tags and views, clamp 0 (SiLU), scratch, int8 scratch qx, qh (``int8``: as moe_ffn's), Y)."""
    (gk, gb, g0, _), (uk, ub, u0, _) = ew._parts
    dk, db = ew._down
    return [np.zeros((m, ew.n_embd), np.float32), np.zeros((m, ew.n_embd // 16), np.float32),
            np.zeros((m, k), np.int64), np.zeros((m, k), np.float32), None,
            gk.tag, gb, g0, uk.tag, ub, u0, dk.tag, db, np.float32(0),
            routed_scratch(m * k, ew.n_expert, ew.n_ff, ew.n_embd, 2),
            *routed_int8_scratch(ew, m, k, int8), np.full((m, ew.n_embd), np.nan, np.float32)]


def _cases():
    """Every mode on the first pair; the fused and value-table pairs in "auto" (by type), their
    other modes in the full tier."""
    pairs = [((Q.Q8_0, Q.Q4_0, False), "q8_0-q4_0"), ((Q.Q4_K, Q.Q8_0, True), "q4_k-fused"),
             ((Q.Q8_0, Q.MXFP4, False), "q8_0-mxfp4")]
    for i, (pair, name) in enumerate(pairs):
        for int8, mode in ((False, "float"), ("auto", "auto"), (True, "int8")):
            marks = () if i == 0 or mode == "auto" else pytest.mark.full
            yield pytest.param(*pair, int8, id=f"{name}-{mode}", marks=marks)


@pytest.mark.parametrize("gt,dt,fused,int8", list(_cases()))
def test_routed_ffn_equals_moe_ffn(gt, dt, fused, int8):
    """Float, int8 per phase ("auto": by type) and int8 everywhere: the same codes as
    moe_ffn's (quantized from the same rows), so the same tolerance."""
    rng = np.random.default_rng(11)
    ew, k, m = _experts(rng, gt, dt, fused), 4, 16
    args = _bound(ew, m, k, int8)
    if int8 is True and has_int8_dot():
        assert args[-3] is not None and args[-2] is not None          # both phases bound int8
    X, _, I, W, _ = args[:5]
    Y = args[-1]
    owned = rng.random(ew.n_expert) < 0.5
    for t in (1, 2, 5, 8, 16):
        x = rng.standard_normal((t, ew.n_embd)).astype(np.float32)
        ids = np.stack([rng.choice(ew.n_expert, k, replace=False) for _ in range(t)])
        if t == 16:                                  # many tokens on one expert
            ids[:, 0] = 3
        w = rng.random((t, k)).astype(np.float32)
        X[:t], I[:t], W[:t] = x, ids, w
        Y[:] = np.nan
        for own in (None, owned):
            args[4] = own
            n = routed_ffn_host(t, *args, 2)
            want = ck.moe_ffn(x, ids, w, ew, owned=own, int8=int8)
            scale = np.abs(want).max()
            assert n == len(set(ids.ravel()) & (set(range(ew.n_expert)) if own is None else set(np.flatnonzero(own))))
            assert np.abs(Y[:t] - want).max() <= KERNEL_TOL * scale, (t, own is None)
            assert np.isnan(Y[t:]).all()             # rows past t are not written
    # an id outside 0..E-1: -1, Y untouched (nothing indexed out of bounds)
    I[0, 0] = ew.n_expert
    Y[:] = 7.0
    assert routed_ffn_host(1, *args, 2) == -1 and (Y == 7.0).all()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    spec = TinySpec(arch="glm4moe", nextn=True, n_rot=16)
    return write_tiny_model(tmp_path_factory.mktemp("m") / "tiny.gguf", spec)


def _moes(s) -> list[MoE]:
    return [b.ffn for b in s.model.blocks if isinstance(getattr(b, "ffn", None), MoE)]


def _steps(s, chunks) -> list[np.ndarray]:
    """Logits of each chunk of tokens fed through the KV cache in turn: a prompt (prefill,
    more than 16 tokens) then decode/verify steps of 1..8 tokens."""
    with torch.inference_mode():
        state = s.model.new_state()
        return [s.model.forward(torch.tensor(c), state)[0].numpy().copy() for c in chunks]


CHUNKS = [IDS * 2] + [IDS[:t] for t in range(1, 9)]          # 20 tokens, then T = 1..8


def test_hybrid_logits_equal_the_old_hand_off_and_the_all_cpu_plan(tiny, monkeypatch):
    old_calls = []
    old_call = CpuExperts.__call__
    monkeypatch.setattr(CpuExperts, "__call__", lambda self, *a: old_calls.append(a[0].shape[0]) or old_call(self, *a))
    with rt.load(tiny.path, devices="CPU=16GiB", cache_type="f32", quiet=True) as s:
        all_cpu = _steps(s, CHUNKS)
    old_calls.clear()
    with rt.load(tiny.path, **HYBRID) as s:
        moes = _moes(s)
        assert moes and all(m.experts.device.type == "cpu" for m in moes)
        assert all(b.device_name == "CUDA0" for b in s.model.blocks)      # blocks on the (virtual) GPU
        new = _steps(s, CHUNKS)
        # the prompt went to moe_ffn (one call per MoE layer), every decode step to the compiled hand-off
        assert old_calls == [len(CHUNKS[0])] * len(moes)
        assert all(isinstance(m._handoff, RoutedHandoff) for m in moes)
        for m in moes:
            m.compiled_handoff = False
        old = _steps(s, CHUNKS)
    for i, (a, b, c) in enumerate(zip(new, old, all_cpu)):
        scale = np.abs(c).max()
        assert np.abs(a - b).max() < REL_TOL * scale, f"chunk {i}: new vs old hand-off"
        assert np.abs(a - c).max() < REL_TOL * scale, f"chunk {i}: hybrid vs all-CPU"


def test_exact_speculative_equals_plain_greedy_on_a_hybrid_plan(tiny):
    with rt.load(tiny.path, **HYBRID) as s:
        plain = list(s.generate(IDS, max_tokens=12, stop_at_eos=False))
        spec = list(s.generate(IDS, max_tokens=12, stop_at_eos=False, n_max=3, verify="exact"))
        assert any(isinstance(m._handoff, RoutedHandoff) for m in _moes(s))
    assert spec == plain and len(plain) == 12


@pytest.fixture(scope="module")
def layer(tiny):
    """(block 1's CpuExperts with its own Profile, k) from a hybrid session kept open: the
    expert views point into its memory-mapped file."""
    with rt.load(tiny.path, **HYBRID) as s:
        moe = _moes(s)[0]
        yield CpuExperts(moe.experts.weights, Profile()), moe.router.k


@pytest.mark.parametrize("decode", [None, "int8"], ids=["float", "int8-decode"])
def test_no_allocation_per_call(layer, decode):
    """100 decode-sized calls of the bound hand-off: the result is always the same view of the
    same host buffer, and traced allocation (numpy's and Numba's runtime buffers are traced;
    what remains is Numba's schedule for each parallel launch, ~1 KB) peaks below a quarter of
    one output's size; the old hand-off, measured the same way, allocates more than an output.
    With int8 decode activations the int8 scratch is bound too (nothing allocated per call)."""
    experts, k = layer
    ew = experts.weights
    if decode is not None:
        experts = CpuExperts(ew, Profile(), int8_batch=17, decode=decode)
    h = experts.handoff(torch.device("cpu"), k, None, 16)
    assert h._modes == ((has_int8_dot(),) * 2 if decode == "int8" else (False, False))
    rng = np.random.default_rng(5)
    t = 16
    x = torch.from_numpy(rng.standard_normal((t, ew.n_embd)).astype(np.float32))
    ids = torch.from_numpy(np.stack([rng.choice(ew.n_expert, k, replace=False) for _ in range(t)]))
    w = torch.from_numpy(rng.random((t, k)).astype(np.float32))
    out_bytes = t * ew.n_embd * 4
    first = h.run(h.load(x, ids, w))
    ptr = first.data_ptr()
    # the call's argument tuple has 20 items: Python 3.11 keeps up to 2000 freed tuples of that
    # size in a free list it does not take them from again (traced: 200 B a call until it is full)
    for _ in range(2100):
        h.run(h.load(x, ids, w))

    def peak(call) -> int:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            for _ in range(100):
                call()
            return tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()

    same = []
    new_peak = peak(lambda: same.append(h.run(h.load(x, ids, w)) is first))
    xh, ih, wh = x.numpy(), ids.numpy(), w.numpy()
    old_peak = peak(lambda: experts(xh, ih, wh))
    assert all(same) and len(same) == 100 and h.run(h.load(x, ids, w)).data_ptr() == ptr
    assert new_peak < out_bytes / 4 < out_bytes < old_peak, (new_peak, out_bytes, old_peak)
    want = experts(xh, ih, wh)
    assert np.abs(first.numpy() - want).max() <= KERNEL_TOL * np.abs(want).max()


def test_owned_mask_and_fallbacks(layer):
    """Hot experts: with no expert owned the CPU side is exactly zero. Not taken (moe_ffn
    runs them): a batch past the buffers, another k, experts with biases, int8 activations."""
    experts, k = layer
    ew = experts.weights
    h = experts.handoff(torch.device("cpu"), k, np.zeros(ew.n_expert, bool), 16)
    x = torch.ones((2, ew.n_embd))
    ids = torch.tensor([list(range(k))] * 2)
    w = torch.ones((2, k))
    assert h.takes(x, ids) and not h.run(h.load(x, ids, w)).any()
    assert not h.takes(torch.ones((17, ew.n_embd)), torch.zeros((17, k), dtype=torch.int64))
    assert not h.takes(x, ids[:, :1])
    biased = CpuExperts(ew, Profile(), biases={"down": np.zeros((ew.n_expert, ew.n_embd), np.float32)})
    assert biased.handoff(torch.device("cpu"), k, None, 16) is None

    # int8 activations: the process setting sends decode batches to moe_ffn (where the CPU
    # has VNNI or AVX2: elsewhere both run float); int8 only for prompts (int8_batch 17) does not
    prompt_only = CpuExperts(ew, Profile(), int8_batch=17).handoff(torch.device("cpu"), k, None, 16)
    ck.set_int8_activations(True)
    try:
        assert h.takes(x, ids) is not has_int8_dot()
        assert prompt_only.takes(x, ids)
    finally:
        ck.set_int8_activations(False)


def test_bench_prints_both_hand_offs(tiny, capsys):
    """bench.hybrid_handoff runs (tiny settings) and prints the rows it promises."""
    from bench.hybrid_handoff import main
    assert main([str(tiny.path), "--calls", "3", "--tokens", "3", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("CPU side", "bare expert kernel", "hand-off = CPU side - kernel", "whole MoE layer call",
                "decode t/s"):
        assert row in out
