"""Layer 1 for the fused dequant-matmul (gpu.triton_matmul): every fused type against
``gguf.quants.dequantize`` + a float64 product, for B = 1, 3, 16; and the choice between the
fused kernel and the chunked path (gpu.fused / QuantTensor.linear).

Without CUDA the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
set here before the kernel module is imported and left set: the interpreter reads it
at launch too); with CUDA they run compiled.

Tolerance: the kernel dequantizes in float32 (operation order may differ from gguf-py's by
an ulp per weight) and accumulates K products in float32, so the error is bounded by about
K·2⁻²⁴ of Σ|x·w| (3e-5 at K = 512); we allow 1e-5 of Σ|x·w| plus 1e-6, which random
rounding keeps well inside (observed ~1e-7 of it).
"""
from __future__ import annotations

import ast
import inspect
import os
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize

import gpu.fused as fused
import gpu.quant as gq
from gpu.qtypes import FUSED_KERNEL_IDS, FUSED_TYPES
from tests.tiny_models import random_blocks

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"      # read at decoration and again at launch: left set
tm = pytest.importorskip("gpu.triton_matmul", reason="triton is not installed (pip install .[test])")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402  (after the skip)

DEV = torch.device("cpu" if isinstance(tm._fused_kernel, InterpretedFunction) else "cuda")
TYPES = sorted(FUSED_TYPES, key=lambda q: q.name)


def _weights(rng, qtype, rows, cols):
    qk, size = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(rng, rows * cols // qk, qtype, 0.1).reshape(rows, cols // qk * size)
    return raw, dequantize(raw, qtype).astype(np.float64)


def _check(got: np.ndarray, x: np.ndarray, w: np.ndarray):
    x64 = x.astype(np.float64)
    scale = np.abs(x64) @ np.abs(w).T
    err = np.abs(got.astype(np.float64) - x64 @ w.T)
    assert (err <= 1e-5 * scale + 1e-6).all(), f"max error {err.max():.3g}, max scale {scale.max():.3g}"


@pytest.mark.parametrize("batch", [1, 3, 16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_fused_matches_gguf(qtype, batch):
    rng = np.random.default_rng(int(qtype) * 100 + batch)
    raw, w = _weights(rng, qtype, 40, 512)                    # 40 rows: a partial row tile
    x = rng.standard_normal((batch, 512)).astype(np.float32)
    got = tm.fused_linear(torch.from_numpy(raw).to(DEV), qtype, torch.from_numpy(x).to(DEV), split_k=2)
    assert got.shape == (batch, 40) and got.dtype == torch.float32
    _check(got.cpu().numpy(), x, w)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_fused_bf16(qtype):
    """bf16 x (the CUDA compute dtype): each weight rounded to bf16 (≤ 2⁻⁸ relative on CUDA,
    which rounds to nearest; ≤ 2⁻⁷ under the interpreter, which truncates), products summed in
    float32, the result rounded to bf16 (≤ 2⁻⁸) — against the exact float64 product."""
    rng = np.random.default_rng(11)
    raw, w = _weights(rng, qtype, 40, 512)
    x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32)).bfloat16()
    got = tm.fused_linear(torch.from_numpy(raw).to(DEV), qtype, x.to(DEV))
    assert got.dtype == torch.bfloat16
    x64 = x.double().numpy()
    want = x64 @ w.T
    err = np.abs(got.double().cpu().numpy() - want)
    bound = 2 ** -8 * np.abs(want) + (2 ** -7 + 1e-5) * (np.abs(x64) @ np.abs(w).T)
    assert (err <= bound).all(), f"max error {err.max():.3g}"


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q6_K], ids=lambda q: q.name)
def test_fused_on_an_expert_view_with_odd_tiles(qtype):
    """One expert of a 3-D tensor (a view at an offset), a row length of 3 K-tiles split
    unevenly, the default split."""
    rng = np.random.default_rng(7)
    cols = 768 if qtype == Q.Q6_K else 96
    raws, ws = zip(*(_weights(rng, qtype, 33, cols) for _ in range(3)))
    stacked = torch.from_numpy(np.stack(raws)).to(DEV)
    x = rng.standard_normal((5, cols)).astype(np.float32)
    for split in (None, 2):
        got = tm.fused_linear(stacked[1], qtype, torch.from_numpy(x).to(DEV), split_k=split)
        _check(got.cpu().numpy(), x, ws[1])


