"""Decode/verify batches (T <= 16) of the CPU routed experts in int8 activations for the weight
types whose int8 path is faster (``--decode-activations auto``, the default;
``placement.limits.DECODE_INT8_TYPES``), float for the others, with a switch.

Held here: the mode actually bound and run (the compiled entries' argument types, which
name the int8 scratch; the logits move off the float path's), the compiled block against the
reference path in the same mode, ``float`` giving the float path bit for bit, exact
speculative decoding equal to plain greedy, the CLI flag and the planner's count.

Tolerances: compiled vs reference in int8 mode, REL_TOL_INT8 (below). Both paths quantize
the same activations the same way (``rowdot8.quantize_rows`` per 32 values), but their
inputs differ by float32 summation order (~3e-7 of the largest logit in float mode,
tests/kernels/test_compiled_block.py); where an activation sits at a rounding boundary of its 1/127
step the two paths round it to neighbouring codes, a change of up to max|x|/127 in one of
32 values, which the following blocks carry on. So: at least half the batches within the
float tolerance REL_TOL (the same codes: a wrong scale or offset would show in every one),
all within REL_TOL_INT8 (observed: flips of 1.4e-3 and 2.8e-3 on these models). int8 vs float: moved (int8
ran) and under INT8_VS_FLOAT = 6e-2 of the largest logit: the int8 activations' error
bound (cpu_kernels.settings) gives ~1e-2, and a near-tied top-k choice that flips moves a
position as a different expert set would, up to 6e-2 in int8 prefill on the shipped model
(docs/cpu-kernels.md); observed here 1.3e-2 (Q4_K), 9.0e-3 (MXFP4), 3.2e-2 (Q5_K).
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from numba import types as nb_types

import offload.runtime as rt
from cpu_kernels import block as kb
from cpu_kernels.simd8 import has_int8_dot
from offload.commands.run import build_parser, session_options
from offload.compiled_block import CompiledBlock, MoeArgs
from placement import limits
from placement.compute import Devices
from tests.kernels.test_compiled_block import PROMPT, batches_after_prefill, both, rel_err
from tests.tiny_models import TinySpec, write_tiny_model

REL_TOL = 1e-5            # tests/kernels/test_compiled_block.py's: float32 summation order only
REL_TOL_INT8 = 1e-2       # see the module docstring
INT8_VS_FLOAT = 6e-2

needs_vnni = pytest.mark.skipif(not has_int8_dot(), reason="int8 path needs AVX512-VNNI, AVX-VNNI or AVX2")
SPECS = {"Q4_K": TinySpec(expert_type=Q.Q4_K, seed=21),
         "MXFP4": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, expert_type=Q.MXFP4, seed=22),
         # tests/kernels/test_compiled_block.py's transformers-checked Q5_K model, in int8 mode here
         "Q5_K": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, expert_type=Q.Q5_K, seed=6)}


# Q4_K (glm4moe) and MXFP4 (qwen3moe) by default; Q5_K, a third type of the same int8 decode
# path (its int8 row routines: tests/kernels/test_cpu_kernels.py::test_int8_matmul), is the full tier
@pytest.fixture(scope="module", params=["Q4_K", "MXFP4", pytest.param("Q5_K", marks=pytest.mark.full)])
def model(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("m") / f"{request.param}.gguf", SPECS[request.param])


def _moe_modes(s) -> list[tuple[bool, bool]]:
    """(gate·up int8, down int8) bound into each compiled MoE block."""
    out = []
    for b in s.model.blocks:
        if isinstance(b, CompiledBlock) and isinstance(b.ffn_args, MoeArgs):
            out.append((b.ffn_args.qx is not None, b.ffn_args.qh is not None))
    return out


def _int8_specialisations() -> int:
    """moe_half and blocks_run specialisations compiled or loaded with int8 scratch (a tuple, not
    None). Both: a run of blocks links moe_half into blocks_run's code, so when that comes from
    Numba's cache only blocks_run lists the signature."""
    qx = 19                                              # moe_half's qx; in a run's MoE tuples, qx - 2
    halves = [sig[qx] for sig in kb.moe_half.signatures]
    moe = list(inspect.signature(kb.blocks_run.py_func).parameters).index("moe_args")
    runs = [sig[moe].item_type[qx - 2] for sig in kb.blocks_run.signatures if isinstance(sig[moe], nb_types.ListType)]
    return sum(1 for t in halves + runs if not isinstance(t, nb_types.NoneType))


def _steps(m):
    """Logits of batches of T = 1..8 after a prefill (model ``m``)."""
    return batches_after_prefill(m, PROMPT[:8], range(1, 9))


