"""DeepSeek-V4's compiled FFN half (``cpu_kernels.v4_ffn``: mHC pre-mix, ffn_norm, √softplus
routing by top-k or by hash table, clamped routed and shared experts, mHC combine, one call)
against the torch reference the deepseek4 block runs (``gpu.hyper.HyperConnection``,
``gpu.norm.RMSNorm``, ``gpu.router``'s routers, ``offload.moe.MoE`` over ``gpu.experts``
with the weights dequantized, ``gpu.ffn.SwiGLU`` with the clamped GLU), and its routing helper
alone against the routers on the same logits.

Tolerances:
- routing: same ids; weights within ROUTE_TOL = 1e-6 relative (float32 libm exp/log1p and the
  order of a k-term sum against torch's: a few ulp).
- the whole half, float activations: both paths compute in float32 from the same weights
  (quantized ones dequantized exactly to float32 for torch; the kernels decode the same
  values), so only the order of float32 sums differs; REL_TOL = 1e-5 of the largest output
  (tests/kernels/test_compiled_block.py's bound; observed here <= 3.5e-7). The FFN's output is
  checked to be a sizeable part of that scale (~0.4 of it), so a wrong expert, weight or clamp
  shows (without the clamps: ~1).
- int8 activations (``qx``/``qh`` bound): the reference quantizes the same rows the same way
  (``moe_ffn`` through ``CpuExperts`` in int8 mode), but its input differs by float32
  rounding, so an activation at a rounding boundary of its 1/127 step can take the
  neighbouring code (tests/kernels/test_decode_activations.py); REL_TOL_INT8 = 1e-2
  (observed here 2.5e-7: the same codes; int8 against float activations 5e-3).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import cpu_kernels as ck
from cpu_kernels.layout import weight_bytes
from cpu_kernels.moe import routed_int8_scratch
from cpu_kernels.registry import get_kernel
from cpu_kernels.simd8 import has_int8_dot
from cpu_kernels.v4_ffn import sqrt_softplus_route, v4_ffn_half
from gpu.experts import TorchExperts
from gpu.ffn import SwiGLU, glu
from gpu.hyper import HyperConnection
from gpu.norm import RMSNorm
from gpu.quant import QuantTensor
from gpu.router import HashRouter, SqrtSoftplusRouter
from offload.cpu_ops import CpuExperts
from offload.moe import MoE
from offload.profile import Profile
from tests.tiny_models import random_tensor

ROUTE_TOL = 1e-6
REL_TOL = 1e-5
REL_TOL_INT8 = 1e-2
CHUNKS = 2
N_STREAMS, D, N_EXPERT, K, N_FF, N_VOCAB = 4, 128, 16, 4, 64, 40
EPS, HC_EPS, HC_ITERS, W_SCALE = 1e-6, 1e-6, 20, 1.5
# small enough that gate and up pass them (asserted): the clamped SwiGLU of both kinds of expert
CLAMP_EXP, CLAMP_SH = np.float32(1.0), np.float32(1.25)
WEIGHTS = {"f32": (Q.F32, Q.F32), "quant": (Q.MXFP4, Q.Q8_0)}     # (routed, shared and router): V4-Flash's


def _proj(w: np.ndarray):
    """x @ w.T over float32 weights: the torch reference's projections."""
    wt = torch.from_numpy(w)
    return lambda x: x @ wt.T


def _hash_table(rng) -> np.ndarray:
    """(n_vocab, K) int32 of distinct expert ids per token, as ``offload.weights.table`` gives."""
    return np.stack([rng.choice(N_EXPERT, K, replace=False) for _ in range(N_VOCAB)]).astype(np.int32)


# ---------------------------------------------------------------------------- routing alone


def _route(logits, probs_b, table, tokens):
    ids = np.full((logits.shape[0], K), -7, np.int64)
    wts = np.full((logits.shape[0], K), np.nan, np.float32)
    status = sqrt_softplus_route(logits, probs_b, table, tokens, W_SCALE, ids, wts)
    return status, ids, wts