def test_fused_refuses_what_it_cannot_do():
    raw = torch.zeros((4, 34 * 2), dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="1..16 rows"):
        tm.fused_linear(raw, Q.Q8_0, torch.zeros((17, 64), device=DEV))
    with pytest.raises(ValueError, match="do not hold 96 columns"):
        tm.fused_linear(raw, Q.Q8_0, torch.zeros((1, 96), device=DEV))
    with pytest.raises(NotImplementedError, match="Q2_K"):
        tm.fused_linear(raw, Q.Q2_K, torch.zeros((1, 256), device=DEV))


def test_each_fused_type_has_its_own_decode_branch():
    """``_dequant``'s chain has one ``QTYPE == _X`` branch per entry of the fused-type table and
    its final ``else`` decodes nothing: no type falls through to the last branch's layout."""
    fn = ast.parse(textwrap.dedent(inspect.getsource(tm._dequant.fn))).body[0]
    node, ids = next(n for n in fn.body if isinstance(n, ast.If)), []
    while isinstance(node, ast.If):
        test = node.test
        assert isinstance(test, ast.Compare) and ast.unparse(test.left) == "QTYPE", ast.unparse(test)
        ids.append(getattr(tm, test.comparators[0].id).value)
        node = node.orelse[0] if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If) else node.orelse
    assert sorted(ids) == sorted(FUSED_KERNEL_IDS.values()) and len(ids) == len(set(ids))
    assert len(node) == 1 and ast.unparse(node[0]).startswith("tl.static_assert(False, 'no _dequant branch")


def test_a_type_listed_without_a_branch_fails_instead_of_decoding(monkeypatch):
    """The trap: a type added to the fused table whose branch was forgotten must not decode as
    another type's layout. Q8_K has no branch; its 292-byte blocks keep even a wrong decode in
    bounds, so only the missing-branch guard can make this raise."""
    monkeypatch.setitem(FUSED_KERNEL_IDS, Q.Q8_K, int(Q.Q8_K))
    raw = torch.zeros((4, 292), dtype=torch.uint8, device=DEV)
    with pytest.raises(Exception) as failed:     # interpreted: AssertionError; compiled: CompilationError
        tm.fused_linear(raw, Q.Q8_K, torch.ones((1, 256), device=DEV))
    causes, e = [], failed.value                 # (compiled, the message is on the cause)
    while e is not None:
        causes.append(str(e))
        e = e.__cause__ or e.__context__
    assert any("no _dequant branch" in c for c in causes), causes


def test_a_type_without_a_fused_kernel_takes_the_dequant_path(monkeypatch):
    """On a fused device and at a decode batch, a type with no kernel branch (Q2_K) goes
    through per-call dequantization, never the kernel."""
    monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", (DEV.type,))
    monkeypatch.setattr(fused, "linear", lambda *a: pytest.fail("fused kernel called for Q2_K"))
    rng = np.random.default_rng(4)
    raw, w = _weights(rng, Q.Q2_K, 8, 256)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    got = gq.QuantTensor.upload(raw, Q.Q2_K, (8, 256), DEV).linear(torch.from_numpy(x).to(DEV), torch.float32)
    _check(got.cpu().numpy(), x, w)


