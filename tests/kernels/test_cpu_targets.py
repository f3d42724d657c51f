"""The kernels compiled for other CPU classes (``cpu_kernels.targets``) in fresh processes,
and the class table itself."""
from __future__ import annotations

import pytest

# ---------------------------------------------------------------- CPUs without AVX-512

_PROBE = """
import json, sys
import numpy as np
import cpu_kernels as ck
from cpu_kernels.matmul import quantized_activations, use_int8
from cpu_kernels.registry import get_kernel
from cpu_kernels.simd8 import has_int8_dot
from cpu_kernels.synth import random_blocks
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize
ck.set_int8_activations(True)
rng = np.random.default_rng(12)
for name in sys.argv[1:]:
    qt = T[name]
    cols = 512 if name in ("Q4_K", "IQ4_XS") else 480
    w = random_blocks(qt, (9, cols), rng)
    W = dequantize(w, qt).astype(np.float64)
    x = rng.standard_normal((20, cols)).astype(np.float32)
    xq, dq = quantized_activations(x)[:2]          # the kernels' own rounding of the activations
    xh = (xq[:, :cols].astype(np.float64).reshape(20, -1, 32) * dq[:, :cols // 32, None]).reshape(x.shape)
    # one token, a token batch (rowdot8), a prompt batch of 17 (the GEMM, gemm8)
    y = np.concatenate([ck.matmul(x[:1], w, qt), ck.matmul(x[1:3], w, qt), ck.matmul(x[3:], w, qt)])
    int8 = use_int8(get_kernel(qt))
    xr = xh if int8 else x.astype(np.float64)       # what the kernel multiplies exactly
    err = np.abs(y - xr @ W.T) / (1e-5 * (np.abs(xr) @ np.abs(W).T) + 1e-30)
    print(json.dumps(dict(type=name, vnni=has_int8_dot(), int8=bool(int8), err=float(err.max()))))
"""


# Per class, two types by default (a nibble/bit-field layout and a value table); the class's
# other two types are the full tier ("more").
@pytest.mark.parametrize("half", ["core", pytest.param("more", marks=pytest.mark.full)])
@pytest.mark.parametrize("target", ["avx512+vnni", "avx2+avxvnni", "avx2"])
def test_kernels_compiled_for_other_cpus(target, half, tmp_path):
    """A fresh process whose Numba target is another CPU class (``cpu_kernels.targets``:
    NUMBA_CPU_NAME and NUMBA_CPU_FEATURES; this host runs the code, it has every instruction
    used): "avx512+vnni" (Cascade Lake class: no GFNI, no VBMI) runs the int8 path with word
    shifts for nibbles and bit fields and ``vpshufb`` for value tables; "avx2+avxvnni"
    (Alder Lake class) with 256-bit VNNI and byte shuffles; "avx2" (Haswell class) with
    ``vpmaddubsw`` + ``vpmaddwd`` (``pair8.dpbusd``: one pair for codes below 128 — Q4_0,
    MXFP4 — two for full-byte codes — IQ4_XS, IQ4_NL, whose value tables are also two 8-lane
    ``vpermps`` and a blend per 8 weights on the float path). Batches of 1, 2 and 17 tokens: the
    last is a prompt batch, the int8 GEMM (``gemm8``). Same bound as on this CPU: float
    rounding of the exact product of the weights with the activations the path uses (1e-5
    of the magnitudes)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from cpu_kernels.targets import numba_env
    cls, types, want_int8 = {"avx512+vnni": ("cascadelake", ["Q4_K", "IQ4_XS", "Q4_0", "MXFP4"], True),
                             "avx2+avxvnni": ("alderlake", ["Q4_0", "MXFP4", "Q5_1", "Q4_K"], True),
                             "avx2": ("haswell", ["Q4_0", "IQ4_XS", "MXFP4", "IQ4_NL"], True)}[target]
    types = types[:2] if half == "core" else types[2:]
    try:
        target_env = numba_env(cls)
    except ValueError as e:
        pytest.skip(str(e))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), **target_env)
    r = subprocess.run([sys.executable, "-c", _PROBE, *types], env=env, capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["type"] for row in rows] == types
    for row in rows:
        assert row["vnni"] is want_int8 and row["int8"] is want_int8, row
        assert row["err"] <= 1.0, row


def test_cpu_class_targets():
    """``python -m cpu_kernels.targets CLASS`` prints the two exports; an unknown class is
    one line and exit 2; the Haswell string turns off every AVX-512 and VNNI feature."""
    import subprocess
    import sys

    from cpu_kernels.targets import numba_env
    try:
        env = numba_env("haswell")
    except ValueError as e:           # not an AVX2 host
        pytest.skip(str(e))
    on = {f[1:] for f in env["NUMBA_CPU_FEATURES"].split(",") if f[0] == "+"}
    assert env["NUMBA_CPU_NAME"] == "haswell" and {"avx2", "fma", "f16c"} <= on
    assert not any(f.startswith(("avx512", "amx", "avxvnni")) for f in on)
    r = subprocess.run([sys.executable, "-m", "cpu_kernels.targets", "pentium"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "unknown CPU class 'pentium'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "cpu_kernels.targets", "haswell"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("export NUMBA_CPU_NAME='haswell'\n")


_COMPILE_ONLY = """
import json, sys
import numpy as np
from numba import njit, typeof, types
from gguf import GGMLQuantizationType as T
from cpu_kernels.dispatch import decode_block_pair
from cpu_kernels.gemm8 import tile_dot4_16
from cpu_kernels.pair8 import pdot
from cpu_kernels.registry import get_kernel
from cpu_kernels.simd import vlane
from cpu_kernels.simd8 import has_int8_dot

