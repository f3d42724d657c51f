"""`offload probe` and the calibrated forecast of `offload plan` (issue 32): the probe's terms
reach the forecast, its cache is keyed by CPU and offload version, a corrupt cache is measured
again, `--no-probe` prints what `offload plan` printed before, a written profile carries the
terms to a plan for another box. Plumbing only: no timing is asserted (speed lives in
bench/forecast.py). In-process, on the shipped model the suite already compiles."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from offload.cli import main as cli_main
from offload.commands.run import DEFAULT_MODEL
from offload.probe import (CACHE_ENV, MEASURED, ProbeResult, cache_path, cpu_name, offload_version, probe_version,
                           read_cached)
from placement.hardware import HardwareProfile

MODEL = str(DEFAULT_MODEL)


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One real probe (short), its cache folder and the profile it wrote."""
    folder = tmp_path_factory.mktemp("probe")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(folder / "cache"))
        profile = folder / "box.yaml"
        assert cli_main(["probe", "--seconds", "0.3", "--write", str(profile)]) == 0
        yield folder / "cache", profile


@pytest.fixture
def cache(probed, monkeypatch):
    folder, _ = probed
    monkeypatch.setenv(CACHE_ENV, str(folder))
    path = cache_path(cpu_name(), probe_version())
    saved = path.read_text()
    yield path
    path.write_text(saved)


def test_probe_caches_per_cpu_and_version_and_writes_a_profile(probed):
    folder, profile = probed
    path = cache_path(cpu_name(), probe_version())
    assert path.parent == folder and path.is_file()
    result = read_cached(path, cpu_name(), probe_version())
    assert result is not None and set(result.hardware.measured) == set(MEASURED)
    assert sorted(result.verify_ms) == [1, 2, 3] and sorted(result.draft_ms) == [1, 2, 3]
    # several sequences decoded at once: each one's share of a batched step (offload serve -np N)
    assert result.hardware.batch_step_us is not None and result.hardware.batch_step_us >= 0
    # another CPU or another version does not read this file
    assert read_cached(path, "another CPU", probe_version()) is None
    assert read_cached(path, cpu_name(), "0.0.0-other") is None
    # nor does this version's offload with the probe measuring something else (an older method)
    assert read_cached(path, cpu_name(), offload_version()) is None
    assert cache_path("another CPU", probe_version()) != path != cache_path(cpu_name(), "0.0.0-other")
    assert cache_path(cpu_name(), probe_version(), threads=1) != path      # `offload probe -t 1`
    # kernels compiled for another class (NUMBA_CPU_NAME/FEATURES, bench --cpu-target) run at
    # that class's speed: their terms are another file
    from numba.core import config
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "CPU_FEATURES", "+avx,+avx2,+fma,+f16c,-avx512f")
        assert cache_path(cpu_name(), probe_version()) != path
    # the written profile is the measured hardware, as --hw-profile reads it
    assert HardwareProfile.from_yaml(profile) == result.hardware


def test_plan_here_uses_the_cached_terms(cache, capsys):
    d = yaml.safe_load(cache.read_text())
    d["hardware"]["forward_us"] = 5000.0
    cache.write_text(yaml.safe_dump(d))
    code, out, err = _cli(capsys, "plan", MODEL)
    assert code == 0 and "probe cached" in err
    assert "measured on this box: " in out and "forward 5000 us" in out and "uncalibrated" not in out
    assert re.search(r"predicted plain decode: [\d.]+ t/s \[\d+-\d+\]", out)
    code, out, _ = _cli(capsys, "plan", MODEL, "--json")
    doc = json.loads(out)
    hw = doc["speculative"]["profile"]["hardware"]
    assert hw["forward_us"] == 5000.0 and set(hw["measured"]) == set(MEASURED)
    assert doc["forecast_interval"]["measured"] and len(doc["forecast_interval"]["speedup"]) == 7
    # T(0) carries the 5 ms per pass: plain decode below 200 t/s
    assert doc["speculative"]["predicted_plain_tps"] < 200


def test_corrupt_cache_is_measured_again(cache, capsys):
    cache.write_text("hardware: [not, a, profile\n")
    code, out, err = _cli(capsys, "plan", MODEL, "--spec-max-n", "2")
    assert code == 0 and "probe ran" in err and "measured on this box: " in out
    assert isinstance(read_cached(cache, cpu_name(), probe_version()), ProbeResult)