def _logits(rng, t):
    """Router logits across softplus's regimes: tiny scores, log1p(exp), and past its threshold
    of 20 (identity)."""
    logits = (rng.standard_normal((t, N_EXPERT)) * 4).astype(np.float32)
    logits[0, :3] = (-30.0, 21.0, 19.5)
    return logits


def test_top_k_route_is_the_sqrt_softplus_router():
    rng = np.random.default_rng(1)
    logits = _logits(rng, 8)
    bias = (rng.standard_normal(N_EXPERT) * 0.5).astype(np.float32)
    status, ids, wts = _route(logits, bias, None, np.arange(8, dtype=np.int64))
    want_ids, want_w = SqrtSoftplusRouter(lambda x: x, torch.from_numpy(bias), k=K, scale=W_SCALE)(
        torch.from_numpy(logits))
    assert status == 0
    np.testing.assert_array_equal(ids, want_ids.numpy())
    np.testing.assert_allclose(wts, want_w.numpy(), rtol=ROUTE_TOL, atol=0)


def test_hash_route_is_the_hash_router():
    rng = np.random.default_rng(2)
    logits, table = _logits(rng, 8), _hash_table(rng)
    tokens = rng.integers(0, N_VOCAB, 8).astype(np.int64)
    status, ids, wts = _route(logits, None, table, tokens)
    want_ids, want_w = HashRouter(lambda x: x, torch.from_numpy(table), scale=W_SCALE)(
        torch.from_numpy(logits), torch.from_numpy(tokens))
    assert status == 0
    np.testing.assert_array_equal(ids, want_ids.numpy())
    np.testing.assert_allclose(wts, want_w.numpy(), rtol=ROUTE_TOL, atol=0)


def test_route_refuses_ids_outside_the_table_and_the_experts():
    """-1, nothing read out of bounds: a token id past the table, a table entry past the experts."""
    rng = np.random.default_rng(3)
    logits, table = _logits(rng, 2), _hash_table(rng)
    assert _route(logits, None, table, np.array([0, N_VOCAB], np.int64))[0] == -1
    assert _route(logits, None, table, np.array([-1, 0], np.int64))[0] == -1
    table[5, 2] = N_EXPERT
    assert _route(logits, None, table, np.array([5, 0], np.int64))[0] == -1


def test_nan_logits_route_without_raising():
    """NaN scores are skipped in the choice (all NaN: the first ids), their weights NaN."""
    logits = _logits(np.random.default_rng(4), 2)
    logits[0] = np.nan
    logits[1, 5] = np.nan
    status, ids, wts = _route(logits, np.zeros(N_EXPERT, np.float32), None, np.zeros(2, np.int64))
    assert status == 0
    assert list(ids[0]) == list(range(K)) and np.isnan(wts[0]).all()
    assert 5 not in ids[1] and np.isfinite(wts[1]).all()


# ---------------------------------------------------------------------------- the whole half


@dataclass
class Layer:
    """One V4 FFN sublayer's weights: raw GGUF data with their types, and dequantized float32."""
    hc: tuple                 # fn, base, scale (float32)
    ffn_norm: np.ndarray
    raw: dict                 # name → (data, qtype)
    deq: dict                 # name → float32 values
    probs_b: np.ndarray | None
    table: np.ndarray | None

    @property
    def experts(self) -> ck.ExpertWeights:
        (g, gt), (u, ut), (d, dt) = (self.raw[n] for n in ("gate", "up", "down"))
        return ck.ExpertWeights(g, u, d, gt, ut, dt, name="blk.7")


