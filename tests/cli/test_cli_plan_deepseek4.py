"""`offload plan` on DeepSeek-V4-Flash headers: bad input refused in one line (status 2), a
trunk that claims an MTP block it lacks, and the three boxes of issue 31 with the MTP sidecar."""
from __future__ import annotations

import json

import pytest
from gguf.constants import Keys

from offload.gguf_model import open_model
from placement.memory import MemorySettings, kv_bytes
from tests.cli.test_cli_plan import offload
from tests.fixtures.real_models import ALL, U32, Q, write_fixture

BOX = ["--devices", "CUDA0=24GiB,CPU=192GiB", "-c", "32768"]
ARCH = "deepseek4"


def _v4(tmp_path, name, edit):
    m = ALL["deepseek-v4-flash"]()
    m.name = f"v4-{name}"
    edit(m)
    return str(write_fixture(m, tmp_path, tokenizer="none"))


def _key(template, value):
    def edit(m):
        key = template.format(arch=ARCH)
        m.metadata[key] = (m.metadata[key][0] if key in m.metadata else U32, value)
    return edit


def _tid2eid(qtype, shape):
    def edit(m):
        m.tensors = [(n, shape, qtype) if n == "blk.0.ffn_gate_tid2eid.weight" else (n, s, t)
                     for n, s, t in m.tensors]
    return edit