def test_selection_cuda_decode_only(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(fused, "CROSSOVER", 16)
    assert fused.use_fused(Q.Q4_K, cuda, 1) and fused.use_fused(Q.Q4_K, cuda, 16)
    assert not fused.use_fused(Q.Q4_K, cuda, 17)              # prefill: chunked dequant + GEMM
    assert not fused.use_fused(Q.Q4_K, cpu, 1)                # CPU / virtual GPU: as before
    assert not fused.use_fused(Q.Q2_K, cuda, 1)               # no fused kernel for the type
    assert not fused.use_fused(Q.F16, cuda, 1)
    monkeypatch.setattr(fused, "CROSSOVER", 4)
    assert fused.use_fused(Q.Q8_0, cuda, 4) and not fused.use_fused(Q.Q8_0, cuda, 5)
    monkeypatch.setattr(fused, "CROSSOVER", 0)                # switched off
    assert not fused.use_fused(Q.Q8_0, cuda, 1)
    monkeypatch.setattr(fused, "CROSSOVER", 16)
    fused.triton_available.cache_clear()
    monkeypatch.setattr(fused.importlib.util, "find_spec", lambda name: None)
    assert not fused.use_fused(Q.Q8_0, cuda, 1)               # no triton: chunked path
    fused.triton_available.cache_clear()


@pytest.mark.parametrize("text, ok", [("8", True), ("0", True), ("17", False), ("x", False)])
def test_crossover_env(monkeypatch, text, ok):
    monkeypatch.setenv("OFFLOAD_FUSED_MAX_B", text)
    if ok:
        assert fused._crossover_from_env() == int(text)
    else:
        with pytest.raises(ValueError, match="OFFLOAD_FUSED_MAX_B"):
            fused._crossover_from_env()


@pytest.mark.parametrize("batch", [2, 20])
def test_quant_tensor_linear_routes_by_batch(monkeypatch, batch):
    """QuantTensor.linear (what Linear and TorchExperts call) takes the fused kernel for a
    decode batch on a fused device and the chunked path otherwise; both give the product."""
    monkeypatch.setattr(fused, "FUSED_DEVICE_TYPES", (DEV.type,))
    calls = []
    real = fused.linear
    monkeypatch.setattr(fused, "linear", lambda *a: calls.append(1) or real(*a))
    rng = np.random.default_rng(3)
    raw, w = _weights(rng, Q.Q4_K, 24, 256)
    x = rng.standard_normal((batch, 256)).astype(np.float32)
    t = gq.QuantTensor.upload(raw, Q.Q4_K, (24, 256), DEV)
    got = t.linear(torch.from_numpy(x).to(DEV), torch.float32)
    assert len(calls) == (1 if batch <= fused.CROSSOVER else 0)
    _check(got.cpu().numpy(), x, w)


def test_every_kernel_compiles_for_hopper():
    """The compiled path (not the interpreter's): every type lowers to an sm_90 cubin with
    bf16 x, ahead of time — triton ships ptxas, no GPU needed. In a fresh interpreter:
    compiling needs the kernel without TRITON_INTERPRET."""
    import subprocess
    import sys
    code = ("import torch\nfrom gpu.qtypes import FUSED_TYPES\nfrom gpu.triton_matmul import compile_for\n"
            "for q in FUSED_TYPES:\n    assert 'cubin' in compile_for(q, torch.bfloat16, 90).asm, q\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]


def test_fused_splits_matrices_past_int32_offsets(monkeypatch):
    """Byte offsets inside the kernel are int32: a larger matrix goes through in row spans."""
    monkeypatch.setattr(tm, "_OFFSET_LIMIT", 5 * 34 * 16)               # 5 rows of Q8_0 × 512 cols
    rng = np.random.default_rng(5)
    raw, w = _weights(rng, Q.Q8_0, 23, 512)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    got = tm.fused_linear(torch.from_numpy(raw).to(DEV), Q.Q8_0, torch.from_numpy(x).to(DEV))
    assert got.shape == (2, 23)
    _check(got.cpu().numpy(), x, w)


def test_bad_crossover_env_is_one_line_at_the_cli():
    import subprocess
    import sys
    from offload.probe import SHIPPED_MODEL
    env = os.environ | {"OFFLOAD_FUSED_MAX_B": "lots"}
    # a model that opens: a missing one is refused first, before the runtime (and its settings) load
    r = subprocess.run([sys.executable, "-m", "offload", "run", str(SHIPPED_MODEL)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["offload: error: OFFLOAD_FUSED_MAX_B='lots': expected an integer 0..16"]


def test_offload_and_plan_never_import_triton(fixture_paths):
    import subprocess
    import sys
    code = ("import sys, offload\nfrom offload.cli import main\n"
            f"assert main(['plan', {fixture_paths['qwen3-30b-a3b']!r}, '--devices', 'CUDA0=24GiB,CPU=128GiB']) == 0\n"
            "assert 'triton' not in sys.modules and 'torch' not in sys.modules, 'imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