def _layer(seed: int, wtype: str, router: str) -> Layer:
    rng = np.random.default_rng(seed)
    et, st = WEIGHTS[wtype]
    nd = N_STREAMS * D
    raw, deq = {}, {}
    for name, shape, qtype, std in (
            ("router", (N_EXPERT, D), st, 0.1), ("gate", (N_EXPERT, N_FF, D), et, 0.1),
            ("up", (N_EXPERT, N_FF, D), et, 0.1), ("down", (N_EXPERT, D, N_FF), et, 0.1),
            ("gate_sh", (N_FF, D), st, 0.12), ("up_sh", (N_FF, D), st, 0.12), ("down_sh", (D, N_FF), st, 0.1)):
        data, _, deq[name] = random_tensor(rng, shape, qtype, std)
        raw[name] = (data if qtype == Q.F32 else data.view(np.uint8), qtype)
    hc = ((rng.standard_normal(((2 + N_STREAMS) * N_STREAMS, nd)) * 0.05).astype(np.float32),
          (rng.standard_normal((2 + N_STREAMS) * N_STREAMS) * 0.5).astype(np.float32),
          rng.uniform(0.5, 1.5, 3).astype(np.float32))
    ffn_norm = rng.uniform(0.5, 1.5, D).astype(np.float32)
    if router == "hash":
        return Layer(hc, ffn_norm, raw, deq, None, _hash_table(rng))
    return Layer(hc, ffn_norm, raw, deq, (rng.standard_normal(N_EXPERT) * 0.3).astype(np.float32), None)


def _streams(seed: int, t: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + 100)
    return (rng.standard_normal((t, N_STREAMS, D)).astype(np.float32),
            rng.integers(0, N_VOCAB, t).astype(np.int64))


def _tagged(layer: Layer, name: str):
    data, qtype = layer.raw[name]
    kern = get_kernel(qtype, name)
    return kern.tag, weight_bytes(data, kern, 2, name)


def _kernel(layer: Layer, x, tokens, *, qx=None, qh=None):
    """(status, out) of v4_ffn_half over the layer's raw weights."""
    ew = layer.experts
    (gk, gb, g0, _), (uk, ub, u0, _) = ew._parts
    dk, db = ew._down
    tr, wr = _tagged(layer, "router")
    (tsg, wsg), (tsu, wsu), (tsd, wsd) = (_tagged(layer, n) for n in ("gate_sh", "up_sh", "down_sh"))
    out = np.full(x.shape, np.nan, np.float32)
    status = v4_ffn_half(x, out, tokens, EPS, *layer.hc, HC_ITERS, HC_EPS, layer.ffn_norm, tr, wr, layer.probs_b,
                         layer.table, K, W_SCALE, gk.tag, gb, g0, uk.tag, ub, u0, dk.tag, db, ew.n_ff, CLAMP_EXP,
                         qx, qh, tsg, wsg, tsu, wsu, tsd, wsd, CLAMP_SH, CHUNKS)
    return status, out


def _torch_experts(layer: Layer) -> TorchExperts:
    q = {n: QuantTensor(torch.from_numpy(layer.deq[n]), Q.F32, layer.deq[n].shape) for n in ("gate", "up", "down")}
    return TorchExperts(**q, act="swiglu_clamp", limit=float(CLAMP_EXP))


def _reference(layer: Layer, x, tokens, experts) -> tuple[np.ndarray, dict]:
    """deepseek4's second half (``Deepseek4Block.__call__``'s last two lines) in torch: (out,
    what it computed on the way: h, ids, f)."""
    hc = HyperConnection(*(torch.from_numpy(v) for v in layer.hc), n_streams=N_STREAMS, sinkhorn_iters=HC_ITERS,
                         hc_eps=HC_EPS, norm_eps=EPS)
    gate = _proj(layer.deq["router"])
    if layer.table is not None:
        router = HashRouter(gate, torch.from_numpy(layer.table), scale=W_SCALE)
    else:
        router = SqrtSoftplusRouter(gate, torch.from_numpy(layer.probs_b), k=K, scale=W_SCALE)
    shared = SwiGLU(*(_proj(layer.deq[n]) for n in ("gate_sh", "up_sh", "down_sh")),
                    glu=glu("swiglu_clamp", float(CLAMP_SH)))
    moe = MoE(router=router, experts=experts, shared=shared, pool=None, profile=Profile())
    xt, tt = torch.from_numpy(x), torch.from_numpy(tokens)
    with torch.inference_mode():
        y, post, comb = hc(xt)
        h = RMSNorm(torch.from_numpy(layer.ffn_norm), EPS)(y)
        f = moe(h, tt)
        out = HyperConnection.combine(f, xt, post, comb)
        ids, _ = router(h, tt)
    return out.numpy(), dict(h=h.numpy(), ids=ids.numpy(), f=f.numpy())


