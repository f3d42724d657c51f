"""The compiled CPU block (``offload.compiled_block``) against the torch reference path it
was bound from (an architecture's ``DecoderBlock``, e.g. ``offload.models.glm4moe.Glm4MoeBlock``): same logits within a stated tolerance on
the shipped model and on the transformers-checked tiny models, for batches of T = 1…8 after
a prefill, for a prompt short enough to run compiled, for a prefill by the reference path
continued by compiled steps (they share the KV cache), for the NextN head, and across a
rollback (``truncate``). Speculative decoding with exact verify equal to plain greedy runs
with the compiled path on in tests/speculative/test_speculative_shipped.py (it is the default).

Tolerance: both paths compute in float32 from the same weights; only the order of float32
sums differs (4-row register blocking and vector lanes vs torch's matmuls), observed
~3e-7 of the largest logit. REL_TOL = 1e-5 leaves 30x room; a real mistake (a missing bias,
RoPE pairs, a routing weight) shows at 1e-2 or more.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import offload.runtime as rt
from offload.compiled_block import (
    ENV,
    GQA_BLOCK,
    REFERENCE,
    AttentionArgs,
    BlockRun,
    CompiledBlock,
    CompiledParts,
    DenseArgs,
    MoeArgs,
    compile_block,
    path_lines,
)
from placement.limits import DECODE_TOKENS
from tests.tiny_models import TinySpec, write_tiny_model

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
REL_TOL = 1e-5
PROMPT = [3, 17, 257, 101, 46, 290, 5, 77, 200, 12, 64, 128, 9, 33, 71, 150, 2, 88, 19, 240]


def rel_err(a, ref) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(ref)).max() / np.abs(np.asarray(ref)).max())


@contextmanager
def reference_blocks(model):
    """Run ``model`` through the reference blocks (trunk and NextN head) meanwhile."""
    blocks, head = model.blocks, model.nextn
    model.blocks = [getattr(b, "reference", b) for b in blocks]
    if head is not None:
        saved = head.block
        head.block = getattr(saved, "reference", saved)
    try:
        yield
    finally:
        model.blocks = blocks
        if head is not None:
            head.block = saved


def both(model, fn):
    """fn(model) through the compiled blocks, then through the reference blocks."""
    with torch.inference_mode():
        fast = fn(model)
        with reference_blocks(model):
            ref = fn(model)
    return fast, ref


def batches_after_prefill(model, prompt, sizes):
    """Logits of each batch of ``sizes`` tokens fed after a prefill of ``prompt``."""
    state = model.new_state(None)
    model.forward(torch.tensor(prompt), state, logits="none")
    out, nxt = [], 300
    for t in sizes:
        logits, _ = model.forward(torch.arange(nxt, nxt + t) % model.config.n_vocab, state)
        out.append(logits.numpy())
        nxt += t
    return out


@pytest.fixture(scope="module")
def shipped():
    if not SHIPPED.is_file():
        pytest.skip(f"{SHIPPED.name} not present")
    with rt.load(SHIPPED, devices="CPU=16GiB", cache_type="f32", quiet=True) as s:
        yield s


def test_all_cpu_blocks_are_compiled(shipped):
    assert all(isinstance(b, CompiledBlock) for b in shipped.model.blocks)
    assert isinstance(shipped.model.nextn.block, CompiledBlock)


@contextmanager
def one_block_at_a_time(model):
    """Run the compiled blocks through their own calls (no ``BlockRun``) meanwhile."""
    runs = model.block_runs
    model.block_runs = lambda: [(lambda x, p, c, b=b: b(x, p, c[0]), i, i + 1) for i, b in enumerate(model.blocks)]
    try:
        yield
    finally:
        model.block_runs = runs


def test_shipped_trunk_steps_in_runs(shipped):
    """The trunk's consecutive compiled blocks of one kind step as runs (one compiled call
    each), covering every block once, in order."""
    runs = shipped.model.block_runs()
    assert [lo for _, lo, _ in runs] == [0] + [hi for _, _, hi in runs[:-1]]
    assert runs[-1][2] == len(shipped.model.blocks)
    assert any(isinstance(step, BlockRun) for step, _, _ in runs)


def runs_match_single_blocks_and_reference(model):
    """Runs vs the same compiled blocks called one by one vs the reference path: the same
    kernels in the same order, so runs and single blocks agree to float32 rounding of
    the inlined code (fastmath may contract differently), and both to the reference within
    REL_TOL; across a rollback too (the run advances every cache of the run)."""
    sizes = [1, 2, 3, 5, 8]

    def steps(m):
        out = batches_after_prefill(m, PROMPT[:4], sizes)
        state = m.new_state(None)
        m.forward(torch.tensor(PROMPT[:6]), state, logits="none")
        m.forward(torch.tensor(PROMPT[6:10]), state, logits="none")
        state.truncate(7)
        logits, _ = m.forward(torch.tensor([42, 7]), state)
        return out + [logits.numpy()]
    with torch.inference_mode():
        run = steps(model)
        with one_block_at_a_time(model):
            single = steps(model)
    _, ref = both(model, steps)
    for t, a, b, r in zip(sizes + ["rollback"], run, single, ref):
        assert rel_err(a, b) < REL_TOL, f"T={t}"
        assert rel_err(a, r) < REL_TOL, f"T={t}"


def test_shipped_runs_equal_single_blocks_and_reference(shipped):
    runs_match_single_blocks_and_reference(shipped.model)


def test_dense_and_moe_runs_equal_single_blocks_and_reference(tmp_path):
    """Two leading dense blocks and two MoE blocks: a dense run and an MoE run."""
    tiny = write_tiny_model(tmp_path / "dense2.gguf", TinySpec(n_layer=4, n_dense=2, seed=3))
    with rt.load(tiny.path, cache_type="f32", quiet=True) as s:
        runs = s.model.block_runs()
        assert [(type(step), lo, hi) for step, lo, hi in runs] == [(BlockRun, 0, 2), (BlockRun, 2, 4)]
        runs_match_single_blocks_and_reference(s.model)


def test_several_sequences_step_each_run_in_one_call_as_the_blocks_one_by_one(tmp_path):
    """Three sequences stepped together (continuous batching: a ``SequenceBatch`` per block)
    go through each run, dense and MoE, in one ``blocks_run`` call and give the logits of
    the same blocks called one by one (the same kernels in the same order: float32 rounding of
    the inlined code, as for one sequence above), over two steps of 1 and 2 rows per sequence
    at three cache lengths."""
    tiny = write_tiny_model(tmp_path / "dense2.gguf", TinySpec(n_layer=4, n_dense=2, seed=3))
    with rt.load(tiny.path, cache_type="f32", quiet=True) as s:
        model = s.model

        def steps(m):
            states = [m.new_state(None) for _ in range(3)]
            for st, n in zip(states, (3, 5, 4)):
                m.forward(torch.tensor(PROMPT[:n]), st, logits="none")
            out = []
            for rows in ([1, 2, 1], [2, 1, 1]):
                seqs = [(torch.tensor(PROMPT[10:10 + r]), st, "all") for r, st in zip(rows, states)]
                out += [z.numpy() for z, _ in m.forward_batch(seqs)]
            return out
        with torch.inference_mode():
            run = steps(model)
            assert [True in step._entries for step, _, _ in model.block_runs()] == [True, True]
            with one_block_at_a_time(model):
                single = steps(model)
        assert len(run) == 6
        for a, b in zip(run, single):
            assert rel_err(a, b) < REL_TOL


@pytest.mark.parametrize("prompt_len", [4, len(PROMPT)], ids=["compiled-prefill", "reference-prefill"])
def test_shipped_batches_of_1_to_8_match_reference(shipped, prompt_len):
    """After a prefill run compiled (4 tokens) or by the reference path (20 > DECODE_TOKENS),
    batches of T = 1…8 tokens give the reference path's logits."""
    assert len(PROMPT) > DECODE_TOKENS
    fast, ref = both(shipped.model, lambda m: batches_after_prefill(m, PROMPT[:prompt_len], range(1, 9)))
    for t, (a, b) in enumerate(zip(fast, ref), start=1):
        assert a.shape == (t, shipped.config.n_vocab)
        assert rel_err(a, b) < REL_TOL, f"T={t}"


