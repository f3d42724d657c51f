"""``offload run`` end to end through ``python -m offload``: stdout carries only the
generated text, timings go to stderr, --stats-json is written; bad input gives one line on
stderr and exit status 2, never a traceback or a partial file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q, GGUFWriter

import offload.runtime as rt
from tests.tiny_models import TinySpec, write_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def run(*args, check_rc=None):
    # bytes, decoded here: text mode would read a generated "\r" as "\n" (universal newlines)
    p = subprocess.run([sys.executable, "-m", "offload", "run", *map(str, args)], cwd=ROOT,
                       capture_output=True, timeout=300)
    p.stdout, p.stderr = p.stdout.decode(), p.stderr.decode()
    if check_rc is not None:
        assert p.returncode == check_rc, p.stderr
    return p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "tiny.gguf", TinySpec(seed=31))


def test_stdout_is_exactly_the_generated_text(tiny, tmp_path):
    """By default ``offload run`` samples as llama.cpp does (temperature 0.8, top-k 40, top-p
    0.95, min-p 0.05) with a fresh seed it prints: the text is the library's generation with
    those settings and that seed."""
    stats = tmp_path / "stats.json"
    p = run(tiny.path, "-p", "def the", "-n", "12", "--ignore-eos", "--stats-json", stats, check_rc=0)
    line = next(x for x in p.stderr.splitlines() if x.startswith("offload: sampling: "))
    assert line.startswith("offload: sampling: temp 0.8, top-k 40, top-p 0.95, min-p 0.05, seed "), line
    seed = int(line.rsplit(" ", 1)[1])
    with rt.load(tiny.path, quiet=True) as s:
        want = s.detokenize(s.generate("def the", max_tokens=12, stop_at_eos=False, temperature=0.8, top_k=40,
                                       top_p=0.95, min_p=0.05, seed=seed))
    assert p.stdout == want + "\n"
    assert "prompt eval time" in p.stderr and "eval time" in p.stderr
    assert ": compiled" not in p.stderr and "nextn block" not in p.stderr     # the block paths: -v only
    d = json.loads(stats.read_text())
    assert d["n_gen"] == 12 and d["n_prompt"] == len(rt.load(tiny.path, quiet=True).tokenize("def the"))
    assert d["tokens_per_second"] > 0


def test_virtual_gpus_plan_is_announced_and_gives_the_same_text(tiny):
    plain = run(tiny.path, "-p", "def the", "-n", "8", "--ignore-eos", "--temp", "0", check_rc=0)
    gpu = run(tiny.path, "-p", "def the", "-n", "8", "--ignore-eos", "--temp", "0",
              "--devices", "CUDA0=8GiB,CUDA1=8GiB,CPU=8GiB",
              "-ts", "1,1", "--n-cpu-moe", "2", "--virtual-gpus", check_rc=0)
    assert gpu.stdout == plain.stdout
    assert "virtual" in gpu.stderr and "CUDA1" in gpu.stderr


def test_verbose_lists_each_blocks_path(capsys):
    """``-v`` on the shipped model: one line per run of blocks with one path, and the NextN
    head's; a virtual GPU's blocks say they take the reference path and why."""
    from offload.cli import main
    assert main(["run", "-p", "def", "-n", "2", "-v"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "offload: blocks 0-3: compiled" in err and "offload: nextn block: compiled" in err
    assert main(["run", "-p", "def", "-n", "2", "-v", "--devices", "CUDA0=1GiB,CPU=16GiB", "--virtual-gpus",
                 "--n-cpu-moe", "2"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert any(line.startswith("offload: block") and line.endswith(": reference: attention on CUDA0")
               for line in err), err


def run_here(capsys, *args):
    """The same entry point in this process (bad-input cases: no interpreter start-up each).
    An uncaught exception would fail the test just as a traceback would."""
    from offload.cli import main
    rc = main(["run", *map(str, args)])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out.out, out.err)


def test_bad_inputs_are_one_line_and_status_2(tiny, tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny.path.read_bytes()[: tiny.path.stat().st_size // 2])
    llama = tmp_path / "llama.gguf"    # a well-formed GGUF of an architecture we do not run
    w = GGUFWriter(str(llama), "llama")
    w.add_block_count(1), w.add_context_length(64), w.add_embedding_length(32), w.add_head_count(4)
    w.add_tensor("token_embd.weight", __import__("numpy").zeros((8, 32), dtype="float32"))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    stats = tmp_path / "never.json"
    cases = [
        ((tmp_path / "missing.gguf",), "missing.gguf"),
        ((junk,), "junk.gguf"),
        ((truncated,), "truncated.gguf"),
        ((llama,), "unsupported architecture 'llama' (supported: deepseek2, deepseek4, glm4moe, gpt-oss, qwen3moe"),
        ((tiny.path, "--devices", "CUDA0=8GiB,CPU=8GiB", "--stats-json", stats), "--virtual-gpus"),
        ((tiny.path, "-n", "0"), "-n"),
        ((tiny.path, "--prompt-file", tmp_path / "nope.txt"), "nope.txt"),
        ((tiny.path, "--min-p", "1.5"), "min_p"),
        ((tiny.path, "--repeat-penalty", "0"), "repeat penalty"),
    ]
    for args, needle in cases:
        p = run_here(capsys, *args)
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert lines[-1].startswith("offload: error:") and needle in lines[-1], (args, p.stderr)
        assert "Traceback" not in p.stderr and p.stdout == ""
    assert not stats.exists()


def test_refusals_before_loading_do_not_wait_for_torch(tmp_path):
    """A missing model, an unreadable plan file or a launch that disagrees with the plan is
    refused before torch is imported (about 1 s of a refusal's 1.9 s here): a fresh process
    reports its exit status and whether torch was loaded."""
    code = ("import sys\nfrom offload.cli import main\n"
            "rc = main(['run', *sys.argv[1:]])\nprint(rc, 'torch' in sys.modules)")
    for args in ([str(tmp_path / "missing.gguf")], ["--placement", str(tmp_path / "missing.yaml")]):
        p = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
        assert p.stdout.split() == ["2", "False"], (args, p.stdout, p.stderr)
        assert p.stderr.count("\n") == 1 and "offload: error:" in p.stderr, p.stderr


def test_unsupported_cache_type_and_tiny_context_are_refused(tiny, capsys):
    p = run_here(capsys, tiny.path, "--cache-type", "q3_k", "-n", "2")      # not a KV cache type llama.cpp has
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "--cache-type" in last and "q3_k" in last and "Traceback" not in p.stderr
    p = run_here(capsys, tiny.path, "-c", "8", "-p", "def the def the def the", "-n", "4")
    assert p.returncode == 2 and "exceed the context of 8" in p.stderr.strip().splitlines()[-1]


def test_experts_of_a_type_without_cpu_kernel_are_refused_at_load(tmp_path, capsys):
    tq2 = write_tiny_model(tmp_path / "tq2.gguf", TinySpec(expert_type=Q.TQ2_0, seed=5))
    p = run_here(capsys, tq2.path, "-n", "2")
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stdout == ""
    assert "ffn_gate_exps.weight is TQ2_0" in last and "no CPU kernel" in last
