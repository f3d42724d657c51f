"""DeepSeek-V4-Flash (deepseek4) planned from real-shaped headers: inventory, bytes, keys,
caches, the hc head, the routing tables (../shared/deepseek4.md §1, §5)."""
from __future__ import annotations

import math
import warnings

import pytest
from gguf import GGMLQuantizationType

from offload.gguf_model import open_model
from placement.memory import MemorySettings, dsv4_cache, kv_bytes
from placement.tensors import Role
from tests.fixtures.real_models import ALL, write_fixture

Q = GGMLQuantizationType
MIB, GIB = 1 << 20, 1 << 30


def _v4_bytes() -> tuple[int, int]:
    """The trunk's and the MTP sidecar's bytes from §1.3's shapes and §5's mainline types,
    counted apart from the fixture: MXFP4 17 B / 32 values, Q8_0 34 / 32, BF16 2, F32 and I32 4."""
    E, V, H, D, ql, n_exp, ff, hc = 4096, 129280, 64, 512, 1024, 256, 2048, 4
    mx, q8 = lambda n: n * 17 // 32, lambda n: n * 34 // 32          # noqa: E731
    root = 2 * V * E + q8(V * E) + 4 * (E + hc * hc * E + hc + 1)      # embd BF16, output Q8_0, norm + hc head
    block = (4 * (E + H + ql + D + E)                                  # attn_norm, sinks, q_a/kv norms, ffn_norm
             + q8(E * ql + ql * H * D + E * D + 8 * 1024 * E + 8 * 1024 * E)   # q_a, q_b, kv, out_a, out_b
             + 4 * 2 * ((2 + hc) * hc * hc * E + (2 + hc) * hc + 3)   # hc_attn_* / hc_ffn_* (F32)
             + 2 * n_exp * E                                          # router BF16
             + mx(3 * n_exp * ff * E) + q8(3 * ff * E))               # experts MXFP4, shared Q8_0
    hca = 2 * 2 * D * E + 4 * (128 * D + D)                           # compressor kv/gate BF16, ape/norm F32
    csa = (2 * 2 * 2 * D * E + 4 * (4 * 2 * D + D)                   # the overlapping compressor (2·512 wide)
           + 2 * 64 * E + q8(ql * 64 * 128)                          # indexer.proj BF16, indexer.attn_q_b Q8_0
           + 2 * 2 * 2 * 128 * E + 4 * (4 * 2 * 128 + 128))           # indexer_compressor_*
    tid2eid, bias = 4 * V * 6, 4 * n_exp                               # I32 routing table / exp_probs_b
    trunk = root + 43 * block + 20 * hca + 21 * csa + 3 * tid2eid + 40 * bias
    mtp = root + block + bias + q8(2 * E * E) + 4 * 3 * E                # blk.43 + eh_proj and its 3 norms
    return trunk, mtp


@pytest.fixture(scope="module")
def v4(models):
    return models["deepseek-v4-flash"], models["deepseek-v4-flash-mtp"]


def test_inventory_and_bytes(v4):
    trunk, mtp = v4
    want_trunk, want_mtp = _v4_bytes()
    assert len(trunk.tensors) == 1328 and len(mtp.tensors) == 34
    got_trunk, got_mtp = (sum(t.n_bytes for t in m.tensors) for m in v4)
    assert (got_trunk, got_mtp) == (want_trunk, want_mtp) == (155_876_573_532, 5_225_881_068)
    # §5: ≈145 GiB (experts 137.06 GiB) and ≈4.9 GiB; 284.3 B and 7.67 B parameters
    assert abs(got_trunk / GIB - 145) < 0.5 and abs(got_mtp / GIB - 4.9) < 0.1
    experts = sum(t.n_bytes for t in trunk.tensors if t.role is Role.ROUTED_EXPERTS)
    assert round(experts / GIB, 2) == 137.06
    assert round(sum(t.n_elements for t in trunk.tensors) / 1e9, 2) == 284.33
    assert round(sum(t.n_elements for t in mtp.tensors) / 1e9, 2) == 7.67


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-flash-mtp"])
def test_every_key_and_kind_understood(tmp_path, name):
    path = write_fixture(ALL[name](), tmp_path, tokenizer="none")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = open_model(path)
    assert not [t.name for t in m.tensors if t.role is Role.OTHER]