def test_shipped_prompt_and_rollback_match_reference(shipped):
    """A 12-token prompt in one compiled pass; then a 5-token verify batch, a rollback to
    two of them and one more step — the speculative loop's cache pattern."""
    def run(m):
        state = m.new_state(None)
        a, _ = m.forward(torch.tensor(PROMPT[:12]), state)
        b, _ = m.forward(torch.tensor(PROMPT[12:17]), state)
        state.truncate(14)
        c, _ = m.forward(torch.tensor([42]), state)
        return a.numpy(), b.numpy(), c.numpy()
    for a, b in zip(*both(shipped.model, run)):
        assert rel_err(a, b) < REL_TOL


def test_shipped_nextn_head_matches_reference(shipped):
    def run(m):
        state = m.new_state()
        _, h = m.forward(torch.tensor(PROMPT[:9]), state)
        tok = torch.tensor(PROMPT[1:10])
        logits, h_mtp = m.nextn(tok, h, torch.arange(1, 10), state.nextn_cache)
        step, _ = m.nextn(torch.tensor([5]), h_mtp[-1:], torch.arange(10, 11), state.nextn_cache)
        return logits.numpy(), step.numpy()
    for a, b in zip(*both(shipped.model, run)):
        assert rel_err(a, b) < REL_TOL