def _rel_err(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def _assert_clamps_clip(layer: Layer, seen: dict):
    """Both limits cut: some gate above its limit and some up beyond ±limit, among the routed
    experts the tokens took and in the shared expert."""
    h = seen["h"]
    g = np.einsum("tkfd,td->tkf", layer.deq["gate"][seen["ids"]], h)
    u = np.einsum("tkfd,td->tkf", layer.deq["up"][seen["ids"]], h)
    gs, us = h @ layer.deq["gate_sh"].T, h @ layer.deq["up_sh"].T
    assert (g > CLAMP_EXP).any() and (np.abs(u) > CLAMP_EXP).any()
    assert (gs > CLAMP_SH).any() and (np.abs(us) > CLAMP_SH).any()


@pytest.mark.parametrize("t", [1, 3, 8])
@pytest.mark.parametrize("router", ["top_k", "hash"])
@pytest.mark.parametrize("wtype", list(WEIGHTS))
def test_v4_ffn_half_is_the_torch_block_half(wtype, router, t):
    """Against the torch path with the experts in torch (dequantized) and through ``moe_ffn``
    (``CpuExperts``, float activations): the same output within REL_TOL, for top-k and hash
    routing, F32 and quantized weights."""
    seed = 10 * t + (router == "hash")
    layer = _layer(seed, wtype, router)
    x, tokens = _streams(seed, t)
    status, out = _kernel(layer, x, tokens)
    want, seen = _reference(layer, x, tokens, _torch_experts(layer))
    via_moe_ffn, _ = _reference(layer, x, tokens, CpuExperts(layer.experts, Profile(), act="swiglu_clamp",
                                                              limit=float(CLAMP_EXP), decode="float"))
    _assert_clamps_clip(layer, seen)
    assert np.abs(seen["f"]).max() > 0.1 * np.abs(want).max()      # the FFN shows in the output's scale
    assert status == len(np.unique(seen["ids"]))                     # the touched experts
    assert _rel_err(out, want) <= REL_TOL
    assert _rel_err(out, via_moe_ffn) <= REL_TOL


@pytest.mark.skipif(not has_int8_dot(), reason="int8 path needs AVX512-VNNI, AVX-VNNI or AVX2")
def test_int8_activations_are_moe_ffns():
    """Bound int8 scratch (both phases int8) against ``moe_ffn`` in int8 mode within REL_TOL_INT8,
    and moved off the float result (int8 ran: ~5e-3 here, the int8 activations' error)."""
    layer = _layer(5, "quant", "hash")
    x, tokens = _streams(5, 3)
    qx, qh = routed_int8_scratch(layer.experts, 3, K, True)
    assert qx is not None and qh is not None
    status, out = _kernel(layer, x, tokens, qx=qx, qh=qh)
    want, _ = _reference(layer, x, tokens, CpuExperts(layer.experts, Profile(), act="swiglu_clamp",
                                                      limit=float(CLAMP_EXP), decode="int8"))
    assert status > 0 and _rel_err(out, want) <= REL_TOL_INT8
    assert _rel_err(out, _kernel(layer, x, tokens)[1]) > 1e-4


def test_non_finite_streams_do_not_raise():
    """A NaN and an inf token give NaN rows (error_model numpy: values, not exceptions); the
    other tokens' rows stay what they are alone."""
    layer = _layer(6, "quant", "top_k")
    x, tokens = _streams(6, 3)
    clean = _kernel(layer, x[2:], tokens[2:])[1]
    x[0, 1, 5], x[1, 2, 7] = np.nan, np.inf
    status, out = _kernel(layer, x, tokens)
    assert status > 0
    assert np.isnan(out[:2]).any(axis=(1, 2)).all()
    assert _rel_err(out[2:], clean) <= REL_TOL


def test_token_outside_the_table_leaves_out_untouched():
    layer = _layer(7, "f32", "hash")
    x, tokens = _streams(7, 2)
    tokens[1] = N_VOCAB
    status, out = _kernel(layer, x, tokens)
    assert status == -1 and np.isnan(out).all()