@njit
def step(tag, w, xq):                      # a decode step: decoded codes . activations
    c, d, m = decode_block_pair(tag, w, 0)
    r = pdot(c, xq, 0)
    return vlane(r, 0) + vlane(r, 15)       # a lane of each 256-bit half, so neither is dead code

@njit
def tile(cw, xt):                          # the prompt GEMM's four-row tile product
    a0, a1, a2, a3 = tile_dot4_16(cw, 0, xt, 0)
    return vlane(a0, 0) + vlane(a3, 15)

out = {"int8": has_int8_dot()}
u8, i8 = types.Array(types.uint8, 1, "C"), types.Array(types.int8, 1, "C")
for name in sys.argv[1:]:
    sig = (typeof(get_kernel(T[name]).tag), u8, i8)
    step.compile(sig)                       # compiled, never called: this host may lack the instructions
    out[name] = step.inspect_asm(sig)
tile.compile((u8, i8))
out["tile"] = tile.inspect_asm((u8, i8))
print(json.dumps(out))
"""


def test_avx_vnni_code_compiles_where_it_cannot_run(tmp_path):
    """The Alder Lake class (AVX2 + AVX-VNNI) compiled on any x86 host, run or not: a decode
    step of Q4_0 (codes below 128) and Q8_0 (full bytes) and the GEMM's tile product emit
    256-bit ``vpdpbusd`` (AVX-VNNI: a VEX encoding, ymm registers) and no 512-bit register;
    the AVX2 class emits ``vpmaddubsw``/``vpmaddwd`` instead, two pairs per 32 bytes only for
    Q8_0. Compiled with ``dispatcher.compile`` and read back as assembly, never called."""
    import json
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from cpu_kernels.targets import numba_env
    asm = {}
    for cls in ("alderlake", "haswell"):
        env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / cls), **numba_env(cls, runnable=False))
        r = subprocess.run([sys.executable, "-c", _COMPILE_ONLY, "Q4_0", "Q8_0"], env=env, capture_output=True,
                           text=True, cwd=Path(__file__).resolve().parents[2], timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        asm[cls] = json.loads(r.stdout.splitlines()[-1])
    for cls in asm:
        assert asm[cls]["int8"] is True
        for text in (asm[cls]["Q4_0"], asm[cls]["Q8_0"], asm[cls]["tile"]):
            assert "zmm" not in text
    vnni = asm["alderlake"]
    for key in ("Q4_0", "Q8_0", "tile"):
        dots = [ln for ln in vnni[key].splitlines() if "vpdpbusd" in ln]
        assert dots and all("{vex}" in ln and "%ymm" in ln for ln in dots), (key, dots)
        assert "vpmaddubsw" not in vnni[key], key
    avx2 = asm["haswell"]
    count = {k: len(re.findall(r"vpmaddubsw", avx2[k])) for k in ("Q4_0", "Q8_0")}
    assert all("vpdpbusd" not in avx2[k] for k in avx2 if k != "int8")
    assert count["Q4_0"] == 2 and count["Q8_0"] == 4, count     # per 64 codes: two halves, split or not


def test_codes_below_128_are_declared_where_the_values_allow():
    """A type's int8 decoder says whether its codes stay below 128 (``pair8.I8x64.small``: AVX2
    then multiplies them in one ``vpmaddubsw`` pair, which a larger code could saturate). Codes
    are value + offset, so a decoder may say so only where 2 x offset < 128 (offsets are the
    middle of the value range) — and the 4- to 6-bit types must say so, or AVX2 does twice the work."""
    from cpu_kernels.registry import get_kernel, supported_types
    declared = {}
    for t in supported_types():
        k = get_kernel(t)
        if k.has_int8:
            off = k.block_pair_offset if k.block_pair is not None else k.code_offset
            declared[t.name] = (k.codes_small, off)
            assert k.codes_small == (off < 64), (t.name, k.codes_small, off)
    assert {n for n, (small, _) in declared.items() if not small} >= {"Q8_0", "IQ4_NL", "IQ4_XS"}
    assert {n for n, (small, _) in declared.items() if small} >= {"Q4_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"}
