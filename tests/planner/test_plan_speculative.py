"""`offload plan` carries the cost model's n_max table for plans with a draft head."""
from __future__ import annotations

import json

import yaml

from tests.cli.test_cli_plan import offload

GLM_BOX = ["--devices", "CUDA0=24GiB,CPU=128GiB", "-c", "32768"]


def test_table_and_json_carry_break_even(fixture_paths):
    r = offload("plan", fixture_paths["glm-4.5-air"], *GLM_BOX)
    assert r.returncode == 0, r.stderr
    assert "break-even n_max:" in r.stdout and "predicted plain decode:" in r.stdout
    doc = json.loads(offload("plan", fixture_paths["glm-4.5-air"], *GLM_BOX, "--json").stdout)
    spec = doc["speculative"]
    rows = spec["rows"]
    assert [row["n_max"] for row in rows] == list(range(7))
    assert rows[0]["speedup"] == 1.0
    # break-even = largest n with S(n) >= 1; best = argmax S(n), both read off the rows
    assert spec["break_even_n_max"] == max(row["n_max"] for row in rows if row["speedup"] >= 1.0)
    assert spec["best_n_max"] == max(rows, key=lambda row: row["speedup"])["n_max"] == spec["n_max"]
    assert spec["type"] == "mtp" and spec["source"] == "predicted" and "hardware" in spec["profile"]


def test_experts_on_gpu_allow_longer_drafts_than_experts_on_cpu(fixture_paths):
    def break_even(*placement):
        r = offload("plan", fixture_paths["glm-4.5-air"], "-c", "4096", "--json", *placement)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["speculative"]["break_even_n_max"]
    on_gpu = break_even("--devices", "CUDA0=80GiB,CUDA1=80GiB,CPU=128GiB")
    on_cpu = break_even("--devices", "CUDA0=80GiB,CUDA1=80GiB,CPU=128GiB", "--cpu-moe")
    assert on_gpu > on_cpu


def test_section_survives_the_plan_file_and_a_hw_profile_changes_it(fixture_paths, tmp_path):
    out = tmp_path / "plan.yaml"
    assert offload("plan", fixture_paths["glm-4.5-air"], *GLM_BOX, "-o", str(out)).returncode == 0
    spec = yaml.safe_load(out.read_text())["speculative"]
    again = json.loads(offload("plan", "--placement", str(out), "--json").stdout)["speculative"]
    assert again["rows"] == spec["rows"] and again["n_max"] == spec["n_max"]

    fast_ram = tmp_path / "hw.yaml"
    fast_ram.write_text("cpu_read_gbps: 2000\n")
    fast = json.loads(offload("plan", "--placement", str(out), "--hw-profile", str(fast_ram), "--json").stdout)
    assert fast["speculative"]["predicted_plain_tps"] > spec["predicted_plain_tps"]
    assert fast["speculative"]["profile"]["hardware"]["cpu_read_gbps"] == 2000


