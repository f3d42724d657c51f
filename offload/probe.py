"""The probe behind a calibrated ``offload plan``: this box's fixed costs in about 2 s.

The plan's forecast needs the fixed cost per CPU block and per forward pass of the compiled
path, the decode loop's own time per step, a draft-head pass, and the CPU's read rate. Those
are what ``offload tune`` measures on a loaded model, so the probe runs tune's measurement
(``offload.tune.time_passes``) and its fit (``placement.cost_fit.fit_profile``) on the shipped
model, which loads in a moment on any box and runs the same compiled blocks, head, sampling
and loop as a large model:

- ``cpu_layer``: one decode token through the model's compiled block runs alone
  (``time_blocks``, many samples), less the blocks' reads, per block;
- ``forward``, ``draft_pass`` (what a NextN head pass costs beyond a target pass's fixed part:
  its eager ops), ``cpu_compute`` and the read rate of a model that sits in the CPU's last-level
  cache (the shipped one does): fitted, as tune fits them, to the pass medians T_verify(B) and
  T_draft(B), B = 1..3 (first with ``cpu_layer`` free too, for the rate the reads are taken
  off at);
- ``step``, ``spec_step``: the real decode loop's time outside its passes
  (``PassTimes.loop_overheads``), plain and drafting;
- ``batch_step_us``: what each of several sequences decoded at once adds to a step beyond the
  pass (its loop and the hand-offs to the batcher's thread; ``offload tune``'s batched runs, 2
  and 4 sequences), for the forecast of ``offload serve -np N``;
- ``cpu_read``: the compiled Q8_0 mat-vec (``cpu_kernels.matmul``, the kernels' register-
  blocked row walk) over a buffer far larger than any CPU cache: the rate of a model that
  does not fit (``HardwareProfile.for_cpu_weights`` picks one of the two per plan);
- ``cpu_cache_bytes``: how much of the reported last-level cache a model can count on: the
  same mat-vec over buffers of 16 MiB, 32 MiB, ... up to the reported size, the largest read
  clearly faster than RAM (``in_cache_bytes``).

The result is cached per CPU model and offload version (``cache_path``; ``OFFLOAD_CACHE_DIR``
relocates the folder): a later plan on the box reads it back, a corrupt file is measured again.
Compile and load time are not part of the ~2 s (Numba caches its kernels).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

from offload.errors import OffloadError
from offload.host_cache import (CACHE_ENV, cache_dir, cpu_name, cpu_slug, last_level_cache_bytes,  # noqa: F401
                                offload_version, target_slug)
from placement.hardware import HardwareProfile, ProfileError

SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-glm4moe-mtp.gguf"
PROBE_SECONDS = 2.0
READ_MIB = 256               # larger than the last-level cache of any CPU this is for
MAX_BATCH = 3                # T_verify(B), T_draft(B) for B = 1..3: enough to separate the terms
CALIB_TOKENS = 24
FIT_FREE = ("cpu_read", "cpu_compute", "cpu_layer", "forward")     # as offload tune fits them
MEASURED = ("cpu_read", "cpu_layer", "cpu_compute", "forward", "draft_pass", "step", "spec_step")
# raised when what the probe measures changes, so a cached result from before is measured again
# (the package version does not move between development commits); 2: the step includes sampling;
# 3: the compute term counts the pairs beyond each expert's first; 4: the cache a plan counts on
# is the one measured (``in_cache_bytes``), not the size the OS reports
METHOD = 4
CACHE_MARGIN = 1.2           # read this much faster than RAM to count as served from cache
CACHE_LADDER_MIB = (16, 512)  # buffer sizes tried for it: powers of two in this range, up to the LLC


def probe_version() -> str:
    """What a cached result must have been measured by: this offload and this probe method."""
    return f"{offload_version()}+m{METHOD}"


def cache_path(cpu: str, version: str, threads: int | None = None) -> Path:
    """The cache file of a CPU model, the kernels' compile target (``target_slug``) and offload
    version (and a thread count other than the kernels' default, which ``offload plan`` and
    ``offload run`` use)."""
    suffix = "" if threads is None else f"-t{threads}"
    return cache_dir() / f"probe-{cpu_slug(cpu)}-{target_slug()}-{version}{suffix}.yaml"


@dataclass(frozen=True)
class ProbeResult:
    """What the probe measured on one box: the CPU part of a ``HardwareProfile`` and how."""

    cpu: str
    version: str
    threads: int
    hardware: HardwareProfile              # CPU terms measured (``hardware.measured``), no GPUs
    seconds: float                         # timed part
    date: str
    verify_ms: dict[int, float] = field(default_factory=dict)
    draft_ms: dict[int, float] = field(default_factory=dict)
    fit_error: float = 0.0                 # largest relative error of the fitted passes

    def to_dict(self) -> dict:
        return {"cpu": self.cpu, "offload_version": self.version, "threads": self.threads,
                "date": self.date, "seconds": round(self.seconds, 3),
                "verify_ms": {b: round(t, 4) for b, t in self.verify_ms.items()},
                "draft_ms": {b: round(t, 4) for b, t in self.draft_ms.items()},
                "fit_error": round(self.fit_error, 4), "hardware": self.hardware.to_dict()}

    @classmethod
    def from_dict(cls, d: object) -> ProbeResult:
        if not isinstance(d, dict):
            raise ProfileError("probe result: expected a mapping")
        try:
            return cls(str(d["cpu"]), str(d["offload_version"]), int(d["threads"]),
                       HardwareProfile.from_dict(d["hardware"]), float(d["seconds"]), str(d["date"]),
                       {int(b): float(t) for b, t in d.get("verify_ms", {}).items()},
                       {int(b): float(t) for b, t in d.get("draft_ms", {}).items()},
                       float(d.get("fit_error", 0.0)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileError(f"probe result: {e!r}") from None

    def describe(self) -> str:
        hw = self.hardware
        return (f"cpu_read {hw.cpu_read_gbps:.1f} GB/s ({hw.cpu_cache_read_gbps or 0:.1f} GB/s within "
                f"{hw.cpu_cache_bytes >> 20} MiB measured in cache), cpu_layer {hw.cpu_layer_us:.0f} us, "
                f"forward {hw.forward_us:.0f} us, draft pass +{hw.draft_pass_us:.0f} us, step {hw.step_us:.0f} us, spec_step {hw.spec_step_us:.0f} us"
                + (f", per batched sequence {hw.batch_step_us:.0f} us" if hw.batch_step_us is not None else "")
                + " (T_verify(B) " + " ".join(f"{t:.3f}" for t in self.verify_ms.values())
                + " ms, T_draft(B) " + " ".join(f"{t:.3f}" for t in self.draft_ms.values())
                + f" ms, fit within {100 * self.fit_error:.0f}%)")


def read_cached(path: Path, cpu: str, version: str) -> ProbeResult | None:
    """The cached result for this CPU and version; None when missing, unreadable, corrupt or
    written for another CPU or version (the caller measures again)."""
    try:
        result = ProbeResult.from_dict(yaml.safe_load(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ProfileError):
        return None
    return result if (result.cpu, result.version) == (cpu, version) else None


def write_cache(path: Path, result: ProbeResult) -> str | None:
    """Write ``result``; a one-line reason when the folder cannot be written (not fatal)."""
    from offload.errors import write_atomic
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(str(path), yaml.safe_dump(result.to_dict(), sort_keys=False))
    except OSError as e:
        return f"cannot cache the probe in {path.parent}: {e.strerror}"
    return None


def weights_read_gbps(tensors, placed: dict[str, str], n_expert_used: int, other_gbps: float, *,
                      threads: int | None = None, log=None, refresh: bool = False) -> float | None:
    """The rate a decode token reads a plan's CPU-resident target weights at on this CPU:
    one token's reads of each part (``decode_int8.token_reads``: a layer's routed experts at
    the rate of one token through k experts of their shape and type, a 768 x 2048 Q4_0 expert
    streaming at 17 GB/s, not at the 22 of one big Q4_0 matrix; other matrices at their type's
    batch-1 rate) on the path this CPU decodes the type with (``decode_int8.read_rates``),
    ``other_gbps`` for types without an int8 decoder; ``refresh``: the rates measured again
    (``offload plan --refresh-probe``), not read from their cache. None when the plan reads no
    weight on the CPU."""
    from cpu_kernels.settings import max_threads
    from offload.decode_int8 import read_rates, token_reads
    reads = token_reads(tensors, placed, n_expert_used)
    if not reads:
        return None
    rates = read_rates(reads, threads or max_threads(), log, refresh=refresh)
    seconds = sum(n / (rates.get(p, other_gbps) * 1e9) for p, n in reads.items())
    return sum(reads.values()) / seconds / 1e9


def at_weights_rate(hw: HardwareProfile, tensors, placed: dict[str, str], n_expert_used: int,
                    **kw) -> tuple[HardwareProfile, float | None]:
    """``hw`` with its RAM read rate that of the plan's CPU weights (``weights_read_gbps``, its
    keywords ``kw``), and that rate (None, ``hw`` unchanged: no CPU weights)."""
    rate = weights_read_gbps(tensors, placed, n_expert_used, hw.cpu_read_gbps, **kw)
    return (hw if rate is None else replace(hw, cpu_read_gbps=rate)), rate


def cache_ladder(llc_bytes: int) -> list[int]:
    """Buffer sizes (bytes) the probe reads to find how much of the reported last-level
    cache a model can count on: powers of two from 16 MiB up to the reported size."""
    lo, hi = CACHE_LADDER_MIB
    sizes, mib = [], lo
    while mib <= hi and mib << 20 <= llc_bytes:
        sizes.append(mib << 20)
        mib *= 2
    return sizes


def in_cache_bytes(rates: dict[int, float], *, ram_gbps: float) -> int:
    """The largest buffer (bytes) read ``CACHE_MARGIN`` faster than RAM, walking up from the
    smallest size until one reads at RAM's rate; 0 when none does. A VM may report a whole
    socket's cache (one reported 480 MiB and read 128 MiB at the RAM rate), so a plan whose
    CPU weights fit the reported size may still stream from RAM."""
    fits = 0
    for size in sorted(rates):
        if rates[size] < CACHE_MARGIN * ram_gbps:
            break
        fits = size
    return fits


def read_gbps(mib: int = READ_MIB, repeat: int = 5) -> float:
    """Bytes per second the compiled Q8_0 mat-vec streams from memory (median of ``repeat``)."""
    from gguf import GGMLQuantizationType

    from cpu_kernels import matmul

    cols = 4096
    row_bytes = cols // 32 * 34                  # block_q8_0: f16 scale + 32 int8
    rows = max(mib * (1 << 20) // row_bytes, 4)
    w = np.full((rows, row_bytes), 1, dtype=np.uint8)   # written, so every page is real memory
    x = np.ones((1, cols), dtype=np.float32)
    matmul(x, w, GGMLQuantizationType.Q8_0)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        matmul(x, w, GGMLQuantizationType.Q8_0)
        times.append(time.perf_counter() - t0)
    return w.nbytes / statistics.median(times) / 1e9


def time_blocks(session, ids: list[int], *, seconds: float, min_rounds: int = 20) -> float:
    """Median seconds of one decode token through the model's blocks alone (its compiled
    block runs, ``CausalLM.block_runs``; no embedding, head or loop), at the context position
    after ``ids``; the caches rolled back after each. A direct, many-sample measurement of
    what a block costs, where the fit can only tell blocks from passes by the difference of
    a target and a draft pass."""
    import torch

    model = session.model
    with torch.inference_mode():
        state = model.new_state()
        model.forward(torch.as_tensor(ids[:-1]), state, logits="none")
        start = len(ids) - 1
        x0, positions = model.embed(torch.as_tensor(ids[-1:])), state.positions(1)
        runs = model.block_runs()
        times: list[float] = []
        t_end = time.perf_counter() + seconds
        while len(times) < min_rounds or time.perf_counter() < t_end:
            x = x0
            t0 = time.perf_counter()
            for step, lo, hi in runs:
                x = step(x, positions, state.caches[lo:hi])
            times.append(time.perf_counter() - t0)
            state.truncate(start)
    return statistics.median(times)


def measure(*, seconds: float = PROBE_SECONDS, read_mib: int = READ_MIB, model_path: str | Path = SHIPPED_MODEL,
            threads: int | None = None) -> ProbeResult:
    """Run the probe (load the shipped model, time its passes and loop, fit, read rate)."""
    import torch

    from cpu_kernels.settings import max_threads
    from offload import runtime
    from offload import tune
    from offload.bench_tasks import TASKS
    from offload.gguf_model import open_model
    from placement.cost_fit import fit_profile
    from placement.devices import parse_devices
    from placement.planner import PlanOptions, make_plan
    from placement.speculative import plan_footprint

    if not Path(model_path).is_file():
        raise OffloadError(f"probe: the shipped model is missing ({model_path}); plan with --no-probe "
                           "or --hw-profile")
    model = open_model(str(model_path))
    plan = make_plan(model, parse_devices("CPU=4GiB"), PlanOptions())
    with torch.inference_mode(), runtime.load_plan(model, plan, quiet=True, threads=threads) as session:
        session.warmup()
        t0 = time.perf_counter()
        gbps = read_gbps(read_mib)
        cached = in_cache_bytes({b: read_gbps(b >> 20) for b in cache_ladder(last_level_cache_bytes())},
                                ram_gbps=gbps)
        calib = tune.decode(session, session.tokenize(TASKS["code"]), n_tokens=CALIB_TOKENS)
        left = max(seconds - (time.perf_counter() - t0), 0.3)
        passes = tune.time_passes(session, calib, max_batch=MAX_BATCH, seconds=left * 0.75, min_rounds=2,
                                  loop_tokens=2 * MAX_BATCH + 1)
        blocks_s = time_blocks(session, calib.prompt + calib.tokens, seconds=left * 0.25)
        batched = tune.decode_several(session, [session.tokenize(t) for t in TASKS.values()], n_tokens=CALIB_TOKENS)
        timed = time.perf_counter() - t0
    verify_s, draft_s = passes.verify_s(), passes.draft_s()
    fp = plan_footprint(plan, model, None)
    fit = fit_profile(fp, HardwareProfile(cpu_read_gbps=gbps), verify_s=verify_s, draft_s=draft_s, free=FIT_FREE)
    # the blocks' own time less their reads (at the fitted rate) is the per-block cost; the
    # passes are fitted again with it fixed, which frees the draft head's own per-pass cost
    params = fit.profile.linear_params()
    block_bytes = sum(n for lay in fp.target.layers for _, n in lay.reads) + sum(
        s.bytes_per_expert * lay.n_expert_used * s.n_experts / lay.n_expert
        for lay in fp.target.layers for s in lay.experts)
    layer_s = max(blocks_s - block_bytes * params["cpu_read"], 0.0) / len(fp.target.layers)
    fit = fit_profile(fp, fit.profile.with_linear_params({"cpu_layer": layer_s}, source=""),
                      verify_s=verify_s, draft_s=draft_s,
                      free=[p for p in FIT_FREE if p != "cpu_layer"] + ["draft_pass"])
    step_s, spec_step_s = passes.loop_overheads()
    cpu, n_threads = cpu_name(), threads or max_threads()
    hw = fit.profile.with_linear_params({"step": step_s, "spec_step": spec_step_s}, source="")
    hw = replace(hw, cpu_read_gbps=gbps, cpu_cache_read_gbps=fit.profile.cpu_read_gbps,
                 batch_step_us=tune.batch_step(batched, fp, hw),
                 cpu_cache_bytes=cached, measured=MEASURED,
                 source=f"offload probe: {cpu}, {n_threads} threads, {time.strftime('%Y-%m-%d')}")
    return ProbeResult(cpu, probe_version(), n_threads, hw, timed, time.strftime("%Y-%m-%d %H:%M"),
                       {b: t * 1e3 for b, t in verify_s.items()}, {b: t * 1e3 for b, t in draft_s.items()},
                       fit.max_rel_error)


def calibrate(*, refresh: bool = False, **probe) -> tuple[ProbeResult, str]:
    """This box's probe result, from the cache or measured now (and cached), and a line that
    says which."""
    cpu, version = cpu_name(), probe_version()
    path = cache_path(cpu, version, probe.get("threads"))
    cached = None if refresh else read_cached(path, cpu, version)
    if cached is not None:
        return cached, f"probe cached {cached.date} in {path}"
    result = measure(**probe)
    why = write_cache(path, result)
    return result, f"probe ran {result.seconds:.1f}s" + (f" ({why})" if why else f", cached in {path}")


# ---------------------------------------------------------------------------------------------
# Named profiles: a box's probe written on it, read by name where plans for it are made.
# ---------------------------------------------------------------------------------------------

PROFILES_ENV = "OFFLOAD_PROFILES"      # more folders of named hardware profiles (path-separated)
SHIPPED_PROFILES = Path(__file__).resolve().parents[1] / "bench" / "profiles"


def user_profiles() -> Path:
    """This user's folder of named profiles (``offload probe --write NAME`` writes there)."""
    return Path.home() / ".config" / "offload" / "profiles"