RATIOS = "{arch}.attention.compress_ratios"
BAD = {
    "ratios short": (_key(RATIOS, [0] * 40),
                     "deepseek4.attention.compress_ratios has 40 value(s) for 43 blocks"),
    "bad ratio": (_key(RATIOS, [0, 0, 4, 8] + [4] * 40),
                  "deepseek4.attention.compress_ratios holds 8; each ratio must be one of 0 (window), 4 (CSA), "
                  "128 (HCA)"),
    "hc count": (_key("{arch}.hyper_connection.count", 3),
                 "tensor output_hc_fn.weight has shape (4, 16384) but deepseek4.hyper_connection.count = 3, "
                 "deepseek4.embedding_length = 4096 gives (3, 12288)"),
    "hc count missing": (lambda m: m.metadata.pop("deepseek4.hyper_connection.count"),
                         "missing metadata key deepseek4.hyper_connection.count"),
    "gating": (_key(Keys.LLM.EXPERT_GATING_FUNC, 1),
               "deepseek4: expert_gating_func is 1; only 4 (sqrt-softplus) is supported"),
    "quantized tid2eid": (_tid2eid(Q.Q8_0, (129280, 32)),
                          "tensor blk.0.ffn_gate_tid2eid.weight is Q8_0, but ffn_gate_tid2eid holds expert ids "
                          "per token: I32, never a quantized type"),
    "f16 tid2eid": (_tid2eid(Q.F16, (129280, 6)), "tensor blk.0.ffn_gate_tid2eid.weight is F16"),
    "compressor on a window block": (
        lambda m: m.add("blk.0.attn_compressor_kv.weight", (1024, 4096), Q.BF16),
        "tensor blk.0.attn_compressor_kv.weight belongs to a compressed block but "
        "deepseek4.attention.compress_ratios[0] = 0"),
    "HCA compressor on a CSA block": (
        lambda m: m.tensors.__setitem__(
            next(i for i, t in enumerate(m.tensors) if t[0] == "blk.2.attn_compressor_kv.weight"),
            ("blk.2.attn_compressor_kv.weight", (512, 4096), Q.BF16)),
        "tensor blk.2.attn_compressor_kv.weight has shape (512, 4096) but deepseek4.attention.compress_ratios[2] "
        "= 4, deepseek4.attention.key_length = 512, deepseek4.embedding_length = 4096 gives (1024, 4096)"),
    "tid2eid width": (_tid2eid(Q.I32, (129280, 8)),
                      "tensor blk.0.ffn_gate_tid2eid.weight has shape (129280, 8) but deepseek4.vocab_size = "
                      "129280, deepseek4.expert_used_count = 6 gives (129280, 6)"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_header_one_line_status_2(tmp_path, case):
    edit, expected = BAD[case]
    r = offload("plan", _v4(tmp_path, case.replace(" ", "-"), edit), *BOX)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("offload: error: "), r.stderr
    assert expected in r.stderr and r.stdout == ""


def test_hc_count_the_tensors_do_not_match_names_the_block_tensor(tmp_path):
    """A header whose hc head agrees but whose blocks were written for 3 streams."""
    def edit(m):
        m.tensors = [(n, (15, 3 * 4096) if n == "blk.0.hc_attn_fn.weight" else s, t) for n, s, t in m.tensors]
    r = offload("plan", _v4(tmp_path, "hc-block", edit), *BOX)
    assert r.returncode == 2 and r.stderr == (
        f"offload: error: {tmp_path}/v4-hc-block.gguf: tensor blk.0.hc_attn_fn.weight has shape (15, 12288) but "
        "deepseek4.hyper_connection.count = 4, deepseek4.embedding_length = 4096 gives (24, 16384)\n")


def test_trunk_claiming_an_mtp_block_it_lacks_plans_without_a_draft_head(tmp_path):
    """Some 0731 trunks say nextn_predict_layers = 1 but hold no MTP tensors: like llama.cpp
    (which probes blk.{n}.nextn.eh_proj), plan all 43 blocks as the trunk, no draft head."""
    path = _v4(tmp_path, "nextn", _key(Keys.LLM.NEXTN_PREDICT_LAYERS, 1))
    r = offload("plan", path, *BOX, "--json")
    assert r.returncode == 0, r.stderr
    assert r.stderr == (f"offload: warning: {path}: deepseek4.nextn_predict_layers is 1 but there is no "
                        "blk.42.nextn.eh_proj.weight: no MTP head in this file; planned without a draft head "
                        "(give --draft MTP.gguf to draft)\n")
    doc = json.loads(r.stdout)
    assert doc["drafting"] == "none" and doc["speculative"] is None
    spec = open_model(_v4(tmp_path, "plain", lambda m: None)).spec
    assert sum(d["kv_bytes"] for d in doc["devices"]) == sum(kv_bytes(spec, i, MemorySettings(32768))
                                                           for i in range(43))   # every block a trunk block


BOXES = {
    "1x24GB+192GB": "CUDA0=24GiB,CPU=192GiB",
    "1x96GB+768GB": "CUDA0=96GiB,CPU=768GiB",
    "4x32GB+512GB": "CUDA0=32GiB,CUDA1=32GiB,CUDA2=32GiB,CUDA3=32GiB,CPU=512GiB",
}


@pytest.mark.parametrize("box", BOXES)
def test_the_three_boxes_with_the_mtp_sidecar(fixture_paths, models, box):
    """Issue 31's boxes, V4-Flash with its MTP sidecar, --fit on: the plan fits at the model's
    full context, the draft head (all of blk.43, its hc head, output) is on a GPU, and the
    emitted llama.cpp flags put every tensor where the plan does."""
    trunk, mtp = fixture_paths["deepseek-v4-flash"], fixture_paths["deepseek-v4-flash-mtp"]
    r = offload("plan", trunk, "--draft", mtp, "--devices", BOXES[box], "--fit", "on", "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(r.stdout)
    assert doc["context"] == 1048576 and doc["drafting"] == "--draft"
    for d in doc["devices"]:
        assert d["free_after_bytes"] >= 0 and d["free_after_bytes"] >= d["target_bytes"], d
    head = doc["draft_placement"]["device"]
    assert head.startswith("CUDA")
    assert {dev for name, dev in doc["draft_tensors"].items() if name != "token_embd.weight"} == {head}
    assert doc["draft_tensors"]["token_embd.weight"] == "CPU"
    assert {doc["tensors"][n] for n in ("output.weight", "output_hc_fn.weight", "output_hc_base.weight",
                                       "output_hc_scale.weight")} == {doc["tensors"]["output.weight"]}
    # KV: the trunk's 43 blocks at 1M context (6.77 GiB) and the MTP block's window ring
    spec = models["deepseek-v4-flash"].spec
    want = sum(kv_bytes(spec, i, MemorySettings(1048576)) for i in range(43)) + 768 * 512 * 2
    assert sum(d["kv_bytes"] for d in doc["devices"]) == want
    args = doc["llama_cpp_args"]
    assert args[args.index("-md"):args.index("-md") + 6] == ["-md", mtp, "--spec-type", "draft-mtp", "-devd", head]
    from tests.llama_cpp_ref import apply_flags
    tensors, draft = apply_flags(args, list(doc["tensors"]), spec.n_layer, list(doc["draft_tensors"]))
    assert tensors == doc["tensors"] and draft == doc["draft_tensors"]


def test_plan_file_round_trip_with_the_sidecar(tmp_path, fixture_paths):
    trunk, mtp = fixture_paths["deepseek-v4-flash"], fixture_paths["deepseek-v4-flash-mtp"]
    out = tmp_path / "v4.yaml"
    first = offload("plan", trunk, "--draft", mtp, "--devices", BOXES["4x32GB+512GB"], "--fit", "on", "-c", "131072",
                    "--json", "-o", str(out))
    again = offload("plan", "--placement", str(out), "--json")
    assert first.returncode == 0 and again.returncode == 0, again.stderr
    a, b = json.loads(first.stdout), json.loads(again.stdout)
    assert (a["tensors"], a["draft_tensors"], a["devices"]) == (b["tensors"], b["draft_tensors"], b["devices"])


@pytest.mark.parametrize("box", BOXES)
def test_the_three_boxes_with_the_dspark_drafter(fixture_paths, models, box):
    """V4-Flash-0731's DSpark drafter (arch dflash, recognised by its header) on issue 31's
    boxes, --fit on, 32k context: every drafter tensor sits on one GPU (its glue outside the
    stages as llama.cpp's output layer), the fit counts its weights and its three window
    caches, the forecast is a block drafter's (DSpark's prior acceptance, S(n) from one block
    pass per step), and llama.cpp is told draft-dspark."""
    trunk, dspark = fixture_paths["deepseek-v4-flash"], fixture_paths["deepseek-v4-flash-dspark"]
    r = offload("plan", trunk, "--draft", dspark, "--devices", BOXES[box], "--fit", "on", "-c", "32768",
                "--no-probe", "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(r.stdout)
    for d in doc["devices"]:
        assert d["free_after_bytes"] >= d["target_bytes"], d
    head = doc["draft_placement"]["device"]
    assert head.startswith("CUDA") and set(doc["draft_tensors"].values()) == {head}
    assert len(doc["draft_tensors"]) == len(models["deepseek-v4-flash-dspark"].tensors)
    spec = models["deepseek-v4-flash"].spec
    draft_spec = models["deepseek-v4-flash-dspark"].spec
    want = sum(kv_bytes(spec, i, MemorySettings(32768)) for i in range(43)) + \
        sum(kv_bytes(draft_spec, i, MemorySettings(32768)) for i in range(3))
    assert sum(d["kv_bytes"] for d in doc["devices"]) == want
    s = doc["speculative"]
    assert s["type"] == "dspark" and s["profile"]["acceptance"]["accept"] == [0.84, 0.84, 0.57]
    assert s["best_n_max"] >= 1 and s["break_even_n_max"] >= s["best_n_max"]
    args = doc["llama_cpp_args"]
    assert args[args.index("-md"):args.index("-md") + 4] == ["-md", dspark, "--spec-type", "draft-dspark"]


def test_dspark_drafter_mismatches_are_one_line(tmp_path, fixture_paths):
    """A dflash drafter for another architecture, width, vocabulary or tap set is refused in
    one line before any weight is read; offload run refuses, before loading, --spec-type mtp
    with a dflash draft and --spec-type dspark with an MTP draft."""
    from tests.fixtures.real_models import ALL

    def variant(name, edit):
        m = ALL["deepseek-v4-flash-dspark"]()
        m.name = f"dspark-{name}"
        edit(m)
        return str(write_fixture(m, tmp_path, tokenizer="none"))

    def taps(m):
        m.metadata["dflash.target_layers"] = (m.metadata["dflash.target_layers"][0], [41, 42, 99])

    def vocab(m):
        m.tensors = [(n, (1000, 256) if n == "markov_w1.weight" else shape, q) for n, shape, q in m.tensors]

    trunk = fixture_paths["deepseek-v4-flash"]
    cases = [(fixture_paths["qwen3-30b-a3b"], fixture_paths["deepseek-v4-flash-dspark"], "not for qwen3moe"),
             (trunk, variant("taps", taps), "target_layers"),
             (trunk, variant("vocab", vocab), "vocabulary is 1000 tokens")]
    for model, draft, needle in cases:
        r = offload("plan", model, "--draft", draft, "--devices", BOXES["1x96GB+768GB"], "-c", "4096")
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, (needle, r.stderr)
    for draft, kind, needle in [(fixture_paths["deepseek-v4-flash-dspark"], "mtp", "draft with --spec-type dspark"),
                                (fixture_paths["deepseek-v4-flash-mtp"], "dspark", "needs a DSpark drafter")]:
        r = offload("run", trunk, "--draft", draft, "--devices", BOXES["1x96GB+768GB"], "-c", "4096",
                    "--virtual-gpus", "-n", "1", "--spec-type", kind)
        assert r.returncode == 2 and needle in r.stderr.splitlines()[-1], r.stderr
        assert "Traceback" not in r.stderr