def test_no_probe_prints_the_plan_as_before_and_priors_say_uncalibrated(cache, capsys):
    from offload.gguf_model import open_model
    from placement.devices import parse_devices
    from placement.planner import PlanOptions, make_plan
    from placement.speculative import predict

    spec = ("--devices", "CPU=16GiB")
    code, before, err = _cli(capsys, "plan", MODEL, "--no-probe")
    assert code == 0 and "probe" not in err
    for new in ("measured on this box", "uncalibrated", "range", "offload tune", "t/s ["):
        assert new not in before.split("\nn-gram self-drafting")[0]     # the n-gram forecast names tune
    model = open_model(MODEL)
    table, _ = predict(make_plan(model, parse_devices(spec[1]), PlanOptions()), model, None)
    code, fixed, _ = _cli(capsys, "plan", MODEL, *spec, "--no-probe")
    assert table.format() in fixed and "profile: defaults" in fixed
    code, now, err = _cli(capsys, "plan", MODEL, *spec)          # another box: no probe, priors
    assert code == 0 and "probe" not in err
    assert "uncalibrated: every cost term is a prior" in now and "priors: " in now
    # the same plan and table, with the inputs' lines, the ranges and the advice added
    new = [line for line in now.splitlines() if not line.startswith(("uncalibrated:", "priors:", "acceptance: ",
                                                                     "the speedup's interval"))]
    new = [re.sub(r" \[\d+-\d+\]| +range$| +[\d.]+-[\d.]+x$", "", line) for line in new]
    new = [re.sub(r"^break-even n_max: \d+-\d+ ", f"break-even n_max: {table.break_even_n} ", line) for line in new]
    assert new == fixed.splitlines()


def test_a_profile_from_another_box_calibrates_its_plan(probed, capsys):
    _, profile = probed
    code, out, err = _cli(capsys, "plan", MODEL, "--devices", "CPU=16GiB", "--hw-profile", str(profile))
    assert code == 0 and "probe" not in err
    hw = HardwareProfile.from_yaml(profile)
    assert "measured on this box: " in out and f"forward {hw.forward_us:.0f} us" in out


@pytest.mark.parametrize("text,match", [
    (None, "No such file"),
    ("measured: [bogus]\n", "measured: unknown parameter"),
    ("cpu_read_gbps: [1\n", "malformed YAML"),
])
def test_bad_profiles_are_one_line_errors(tmp_path, capsys, text, match):
    path = tmp_path / "box.yaml"
    if text is not None:
        path.write_text(text)
    code, out, err = _cli(capsys, "plan", MODEL, "--devices", "CPU=16GiB", "--hw-profile", str(path))
    assert code == 2 and err.count("\n") == 1 and match in err and "Traceback" not in err


def test_a_model_without_draft_head_gets_a_plain_forecast(fixture_paths, probed, capsys):
    """No n_max table, but the plain decode forecast with its range: uncalibrated for a written
    device spec, calibrated by a profile; --no-probe prints the plan as before (no forecast)."""
    _, profile = probed
    qwen = fixture_paths["qwen3-30b-a3b"]
    box = ("--devices", "CUDA0=24GiB,CPU=128GiB", "-c", "4096")
    code, out, err = _cli(capsys, "plan", qwen, *box)
    assert code == 0 and "probe" not in err
    assert "plain decoding (no draft head; predicted, profile: defaults):" in out and "uncalibrated" in out
    assert re.search(r"^predicted plain decode: [\d.]+ t/s \[\d+-\d+\]$", out, re.M)
    assert "acceptance: " not in out and "draft pass" not in out         # no MTP table (the n-gram forecast only)
    assert "n-gram self-drafting" in out
    code, out, _ = _cli(capsys, "plan", qwen, *box, "--hw-profile", str(profile), "--json")
    doc = json.loads(out)
    lo, hi = doc["forecast_interval"]["plain_tps"]
    assert lo <= doc["predicted_plain_tps"] <= hi and doc["forecast_interval"]["measured"]
    code, out, _ = _cli(capsys, "plan", qwen, *box, "--no-probe")
    assert "predicted plain decode" not in out and "uncalibrated" not in out


