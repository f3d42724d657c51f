"""cpu_kernels against gguf.quants.dequantize + float64 numpy.

Every supported type, on random valid blocks (all bit patterns of the quant fields, sane
scales: ``cpu_kernels.synth``) and, where gguf-py can quantize, on quantized Gaussian
weights; raw data read back through ``gguf.GGUFReader`` memmaps. The fused expert FFN is
tests/kernels/test_moe_kernels.py's, other CPU classes tests/kernels/test_cpu_targets.py's.

Tolerance. The kernels compute in float32 with the true dequantized weights (activations
are not quantized), so the only error is float32 rounding of products and sums, taken in
a different order than the reference: at most ~n * 2**-24 * sum_c |w_c x_c| for n
accumulated terms, typically sqrt(n) times smaller. Outputs are compared per element
against ``TOL * (|x| @ |W|^T)`` with TOL = 1e-5 (n <= 1024 here: the worst case is
6e-5, the typical 2e-6; observed ~1e-7).

First run compiles one kernel per quant type (Numba, cached on disk afterwards).
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from numba import typeof

import cpu_kernels as ck
from cpu_kernels.layout import weight_bytes
from cpu_kernels.registry import get_kernel
from cpu_kernels.synth import random_blocks

TOL = 1e-5
ISSUE_TYPES = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K,
               T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4, T.IQ4_NL, T.IQ4_XS}
# The 1-3-bit lattice types (issue 13): grids + signs, 256-weight blocks.
IQ_TYPES = {T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M}
ISSUE_TYPES |= IQ_TYPES
# Types gguf-py can quantize (real quantized data rather than random blocks).
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.MXFP4]
BLOCK = {T.Q2_K: 256, T.Q3_K: 256, T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256, T.IQ4_XS: 256,
         **{t: 256 for t in IQ_TYPES}}


def dequant(w: np.ndarray, qt: T) -> np.ndarray:
    """float64 weights from raw GGUF data, as gguf-py decodes them."""
    return dequantize(np.asarray(w), qt).astype(np.float64)


def check_close(y, x, W):
    """y (float32 [B, rows]) against x @ W^T in float64, within TOL of sum |w x|."""
    x64 = np.asarray(x, np.float64)
    ref = x64 @ W.T
    bound = TOL * (np.abs(x64) @ np.abs(W).T) + 1e-30
    err = np.abs(y.astype(np.float64) - ref)
    assert y.dtype == np.float32 and y.shape == ref.shape
    assert np.all(err <= bound), f"max err/bound {np.max(err / bound):.3g}"


def seed(*parts) -> np.random.Generator:
    return np.random.default_rng([int(p) for p in parts])


def test_registry_has_the_issue_types():
    assert set(ck.supported_types()) == ISSUE_TYPES


@pytest.mark.parametrize("qt", sorted(ISSUE_TYPES, key=int), ids=lambda t: t.name)
def test_matmul_random_blocks(qt):
    rng = seed(1, qt)
    cols = 2 * BLOCK.get(qt, 256)
    w = random_blocks(qt, (13, cols), rng)          # 13 rows: not a multiple of 4 or of threads
    W = dequant(w, qt)
    for b in (1, 3, 16, 17):                          # 17 spans two token tiles
        x = rng.standard_normal((b, cols)).astype(np.float32)
        check_close(ck.matmul(x, w, qt), x, W)
    # a type registered without offsets (has_min False: layout.bsums_for passes zeros) gives the
    # same bits whatever the 16-column sums hold; Q4_1's offsets do read them
    from cpu_kernels.layout import bsums_of
    from cpu_kernels.matmul import _matmul_kernel
    kern, wb = get_kernel(qt), weight_bytes(w, get_kernel(qt), 2, "w")
    x = rng.standard_normal((3, cols)).astype(np.float32)
    ys = [np.empty((3, 13), np.float32) for _ in range(2)]
    for y, bs in zip(ys, (bsums_of(x), np.full((3, cols // 16), 1e3, np.float32))):
        _matmul_kernel(kern.tag, wb, x, bs, y, 2)
    if not kern.has_min:
        assert np.array_equal(ys[0], ys[1])
    if qt == T.Q4_1:
        assert not np.allclose(ys[0], ys[1])


@pytest.mark.parametrize("qt", [t for t in sorted(ISSUE_TYPES, key=int) if BLOCK.get(t, 32) == 32 or t in
                                (T.F32, T.F16, T.BF16)], ids=lambda t: t.name)
def test_a_batch_of_32_weight_rows_gives_each_token_its_one_token_bits(qt):
    """Float decode batches (2-16 tokens) of 32-weight types run two tokens at a time
    (``rowdot._two_blocks32``, an odd last token by ``_one``) with each token's sums in the
    one-token order, so a verify batch gives each row the bits plain decoding gives it, as the
    scratch-accumulator loop before it did (its speed: bench.cpu_kernels --batches 1,2,4,8)."""
    rng = seed(2, qt)
    cols = 3 * 32 + 64 * 2                            # 224: an odd number of blocks (and no pair tail)
    w = random_blocks(qt, (13, cols), rng)
    x = rng.standard_normal((7, cols)).astype(np.float32)      # 7: pairs and an odd last token
    batched = ck.matmul(x, w, qt, int8=False)
    ones = np.stack([ck.matmul(x[i:i + 1], w, qt, int8=False)[0] for i in range(len(x))])
    np.testing.assert_array_equal(batched, ones)


def test_ksigns_rule_is_ggmls_table():
    """The lattice decoders compute ksigns_iq2xs (7 sign bits, bit 7 their parity) instead
    of looking it up: the rule against the reference values gguf-py carries."""
    from cpu_kernels.iquants import KSIGNS
    i = np.arange(128)
    parity = np.array([bin(v).count("1") & 1 for v in i])
    assert np.array_equal(KSIGNS, i | parity << 7)


@pytest.mark.parametrize("qt", QUANTIZABLE, ids=lambda t: t.name)
def test_matmul_quantized_gaussian_weights(qt):
    rng = seed(2, qt)
    Wf = rng.standard_normal((21, 384)).astype(np.float32) * 0.05
    w = quantize(Wf, qt)
    if qt == T.BF16:                                  # gguf returns bf16 as uint8 pairs
        assert w.dtype == np.uint8
    W = dequant(w, qt)
    x = rng.standard_normal((3, 384)).astype(np.float32)
    check_close(ck.matmul(x, w, qt), x, W)
    y1 = ck.matmul(x[0], w, qt)                        # 1-D x gives a 1-D result
    assert y1.shape == (21,)
    check_close(y1[None], x[:1], W)


@pytest.mark.parametrize("qt", [T.F32, T.Q8_0, T.Q4_0, T.MXFP4], ids=lambda t: t.name)
def test_grouped_matmul_is_each_groups_product(qt):
    """deepseek4's grouped ``attn_output_a``: group g's rows times group g's activations,
    against float64, and bit for bit the diagonal blocks of the full product (the same dot
    per row and token), across token tiles."""
    rng = seed(4, qt)
    groups, per, cols = 3, 8, 64
    w = random_blocks(qt, (groups * per, cols), rng)
    W = dequant(w, qt)
    for b in (1, 17):
        x = rng.standard_normal((b, groups, cols)).astype(np.float32)
        y = ck.grouped_matmul(x, w, qt, groups)
        for g in range(groups):
            check_close(y[:, g * per:(g + 1) * per], x[:, g], W[g * per:(g + 1) * per])
        full = ck.matmul(x.reshape(b * groups, cols), w, qt).reshape(b, groups, groups, per)
        assert np.array_equal(y, np.stack([full[:, g, g] for g in range(groups)], 1).reshape(b, -1))
    with pytest.raises(ValueError, match="groups"):
        ck.grouped_matmul(x, w, qt, 5)


@pytest.mark.parametrize("qt", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_rows_not_a_multiple_of_32(qt):
    rng = seed(3, qt)
    w = random_blocks(qt, (5, 100), rng, scale=0.5)
    x = rng.standard_normal((3, 100)).astype(np.float32)
    check_close(ck.matmul(x, w, qt), x, dequant(w, qt))


def test_reader_memmaps_used_in_place(tmp_path):
    """Tensors written with GGUFWriter and mapped by GGUFReader, 2-D and one expert of a
    3-D *_exps tensor: results match and the kernels' byte view is the mapped memory."""
    rng = seed(4)
    tensors = {
        "blk.0.attn_q.weight": (T.Q4_K, (12, 512)),
        "blk.0.ffn_down.weight": (T.F16, (6, 96)),
        "blk.0.ffn_up.weight": (T.BF16, (7, 64)),
        "blk.0.ffn_gate_exps.weight": (T.Q8_0, (3, 256, 256)),
        "blk.0.ffn_up_exps.weight": (T.Q8_0, (3, 256, 256)),
        "blk.0.ffn_down_exps.weight": (T.Q4_0, (3, 256, 256)),
    }
    data = {n: random_blocks(qt, shape, rng) for n, (qt, shape) in tensors.items()}
    path = tmp_path / "t.gguf"
    wr = GGUFWriter(str(path), "llama")
    for n, (qt, _) in tensors.items():
        wr.add_tensor(n, data[n], raw_dtype=None if qt in (T.F16, T.F32) else qt)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()

    reader = GGUFReader(str(path))
    got = {t.name: t for t in reader.tensors}
    for n, (qt, shape) in tensors.items():
        t = got[n]
        assert t.tensor_type == qt
        assert np.array_equal(np.asarray(t.data), data[n])
        if len(shape) == 2:
            x = rng.standard_normal((2, shape[1])).astype(np.float32)
            check_close(ck.matmul(x, t.data, qt, name=n), x, dequant(t.data, qt))
            view = weight_bytes(t.data, get_kernel(qt), 2, n)
            assert np.shares_memory(view, t.data) and not view.flags.writeable
        else:
            e = 2
            x = rng.standard_normal((3, shape[2])).astype(np.float32)
            check_close(ck.matmul(x, t.data[e], qt, name=n), x, dequant(t.data[e], qt))
    # The fused FFN straight from the mapped 3-D tensors.
    ew = ck.ExpertWeights(got["blk.0.ffn_gate_exps.weight"].data, got["blk.0.ffn_up_exps.weight"].data,
                          got["blk.0.ffn_down_exps.weight"].data, T.Q8_0, T.Q8_0, T.Q4_0, name="blk.0")
    x = rng.standard_normal((2, 256)).astype(np.float32)
    ids = np.array([[0, 2], [1, 2]])
    wts = np.array([[0.7, 0.3], [0.4, 0.6]], np.float32)
    G = dequant(data["blk.0.ffn_gate_exps.weight"], T.Q8_0)
    U = dequant(data["blk.0.ffn_up_exps.weight"], T.Q8_0)
    D = dequant(data["blk.0.ffn_down_exps.weight"], T.Q4_0)
    y, ref, bound = ck.moe_ffn(x, ids, wts, ew), *moe_reference(x, ids, wts, G, U, D, None)
    assert np.all(np.abs(y - ref) <= bound)


