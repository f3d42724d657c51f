"""bench.depth's model writer: the GGUF it writes is what the benchmark says it is (names,
shapes, quant types, byte counts) and offload loads and runs it. Tiny sizes; no timing."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import offload.runtime as rt
from bench.depth import NARROW, WIDE, DepthSpec, main, model_bytes, prompt_ids, tensors, token_bytes, write_model
from offload.gguf_model import open_model
from tests.tiny_models import tiny_vocab

TINY = DepthSpec(n_layer=3, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_expert=4, n_expert_used=2,
                 n_ff_exp=32)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("depth") / TINY.file_name, TINY)


def test_file_holds_the_tensors_the_bench_claims(tiny_path):
    m = open_model(tiny_path)
    n_vocab = len(tiny_vocab()[0])
    want = {t.name: (t.shape, t.qtype) for t in tensors(TINY, n_vocab)}
    got = {t.name: (tuple(t.shape), t.ggml_type) for t in m.tensors}
    assert got == want
    assert got["blk.2.ffn_down_exps.weight"] == ((4, 64, 32), Q.Q4_0)
    assert got["blk.0.attn_q.weight"] == ((64, 64), Q.Q8_0)
    assert m.spec.arch == "qwen3moe" and m.spec.n_layer == 3
    assert (m.spec.n_expert, m.spec.n_expert_used) == (4, 2)
    assert sum(t.n_bytes for t in m.tensors) == model_bytes(TINY, n_vocab)
    assert not list(tiny_path.parent.glob("*.part"))        # the temp file was renamed


def test_active_bytes_count_top_k_of_the_experts(tiny_path):
    m = open_model(tiny_path)
    b = token_bytes(tiny_path)
    exps = sum(t.n_bytes for t in m.tensors if "_exps" in t.name)
    embd = m.tensor("token_embd.weight")
    rest = sum(t.n_bytes for t in m.tensors if "_exps" not in t.name) - embd.n_bytes
    assert b.total == sum(t.n_bytes for t in m.tensors)
    assert b.active == int(rest + exps * 2 / 4 + embd.n_bytes / embd.shape[0])
    per_block = sum(t.n_bytes * (0.5 if "_exps" in t.name else 1) for t in m.tensors if t.layer == 1)
    assert b.active_per_block == pytest.approx(per_block)
    # multiply-adds a token: every block's matrices, the experts' top-2 of 4 (norms are 1-D)
    macs = sum(np.prod(t.shape) * (0.5 if "_exps" in t.name else 1) for t in m.tensors
               if t.layer is not None and len(t.shape) >= 2)
    assert b.macs == int(macs) and b.macs > 0


def test_offload_loads_and_runs_it(tiny_path):
    with rt.load(str(tiny_path), quiet=True, devices="CPU=1GiB", ctx=64) as s:
        logits = s.logits(prompt_ids(8))
        out = list(s.generate(prompt_ids(8), max_tokens=3, stop_at_eos=False))
    assert logits.shape == (8, len(tiny_vocab()[0]))
    assert np.isfinite(logits).all() and logits.std() > 0     # random weights, not a degenerate net
    assert len(out) == 3


def test_the_two_models_are_the_issue_sizes():
    n_vocab = len(tiny_vocab()[0])
    # issue 11 states "about 4.8 GB" and "0.38 GB" for these widths (5.05e9 and 0.377e9 bytes)
    assert model_bytes(WIDE, n_vocab) == pytest.approx(4.8e9, rel=0.06)
    assert model_bytes(NARROW, n_vocab) == pytest.approx(0.38e9, rel=0.06)
    assert replace(NARROW, n_layer=4).file_name != NARROW.file_name


def test_bad_workload_is_one_line(capsys):
    assert main(["--only", "narrow,deep"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--only" in err and "deep" in err


def test_keep_that_is_a_file_is_one_line(tmp_path, capsys):
    not_a_dir = tmp_path / "f"
    not_a_dir.write_text("x")
    assert main(["--only", "narrow", "--no-llama", "--keep", str(not_a_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bench.depth: ") and str(not_a_dir) in err[-1]


def test_sweep_fit_is_the_slope_minus_the_reads():
    """Seconds per token exactly 2 ms + 300 µs per block; a block reads 1 MB at a 10 GB/s
    ceiling = 100 µs: the fit gives slope 300 µs and fixed cost 200 µs (float rounding only)."""
    from bench.depth import Bytes, Row, sweep_fit
    b = Bytes(total=0, active=0, active_per_block=1e6, n_layer=48)
    rows = [Row(f"sweep {n}", "decode", n, b, offload=[1 / (2e-3 + 300e-6 * n)] * 3) for n in (4, 12, 24, 48)]
    slope, fixed = sweep_fit(rows, "offload", 10.0)
    assert slope == pytest.approx(300, rel=1e-9) and fixed == pytest.approx(200, rel=1e-9)
    assert sweep_fit(rows, "llama", 10.0) is None           # that engine did not run
    for r in rows:                                           # a slower pass (contention) besides each
        r.offload = [r.offload[0] / 2, r.offload[0]]
    assert sweep_fit(rows, "offload", 10.0, "best")[1] == pytest.approx(200, rel=1e-9)


def test_llama_cpp_reads_it_the_same(tiny_path):
    """Where llama-cpp-python is installed (skipped otherwise): llama.cpp loads the file and its
    last-position logits agree with offload's. llama.cpp quantizes activations to 8 bits for
    quantized matmuls, so agreement is ~1e-2 of the logit scale (as tests/archs/test_runtime_hf.py)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    ids = prompt_ids(8)
    llm = llama_cpp.Llama(model_path=str(tiny_path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(ids)
    ref = np.array(llm.scores[len(ids) - 1], dtype=np.float32)
    with rt.load(str(tiny_path), quiet=True, devices="CPU=1GiB", ctx=64) as s:
        ours = s.logits(ids)[-1]
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 3e-2


def test_unknown_cpu_target_is_one_line(capsys):
    assert main(["--only", "narrow", "--no-llama", "--cpu-target", "pentium"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("bench.depth: --cpu-target: ") and "pentium" in err[-1] and "avx2" in err[-1]


def test_llama_build_flags_are_the_class():
    """bench.llama_build configures ggml for exactly the class's instruction sets: no native
    tuning, no AMX, AVX-512 only where the class has it (the aliases name the same builds)."""
    from bench.llama_build import cmake_args
    for alias, cls in (("avx2", "haswell"), ("avx-vnni", "alderlake"), ("avx512", "cascadelake")):
        assert cmake_args(alias) == cmake_args(cls)
    flags = {cls: dict(a[2:].split("=", 1) for a in cmake_args(cls) if a.startswith("-DGGML_"))
             for cls in ("haswell", "alderlake", "cascadelake")}
    for cls, f in flags.items():
        assert f["GGML_NATIVE"] == "OFF" and f["GGML_AVX2"] == "ON" and f["GGML_FMA"] == "ON", cls
        assert all(f[k] == "OFF" for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")), cls
    assert flags["haswell"]["GGML_AVX512"] == "OFF" and flags["haswell"]["GGML_AVX_VNNI"] == "OFF"
    assert flags["alderlake"]["GGML_AVX_VNNI"] == "ON" and flags["alderlake"]["GGML_AVX512"] == "OFF"
    assert flags["cascadelake"]["GGML_AVX512"] == "ON" and flags["cascadelake"]["GGML_AVX512_VNNI"] == "ON"
    assert flags["cascadelake"]["GGML_AVX512_VBMI"] == "OFF"
