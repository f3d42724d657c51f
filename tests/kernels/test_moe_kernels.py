"""The fused expert FFN (``cpu_kernels.moe_ffn``) against a float64 reference: top-k routing
over 128 experts, partial ownership, fused gate_up, float and int8 activations.

Tolerances as tests/kernels/test_cpu_kernels.py's (float32 rounding of the true dequantized
weights: TOL of the magnitudes); int8 below. The per-type row routines the MoE phases call
are matmul's, checked there for every type.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

import cpu_kernels as ck
from cpu_kernels.registry import get_kernel
from cpu_kernels.synth import random_blocks
from tests.kernels.test_cpu_kernels import TOL, dequant, moe_reference, seed, silu

# ---------------------------------------------------------------------------- MoE

full = pytest.mark.full
MOE_CASES = [  # gate/up type, down type, fused gate_up
    (T.Q4_K, T.Q6_K, False),
    (T.Q8_0, T.Q4_0, False),
    (T.MXFP4, T.IQ4_XS, True),
    # a lattice type on each side (the MoE phases call the same per-type row routines as
    # matmul, which test_matmul_random_blocks checks for every lattice type)
    (T.IQ1_M, T.IQ2_S, True),
    # the other lattice types through the MoE phases too (DeepSeek's 1.58-bit: IQ1_S gate/up,
    # IQ2_XXS down): the full tier
    pytest.param(T.IQ1_S, T.IQ2_XXS, False, marks=full),
    pytest.param(T.IQ2_XS, T.IQ3_XXS, False, marks=full),
    pytest.param(T.IQ3_S, T.IQ1_M, False, marks=full),
]


@pytest.mark.parametrize("gt,dt,fused", MOE_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_moe_matches_reference(gt, dt, fused):
    rng = seed(7, gt, dt)
    E, n_embd, n_ff, k = 128, 256, 512, 8
    scale = 0.02
    if fused:
        gu = random_blocks(gt, (E, 2 * n_ff, n_embd), rng, scale)
        G, U = dequant(gu, gt)[:, :n_ff], dequant(gu, gt)[:, n_ff:]
        gate = up = None
    else:
        gate, up = random_blocks(gt, (E, n_ff, n_embd), rng, scale), random_blocks(gt, (E, n_ff, n_embd), rng, scale)
        G, U = dequant(gate, gt), dequant(up, gt)
        gu = None
    down = random_blocks(dt, (E, n_embd, n_ff), rng, scale)
    D = dequant(down, dt)
    ew = ck.ExpertWeights(gate, up, down, None if fused else gt, None if fused else gt, dt,
                          gate_up=gu, gate_up_type=gt if fused else None, name="blk.5")
    assert (ew.n_expert, ew.n_embd, ew.n_ff) == (E, n_embd, n_ff)
    owned = rng.random(E) < 0.5
    for B in (1, 3, 16):
        x = rng.standard_normal((B, n_embd)).astype(np.float32)
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(B)]).astype(np.int32)
        if B == 16:                                  # several tokens on one expert
            ids[:, 0] = ids[0, 0]
        wts = rng.random((B, k)).astype(np.float32)
        for own in (None, owned):
            y = ck.moe_ffn(x, ids, wts, ew, owned=own)
            ref, bound = moe_reference(x, ids, wts, G, U, D, own)
            assert y.dtype == np.float32 and y.shape == (B, n_embd)
            err = np.abs(y - ref)
            assert np.all(err <= bound), f"B={B}: max err/bound {np.max(err / bound):.3g}"


def test_moe_owned_parts_add_up_and_batch_equals_single_tokens():
    rng = seed(8)
    E, n_embd, n_ff, k, B = 128, 256, 256, 8, 6
    ws = [random_blocks(t, s, rng, 0.02) for t, s in ((T.Q8_0, (E, n_ff, n_embd)), (T.Q8_0, (E, n_ff, n_embd)),
                                                      (T.Q4_0, (E, n_embd, n_ff)))]
    ew = ck.ExpertWeights(*ws, T.Q8_0, T.Q8_0, T.Q4_0)
    x = rng.standard_normal((B, n_embd)).astype(np.float32)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(B)])
    ids[1] = ids[0]                                   # two tokens with identical routing
    wts = rng.random((B, k)).astype(np.float32)
    owned = rng.random(E) < 0.3
    y_all = ck.moe_ffn(x, ids, wts, ew)
    parts = ck.moe_ffn(x, ids, wts, ew, owned=owned) + ck.moe_ffn(x, ids, wts, ew, owned=~owned)
    np.testing.assert_allclose(parts, y_all, rtol=1e-5, atol=1e-5 * np.abs(y_all).max())
    single = np.concatenate([ck.moe_ffn(x[i:i + 1], ids[i:i + 1], wts[i:i + 1], ew) for i in range(B)])
    np.testing.assert_allclose(y_all, single, rtol=1e-5, atol=1e-5 * np.abs(y_all).max())
    assert not np.any(ck.moe_ffn(x, ids, wts, ew, owned=np.zeros(E, bool)))


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_row_routines_take_flat_weight_bytes(int8):
    """The MoE phases (3-D expert stacks) and matmul (2-D matrices) hand the row routines
    their weights' flat bytes, so a quant type's routines are one compiled copy for both (a
    copy per weight shape: 315 3-D copies among a cold suite's 1,820 compiles). The routines hold that
    contract while Numba types them: a 2-D weight fails to compile, naming it. (Every MoE and
    matmul test here and in test_cpu_kernels compiles through the same check.)"""
    from numba import njit
    from numba.core.errors import TypingError

    from cpu_kernels.rowdot import dot4
    from cpu_kernels.rowdot8 import dot4_i8
    tag = get_kernel(T.Q8_0).tag
    w = np.zeros((4, 34), np.uint8)
    f = np.zeros((1, 32), np.float32)
    if int8:
        call = njit(lambda w: dot4_i8(tag, w, 0, 34, 68, 102, 32, np.zeros((1, 64), np.int8), f, f, f, f,
                                      np.zeros(1, np.int64), 1, np.zeros(64, np.float32),
                                      np.zeros(4, np.float32), np.zeros((1, 4), np.float32)))
    else:
        call = njit(lambda w: dot4(tag, w, 0, 34, 68, 102, 32, f, f, np.zeros(1, np.int64), 1,
                                   np.zeros(64, np.float32), np.zeros(4, np.float32),
                                   np.zeros((1, 4), np.float32), np.zeros(64, np.float32)))
    with pytest.raises(TypingError, match="flat weight bytes"):
        call(w)


def test_moe_identity_experts_known_answer():
    """F32 experts with gate = up = down = identity: each token's output is
    (sum of its owned routing weights) * silu(x) * x exactly (up to float32 rounding)."""
    E, n, k = 4, 64, 2
    eye = np.broadcast_to(np.eye(n, dtype=np.float32), (E, n, n)).copy()
    ew = ck.ExpertWeights(eye, eye.copy(), eye.copy(), T.F32, T.F32, T.F32)
    x = np.linspace(-4, 4, 3 * n, dtype=np.float32).reshape(3, n)
    ids = np.array([[0, 1], [2, 3], [1, 3]])
    wts = np.array([[0.25, 0.75], [0.5, 0.5], [1.0, 2.0]], np.float32)
    owned = np.array([True, True, False, True])
    y = ck.moe_ffn(x, ids, wts, ew, owned=owned)
    xd = x.astype(np.float64)
    expect = np.array([[1.0], [0.5], [3.0]]) * silu(xd) * xd
    np.testing.assert_allclose(y, expect, rtol=1e-6, atol=1e-6)


def test_moe_input_errors():
    rng = seed(9)
    ws = [random_blocks(T.Q8_0, s, rng) for s in ((4, 32, 64), (4, 32, 64), (4, 64, 32))]
    ew = ck.ExpertWeights(*ws, T.Q8_0, T.Q8_0, T.Q8_0, name="blk.2")   # fails before compiling
    x = np.ones((2, 64), np.float32)
    w = np.ones((2, 2), np.float32)
    with pytest.raises(ValueError, match="blk.2: expert id outside 0..3"):
        ck.moe_ffn(x, np.array([[0, 4], [1, 2]]), w, ew)
    with pytest.raises(ValueError, match="owned"):
        ck.moe_ffn(x, np.array([[0, 3], [1, 2]]), w, ew, owned=np.ones(3, bool))
    with pytest.raises(ValueError, match="activation"):
        ck.moe_ffn(x, np.array([[0, 3], [1, 2]]), w, ew, act="gelu")
    with pytest.raises(ValueError, match=r"\[B=2, k\]"):
        ck.moe_ffn(x, np.array([0, 3]), w, ew)
    with pytest.raises(ValueError, match="does not match"):
        ck.ExpertWeights(np.ascontiguousarray(ws[0][:, :16]), ws[1], ws[2], T.Q8_0, T.Q8_0, T.Q8_0,
                         name="blk.2")


INT8_MOE_CASES = [  # gate/up type, down type, fused gate_up, n_ff
    (T.Q4_K, T.Q6_K, False, 512),     # 256-weight blocks: sub-block pairs (rowdot8)
    (T.Q4_0, T.Q8_0, False, 480),     # block pairs; n_ff = 15 blocks: down's last block alone
    (T.MXFP4, T.Q5_1, True, 480),     # value table and e8m0 scales; mins and 5th bits
    # lattice types (grid bytes + 128 as codes; their int8 row routines are test_int8_matmul's
    # for every type): the full tier
    pytest.param(T.IQ1_S, T.IQ2_XXS, False, 512, marks=full),
    pytest.param(T.IQ3_S, T.IQ1_M, True, 512, marks=full),
]


@pytest.mark.parametrize("gt,dt,fused,n_ff", INT8_MOE_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_int8_moe(gt, dt, fused, n_ff, int8_mode):
    """Two quantization steps (x, then the expert hidden state): each adds at most
    ~1/254 of max|.| per 32 values; against the exact float64 result the error stays
    under 3% of the same magnitude bound as the float test (observed ~0.3%). B = 1 takes
    the one-token routines, B = 4 and 16 the token-batch ones (16: one expert shared), B = 40
    the prompt-batch GEMM (the shared expert: two full tiles and one of 8 tokens; experts
    with fewer than GEMM_MIN_LANES tokens go token by token)."""
    rng = seed(11, gt, dt)
    E, n_embd, k = 64, 256, 8
    if fused:
        gu = random_blocks(gt, (E, 2 * n_ff, n_embd), rng, 0.02)
        G, U = dequant(gu, gt)[:, :n_ff], dequant(gu, gt)[:, n_ff:]
        g = u = None
    else:
        g, u = random_blocks(gt, (E, n_ff, n_embd), rng, 0.02), random_blocks(gt, (E, n_ff, n_embd), rng, 0.02)
        G, U = dequant(g, gt), dequant(u, gt)
        gu = None
    d = random_blocks(dt, (E, n_embd, n_ff), rng, 0.02)
    ew = ck.ExpertWeights(g, u, d, None if fused else gt, None if fused else gt, dt,
                          gate_up=gu, gate_up_type=gt if fused else None)
    for B in (1, 4, 16, 40):
        x = rng.standard_normal((B, n_embd)).astype(np.float32)
        ids = np.stack([rng.choice(E, k, replace=False) for _ in range(B)])
        if B >= 16:
            ids[:, 0] = ids[0, 0]
        wts = rng.random((B, k)).astype(np.float32)
        y = ck.moe_ffn(x, ids, wts, ew)
        ref, bound = moe_reference(x, ids, wts, G, U, dequant(d, dt), None)
        assert np.all(np.abs(y - ref) <= bound * (0.03 / TOL)), f"B={B}"


@pytest.mark.parametrize("gt,dt", [(T.Q4_0, T.Q8_0), (T.Q4_K, T.Q6_K)], ids=lambda v: v.name)
def test_prompt_batch_gemm_phases_equal_the_token_phases(gt, dt, int8_mode):
    """The GEMM phases of a prompt batch (``gemm8``: tokens in lanes) and the token-batch
    phases (``rowdot8``) on the same quantized inputs: the same integer dot products and
    scales summed in another order, so float32 rounding only (1e-5 of the magnitudes; observed
    ~1e-7). Expert sizes cover full tiles, a partial tile, and slots under GEMM_MIN_LANES."""
    from cpu_kernels import moe as M
    from cpu_kernels.matmul import quantized_activations
    from placement.limits import GEMM_MIN_LANES
    rng = seed(12, gt, dt)
    E, n_embd, n_ff, k, B = 8, 256, 256, 4, 60
    ew = ck.ExpertWeights(*(random_blocks(t, shape, rng, 0.02) for t, shape in
                            ((gt, (E, n_ff, n_embd)), (gt, (E, n_ff, n_embd)), (dt, (E, n_embd, n_ff)))),
                          gt, gt, dt)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(B)])
    ids[GEMM_MIN_LANES - 1:, :] = np.where(ids[GEMM_MIN_LANES - 1:] == 7, 0, ids[GEMM_MIN_LANES - 1:])
    flat = ids.reshape(-1).astype(np.int64)
    order = np.argsort(flat, kind="stable")
    tok = np.repeat(np.arange(B, dtype=np.int64), k)[order]
    flat = flat[order]
    first = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])
    se, ss = flat[first], np.r_[first, flat.size].astype(np.int64)
    sizes = np.diff(ss)
    assert sizes.max() > 16 and sizes.min() < GEMM_MIN_LANES and np.any(sizes % 16 >= GEMM_MIN_LANES)
    (gk, gw, g0, _), (uk, uw, u0, _) = ew._parts
    dk, dw = ew._down
    x = rng.standard_normal((B, n_embd)).astype(np.float32)
    xq, dx, bs, xs4, dx8 = quantized_activations(x)
    H = np.empty((flat.size, n_ff), np.float32)
    H_gemm = np.empty_like(H)
    M._gate_up_phase(gk.tag, gw, g0, uk.tag, uw, u0, x, bs, xq, dx, xs4, dx8, se, ss, tok, H, 2, np.float32(0))
    M._gate_up_gemm_rows(gk.tag, gw, g0, uk.tag, uw, u0, xq, dx, bs, xs4, dx8, se, ss, tok, H_gemm, 2,
                         np.float32(0), GEMM_MIN_LANES)
    assert np.all(np.abs(H_gemm - H) <= 1e-5 * np.abs(H).max())
    hq = quantized_activations(H)
    out = np.empty((flat.size, n_embd), np.float32)
    out_gemm = np.empty_like(out)
    M._down_phase(dk.tag, dw, H, hq[2], hq[0], hq[1], hq[3], hq[4], se, ss, out, 2)
    M._down_gemm_rows(dk.tag, dw, *hq, se, ss, out_gemm, 2, GEMM_MIN_LANES)
    assert np.all(np.abs(out_gemm - out) <= 1e-5 * np.abs(out).max())


def test_vector_silu_glu_is_the_scalar_one():
    """simd.vsilu_glu (the prompt-batch GEMM's gate·up epilogue, 16 lanes) against moe._silu_glu
    (scalar, libm exp), both compiled as the kernels are (fast-math): finite results within
    1e-6 relative (its exp is Cephes' polynomial, ~1 ulp, then a division); the same zeros —
    gates at or below -80, NaN gates or ups, results under float32's smallest normal — with
    and without the clamp (DeepSeek-V4's swiglu_clamp at 7)."""
    from numba import njit

    from cpu_kernels.moe import _silu_glu
    from cpu_kernels.simd import vload, vsilu_glu, vstore

    @njit(fastmath=True, error_model="numpy")
    def lanes(g, u, clamp, out):
        for i in range(0, g.size, 16):
            vstore(out, i, vsilu_glu(vload(g, i), vload(u, i), clamp))

    @njit(fastmath=True, error_model="numpy")
    def scalar(g, u, clamp, out):
        for i in range(g.size):
            out[i] = _silu_glu(g[i], u[i], clamp)

    rng = seed(40)
    n = 1 << 14
    g = (rng.standard_normal(n) * rng.choice([0.01, 1, 10, 50, 100], n)).astype(np.float32)
    u = (rng.standard_normal(n) * rng.choice([1e-37, 1e-3, 1, 10], n)).astype(np.float32)
    g[:6] = [np.nan, -80, -80.001, 0, 87, -1e-3]
    u[6:8] = [np.nan, 0]
    for clamp in (np.float32(0), np.float32(7)):
        got, want = np.empty(n, np.float32), np.empty(n, np.float32)
        lanes(g, u, clamp, got)
        scalar(g, u, clamp, want)
        np.testing.assert_array_equal(got == 0, want == 0)
        assert not np.isnan(got).any() and not np.isnan(want).any()
        nz = want != 0
        assert nz.sum() > n // 2
        assert np.all(np.abs(got[nz] - want[nz]) <= 1e-6 * np.abs(want[nz]))