def test_spec(v4):
    trunk, mtp = v4
    s = trunk.spec
    assert (s.arch, s.n_layer, s.n_nextn, s.n_embd, s.n_head, s.n_head_kv[0], s.head_dim_k) == \
        ("deepseek4", 43, 0, 4096, 64, 1, 512)
    assert (s.hc_mult, s.n_hash_layers, s.o_groups, s.o_lora_rank, s.q_lora_rank) == (4, 3, 8, 1024, 1024)
    assert (s.indexer_n_head, s.indexer_head_dim, s.indexer_top_k, s.sliding_window) == (64, 128, 512, 128)
    assert [s.compress_ratio(i) for i in (0, 1, 2, 3, 41, 42)] == [0, 0, 4, 128, 128, 4]
    assert (mtp.spec.n_layer, mtp.spec.n_nextn, mtp.spec.compress_ratio(43)) == (44, 1, 0)


def test_roles(v4):
    trunk, mtp = v4
    role = {t.name: t.role for t in trunk.tensors}
    assert {n: role[n] for n in ("output.weight", "output_hc_fn.weight", "output_hc_base.weight",
                                 "output_hc_scale.weight")} == dict.fromkeys(
        ("output.weight", "output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight"), Role.OUTPUT)
    assert role["blk.0.ffn_gate_tid2eid.weight"] is Role.ROUTER and role["blk.5.hc_ffn_fn.weight"] is Role.ATTENTION
    assert role["blk.2.indexer_compressor_kv.weight"] is Role.ATTENTION
    nextn = {t.name for t in mtp.tensors if t.role is Role.NEXTN}
    assert nextn == {f"blk.43.nextn.{n}.weight" for n in ("eh_proj", "enorm", "hnorm", "shared_head_norm")}


def test_routing_tables_are_counted_exactly(v4):
    """ffn_gate_tid2eid: I32, (n_vocab, n_expert_used), 4 bytes a value, on blocks 0-2 only."""
    trunk, _ = v4
    tables = [t for t in trunk.tensors if "tid2eid" in t.name]
    assert [t.layer for t in tables] == [0, 1, 2]
    assert all(t.ggml_type is Q.I32 and t.shape == (129280, 6) and t.n_bytes == 129280 * 6 * 4 for t in tables)


def _kv(spec, ctx, blocks):
    return sum(kv_bytes(spec, i, MemorySettings(ctx)) for i in blocks)


def test_kv_at_32k_and_128k(v4):
    """§5: compressed caches 6880 B/token at f16 (21·512/4 + 21·128/4 + 20·512/128 values), a
    window ring per block of sliding_window + ubatch (768 cells after padding), and the f32
    compressor state: ≈0.21 GiB at 32k and ≈0.84 GiB at 128k plus the ring and state."""
    trunk, mtp = v4
    s = trunk.spec
    for ctx, mib in ((32768, 263.4), (131072, 908.4)):
        got = _kv(s, ctx, range(43))
        ring = 43 * 768 * 512 * 2
        state = sum(4 * (c.state_rows * c.state_width + c.indexer_state_rows * c.indexer_state_width)
                    for c in (dsv4_cache(s, i, MemorySettings(ctx)) for i in range(43)))
        assert got == 6880 * ctx + ring + state
        assert round(got / MIB, 1) == mib
    assert round(_kv(s, 32768, range(43)) / MIB) in range(240, 280)        # "about 250 MiB"
    assert round(_kv(s, 131072, range(43)) / MIB) in range(860, 940)       # "about 900 MiB"
    # the MTP block keeps only its window ring
    assert kv_bytes(mtp.spec, 43, MemorySettings(32768)) == 768 * 512 * 2
    assert math.ceil(32768 / 128) == dsv4_cache(s, 3, MemorySettings(32768)).compressed_rows


# -- placement and compute --------------------------------------------------------------

HC_HEAD = ("output_hc_fn.weight", "output_hc_base.weight", "output_hc_scale.weight")


def _fit(model, box, ctx=32768, draft=None):
    from placement.devices import parse_devices
    from placement.fit import fit
    devices = parse_devices(box)
    return fit(model, devices, {d.name: GIB for d in devices if d.is_gpu}, MemorySettings(ctx), draft=draft)


def test_hc_head_goes_where_the_output_goes(v4):
    """The hc head (output_hc_*) collapses the streams right before output_norm/output: on
    the output's GPU, for the trunk and for the MTP sidecar's own head; a sidecar's
    token_embd is its input layer: on the CPU, as llama.cpp keeps it."""
    trunk, mtp = v4
    for box in ("CUDA0=24GiB,CPU=192GiB", "CUDA0=32GiB,CUDA1=32GiB,CUDA2=32GiB,CUDA3=32GiB,CPU=512GiB"):
        plan = _fit(trunk, box, draft=mtp)
        out = plan.tensors["output.weight"]
        assert out.startswith("CUDA") and {plan.tensors[n] for n in HC_HEAD} == {out}
        assert {plan.draft_tensors[n] for n in HC_HEAD + ("output.weight", "blk.43.nextn.eh_proj.weight")} == \
            {plan.placement.draft_device} and plan.placement.draft_device.startswith("CUDA")
        assert plan.draft_tensors["token_embd.weight"] == "CPU"