def test_spec_type_none_and_missing_head(fixture_paths, tmp_path):
    doc = json.loads(offload("plan", fixture_paths["glm-4.5-air"], *GLM_BOX, "--spec-type", "none", "--json").stdout)
    assert doc["speculative"] is None
    r = offload("plan", fixture_paths["qwen3-30b-a3b"], "--devices", "CUDA0=24GiB,CPU=128GiB", "--spec-type", "mtp")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no NextN" in r.stderr
    bad = tmp_path / "hw.yaml"
    bad.write_text("cpu_read_gbps: fast\n")
    r = offload("plan", fixture_paths["glm-4.5-air"], *GLM_BOX, "--hw-profile", str(bad), "-o", str(tmp_path / "p.yaml"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "p.yaml").exists()


def test_section_reads_typed_and_writes_back_as_written(fixture_paths, tmp_path):
    """``SpecSection``: the file form in, the same keys in the same order out (a refreshed
    tune section has ``rows`` after ``tune``), and ``plan_profile`` is the section's profile."""
    from placement.cost import SpecProfile
    from placement.spec_section import SpecSection

    out = tmp_path / "plan.yaml"
    assert offload("plan", fixture_paths["glm-4.5-air"], *GLM_BOX, "-o", str(out)).returncode == 0
    d = yaml.safe_load(out.read_text())["speculative"]
    rows, profile = d.pop("rows"), d.pop("profile")
    d.update({"source": "tune", "measured_speedup": None, "choice": "best measured", "tune": {"repeats": 1},
              "rows": rows, "profile": profile})
    section = SpecSection.from_dict(d)
    assert section.n_max == d["n_max"] and section.source == "tune" and section.measured_speedup is None
    assert isinstance(section.profile, SpecProfile) and section.profile == SpecProfile.from_dict(profile)
    assert list(section.to_dict()) == list(d) and section.to_dict() == d
    assert SpecSection.from_dict(section.to_dict()) == section
    assert SpecSection().to_dict() == {} and list(SpecSection.of({"p_min": 0.5, "type": "mtp"}).to_dict()) == \
        ["p_min", "type"]


def test_ngram_forecast_for_every_model(fixture_paths):
    """Without a draft head (qwen3) the plan still forecasts n-gram self-drafting: per n_max
    the acceptance at which it pays, rising with n (longer verify batches cost more);
    ``--spec-type ngram`` gives that forecast alone (no MTP section)."""
    box = ["--devices", "CUDA0=24GiB,CPU=128GiB", "--cpu-moe", "--no-probe"]
    doc = json.loads(offload("plan", fixture_paths["qwen3-30b-a3b"], *box, "--json").stdout)
    need = doc["ngram_forecast"]["break_even_acceptance"]
    assert list(need) == [str(n) for n in range(1, 7)] and doc["ngram_forecast"]["draft_ms"] == 0.0
    values = [a for a in need.values() if a is not None]
    assert values and all(0 < a < 1 for a in values) and values == sorted(values)
    r = offload("plan", fixture_paths["qwen3-30b-a3b"], *box)
    assert "n-gram self-drafting" in r.stdout and "pays when acceptance" in r.stdout
    doc = json.loads(offload("plan", fixture_paths["glm-4.5-air"], *GLM_BOX, "--spec-type", "ngram-simple",
                             "--json").stdout)
    assert doc["speculative"] is None and "ngram_forecast" in doc
    r = offload("plan", fixture_paths["glm-4.5-air"], *GLM_BOX, "--spec-type", "medusa")
    assert r.returncode == 2 and "--spec-type" in r.stderr and "Traceback" not in r.stderr


def test_a_plan_tuned_for_ngram_gives_llama_cpp_its_ngram_kind(fixture_paths):
    """A plan whose speculative section drafts with n-grams (``offload tune`` chose them) reads
    back, and its llama.cpp line asks for llama.cpp's nearest kind with the same draft length."""
    import dataclasses

    from offload.gguf_model import open_model
    from placement.devices import parse_devices
    from placement.llama_args import llama_cpp_args
    from placement.plan_file import load_plan_file, plan_to_yaml
    from placement.planner import PlanOptions, make_plan
    from placement.spec_section import SpecSection

    model = open_model(fixture_paths["qwen3-30b-a3b"])
    plan = make_plan(model, parse_devices("CUDA0=24GiB,CPU=128GiB"), PlanOptions())
    tuned = dataclasses.replace(plan, speculative=SpecSection.of(
        {"type": "ngram", "n_max": 3, "p_min": 0.0, "source": "tune",
         "runner_up": {"type": "mtp", "n_max": 1, "measured_speedup": 1.02, "margin": 0.11}}))
    back = load_plan_file(plan_to_yaml(tuned), "plan.yaml")
    assert back.speculative.type == "ngram" and back.speculative.runner_up["margin"] == 0.11
    args = llama_cpp_args(tuned)
    assert args[args.index("--spec-type"):] == ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "12",
                                                "--spec-ngram-simple-size-m", "3"]
    assert "--spec-type" not in llama_cpp_args(plan)