def silu(v):
    return v / (1.0 + np.exp(-v))


def moe_reference(x, ids, wts, G, U, D, owned):
    """float64 sum over owned routed experts of w * D_e (silu(G_e x) * U_e x), plus the
    per-element tolerance bound (TOL times the same sum of absolute values)."""
    x = np.asarray(x, np.float64)
    ref = np.zeros((x.shape[0], D.shape[1]))
    mag = np.zeros_like(ref)
    for b in range(x.shape[0]):
        for e, wt in zip(ids[b], wts[b]):
            if owned is not None and not owned[e]:
                continue
            g, u = G[e] @ x[b], U[e] @ x[b]
            h = silu(g) * u
            ref[b] += wt * (D[e] @ h)
            # |h| error from gate/up rounding propagates through D: bound both stages.
            hb = TOL * (np.abs(silu(g)) * (np.abs(U[e]) @ np.abs(x[b]))
                        + np.abs(u) * (np.abs(G[e]) @ np.abs(x[b])))
            mag[b] += abs(wt) * (np.abs(D[e]) @ (np.abs(h) + hb))
    return ref, TOL * mag + 1e-30


def test_unsupported_type_names_type_and_tensor():
    w = np.zeros((4, 54), np.uint8)
    with pytest.raises(ck.UnsupportedQuantType, match=r"TQ1_0.*blk\.7\.ffn_down\.weight"):
        ck.matmul(np.ones((1, 256), np.float32), w, T.TQ1_0, name="blk.7.ffn_down.weight")
    with pytest.raises(ck.UnsupportedQuantType, match=r"TQ2_0.*blk\.1\.ffn_down_exps"):
        ck.ExpertWeights(np.zeros((2, 8, 36), np.uint8), np.zeros((2, 8, 36), np.uint8),
                         np.zeros((2, 8, 4), np.uint8), T.Q8_0, T.Q8_0, T.TQ2_0, name="blk.1")


