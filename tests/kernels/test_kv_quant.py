"""Quantized KV caches: the row quantizers against ggml's reference, exact append and
rollback, tiled attention over quantized cells, and the compiled CPU block reading and
writing a quantized cache against the torch path with the same cache type.

Both quantizers (``cpu_kernels.kv_rows`` for the compiled block, ``gpu.quantize`` for the
torch path) must give ggml's bytes: gguf-py's ``quantize`` where it has the type, and
libggml's own ``quantize_row_*_ref`` (llama-cpp-python's build) for every type.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import quantize as gguf_quantize

import cpu_kernels  # noqa: F401  (registers the decoders)
import offload.runtime as rt
from cpu_kernels.kv_rows import QUANT_TYPES, quantize_rows
from cpu_kernels.registry import get_kernel
from gpu.attention import attend, attend_tiles
from gpu.kv_cache import KVCache, QuantRows
from gpu.quantize import quantize as torch_quantize
from tests.kernels.test_compiled_block import PROMPT, SHIPPED, batches_after_prefill, both, rel_err

# the default tier checks two types end to end; every type's quantizer is cheap (full tier too)
DEFAULT = ("Q8_0", "Q4_0")
TYPES = [t if t in DEFAULT else pytest.param(t, marks=pytest.mark.full) for t in QUANT_TYPES]


def rows(n: int = 96, d: int = 128) -> np.ndarray:
    """Rows of mixed scale, with the blocks the rounding rules care about: all zero, constant,
    a magnitude tie of opposite signs (the first wins), values on half steps."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((n, d)) * rng.uniform(0.01, 4.0, (n, 1))).astype(np.float32)
    x[0, :32] = 0
    x[1, :32] = 0.75
    x[2, :32] = 0.1
    x[2, 3], x[2, 9] = -2.0, 2.0
    x[3, :32] = np.arange(-16, 16, dtype=np.float32) * 0.5
    return x


def ggml_ref(qname: str):
    """libggml's quantize_row_<type>_ref, or None without llama-cpp-python's library."""
    try:
        import llama_cpp
        lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    except (ImportError, OSError):
        return None
    fn = getattr(lib, f"quantize_row_{qname.lower()}_ref")
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
    return fn