def test_forward_carries_the_hc_wide_state(v4):
    """deepseek4's hidden state between blocks is (T, hc_mult, n_embd): a block computing on
    another device than the one before it holds hc_mult× the rows of other models there."""
    from placement.memory import forward_model
    trunk, _ = v4
    fm = forward_model(trunk.spec, trunk.tensors, MemorySettings(32768))
    assert fm.state == 512 * 4 * 4096 * 4
    dev = lambda t: "CUDA0" if t.layer == 5 else "CPU"        # noqa: E731
    steps = fm.block_steps(5, dev, "CPU", "CPU")
    assert min(m.get("CPU", 0) for m in steps) == fm.state    # the previous block's state, held on its home
    assert max(m["CUDA0"] for m in steps) > 3 * fm.state      # residual X, its hc_pre square, X' at hc_post


def test_compute_grows_with_the_compressed_entries(v4):
    """Window-only blocks attend to their ring; CSA blocks score every ctx/4 indexer key and
    attend to the entries masked to the top-k."""
    from placement.memory import forward_model
    trunk, _ = v4
    gpu = lambda t: "CUDA0"                                    # noqa: E731

    def peak(ctx, i):
        fm = forward_model(trunk.spec, trunk.tensors, MemorySettings(ctx))
        return max(m["CUDA0"] for m in fm.block_steps(i, gpu, "CUDA0", "CUDA0"))

    assert peak(32768, 0) == peak(131072, 0)                   # window only
    # (HCA's few entries, 256 at 32k, 1024 at 128k, change the chunking of the sink attention's
    # queries more than the keys: its peak need not grow)
    assert peak(131072, 2) - peak(32768, 2) > 512 * (32768 - 8192) * 4   # CSA: the (T, ctx/4) scores alone


def test_routing_table_is_not_the_router(v4):
    from placement.compute import BlockTensors
    trunk, _ = v4
    b = BlockTensors.of([t for t in trunk.tensors if t.layer == 0])
    assert b.router.name == "blk.0.ffn_gate_inp.weight"
    assert {"indexer.proj", "indexer.attn_q_b"} <= set(BlockTensors.of([t for t in trunk.tensors if t.layer == 2]).attn)


def test_bundled_mtp_plans_in_model(models):
    """A bundled trunk + MTP file: blk.43 drafts in-model with its window cache; its own hc
    head (blk.43.nextn.hc_head_*) stays with the block."""
    m = models["deepseek-v4-flash-bundled"]
    assert len(m.tensors) == 1359 and (m.spec.n_layer_trunk, m.spec.n_nextn) == (43, 1)
    plan = _fit(m, "CUDA0=24GiB,CPU=192GiB")
    assert plan.drafting == "in-model NextN"
    assert plan.tensors["blk.43.nextn.hc_head_fn.weight"] == plan.tensors["blk.43.attn_kv.weight"] == "CUDA0"
    kv = sum(t.kv_bytes for t in plan.totals)
    assert kv == _kv(m.spec, 32768, range(43)) + 768 * 512 * 2


def test_0731_ratios_of_length_46(tmp_path):
    """0731 checkpoints list the three DSpark stages after the trunk (46 ratios): llama.cpp reads
    the first block_count."""
    m = ALL["deepseek-v4-flash"]()
    key = "deepseek4.attention.compress_ratios"
    m.metadata[key] = (m.metadata[key][0], m.metadata[key][1][:43] + [0, 0, 0])
    spec = open_model(write_fixture(m, tmp_path, tokenizer="none")).spec
    assert len(spec.compress_ratios) == 43 and spec.compress_ratios[-1] == 4


def test_tied_output_is_found_beside_the_hc_head(v4):
    """Without output.weight the logits come from token_embd (a copy on the output's device),
    even though the hc head's tensors are output-layer tensors too."""
    from placement.memory import tied_output
    trunk, _ = v4
    untied = [t for t in trunk.tensors if t.name != "output.weight"]
    tied = tied_output(untied)
    assert tied is not None and tied.n_bytes == trunk.tensor("token_embd.weight").n_bytes
    assert tied_output(trunk.tensors) is None