def test_shape_errors():
    w = random_blocks(T.Q8_0, (4, 64), seed(5))
    with pytest.raises(ValueError, match=r"\[B, 64\]"):
        ck.matmul(np.ones((1, 32), np.float32), w, T.Q8_0)
    with pytest.raises(ValueError, match="whole number"):
        ck.matmul(np.ones((1, 64), np.float32), np.ascontiguousarray(w[:, :50]), T.Q8_0)
    with pytest.raises(ValueError, match="C-contiguous"):
        ck.matmul(np.ones((1, 32), np.float32), w[:, :34], T.Q8_0)


def test_thread_count_does_not_change_results():
    rng = seed(6)
    w = random_blocks(T.Q4_K, (37, 512), rng)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    try:
        ck.set_num_threads(1)
        y1 = ck.matmul(x, w, T.Q4_K)
        ck.set_num_threads(min(2, __import__("numba").config.NUMBA_NUM_THREADS))
        y2 = ck.matmul(x, w, T.Q4_K)
    finally:
        ck.set_num_threads(None)
    # Each row is computed by one thread in a fixed order: bitwise equal.
    assert np.array_equal(y1, y2)
    with pytest.raises(ValueError):
        ck.set_num_threads(0)


def test_drivers_release_the_gil_and_cache():
    import importlib
    for mod, names in (("cpu_kernels.matmul", ["_matmul_kernel", "_matmul_i8_kernel"]),
                       ("cpu_kernels.moe", ["_gate_up_phase", "_down_phase", "_weighted_sum"])):
        m = importlib.import_module(mod)
        for n in names:
            disp = getattr(m, n)
            assert disp.targetoptions.get("nogil") is True, n
            assert type(disp._cache).__name__ == "FunctionCache", n