def test_named_profiles_are_written_and_read_by_name(cache, capsys, tmp_path, monkeypatch):
    """`offload probe --write NAME` puts the box's profile in ~/.config/offload/profiles;
    `offload plan --hw-profile NAME` finds it there (or in $OFFLOAD_PROFILES, or bench/profiles);
    an unknown name is one line listing the names there are."""
    monkeypatch.setenv("HOME", str(tmp_path))
    code, _, err = _cli(capsys, "probe", "--write", "thisbox")            # the probe's cache answers
    written = tmp_path / ".config" / "offload" / "profiles" / "thisbox.yaml"
    assert code == 0 and written.is_file() and "--hw-profile thisbox" in err
    code, out, _ = _cli(capsys, "plan", MODEL, "--devices", "CPU=16GiB", "--hw-profile", "thisbox")
    assert code == 0 and "measured on this box" in out
    other = tmp_path / "team"
    other.mkdir()
    (other / "bigbox.yaml").write_text("cpu_read_gbps: 123\n")
    monkeypatch.setenv("OFFLOAD_PROFILES", str(other))
    code, out, _ = _cli(capsys, "plan", MODEL, "--devices", "CPU=16GiB", "--hw-profile", "bigbox", "--json")
    assert code == 0 and json.loads(out)["speculative"]["profile"]["hardware"]["cpu_read_gbps"] == 123
    code, out, _ = _cli(capsys, "plan", MODEL, "--devices", "CPU=16GiB", "--hw-profile", "rtx4090_epyc", "--json")
    assert code == 0 and json.loads(out)["speculative"]["profile"]["hardware"]["cpu_read_gbps"] == 250
    code, _, err = _cli(capsys, "plan", MODEL, "--devices", "CPU=16GiB", "--hw-profile", "nosuchbox")
    assert code == 2 and err.count("\n") == 1 and "nosuchbox" in err
    assert "bigbox" in err and "thisbox" in err and "rtx4090_epyc" in err


def test_the_cache_a_plan_may_count_on_is_the_one_measured():
    """The in-cache read rate applies only up to the largest buffer the probe saw read faster
    than RAM (a VM may report a whole socket's last-level cache: one reported 480 MiB and read
    128 MiB at the RAM rate), never up to the reported size."""
    from offload.probe import in_cache_bytes
    mib = 1 << 20
    # this box's ladder: 16..64 MiB at 40-46 GB/s, 128 MiB back at RAM's 28
    rates = {16 * mib: 40.0, 32 * mib: 45.0, 64 * mib: 46.0, 128 * mib: 28.6}
    assert in_cache_bytes(rates, ram_gbps=27.9) == 64 * mib
    # the ladder walks up from the smallest size and stops at the first one read at RAM's rate
    assert in_cache_bytes({16 * mib: 40.0, 32 * mib: 27.0, 64 * mib: 41.0}, ram_gbps=27.9) == 16 * mib
    # nothing read faster than RAM by the margin: no cache to count on
    assert in_cache_bytes({16 * mib: 30.0, 32 * mib: 29.0}, ram_gbps=27.9) == 0
    assert in_cache_bytes({}, ram_gbps=27.9) == 0


def test_the_probe_counts_only_the_cache_it_measured(probed):
    from offload.host_cache import last_level_cache_bytes
    from offload.probe import cache_ladder
    folder, _ = probed
    hw = read_cached(cache_path(cpu_name(), probe_version()), cpu_name(), probe_version()).hardware
    assert hw.cpu_cache_bytes in {0, *cache_ladder(last_level_cache_bytes())}
    assert all(size <= last_level_cache_bytes() for size in cache_ladder(last_level_cache_bytes()))
    assert cache_ladder(0) == []


def test_refresh_probe_measures_the_weight_types_rates_again(cache, capsys):
    """``--refresh-probe`` re-measures what the forecast reads the plan's weights at too: a rate
    cached on a busy box (Q8_0 at 13 GB/s where it reads at 27) otherwise stays for good."""
    from offload.decode_int8 import cache_file
    from cpu_kernels.settings import max_threads
    d = yaml.safe_load(cache.read_text())
    d["hardware"]["cpu_cache_bytes"] = 0     # no cache to count on: the plan reads at its types' rates
    cache.write_text(yaml.safe_dump(d))
    assert _cli(capsys, "plan", MODEL)[0] == 0
    rates = cache_file(max_threads())
    doc = yaml.safe_load(rates.read_text())
    assert doc, "the plan measured its weight types' rates"
    slow = {k: {"float_gbps": 0.01, "int8_gbps": 0.01} for k in doc}
    rates.write_text(yaml.safe_dump(slow))
    code, out, _ = _cli(capsys, "plan", MODEL, "--json")
    assert code == 0 and json.loads(out)["speculative"]["predicted_plain_tps"] < 20    # read at 10 MB/s
    code, out, err = _cli(capsys, "plan", MODEL, "--refresh-probe", "--json")
    assert code == 0 and "measured on this CPU" in err
    assert all(v["float_gbps"] > 0.01 for v in yaml.safe_load(rates.read_text()).values())
    assert json.loads(out)["speculative"]["predicted_plain_tps"] > 100