@pytest.mark.parametrize("cache_type", ["f16", "bf16"])
def test_shipped_half_caches_match_reference(cache_type):
    """The KV cache read and written in its plan type (f16 is the planner's default). Keys
    and values are rounded to 11 (f16) or 8 (bf16) significant bits, so an element whose
    float32 value sits within ~1e-7 of a rounding boundary can round one way in one path and
    the other in the other: one ulp of one cached element, 2**-11 or 2**-8 of it, damped by
    the softmax. Tolerance 1e-3 / 1e-2 of the largest logit (observed 2.3e-5 / 7.5e-7)."""
    tol = {"f16": 1e-3, "bf16": 1e-2}[cache_type]
    with rt.load(SHIPPED, devices="CPU=16GiB", cache_type=cache_type, quiet=True) as s:
        fast, ref = both(s.model, lambda m: batches_after_prefill(m, PROMPT[:6], range(1, 9)))
    errs = [rel_err(a, b) for a, b in zip(fast, ref)]
    assert max(errs) < tol


# the transformers-checked tiny models (tests/archs/test_runtime_hf.py: there the compiled path,
# the default, is held to transformers' float64 forward)
TINY = {
    "glm4moe-Q4_0-qknorm": TinySpec(expert_type=Q.Q4_0, qk_norm=True, seed=1),
    "glm4moe-F16-nonorm": TinySpec(expert_type=Q.F16, weights_norm=False, weights_scale=1.0, seed=4),
    "qwen3moe-Q5_K": TinySpec(arch="qwen3moe", nextn=False, n_rot=32, expert_type=Q.Q5_K, seed=6),
}


# (their compiled blocks against the reference blocks, with the compiled head and embedding
# against the reference ones too: tests/kernels/test_pass_head.py::test_tiny_models_match_reference)


def test_reference_forced_by_env_and_kept_off_cpu(monkeypatch):
    """``OFFLOAD_BLOCKS=reference`` keeps the torch blocks; a block on a (virtual) GPU is
    never compiled. Each says why in its ``path``."""
    monkeypatch.setenv(ENV, "reference")
    with rt.load(SHIPPED, devices="CPU=16GiB", quiet=True) as s:
        assert not any(isinstance(b, CompiledBlock) for b in s.model.blocks)
        assert {b.path for b in s.model.blocks + [s.model.nextn.block]} == {"reference: OFFLOAD_BLOCKS=reference"}
    monkeypatch.delenv(ENV)
    with rt.load(SHIPPED, devices="CUDA0=1GiB,CPU=16GiB", virtual_gpus=True, n_cpu_moe=2,
                 quiet=True) as s:
        kinds = {b.device_name: isinstance(b, CompiledBlock) for b in s.model.blocks}
        paths = {b.device_name: b.path for b in s.model.blocks}
    assert kinds.get("CUDA0") is False
    assert paths["CUDA0"] == "reference: attention on CUDA0"


# -- what an architecture declares, and what each block reports -------------------------

def test_shipped_blocks_report_the_compiled_path(shipped):
    assert {b.path for b in shipped.model.blocks} == {"compiled"}
    assert shipped.model.nextn.block.path == "compiled"
    assert path_lines(shipped.model) == [f"blocks 0-{len(shipped.model.blocks) - 1}: compiled",
                                         "nextn block: compiled"]


def test_compiled_block_reads_its_reference_parts_explicitly(shipped):
    """The parts outside code inspects (tune's routers, op offload's MoE) are the reference's;
    there is no attribute forwarding beyond them."""
    b = shipped.model.blocks[1]
    ref = b.reference
    assert (b.attn, b.ffn, b.attn_norm, b.ffn_norm) == (ref.attn, ref.ffn, ref.attn_norm, ref.ffn_norm)
    assert not hasattr(b, "_cache")