@needs_vnni
def test_auto_binds_and_runs_int8_and_matches_the_reference(model):
    with rt.load(model.path, cache_type="f32", quiet=True) as s:
        modes = _moe_modes(s)
        assert modes and all(m == (True, True) for m in modes)
        fast, ref = both(s.model, _steps)
        assert _int8_specialisations() >= 1            # the int8 specialisation is what ran
    with rt.load(model.path, cache_type="f32", quiet=True, decode_activations="float") as f:
        assert all(m == (False, False) for m in _moe_modes(f))
        flt = [a.copy() for a in torch.inference_mode()(_steps)(f.model)]
    errs = [rel_err(a, b) for a, b in zip(fast, ref)]
    moved = [rel_err(a, b) for a, b in zip(fast, flt)]
    print(f"{model.path.stem}: compiled vs reference (int8 both), T = 1..8: "
          f"{' '.join(f'{e:.1e}' for e in errs)}; int8 vs float max {max(moved):.1e} of the largest logit")
    assert sorted(errs)[len(errs) // 2] < REL_TOL          # same codes: float32 rounding only
    assert max(errs) < REL_TOL_INT8                        # a code flipped at a rounding boundary
    assert 0 < max(moved) < INT8_VS_FLOAT                # int8 ran, within its error bound


def test_float_switch_is_the_float_path_bit_for_bit(model, monkeypatch):
    """``float`` = what ``auto`` runs for a type outside the set (the float specialisation)."""
    with rt.load(model.path, cache_type="f32", quiet=True, decode_activations="float") as f:
        flt = torch.inference_mode()(_steps)(f.model)
    monkeypatch.setattr(limits, "DECODE_INT8_TYPES", frozenset())
    with rt.load(model.path, cache_type="f32", quiet=True) as s:
        assert all(m == (False, False) for m in _moe_modes(s))
        auto = torch.inference_mode()(_steps)(s.model)
    for a, b in zip(flt, auto):
        np.testing.assert_array_equal(a, b)


def test_int8_switch_takes_every_quantized_type(tmp_path):
    """``int8``: Q8_0 experts (outside the set) decode in int8 too; ``auto`` keeps them float."""
    tiny = write_tiny_model(tmp_path / "q8.gguf", TinySpec(seed=23))
    with rt.load(tiny.path, cache_type="f32", quiet=True) as s:
        assert all(m == (False, False) for m in _moe_modes(s))
    with rt.load(tiny.path, cache_type="f32", quiet=True, decode_activations="int8") as s:
        assert all(m == (has_int8_dot(), has_int8_dot()) for m in _moe_modes(s))


def test_exact_speculative_equals_plain_greedy_in_int8(model):
    with rt.load(model.path, cache_type="f32", quiet=True) as s:
        if s.model.nextn is None:
            pytest.skip("no NextN head in this tiny model")
        plain = list(s.generate(PROMPT[:6], max_tokens=12, stop_at_eos=False))
        spec = list(s.generate(PROMPT[:6], max_tokens=12, stop_at_eos=False, n_max=3, verify="exact"))
    assert spec == plain and len(plain) == 12


def test_bad_mode_is_one_line_error(model):
    with pytest.raises(rt.OffloadError, match="decode activations 'fast'"):
        rt.load(model.path, quiet=True, decode_activations="fast")


def test_forced_int8_on_a_cpu_without_vnni_says_it_runs_float(model, capsys):
    """Without a u8 x s8 dot product the int8 path does not exist: ``int8`` runs float and the
    load says so (one line); with one, nothing is said."""
    with rt.load(model.path, cache_type="f32", decode_activations="int8") as s:
        assert all(m == (has_int8_dot(), has_int8_dot()) for m in _moe_modes(s))
    err = capsys.readouterr().err
    assert ("--decode-activations int8 runs float activations" in err) == (not has_int8_dot())


def test_cli_flag_maps_to_the_runtime_setting():
    from offload.commands.run import DECODE_ACTIVATIONS
    from placement.limits import DECODE_ACTIVATIONS as modes
    assert DECODE_ACTIVATIONS == tuple(modes)
    parser = build_parser()
    assert session_options(parser.parse_args([]))["decode_activations"] == "auto"
    for mode in ("int8", "float"):
        assert session_options(parser.parse_args(["--decode-activations", mode]))["decode_activations"] == mode


def test_planner_counts_int8_decode_activations_of_the_routed_experts():
    auto, flt, forced = Devices("auto", ()), Devices("auto", (), decode="float"), Devices("auto", (), decode="int8")
    assert auto.int8(1, [Q.Q4_K, Q.Q4_K], routed=True) and auto.int8(16, [Q.MXFP4], routed=True)
    assert not auto.int8(1, [Q.Q8_0], routed=True) and not auto.int8(1, [Q.Q4_K, Q.Q8_0], routed=True)
    assert not auto.int8(1, [Q.Q4_K])                  # dense matrices: prompt batches only
    assert not flt.int8(1, [Q.Q4_K], routed=True) and flt.int8(17, [Q.Q4_K], routed=True)
    assert forced.int8(1, [Q.Q8_0], routed=True) and not forced.int8(1, [Q.F16], routed=True)


def _bound_int8_bytes(s) -> int:
    """Bytes of the int8 decode scratch each compiled MoE block (trunk and NextN) holds (qx, qh)."""
    n = 0
    head = [s.model.nextn.block] if s.model.nextn is not None else []
    for b in s.model.blocks + head:
        if isinstance(b, CompiledBlock) and isinstance(b.ffn_args, MoeArgs):
            for pair in (b.ffn_args.qx, b.ffn_args.qh):
                n += sum(a.nbytes for a in pair) if pair is not None else 0
    return n


@needs_vnni
@pytest.mark.parametrize("mode", ["auto", "float", "int8"])
def test_planner_counts_the_bound_int8_decode_scratch(tmp_path, mode):
    """The plan's CPU compute carries exactly the int8 scratch the compiled blocks bind at
    load (it lives for the whole run, so no forward-pass moment holds it)."""
    from offload.gguf_model import open_model
    from placement.compute import decode_int8_scratch_bytes
    tiny = write_tiny_model(tmp_path / "q4k.gguf", SPECS["Q4_K"])
    m = open_model(str(tiny.path))
    with rt.load(tiny.path, cache_type="f32", quiet=True, decode_activations=mode) as s:
        bound = _bound_int8_bytes(s)
        planned = decode_int8_scratch_bytes(m.spec, list(m.tensors), lambda t: s.plan.tensors[t.name],
                                            Devices("auto", (), decode=mode))
    assert bound == planned
    assert (bound > 0) == (mode != "float")
