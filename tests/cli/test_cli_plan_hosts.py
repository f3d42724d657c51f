"""`python -m offload plan --hosts` end to end: the per-host tables and forecast, the plan file
written and read back, and every bad input as one line, status 2, no file."""
from __future__ import annotations

import json
from pathlib import Path

from tests.cli.test_cli_plan import assert_one_line_refusal, offload

TWO = "a:CUDA0=24GiB,CPU=200GiB;b:CUDA0=24GiB,CPU=256GiB"


def test_table_and_forecast(fixture_paths):
    r = offload("plan", fixture_paths["deepseek-v3"], "--draft", fixture_paths["deepseek-v3-mtp"], "--hosts", TWO,
                "-c", "32768", "--hop-latency-us", "250")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("plan across 2 hosts: a blocks 0-")
    assert "== host a: blocks 0-" in out and "== host b: blocks " in out and "-60 ==" in out
    assert out.count("\ndevice ") == 2                       # one device table per host
    assert "across 2 hosts (predicted; 2 hops per pass: 1 of 28672 bytes per token" in out
    assert "hop 250 us" in out and "break-even n_max:" in out and "with the hops free" in out
    assert "draft NextN head blk.61" in out.split("== host b")[1]


def test_json_output_file_and_reload(tmp_path, fixture_paths):
    out = tmp_path / "multihost.yaml"
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text("hosts:\n- name: a\n  devices: [{name: CUDA0, budget: 24GiB}, {name: CPU, budget: 192GiB}]\n"
                     "- name: b\n  devices: [{name: CPU, budget: 256GiB}]\n"
                     "- name: c\n  devices: [{name: CUDA0, budget: 32GiB, target: 2GiB}, {name: CUDA1, budget: 32GiB},"
                     " {name: CPU, budget: 192GiB}]\n")
    first = offload("plan", fixture_paths["kimi-k2"], "--hosts", str(hosts), "-c", "32768", "-o", str(out), "--json")
    assert first.returncode == 0, first.stderr
    a = json.loads(first.stdout)
    assert [h["name"] for h in a["hosts"]] == ["a", "b", "c"] and a["hosts"][-1]["blocks"][1] == 60
    assert a["hosts"][2]["devices"][0]["target_bytes"] == 2 << 30 and a["forecast"]["hops_per_pass"] == 3
    assert out.read_text().startswith("# offload placement plan")
    again = offload("plan", "--placement", str(out), "--json")
    assert again.returncode == 0, again.stderr
    b = json.loads(again.stdout)
    assert [h["tensors"] for h in a["hosts"]] == [h["tensors"] for h in b["hosts"]]
    assert [h["devices"] for h in a["hosts"]] == [h["devices"] for h in b["hosts"]]
    assert all(h["mode"] == "plan file" for h in b["hosts"])
    # only `offload run` with ranks runs a plan across hosts: the rest refuse in one line, before any weight is read
    for command in ("bench", "serve", "tune"):
        r = offload(command, "--placement", str(out))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, (command, r.stderr)
        assert "a plan across hosts (a, b, c) runs only with `offload run --rank R --world-size W`" in r.stderr, command
    r = offload("run", "--placement", str(out))
    assert r.returncode == 2 and "is a plan across hosts: run one process per host with --rank R" in r.stderr


def test_the_plan_keeps_the_hop_it_forecast_with(tmp_path, fixture_paths):
    """The speculative section records the link the forecast assumed; planning the file again
    forecasts with it unless a flag says otherwise."""
    out = tmp_path / "multihost.yaml"
    first = offload("plan", fixture_paths["deepseek-v3"], "--draft", fixture_paths["deepseek-v3-mtp"], "--hosts", TWO,
                    "-c", "32768", "--hop-latency-us", "250", "--hop-gbps", "5", "-o", str(out), "--json")
    assert first.returncode == 0, first.stderr
    spec = json.loads(first.stdout)["speculative"]
    assert (spec["hop_latency_us"], spec["hop_gbps"]) == (250, 5)
    assert "hop_latency_us: 250" in out.read_text() and "hop_gbps: 5" in out.read_text()
    again = offload("plan", "--placement", str(out), "--json")
    assert again.returncode == 0, again.stderr
    b = json.loads(again.stdout)
    assert (b["forecast"]["hop_latency_us"], b["forecast"]["hop_gbps"]) == (250, 5)
    assert b["forecast"]["predicted_plain_tps"] == json.loads(first.stdout)["forecast"]["predicted_plain_tps"]
    flag = json.loads(offload("plan", "--placement", str(out), "--hop-latency-us", "50", "--json").stdout)
    assert (flag["forecast"]["hop_latency_us"], flag["forecast"]["hop_gbps"]) == (50, 5)
    assert flag["forecast"]["predicted_plain_tps"] > b["forecast"]["predicted_plain_tps"]