@pytest.mark.parametrize("qname", TYPES)
def test_row_quantizers_give_ggml_bytes(qname):
    qt = Q[qname]
    block, size = GGML_QUANT_SIZES[qt]
    x = rows()
    got = np.zeros((x.shape[0], x.shape[1] // block * size), np.uint8)
    quantize_rows(get_kernel(qt).tag, x, got)
    assert np.array_equal(torch_quantize(torch.from_numpy(x), qt).numpy(), got)
    if qt != Q.IQ4_NL:                                  # gguf-py has no IQ4_NL quantizer
        assert np.array_equal(gguf_quantize(x, qt), got)
    ref_fn = ggml_ref(qname)
    if ref_fn is None:
        pytest.skip("llama-cpp-python's libggml-base not found")
    ref = np.zeros_like(got)
    for i in range(x.shape[0]):
        ref_fn(x[i].ctypes.data, ref[i].ctypes.data, x.shape[1])
    rb, gb = ref.reshape(-1, size), got.reshape(-1, size)
    # ggml leaves an all-zero IQ4_NL block's codes unset (d = 0: any codes decode to 0)
    live = ~((rb[:, :2] == 0).all(1) & (gb[:, :2] == 0).all(1)) if qt == Q.IQ4_NL else slice(None)
    assert np.array_equal(rb[live], gb[live])


@pytest.mark.parametrize("qname", QUANT_TYPES)
def test_append_and_rollback_are_exact(qname):
    """A rejected draft rolled back leaves the kept cells bit for bit as they were, and the
    token accepted instead lands as if the draft had never been (rows never share a block)."""
    qt = Q[qname]
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 12, 64, generator=g), torch.randn(2, 12, 64, generator=g)
    drafted = KVCache(2, 64, device=torch.device("cpu"), dtype=qt, capacity=4)
    plain = KVCache(2, 64, device=torch.device("cpu"), dtype=qt, capacity=4)
    drafted.append(k[:, :7], v[:, :7])
    before = drafted.k[:, :7].clone(), drafted.v[:, :7].clone()
    drafted.append(k[:, 7:11], v[:, 7:11])             # four drafted tokens (the cache grows)
    drafted.truncate(7)
    assert torch.equal(drafted.k[:, :7], before[0]) and torch.equal(drafted.v[:, :7], before[1])
    keys, values = drafted.append(k[:, 11:], v[:, 11:])
    plain.append(k[:, :7], v[:, :7])
    want_k, want_v = plain.append(k[:, 11:], v[:, 11:])
    assert isinstance(keys, QuantRows) and keys.shape == (2, 8, 64)
    assert torch.equal(keys.raw, want_k.raw) and torch.equal(values.raw, want_v.raw)
    assert drafted.nbytes == drafted.k.numel() + drafted.v.numel()      # uint8 blocks, no float copy


def test_tiled_attention_equals_attention_over_the_dequantized_cache():
    """Tiles smaller than the cache, with a sliding window (whole tiles masked for late
    queries) and with sinks: the online softmax equals one softmax over all cells of the same
    dequantized values within float32 rounding of the rescaling (observed ~3e-7; 1e-5)."""
    g = torch.Generator().manual_seed(2)
    cache = KVCache(2, 64, device=torch.device("cpu"), dtype=Q.Q4_1)
    cache.append(torch.randn(2, 290, 64, generator=g), torch.randn(2, 290, 64, generator=g))
    keys, values = cache.append(torch.randn(2, 6, 64, generator=g), torch.randn(2, 6, 64, generator=g))
    q = torch.randn(6, 8, 64, generator=g)
    sinks = torch.randn(8, generator=g)
    for kw in ({}, {"window": 70}, {"sinks": sinks}, {"sinks": sinks, "window": 70}):
        got = attend_tiles(q, keys, values, tile=64, **kw)
        want = attend(q, keys.float(), values.float(), **kw)
        assert (got - want).abs().max() < 1e-5 * want.abs().max()
    # attend takes QuantRows: the tiles, or the compiled CPU read once a model load installed it
    # (tests/kernels/test_kv_attention_cpu.py; same values, summation order only)
    want = attend_tiles(q, keys, values)
    assert (attend(q, keys, values) - want).abs().max() < 1e-5 * want.abs().max()


def test_compiled_block_reads_and_writes_the_torch_paths_q8_0_bytes():
    """The shipped model with a q8_0 cache: compiled blocks against the torch blocks, both
    quantizing with ggml's rounding. Their K/V floats differ in the last bits (float32 sums in
    another order), so a value within that of a rounding boundary takes the neighbouring code:
    one step (1/127 of its block's largest value) of one cached element, damped by the softmax.
    Tolerance 1e-3 of the largest logit (observed 1.4e-4); the caches themselves agree in
    all but a few blocks, and a whole rollback is exact (test_append_and_rollback_are_exact)."""
    with rt.load(SHIPPED, devices="CPU=16GiB", cache_type="q8_0", quiet=True) as s, torch.inference_mode():
        assert {b.path for b in s.model.blocks} == {"compiled"}
        fast, ref = both(s.model, lambda m: batches_after_prefill(m, PROMPT[:6], range(1, 9)))
        assert max(rel_err(a, b) for a, b in zip(fast, ref)) < 1e-3
        fast, ref = both(s.model, cache_blocks)
    same = (fast == ref).all(1)
    assert same.mean() > 0.99


def test_compiled_rollback_is_exact():
    """The compiled block writes its q8_0 rows in place: a drafted batch rolled back leaves the
    kept cells as they were, and the token accepted instead lands as if never drafted."""
    with rt.load(SHIPPED, devices="CPU=16GiB", cache_type="q8_0", quiet=True) as s, torch.inference_mode():
        m = s.model
        drafted, plain = m.new_state(None), m.new_state(None)
        for state in (drafted, plain):
            m.forward(torch.tensor(PROMPT[:6]), state, logits="none")
        before = [(c.k[:, :6].clone(), c.v[:, :6].clone()) for c in drafted.caches]
        m.forward(torch.tensor(PROMPT[6:9]), drafted, logits="none")        # three drafted tokens
        for c in drafted.caches:
            c.truncate(6)
        assert all(torch.equal(c.k[:, :6], k) and torch.equal(c.v[:, :6], v)
                   for c, (k, v) in zip(drafted.caches, before))
        for state in (drafted, plain):
            m.forward(torch.tensor(PROMPT[9:10]), state, logits="none")
        assert all(torch.equal(a.k[:, :7], b.k[:, :7]) and torch.equal(a.v[:, :7], b.v[:, :7])
                   for a, b in zip(drafted.caches, plain.caches))
        assert {b.path for b in m.blocks} == {"compiled"}


def cache_blocks(model) -> np.ndarray:
    """Every q8_0 block (34 bytes) of the trunk's caches after a 12-token prompt."""
    state = model.new_state(None)
    model.forward(torch.tensor(PROMPT[:12]), state, logits="none")
    return np.concatenate([t[:, :c.length].numpy().reshape(-1, 34) for c in state.caches for t in (c.k, c.v)])


@pytest.mark.full
def test_compiled_block_with_a_q4_0_cache_matches_the_torch_path():
    """As the q8_0 test with a 4-bit cache: a code step is 1/8 of the block's largest value,
    so one flipped code weighs more; tolerance 1e-2 (observed 1.2e-6: no flip on this data)."""
    with rt.load(SHIPPED, devices="CPU=16GiB", cache_type="q4_0", quiet=True) as s, torch.inference_mode():
        fast, ref = both(s.model, lambda m: batches_after_prefill(m, PROMPT[:6], range(1, 9)))
    assert max(rel_err(a, b) for a, b in zip(fast, ref)) < 1e-2