def test_parts_are_bound_only_where_declared(shipped):
    """The same reference block: compiled under GQA_BLOCK, kept under REFERENCE (with the
    declared reason), kept when only the MoE half is declared for a dense block."""
    ref = shipped.model.blocks[0].reference          # block 0: dense FFN
    assert isinstance(compile_block(ref, GQA_BLOCK), CompiledBlock)
    kept = compile_block(ref, REFERENCE.because("a test says so"))
    assert kept is ref and ref.path == "reference: a test says so"
    assert compile_block(ref, REFERENCE) is ref and ref.path == "reference: not declared by the architecture"
    moe_only = CompiledParts(attention="gqa", ffn=("moe",))
    assert compile_block(ref, moe_only) is ref and ref.path == "reference: dense FFN not declared"
    with pytest.raises(TypeError):
        compile_block(ref)                             # the declaration is required


@pytest.mark.parametrize("record", [AttentionArgs, MoeArgs, DenseArgs])
def test_record_fields_are_the_kernel_signature(record):
    """Each record's fields, between the per-call arguments before and after them, are the
    compiled half's parameters in order: ``as_args()`` is the kernel's positional tuple."""
    params = list(inspect.signature(record.KERNEL.py_func).parameters)
    assert [*record.BEFORE, *(f.name for f in fields(record)), *record.AFTER] == params


def test_bound_records_name_the_kernel_arguments(shipped):
    b = shipped.model.blocks[1]
    assert isinstance(b.attn_args, AttentionArgs) and isinstance(b.ffn_args, MoeArgs)
    assert b.attn_args.n_head == shipped.config.n_head
    assert b.ffn_args.k_used == shipped.config.n_expert_used
    assert len(b.ffn_args.as_args()) == len(fields(MoeArgs))
    assert isinstance(shipped.model.blocks[0].ffn_args, DenseArgs)


def test_deepseek2_blocks_report_the_reference_path(tmp_path):
    tiny = write_tiny_model(tmp_path / "ds.gguf", TinySpec(arch="deepseek2", seed=40))
    with rt.load(tiny.path, cache_type="f32", quiet=True) as s:
        blocks = s.model.blocks + [s.model.nextn.block]
        assert not any(isinstance(b, CompiledBlock) for b in blocks)
        assert {b.path for b in blocks} == {"reference: MLA attention has no compiled half"}
        assert path_lines(s.model)[0] == f"blocks 0-{len(s.model.blocks) - 1}: reference: MLA attention " \
                                         "has no compiled half"


def test_gpt_oss_blocks_report_the_reference_path(tmp_path):
    tiny = write_tiny_model(tmp_path / "oss.gguf", TinySpec(arch="gpt-oss", expert_type=Q.MXFP4, n_layer=2,
                                                             n_embd=512, n_head=8, n_head_kv=2, head_dim=64,
                                                             n_expert=16, n_expert_used=4, window=16, seed=36))
    with rt.load(tiny.path, quiet=True) as s:
        assert not any(isinstance(b, CompiledBlock) for b in s.model.blocks)
        paths = {b.path for b in s.model.blocks}
    assert len(paths) == 1 and paths.pop().startswith("reference: ")


def test_path_lines_group_runs_of_one_path():
    class B:
        def __init__(self, path):
            self.path = path

    class M:
        blocks = [B("reference: dense FFN on CUDA0")] * 3 + [B("compiled")] * 44 + [B("reference: x")]
        nextn = None
    assert path_lines(M) == ["blocks 0-2: reference: dense FFN on CUDA0", "blocks 3-46: compiled",
                             "block 47: reference: x"]


NEW_PROCESS = """
import sys
from numba.core import event
compiled = []
class Count(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Count())
import offload
with offload.load(sys.argv[1], devices="CPU=16GiB", quiet=True) as s:
    list(s.generate(s.tokenize("import os"), max_tokens=4))
print(sorted(set(compiled)))
"""


def test_a_second_process_loads_and_decodes_without_compiling():
    """What loading and decoding the shipped model compiles is cached on disk: after a first
    process, a second compiles nothing. (The typed lists of a block run's arguments were built
    from Python, whose appends Numba compiles again in every process: ~1 s of each warm load,
    dozens of model-loading subprocesses in this suite.)"""
    import subprocess
    import sys
    outs = [subprocess.run([sys.executable, "-c", NEW_PROCESS, str(SHIPPED)], cwd=SHIPPED.parents[1],
                           capture_output=True, text=True, timeout=600) for _ in range(2)]
    assert all(o.returncode == 0 for o in outs), outs[-1].stderr[-2000:]
    assert outs[1].stdout.strip() == "[]", outs[1].stdout
