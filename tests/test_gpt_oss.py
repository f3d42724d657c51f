"""gpt-oss beyond logit parity (that is tests/test_runtime_hf.py): the CPU expert kernel's
clamped GLU with per-expert biases against float64 numpy; attention sinks and the sliding
window against an explicit float64 softmax; the window cache's rows and bytes are the
planner's; KV per device equals the plan with virtual GPUs; ``offload run`` end to end."""
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
