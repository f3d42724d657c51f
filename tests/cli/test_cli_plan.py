"""`python -m offload plan` end to end, including every bad input: one line, status 2, no file."""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.archs.test_gguf_model import _tiny

ROOT = Path(__file__).resolve().parents[2]


def offload(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "offload", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_table(fixture_paths):
    r = offload("plan", fixture_paths["glm-4.5-air"], "--devices", "CUDA0=24GiB,CUDA1=24GiB,CPU=128GiB",
                "--ctx", "32768")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("device"))
    assert [line.split()[0] for line in lines[header + 1:header + 4]] == ["CUDA0", "CUDA1", "CPU"]
    assert "NextN head blk.46" in r.stdout and "drafting: in-model NextN" in r.stdout
    assert lines[-1].startswith("llama.cpp: -m ")


def test_json_and_emit(fixture_paths):
    common = [fixture_paths["deepseek-v3"], "--devices", "CUDA0=24GiB,CPU=512GiB", "-c", "32768"]
    r = offload("plan", *common, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["context"] == 32768 and doc["speculative"] is None and len(doc["tensors"]) == 1086
    cuda0 = doc["devices"][0]
    assert set(cuda0) == {"name", "budget_bytes", "target_bytes", "weights_bytes", "kv_bytes", "compute_bytes",
                          "free_after_bytes"}
    assert cuda0["free_after_bytes"] == cuda0["budget_bytes"] - cuda0["weights_bytes"] - cuda0["kv_bytes"] \
        - cuda0["compute_bytes"]
    emitted = offload("plan", *common, "--emit", "llama.cpp")
    assert emitted.returncode == 0 and emitted.stdout.count("\n") == 1
    assert shlex.split(emitted.stdout) == doc["llama_cpp_args"]


@pytest.mark.parametrize("devices,where", [
    ("CUDA0=24GiB,CPU=192GiB", {"CUDA0", "CPU"}),     # one 24 GB card + 192 GB RAM
    ("CPU=160GiB", {"CPU"}),                           # CPU only
])
def test_deepseek_r1_1_58_bit_plans(fixture_paths, devices, where):
    """DeepSeek-R1 UD-IQ1_S (IQ1_S / IQ2_XXS routed experts, issue 13) at its full 160k
    context: the planner fits it and routed experts land on the CPU, where they run."""
    r = offload("plan", fixture_paths["deepseek-r1-ud-iq1_s"], "--devices", devices, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["tensors"]) == 1025 and set(doc["tensors"].values()) == where
    assert all(d["free_after_bytes"] >= 0 for d in doc["devices"])
    assert doc["tensors"]["blk.30.ffn_gate_exps.weight"] == "CPU"
    assert doc["tensors"]["blk.3.ffn_down_exps.weight"] == "CPU"


def test_output_file_loads_back(tmp_path, fixture_paths):
    out = tmp_path / "plan.yaml"
    model = fixture_paths["gpt-oss-120b"]
    first = offload("plan", model, "--devices", "CUDA0=24GiB,CUDA1=12GiB,CPU=64GiB", "-c", "16384",
                    "-o", str(out), "--json")
    assert first.returncode == 0, first.stderr
    assert out.read_text().startswith("# offload placement plan")
    again = offload("plan", "--placement", str(out), "--json")      # the model comes from the plan file
    assert again.returncode == 0, again.stderr
    a, b = json.loads(first.stdout), json.loads(again.stdout)
    assert a["tensors"] == b["tensors"] and a["devices"] == b["devices"] and b["mode"] == "plan file"


def _bad_cases(tmp: Path, paths: dict[str, str]) -> dict[str, tuple[list[str], str]]:
    glm, qwen = paths["glm-4.5-air"], paths["qwen3-30b-a3b"]
    box = ["--devices", "CUDA0=24GiB,CPU=128GiB", "-c", "8192"]
    (tmp / "junk.gguf").write_bytes(b"hello, this is not a model at all" * 4)
    good = _tiny(tmp / "tiny.gguf")
    (tmp / "truncated.gguf").write_bytes(good.read_bytes()[:-100])
    _tiny(tmp / "badtype.gguf", tensors=[("blk.0.attn_q.weight", (64, 64), 77)])
    (tmp / "bad.yaml").write_text("version: 1\nmodel: [oops\n")
    (tmp / "badrule.yaml").write_text(
        "version: 1\nmodel: m.gguf\ncontext: 512\ndevices:\n- {name: CPU, budget: 1GiB}\n"
        "layout: {block_count: 1, n_gpu_layers: 0, tensor_split: []}\nrules:\n- {pattern: x, device: CUDA1}\n")
    shard = Path(paths["gpt-oss-120b"])
    (tmp / shard.name).symlink_to(shard)
    return {
        "missing file": ([str(tmp / "nope.gguf"), *box], "nope.gguf: cannot open"),
        "not a gguf": ([str(tmp / "junk.gguf"), *box], "not a GGUF file (bad magic)"),
        "truncated": ([str(tmp / "truncated.gguf"), "--devices", "CPU=1GiB"], "truncated: tensor blk.0.attn_q.weight"),
        "unknown quant type": ([str(tmp / "badtype.gguf"), "--devices", "CPU=1GiB"], "unknown quant type id 77"),
        "missing shard": ([str(tmp / shard.name), *box], "00002-of-00002.gguf is missing"),
        "bad regex": ([glm, *box, "-ot", "blk\\.(1=CPU"], "bad regex 'blk\\.(1' in -ot"),
        "unknown device in -ot": ([glm, *box, "-ot", "exps=CUDA3"], "names device CUDA3, which is not among"),
        "bad device name in -ot": ([glm, *box, "-ot", "exps=GPU0"], "unknown device 'GPU0'"),
        "unknown device": ([glm, "--devices", "TPU0=8GiB,CPU=64GiB"], "unknown device 'TPU0'"),
        "bad size": ([glm, "--devices", "CUDA0=24GB,CPU=64GiB"], "cannot read size '24GB'"),
        "fit cannot fit": ([glm, "--devices", "CUDA0=2GiB,CPU=128GiB"], "cannot fit the non-expert part"),
        "flags cannot fit": ([qwen, "--devices", "CUDA0=4GiB,CPU=64GiB", "-c", "4096", "-ngl", "99"],
                             "the plan does not fit: CUDA0 needs"),
        "cpu cannot fit": ([glm, "--devices", "CUDA0=24GiB,CPU=8GiB", "-c", "8192"], "cannot fit: CPU needs"),
        "malformed yaml": (["--placement", str(tmp / "bad.yaml")], "bad.yaml:3: malformed YAML"),
        "yaml unknown device": (["--placement", str(tmp / "badrule.yaml")], "badrule.yaml:8: rules[0]: device CUDA1"),
        "placement and flags": ([glm, "--placement", str(tmp / "bad.yaml"), "--cpu-moe"],
                                "--placement cannot be combined with --cpu-moe"),
        "placement and ctx": (["--placement", str(tmp / "bad.yaml"), "-c", "4096"],
                              "--placement cannot be combined with --ctx (the plan file fixes it)"),
        "ubatch zero": ([glm, *box, "-ub", "0"], "context and ubatch must be >= 1"),
        "fit-target count": ([glm, "--devices", "CUDA0=24GiB,CPU=128GiB", "--fit-target", "1024,2048"],
                             "--fit-target has 2 values for 1 GPUs"),
        "cache type": ([glm, *box, "--cache-type", "q3_k"], "unknown --cache-type 'q3_k'"),
        "-ctv on a K-only cache": ([paths["deepseek-v3"], "--devices", "CUDA0=24GiB,CPU=512GiB", "-c", "8192",
                                    "-ctk", "q8_0", "-ctv", "q4_0"], "-ctv q4_0 differs from -ctk q8_0"),
        "ts count": ([glm, *box, "-ts", "1,2,3"], "-ts has 3 values but there are 1 GPUs"),
        "ts nan": ([glm, *box, "-ts", "nan"], "-ts: 'nan' is not a comma list of numbers"),
        "draft without nextn": ([glm, *box, "--draft", qwen], "--draft needs a GGUF holding a NextN block"),
        "unknown flag": ([glm, "--frobnicate"], "unrecognized arguments: --frobnicate"),
        "bad int": ([glm, "-ngl", "many"], "argument -ngl/--n-gpu-layers: invalid int value"),
        "unwritable -o": ([glm, *box], "cannot write"),
    }


def assert_one_line_refusal(r, expected: str, out, where: str) -> None:
    """Status 2, one ``offload: error:`` line holding ``expected``, no traceback, nothing on
    stdout and no ``out`` file."""
    assert r.returncode == 2, where
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("offload: error: "), where
    assert expected in r.stderr, where
    assert "Traceback" not in r.stderr and r.stdout == "", where
    assert not out.exists(), where


def test_bad_inputs_one_line_status_2_no_output_file(tmp_path, fixture_paths):
    cases = _bad_cases(tmp_path, fixture_paths)
    for name, (argv, expected) in cases.items():
        out = tmp_path / "missing-dir" / "plan.yaml" if name == "unwritable -o" else tmp_path / f"{name}.yaml"
        r = offload("plan", *argv, "-o", str(out))
        where = f"{name}: {r.stderr!r}"
        assert_one_line_refusal(r, expected, out, where)
        assert not any(p.name.startswith(f".{out.name}.") for p in out.parent.glob("*")) if out.parent.exists() else True


def test_unknown_command_and_bare_offload():
    r = offload("plna")
    assert r.returncode == 2 and r.stderr == "offload: error: unknown command 'plna' (commands: plan, run, bench, tune, serve, probe, profile)\n"
    bare = offload()
    assert bare.returncode == 2 and "usage: offload COMMAND" in bare.stderr