_CACHE_KEYS = """
import importlib, json, pkgutil
import cpu_kernels
from numba.core.dispatcher import Dispatcher
keys = {}
for info in pkgutil.iter_modules(cpu_kernels.__path__):
    mod = importlib.import_module("cpu_kernels." + info.name)
    for name, d in sorted(vars(mod).items()):
        if isinstance(d, Dispatcher) and type(d._cache).__name__ == "FunctionCache":
            keys[d.py_func.__module__ + "." + d.py_func.__qualname__] = d._cache._index_key((), d.targetctx.codegen())[2]
print(json.dumps(keys))
"""


def test_cached_kernels_are_found_by_a_new_process():
    """Numba's on-disk cache finds a kernel only if its key (code + pickled closure) is the same
    in the next process. A closure over another dispatcher pickles that dispatcher's
    per-process id, so such a kernel was compiled again by every process (the block entries:
    ~8 s per `offload run` start on the shipped model). Two processes give the same keys."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    def keys():
        r = subprocess.run([sys.executable, "-c", _CACHE_KEYS], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parents[2])
        return json.loads(r.stdout)

    first, second = keys(), keys()
    assert len(first) >= 10 and any(n.endswith(".blocks_run") for n in first)
    assert [n for n in first if first[n] != second.get(n)] == []



@pytest.mark.parametrize("qt", [T.Q4_0, T.Q4_K, T.MXFP4])
def test_row_group_routines_take_no_references(qt):
    """``rows4`` (called once per 4-row group by matmul and the compiled blocks) and what it
    calls never touch reference counts: NRT's are atomic (lock-prefixed, a full memory
    fence), and one per array argument per call drained the loads in flight on every row
    group (batch-1 mat-vecs ran at 0.4-0.7x the speed without them)."""
    from cpu_kernels.layout import bsums_of
    from cpu_kernels.rowdot import rows4, rows4_scratch
    rng = seed(8, qt)
    w = weight_bytes(random_blocks(qt, (8, 256), rng), get_kernel(qt), 2, "w")
    x = rng.standard_normal((1, 256)).astype(np.float32)
    y = np.zeros((1, 8), np.float32)
    rows4(get_kernel(qt).tag, w, 4, x, bsums_of(x), y, *rows4_scratch())
    check_close(y[:, 4:], x, dequant(w[4:], qt))           # it ran, and right
    sig = [s for s in rows4.signatures if s[0] == typeof(get_kernel(qt).tag)][0]
    ir = rows4.inspect_llvm(sig)
    assert "NRT_incref" not in ir and "NRT_decref" not in ir

# ---------------------------------------------------------------- int8 activations

INT8_TYPES = [t for t in sorted(ISSUE_TYPES, key=int) if get_kernel(t).has_int8]


def quantized(x):
    """x as the int8 path sees it: per 32 values, dx = max |x| / 127, round(x / dx) * dx."""
    xb = np.asarray(x, np.float64).reshape(x.shape[0], -1, 32)
    dx = np.abs(xb).max(-1, keepdims=True).astype(np.float32).astype(np.float64) / 127
    q = np.rint(xb / np.where(dx > 0, dx, 1))
    return (q * dx).reshape(x.shape)


def kernel_quantized(x):
    """x as the kernels quantized it (``quantized_activations``: float32 x / dx, where a
    value on a rounding tie may take the code next to ``quantized``'s)."""
    from cpu_kernels.matmul import quantized_activations
    xq, dx = quantized_activations(x)[:2]
    cols = x.shape[1]
    return (xq[:, :cols].astype(np.float64).reshape(x.shape[0], -1, 32) * dx[:, :cols // 32, None]).reshape(x.shape)


def test_quantize_rows_is_the_int8_rounding():
    """rowdot8.quantize_rows (pair8.quantize32: a 32 in vector registers): d = max |x| / 127
    (within one ulp: the compiler may divide as a multiply by the reciprocal), codes within
    half a code of x / d (rint), sums of 16 and of 4 codes times d, dx8 = d per 4, padding
    zero; an all-zero 32 gives d = 0 and zero codes."""
    from cpu_kernels.matmul import quantized_activations
    rng = seed(30)
    x = (rng.standard_normal((5, 320)) * np.array([1e-3, 1, 10, 300, 1])[:, None]).astype(np.float32)
    x[4, 32:64] = 0
    xq, dx, bsums, xs4, dx8 = quantized_activations(x)
    cols = x.shape[1]
    d = dx[:, :cols // 32]
    amax = np.abs(x).reshape(5, -1, 32).max(-1)
    assert np.all(np.abs(d - (amax / np.float32(127)).astype(np.float32)) <= np.spacing(d))
    assert d[4, 1] == 0 and not xq[4, 32:64].any()
    q = xq[:, :cols].astype(np.int64)
    scaled = x / np.repeat(np.where(d > 0, d, 1), 32, axis=1)
    assert np.all(np.abs(q - scaled) <= 0.5 + 1e-3) and np.abs(q).max() <= 127
    np.testing.assert_allclose(bsums, q.reshape(5, -1, 16).sum(-1) * np.repeat(d, 2, axis=1), rtol=1e-6)
    np.testing.assert_allclose(xs4[:, :cols // 4], q.reshape(5, -1, 4).sum(-1) * np.repeat(d, 8, axis=1),
                               rtol=1e-6)
    np.testing.assert_array_equal(dx8[:, :cols // 4], np.repeat(d, 8, axis=1))
    assert not xq[:, cols:].any() and not dx[:, cols // 32:].any()
    assert not xs4[:, cols // 4:].any() and not dx8[:, cols // 4:].any()


@pytest.mark.parametrize("qt", INT8_TYPES, ids=lambda t: t.name)
def test_int8_matmul(qt, int8_mode):
    """Equals the weights times the int8-dequantized activations (float rounding only),
    and differs from the exact product by at most sum |w| |x - x_hat| (the rounding of
    each activation, at most dx / 2). B = 1 and 3 take the token routines (rowdot8)."""
    _int8_matmul_batches(qt, (1, 3))


# The prompt-batch GEMM (gemm8) decodes with the same per-type decoders as the token routines
# (test_int8_matmul checks every one); what it adds per type is the unit (16 or 32 weights), the
# code offset and the mins. One type of each kind by default (block pairs: offset, mins, signed
# codes, a value table; 256-weight blocks: 16-weight units with mins and with an offset, 32-weight
# units, a value table, a lattice type; Q5_1's fifth bits are test_int8_moe's down projection),
# the others in the full tier.
GEMM_TYPES = [T.Q4_0, T.Q4_1, T.Q8_0, T.MXFP4, T.Q2_K, T.Q4_K, T.Q6_K, T.IQ4_XS, T.IQ2_XXS]


@pytest.mark.parametrize("qt", [*GEMM_TYPES, *(pytest.param(t, marks=pytest.mark.full) for t in INT8_TYPES
                                                if t not in GEMM_TYPES)], ids=lambda t: t.name)
def test_int8_prompt_batch_matmul(qt, int8_mode):
    """test_int8_matmul's bounds for a prompt batch of 40 tokens: the GEMM (gemm8: two full
    tiles of 16 tokens and one of 8; 13 rows: a partial group of 4)."""
    _int8_matmul_batches(qt, (40,))


def _int8_matmul_batches(qt, batches):
    rng = seed(10, qt)
    cols = 2 * BLOCK.get(qt, 240)                     # 480: an odd number of 32-blocks
    w = random_blocks(qt, (13, cols), rng)
    W = dequant(w, qt)
    for b in batches:
        x = rng.standard_normal((b, cols)).astype(np.float32)
        y = ck.matmul(x, w, qt)
        xh = kernel_quantized(x)
        assert np.all(np.abs(xh - quantized(x)) <= np.abs(x).max() / 127 * 1.001)   # a tie at most one code apart
        check_close(y, xh, W)
        bound = np.abs(xh - x) @ np.abs(W).T
        assert np.all(np.abs(y - x.astype(np.float64) @ W.T) <= bound * (1 + 1e-4) + 1e-6)
        assert not np.array_equal(y, _float_path(x, w, qt))     # the int8 path did run


def _float_path(x, w, qt):
    ck.set_int8_activations(False)
    try:
        return ck.matmul(x, w, qt)
    finally:
        ck.set_int8_activations(True)


# ---------------------------------------------------------------- data never raises


def _bad_tokens_and_rows_stay_there(x, w, qt):
    """Zero activations or weights give zeros; a NaN/inf activation of token 1 and bad scales
    in row 4 change only that token's / row's outputs."""
    clean = ck.matmul(x, w, qt)
    assert not np.any(ck.matmul(np.zeros_like(x), w, qt))
    assert not np.any(ck.matmul(x, np.zeros_like(w), qt))
    others = np.delete(np.arange(x.shape[0]), 1)
    for bad in (np.nan, np.inf, -np.inf):
        xb = x.copy()
        xb[1, 7] = bad
        y = ck.matmul(xb, w, qt)
        np.testing.assert_array_equal(y[others], clean[others])
        wb = w.copy()
        row = np.full(wb[4].nbytes // 2, bad, np.float16)      # every f16 field of row 4 bad
        wb[4] = np.frombuffer(row.tobytes(), wb.dtype)
        y = ck.matmul(x, wb, qt)
        np.testing.assert_array_equal(np.delete(y, 4, axis=1), np.delete(clean, 4, axis=1))

BAD_DATA_TYPES = [T.F16, T.Q8_0, T.Q4_K]


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("qt", BAD_DATA_TYPES, ids=lambda t: t.name)
def test_zero_and_non_finite_data_give_values_not_errors(qt, int8):
    """All-zero weights/activations give exact zeros; NaN/inf in one token's activations or
    in one row's weights stay in that token's / row's outputs: the kernels are compiled
    with ``error_model="numpy"``, so no data makes them raise (ZeroDivisionError etc.)."""
    from cpu_kernels.simd8 import has_int8_dot
    if int8 and not has_int8_dot():
        pytest.skip("int8 path needs AVX512-VNNI, AVX-VNNI or AVX2")
    rng = seed(21, qt)
    cols, rows = 256, 12
    w = random_blocks(qt, (rows, cols), rng)
    ck.set_int8_activations(int8)
    try:
        # 20 tokens: int8 takes the prompt-batch GEMM, whose 16 lanes hold different tokens
        x = rng.standard_normal((20, cols)).astype(np.float32)
        _bad_tokens_and_rows_stay_there(x, w, qt)
        x = x[:3]
        _bad_tokens_and_rows_stay_there(x, w, qt)
        # the expert FFN: a NaN routing weight, NaN activations, all-zero experts
        E, n_ff = 4, 64
        gu = [random_blocks(qt, (E, n_ff, cols), rng) for _ in range(2)]
        down = random_blocks(qt, (E, cols, n_ff if qt != T.Q4_K else 256), rng)
        if qt == T.Q4_K:
            gu = [random_blocks(qt, (E, 256, cols), rng) for _ in range(2)]
        ew = ck.ExpertWeights(gu[0], gu[1], down, qt, qt, qt)
        ids = np.array([[0, 1], [2, 3], [1, 2]])
        wts = np.full((3, 2), 0.5, np.float32)
        ref = ck.moe_ffn(x, ids, wts, ew)
        wn = wts.copy()
        wn[1, 0] = np.nan
        xn = x.copy()
        xn[1] = np.nan
        for xi, wi in ((x, wn), (xn, wts)):
            y = ck.moe_ffn(xi, ids, wi, ew)
            np.testing.assert_array_equal(y[[0, 2]], ref[[0, 2]])
        zero = ck.ExpertWeights(*(np.zeros_like(a) for a in (gu[0], gu[1], down)), qt, qt, qt)
        assert not np.any(ck.moe_ffn(x, ids, wts, zero))
    finally:
        ck.set_int8_activations(False)