def profile_dirs() -> list[Path]:
    """Where ``--hw-profile NAME`` looks, in order: $OFFLOAD_PROFILES, ~/.config/offload/profiles
    (where ``offload probe --write NAME`` puts a box's profile), the repository's bench/profiles."""
    extra = [Path(p) for p in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if p]
    return extra + [user_profiles(), SHIPPED_PROFILES]


def hw_profile_path(text: str) -> Path:
    """``--hw-profile``: a YAML file, or the name of one in ``profile_dirs()`` (``rtx4090_epyc``
    for bench/profiles/rtx4090_epyc.yaml); a name nobody has is a one-line error listing the
    names there are."""
    path = Path(text)
    if path.is_file() or path.suffix in (".yaml", ".yml") or os.sep in text:
        return path                       # a path (HardwareProfile.from_yaml says if it is missing)
    for folder in profile_dirs():
        for suffix in (".yaml", ".yml"):
            if (folder / f"{text}{suffix}").is_file():
                return folder / f"{text}{suffix}"
    names = sorted({f.stem for d in profile_dirs() if d.is_dir() for f in d.glob("*.y*ml")})
    raise OffloadError(f"--hw-profile {text}: no such file, and no profile of that name "
                       f"(named profiles: {', '.join(names) or 'none'}; folders: "
                       f"{', '.join(str(d) for d in profile_dirs())})")


def named_profile_target(text: str) -> Path:
    """``--write``: a path, or a bare NAME, which goes to ~/.config/offload/profiles/NAME.yaml
    (where ``offload plan --hw-profile NAME`` finds it; copy the file to another box's folder)."""
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or os.sep in text:
        return path
    return user_profiles() / f"{text}.yaml"
