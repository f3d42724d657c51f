"""deepseek2 beyond logit parity (that is tests/archs/test_runtime_hf.py):

- the MLA cache holds the latent only — one row of kv_lora + rope values per token, no V —
  and its bytes at the plan's cells are the planner's ``kv_bytes``; the older attn_kv_b layout
  keeps full per-head keys and values, as the planner counts it too;
- the NextN (MTP) block drafts with exact verify: output == plain greedy for n_max 1..3, with
  a random head (every draft rejected) and with an "echo" head that passes token t+1 on
  (drafts accepted where greedy repeats), in-model and from a ``--draft`` MTP-only GGUF;
- bad metadata is refused in one line.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

import offload.runtime as rt
from offload.errors import OffloadError
from offload.gguf_model import open_model
from placement.memory import MemorySettings, kv_bytes
from tests.nextn_split import split_nextn
from tests.tiny_models import TinySpec, write_tiny_model

PROMPT = "def main(argv):\n    return"


@pytest.mark.parametrize("mla", [True, False], ids=["latent", "kv_b"])
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_cache_rows_and_bytes_are_the_planners(tmp_path, mla, cache_type):
    spec = TinySpec(arch="deepseek2", mla=mla, nextn=False, seed=40)
    tiny = write_tiny_model(tmp_path / "ds.gguf", spec)
    model = open_model(tiny.path)
    ctx = 300                                        # planner cells: 512
    with rt.load(tiny.path, cache_type=cache_type, ctx=ctx, quiet=True) as s, torch.inference_mode():
        state = s.model.new_state()
        s.model.forward(torch.arange(1, 301), state, logits="none")   # past 256: grows to the cap
        for i, cache in enumerate(state.caches):
            if mla:
                assert cache.v is None and cache.k.shape[0] == 1
                assert cache.k.shape[2] == spec.kv_lora_rank + spec.n_rot
            else:
                assert cache.k.shape[::2] == (spec.n_head, spec.qk_nope + spec.n_rot)
                assert cache.v.shape[::2] == (spec.n_head, spec.v_head_dim)
            assert cache.k.shape[1] == 512
            assert cache.nbytes == kv_bytes(model.spec, i, MemorySettings(ctx=ctx, cache_type=cache_type))


ECHO = TinySpec(arch="deepseek2", tied_output=True, embd_std=2.0, nextn_echo=4.0, n_group=2, n_group_used=1,
                yarn_factor=4.0, yarn_orig_ctx=16, seed=7)
RANDOM = TinySpec(arch="deepseek2", expert_type=Q.Q4_K, q_lora_rank=0, seed=8)


@pytest.mark.parametrize("spec", [RANDOM, ECHO], ids=["random-head", "echo-head"])
def test_mtp_exact_verify_is_plain_greedy(tmp_path, spec):
    tiny = write_tiny_model(tmp_path / "ds.gguf", spec)
    trunk, draft = tmp_path / "trunk.gguf", tmp_path / "mtp.gguf"
    assert split_nextn(tiny.path, trunk, draft) == spec.n_layer
    with rt.load(tiny.path, devices="CPU=4GiB", quiet=True) as s:
        plain = list(s.generate(PROMPT, max_tokens=32, stop_at_eos=False))
        for n_max in (1, 2, 3):
            got = list(s.generate(PROMPT, max_tokens=32, stop_at_eos=False, n_max=n_max, verify="exact"))
            assert got == plain, n_max
            st = s.stats
            assert st.drafted > 0
            if spec is ECHO:       # greedy repeats its last token; the echo head says so
                assert st.accepted > 0
            else:
                assert st.accepted < st.drafted
    with rt.load(trunk, devices="CPU=4GiB", draft=str(draft), quiet=True) as s:
        assert list(s.generate(PROMPT, max_tokens=32, stop_at_eos=False, n_max=2, verify="exact")) == plain


def test_bad_mla_metadata_is_refused(tmp_path):
    from gguf import GGUFReader, GGUFWriter, GGUFValueType, Keys
    tiny = write_tiny_model(tmp_path / "ds.gguf", TinySpec(arch="deepseek2", nextn=False, seed=41))
    r = GGUFReader(str(tiny.path))
    bad = tmp_path / "bad.gguf"
    w = GGUFWriter(str(bad), "deepseek2")
    key = Keys.Attention.KEY_LENGTH.format(arch="deepseek2")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == Keys.General.ARCHITECTURE:
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(k, 100 if k == key else f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=None if t.tensor_type in (Q.F32, Q.F16) else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(OffloadError, match="key_length 100 != kv_lora_rank"):
        rt.load(bad, quiet=True)


def test_run_bench_tune_end_to_end(tmp_path, capsys):
    """A small deepseek2 with its MTP block (the echo head, so drafts are accepted) through
    ``offload run --spec-n-max 2``, ``offload bench`` and ``offload tune`` on a plan with a
    virtual GPU: each exits 0 and reports acceptance per draft position."""
    import json

    from offload.cli import main
    tiny = write_tiny_model(tmp_path / "ds.gguf", TinySpec(arch="deepseek2", n_layer=4, **{
        k: getattr(ECHO, k) for k in ("tied_output", "embd_std", "nextn_echo", "n_group", "n_group_used",
                                      "yarn_factor", "yarn_orig_ctx", "seed")}))
    stats = tmp_path / "stats.json"
    assert main(["run", str(tiny.path), "-p", PROMPT, "-n", "24", "--ignore-eos", "--spec-n-max", "2",
                 "--devices", "CPU=4GiB", "--stats-json", str(stats)]) == 0
    err = capsys.readouterr().err
    assert "acceptance/pos" in err
    assert len(json.loads(stats.read_text())["acceptance_per_position"]) == 2
    plan = tmp_path / "plan.yaml"
    gpu = ["--devices", "CUDA0=4GiB,CPU=4GiB", "--n-cpu-moe", "2", "-c", "1024"]
    assert main(["bench", str(tiny.path), "--tasks", "code", "--n-max", "2", "--repeat", "1", "-n", "16",
                 "--virtual-gpus", *gpu]) == 0
    assert "mtp n=2" in capsys.readouterr().out
    assert main(["plan", str(tiny.path), *gpu, "-o", str(plan)]) == 0
    assert main(["tune", "--placement", str(plan), "--max-n", "2", "--budget", "8s", "-n", "16",
                 "--virtual-gpus"]) == 0
    assert "chosen: drafter" in capsys.readouterr().out