def _bad_cases(tmp: Path, paths: dict[str, str]) -> dict[str, tuple[list[str], str]]:
    dsv3 = paths["deepseek-v3"]
    (tmp / "bad-hosts.yaml").write_text("hosts:\n- name: a\n  devices: [{name: CPU, budget: 1GiB}\n")
    (tmp / "dup-hosts.yaml").write_text("hosts:\n- name: a\n  devices: [{name: CPU, budget: 300GiB}]\n"
                                        "- name: a\n  devices: [{name: CPU, budget: 300GiB}]\n")
    return {
        "bad host name": ([dsv3, "--hosts", "a b:CPU=512GiB"], "--hosts: 'a b' is not a host name"),
        "duplicate host": ([dsv3, "--hosts", "a:CPU=300GiB;a:CPU=300GiB"], "--hosts: host a is given twice"),
        "unknown device": ([dsv3, "--hosts", "a:TPU0=8GiB,CPU=300GiB;b:CPU=300GiB"], "--hosts a: unknown device 'TPU0'"),
        "bad size": ([dsv3, "--hosts", "a:CPU=300GB;b:CPU=300GiB"], "--hosts a CPU: cannot read size '300GB'"),
        "not NAME:DEVICES": ([dsv3, "--hosts", "CPU=300GiB"], "is not NAME:DEVICES"),
        "malformed hosts yaml": ([dsv3, "--hosts", str(tmp / "bad-hosts.yaml")], "bad-hosts.yaml:4: malformed YAML"),
        "duplicate host in yaml": ([dsv3, "--hosts", str(tmp / "dup-hosts.yaml")],
                                   "dup-hosts.yaml:4: hosts[1]: host a is given twice"),
        "missing hosts yaml": ([dsv3, "--hosts", str(tmp / "nope.yaml")], "nope.yaml: cannot read hosts file"),
        "whole does not fit": ([dsv3, "--hosts", "a:CPU=128GiB;b:CPU=128GiB"], "cannot fit across the hosts"),
        "host share does not fit": ([dsv3, "--hosts", "a:CUDA0=2GiB,CPU=200GiB;b:CPU=256GiB", "-c", "32768"],
                                    "host a (blocks 0-"),
        "placement and hosts": (["--placement", str(tmp / "nope.yaml"), "--hosts", TWO],
                                "--placement cannot be combined with --hosts (the plan file fixes it)"),
        "with --devices": ([dsv3, "--hosts", TWO, "--devices", "CPU=1GiB"], "--devices (each host names its devices"),
        "with -ngl": ([dsv3, "--hosts", TWO, "-ngl", "10"], "--hosts cannot be combined with -ngl"),
        "with --emit": ([dsv3, "--hosts", TWO, "--emit", "llama.cpp"], "--emit llama.cpp (llama.cpp flags describe"),
        "hop flag alone": ([dsv3, "--devices", "CPU=512GiB", "--hop-latency-us", "50"],
                           "--hop-latency-us is for a plan across hosts"),
        "bad hop latency": ([dsv3, "--hosts", TWO, "--hop-latency-us", "-5"], "--hop-latency-us must be a number >= 0"),
        "bad hop rate": ([dsv3, "--hosts", TWO, "--hop-gbps", "0"], "--hop-gbps must be a number > 0"),
    }


def test_bad_inputs_one_line_status_2_no_output_file(tmp_path, fixture_paths):
    for name, (argv, expected) in _bad_cases(tmp_path, fixture_paths).items():
        out = tmp_path / f"{name}.yaml"
        r = offload("plan", *argv, "-o", str(out))
        assert_one_line_refusal(r, expected, out, f"{name}: {r.stderr!r}")


def test_one_host_has_no_hops(fixture_paths):
    """A --hosts list of one host is planned the same way; its forecast charges no hop, and
    --json says so (hops_per_pass 0)."""
    r = offload("plan", fixture_paths["kimi-k2"], "--hosts", "a:CUDA0=80GiB,CPU=768GiB", "-c", "8192", "--json")
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)["forecast"]
    assert f["hops_per_pass"] == 0
    assert f["predicted_plain_tps"] == f["hops_free"]["predicted_plain_tps"]


def test_the_pipeline_bench_splits_a_deep_model_evenly(tmp_path):
    """``bench.pipeline``'s hosts for a model other than the shipped one: 1, 2 and 3 equal hosts
    whose plans give 12 blocks as one, two and three equal ranges (the deep-model rows)."""
    from bench.pipeline import host_specs
    from tests.tiny_models import TinySpec, write_tiny_model
    tiny = write_tiny_model(tmp_path / "deep.gguf", TinySpec(arch="qwen3moe", n_layer=12, n_dense=0, nextn=False))
    specs = host_specs(str(tiny.path), Path(tiny.path).stat().st_size)
    ranges = {}
    for w, hosts in specs.items():
        r = offload("plan", str(tiny.path), "--hosts", hosts, "--json")
        assert r.returncode == 0, r.stderr
        ranges[w] = [tuple(h["blocks"]) for h in json.loads(r.stdout)["hosts"]]
    assert ranges == {1: [(0, 11)], 2: [(0, 5), (6, 11)], 3: [(0, 3), (4, 7), (8, 11)]}
