"""Hardware profile for the speculative cost model: how fast this box moves bytes.

Three sources, in increasing order of trust:

1. defaults by GPU name (``gpu_profile("NVIDIA GeForce RTX 4090")``) from the table below
   and a generic CPU default — good enough to rank draft lengths before anything runs;
2. a YAML the user writes (``HardwareProfile.from_yaml``), same schema as ``to_dict``;
3. measured by ``offload tune`` (``placement.cost_fit.fit_profile`` fits the free parameters).

The cost model is linear in the *inverse* bandwidths and the fixed costs, so the profile
also exposes them as one flat parameter vector (``linear_params``) that the fit solves for.
"""
from __future__ import annotations

from placement.errors import PlacementError

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import yaml


class ProfileError(PlacementError):
    """A hardware/acceptance/routing profile that cannot be used; the message is one line."""


# Vendor-sheet peak numbers are not what decode kernels reach. These two factors turn peak
# into the effective figure the model uses; they are assumptions (typical memory-bound
# decode kernels reach 70-90% of HBM/GDDR peak; pinned cudaMemcpy reaches ~80% of PCIe x16).
GPU_READ_EFFICIENCY = 0.8
PCIE_EFFICIENCY = 0.8
PCIE_X16_GBPS = {3: 15.75, 4: 31.5, 5: 63.0}  # per direction, PCI-SIG line rates after encoding

# Peak memory bandwidth (GB/s) and host link (PCIe generation, x16) by GPU model.
# First regex that matches the NVML name wins (so the more specific names come first).
# Sources: NVIDIA product pages / datasheets for each card (memory bandwidth line).
_GPU_TABLE: tuple[tuple[str, str, float, int], ...] = (
    # (regex on NVML name, label, peak GB/s, PCIe gen)
    (r"RTX PRO 6000", "RTX PRO 6000 Blackwell", 1792.0, 5),
    (r"RTX 6000 Ada", "RTX 6000 Ada Generation", 960.0, 4),
    (r"RTX A6000", "RTX A6000", 768.0, 4),
    (r"RTX 5090", "GeForce RTX 5090", 1792.0, 5),
    (r"RTX 5080", "GeForce RTX 5080", 960.0, 5),
    (r"RTX 4090", "GeForce RTX 4090", 1008.0, 4),
    (r"RTX 4080 SUPER", "GeForce RTX 4080 SUPER", 736.0, 4),
    (r"RTX 4080", "GeForce RTX 4080", 716.8, 4),
    (r"RTX 3090 Ti", "GeForce RTX 3090 Ti", 1008.0, 4),
    (r"RTX 3090", "GeForce RTX 3090", 936.0, 4),
    (r"L40S", "L40S", 864.0, 4),
    (r"\bL40\b", "L40", 864.0, 4),
    (r"\bL4\b", "L4", 300.0, 4),
    (r"\bA40\b", "A40", 696.0, 4),
    (r"A100.*80GB.*PCIe", "A100 80GB PCIe", 1935.0, 4),
    (r"A100.*80GB", "A100 80GB SXM4", 2039.0, 4),
    (r"A100", "A100 40GB", 1555.0, 4),
    (r"H100.*PCIe", "H100 PCIe", 2000.0, 5),
    (r"H100 NVL", "H100 NVL", 3900.0, 5),
    (r"H100", "H100 SXM5 80GB", 3350.0, 5),
    (r"H200", "H200", 4800.0, 5),
    (r"B200", "B200", 8000.0, 5),
)
# An unknown GPU gets a middle-of-the-road figure, and says so in its `source`.
_GENERIC_GPU_PEAK_GBPS = 600.0
_GENERIC_GPU_PCIE_GEN = 4

# CPU default when nothing is known: dual-channel DDR5-5600 (2 x 8 B x 5600 MT/s = 89.6 GB/s
# peak), at the same 0.7 fraction as `cpu_read_gbps_from_memory`. A prior, not a measurement.
CPU_READ_EFFICIENCY = 0.7

# Fixed-cost priors for this project's runtime; `offload tune` replaces them. The CPU ones
# are measured (wall time of a decode token, 2 threads, an idle 2-core Xeon) on a model of
# 75 KB blocks, whose bytes take ~5 us: what is left is the fixed cost.
DEFAULT_LINK_LATENCY_US = 15.0   # one synchronous host<->device copy of a hidden state
# A compiled CPU block (offload.compiled_block) inside a run (one compiled call for up to 16
# blocks, BlockRun): its thread fork/joins and scalar work. `python -m bench.pass_cost` on an
# idle 2-core Xeon (2 threads, medians of 400 tokens): 50 us wall per block of the shipped
# model (~75 KB a block, ~2 us of reads); the depth bench's narrow sweep fits 68 us per block,
# which includes its sub-ceiling reads of 2.5 MB blocks (charged here as bytes).
DEFAULT_CPU_LAYER_US = 50.0
DEFAULT_GPU_LAYER_US = 100.0     # ~20-30 eager torch ops per layer at a few us each (not measured)
# Per pass outside the blocks: embedding rows, output norm + lm_head (compiled calls), the
# forward's Python, the decode loop, the finite check, sampling. The same runs: 74 us wall on
# the shipped model, of which its 2 MB F16 head read is ~44 us at the 48 GB/s read ceiling
# (charged as bytes), and 39 us on the narrow 4-block model (0.16 MB head): ~35 us fixed.
DEFAULT_FORWARD_US = 35.0
# Per draft-head pass on top of ``forward``: the NextN head's own eager ops (eh_proj, enorm,
# hnorm). No prior (0); the probe measured ~0.4 ms on a loaded 2-core EPYC (shipped model).
DEFAULT_DRAFT_PASS_US = 0.0
# Per decode step, outside the forward passes (acceptance, cache rollback, the loop itself):
# no prior (0); `offload tune` measures it as a step's wall time minus its passes.
DEFAULT_STEP_US = 0.0
DEFAULT_SPEC_STEP_US = 0.0       # extra per step when drafting (draft bookkeeping)
# Per sequence per step when several sequences are batched (offload serve -np N): its loop plus
# the hand-off of each pass to the batcher's thread. No prior (None: step_us, one sequence's
# loop, which under batching forecast 2.6x the measured aggregate at 8 sequences);
# `offload tune` measures it on batched plain decoding.
DEFAULT_BATCH_STEP_US = None
# Batched (prompt) matmul rates, for the op-offload choice (placement.op_offload). Priors, not
# measurements: a 32-core AVX-512 server CPU at ~30 GFLOP/s per core on quantized expert
# matmuls; one GPU at ~50 % of an RTX 4090's 165 dense bf16 tensor TFLOP/s. YAML overrides them.
DEFAULT_CPU_BATCHED_GFLOPS = 1000.0
DEFAULT_GPU_BATCHED_TFLOPS = 80.0


def cpu_read_gbps_from_memory(channels: int, mt_per_s: float, *,
                              efficiency: float = CPU_READ_EFFICIENCY) -> float:
    """Effective CPU read bandwidth from the DIMM setup: channels x 8 bytes x MT/s x efficiency."""
    if channels <= 0 or mt_per_s <= 0 or not 0 < efficiency <= 1:
        raise ProfileError(f"bad memory setup: channels={channels} MT/s={mt_per_s} efficiency={efficiency}")
    return channels * 8 * mt_per_s * 1e6 / 1e9 * efficiency


DEFAULT_CPU_READ_GBPS = cpu_read_gbps_from_memory(2, 5600)


@dataclass(frozen=True)
class GpuProfile:
    """One GPU as the cost model sees it (effective figures, GB/s = 1e9 bytes/s)."""

    name: str
    read_gbps: float   # effective memory-read bandwidth for decode kernels
    link_gbps: float   # effective host<->device copy bandwidth
    source: str = "user"

    def to_dict(self) -> dict:
        return {"name": self.name, "read_gbps": self.read_gbps, "link_gbps": self.link_gbps,
                "source": self.source}


def gpu_profile(nvml_name: str) -> GpuProfile:
    """Defaults for a GPU from its NVML name (``pynvml.nvmlDeviceGetName``)."""
    for pattern, label, peak, gen in _GPU_TABLE:
        if re.search(pattern, nvml_name, flags=re.IGNORECASE):
            return GpuProfile(nvml_name, peak * GPU_READ_EFFICIENCY, PCIE_X16_GBPS[gen] * PCIE_EFFICIENCY,
                              f"table: {label}, {peak:g} GB/s peak, PCIe {gen}.0 x16")
    return GpuProfile(nvml_name, _GENERIC_GPU_PEAK_GBPS * GPU_READ_EFFICIENCY,
                      PCIE_X16_GBPS[_GENERIC_GPU_PCIE_GEN] * PCIE_EFFICIENCY,
                      f"unknown GPU, generic {_GENERIC_GPU_PEAK_GBPS:g} GB/s peak, PCIe 4.0 x16")


_GPU_DEVICE = re.compile(r"CUDA\d+")
_FIELDS = ("cpu_read_gbps", "cpu_compute_gbps", "link_latency_us", "cpu_layer_us",
           "gpu_layer_us", "forward_us", "draft_pass_us", "step_us", "spec_step_us", "cpu_batched_gflops", "gpu_batched_tflops",
           "gpus", "source", "measured", "cpu_cache_bytes", "cpu_cache_read_gbps", "batch_step_us")
_RATES = ("cpu_batched_gflops", "gpu_batched_tflops")
_FIXED_US = ("link_latency_us", "cpu_layer_us", "gpu_layer_us", "forward_us", "draft_pass_us", "step_us",
             "spec_step_us")
_GPU_FIELDS = ("name", "read_gbps", "link_gbps", "source")


@dataclass(frozen=True)
class HardwareProfile:
    """Bandwidths and fixed costs of one box.

    ``cpu_compute_gbps`` is weight bytes the CPU expert kernels process per second *per
    token row beyond an expert's first* (dequantize + dot again); the first row's work is in
    ``cpu_read_gbps``, the rate of a batch-1 mat-vec (the probe's and tune's reads are). None
    means compute is free next to the memory read, which holds for the small batches of a
    verify step on a memory-bound box.
    ``step_us`` is the time of one decode step outside its forward passes (sampling,
    acceptance, cache rollback, the Python loop), ``spec_step_us`` what a step that drafts
    adds to it (draft sampling and head-cache bookkeeping). ``batch_step_us``: what each
    sequence adds to a step when several are batched (its loop and the hand-offs to the
    batcher's thread; None: ``step_us``); only the several-sequences forecast reads it.
    """

    cpu_read_gbps: float = DEFAULT_CPU_READ_GBPS
    gpus: Mapping[str, GpuProfile] = field(default_factory=dict)   # by device: "CUDA0" -> ...
    cpu_compute_gbps: float | None = None
    link_latency_us: float = DEFAULT_LINK_LATENCY_US
    cpu_layer_us: float = DEFAULT_CPU_LAYER_US
    gpu_layer_us: float = DEFAULT_GPU_LAYER_US
    forward_us: float = DEFAULT_FORWARD_US
    draft_pass_us: float = DEFAULT_DRAFT_PASS_US
    step_us: float = DEFAULT_STEP_US
    spec_step_us: float = DEFAULT_SPEC_STEP_US
    cpu_batched_gflops: float = DEFAULT_CPU_BATCHED_GFLOPS    # CPU expert matmuls on a prompt batch
    gpu_batched_tflops: float = DEFAULT_GPU_BATCHED_TFLOPS    # a GPU's matmuls on a prompt batch
    source: str = "defaults"
    # which ``linear_params`` were measured on the box (``offload probe``, ``offload tune``);
    # the rest are priors, and the forecast's interval is as wide as the priors' spread
    measured: tuple[str, ...] = ()
    # A model whose CPU-resident weights fit in the last-level cache (``cpu_cache_bytes``) is
    # read at the rate measured on such a model (``offload probe``), not at the RAM rate.
    cpu_cache_bytes: int = 0
    cpu_cache_read_gbps: float | None = None
    batch_step_us: float | None = DEFAULT_BATCH_STEP_US

    def __post_init__(self) -> None:
        _check_positive("cpu_read_gbps", self.cpu_read_gbps)
        if self.batch_step_us is not None:
            _check_non_negative("batch_step_us", self.batch_step_us)
        if self.cpu_cache_read_gbps is not None:
            _check_positive("cpu_cache_read_gbps", self.cpu_cache_read_gbps)
        _check_non_negative("cpu_cache_bytes", self.cpu_cache_bytes)
        for name in _RATES:
            _check_positive(name, getattr(self, name))
        if self.cpu_compute_gbps is not None:
            _check_positive("cpu_compute_gbps", self.cpu_compute_gbps)
        for name in _FIXED_US:
            _check_non_negative(name, getattr(self, name))
        for dev, gpu in self.gpus.items():
            if not _GPU_DEVICE.fullmatch(dev):
                raise ProfileError(f"hardware profile: unknown device {dev!r} (expected CUDA0, CUDA1, ...)")
            _check_positive(f"{dev}.read_gbps", gpu.read_gbps)
            _check_positive(f"{dev}.link_gbps", gpu.link_gbps)
        object.__setattr__(self, "measured", tuple(sorted(set(self.measured))))
        unknown = [m for m in self.measured if m not in self.linear_params()]
        if unknown:
            raise ProfileError(f"hardware profile: measured: unknown parameter(s) {', '.join(unknown)}")

    @classmethod
    def for_devices(cls, gpu_names: Mapping[str, str], *, cpu_read_gbps: float | None = None,
                    **fixed_costs: float) -> HardwareProfile:
        """Defaults for a box: ``{"CUDA0": "NVIDIA GeForce RTX 4090", ...}`` from NVML."""
        gpus = {dev: gpu_profile(name) for dev, name in gpu_names.items()}
        cpu = DEFAULT_CPU_READ_GBPS if cpu_read_gbps is None else cpu_read_gbps
        return cls(cpu_read_gbps=cpu, gpus=gpus, source="defaults", **fixed_costs)

    def for_cpu_weights(self, n_bytes: int) -> HardwareProfile:
        """The profile a plan with ``n_bytes`` of CPU-resident weights is read with: the
        in-cache rate when they fit in the last-level cache and that rate was measured."""
        if self.cpu_cache_read_gbps is None or n_bytes > self.cpu_cache_bytes:
            return self
        return replace(self, cpu_read_gbps=self.cpu_cache_read_gbps)

    # -- the flat parameter vector the cost model is linear in (seconds, seconds per byte) --

    def linear_params(self) -> dict[str, float]:
        p = {
            "cpu_read": 1.0 / (self.cpu_read_gbps * 1e9),
            "cpu_compute": 0.0 if self.cpu_compute_gbps is None else 1.0 / (self.cpu_compute_gbps * 1e9),
            "link_latency": self.link_latency_us * 1e-6,
            "cpu_layer": self.cpu_layer_us * 1e-6,
            "gpu_layer": self.gpu_layer_us * 1e-6,
            "forward": self.forward_us * 1e-6,
            "draft_pass": self.draft_pass_us * 1e-6,
            "step": self.step_us * 1e-6,
            "spec_step": self.spec_step_us * 1e-6,
        }
        for dev, gpu in self.gpus.items():
            p[f"gpu_read:{dev}"] = 1.0 / (gpu.read_gbps * 1e9)
            p[f"link:{dev}"] = 1.0 / (gpu.link_gbps * 1e9)
        return p

    def with_linear_params(self, params: Mapping[str, float], *, source: str,
                           measured: bool = True) -> HardwareProfile:
        """A copy with some linear parameters replaced (as produced by a fit: ``measured``
        adds their names to ``measured``)."""
        known = self.linear_params()
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ProfileError(f"hardware profile: unknown parameter(s) {', '.join(unknown)}")
        p = {**known, **params}
        gpus = {dev: gpu if not {f"gpu_read:{dev}", f"link:{dev}"} & set(params) else
                replace(gpu, read_gbps=_inv_gbps(p[f"gpu_read:{dev}"], f"gpu_read:{dev}"),
                        link_gbps=_inv_gbps(p[f"link:{dev}"], f"link:{dev}"), source=source)
                for dev, gpu in self.gpus.items()}
        return HardwareProfile(
            cpu_read_gbps=_inv_gbps(p["cpu_read"], "cpu_read"),
            gpus=gpus,
            cpu_compute_gbps=None if p["cpu_compute"] == 0 else _inv_gbps(p["cpu_compute"], "cpu_compute"),
            link_latency_us=p["link_latency"] * 1e6,
            cpu_layer_us=p["cpu_layer"] * 1e6,
            gpu_layer_us=p["gpu_layer"] * 1e6,
            forward_us=p["forward"] * 1e6,
            draft_pass_us=p["draft_pass"] * 1e6,
            step_us=p["step"] * 1e6,
            spec_step_us=p["spec_step"] * 1e6,
            cpu_batched_gflops=self.cpu_batched_gflops,
            gpu_batched_tflops=self.gpu_batched_tflops,
            source=source,
            measured=tuple(self.measured) + (tuple(params) if measured else ()),
            cpu_cache_bytes=self.cpu_cache_bytes,
            cpu_cache_read_gbps=self.cpu_cache_read_gbps,
            batch_step_us=self.batch_step_us,
        )

    # -- serialisation (plan.yaml `speculative.profile.hardware`, or a user-written YAML) --

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "cpu_read_gbps": self.cpu_read_gbps,
            "cpu_compute_gbps": self.cpu_compute_gbps,
            "link_latency_us": self.link_latency_us,
            "cpu_layer_us": self.cpu_layer_us,
            "gpu_layer_us": self.gpu_layer_us,
            "forward_us": self.forward_us,
            "step_us": self.step_us,
            "spec_step_us": self.spec_step_us,
            "cpu_batched_gflops": self.cpu_batched_gflops,
            "gpu_batched_tflops": self.gpu_batched_tflops,
            "gpus": {dev: gpu.to_dict() for dev, gpu in self.gpus.items()},
            **({"draft_pass_us": self.draft_pass_us} if self.draft_pass_us else {}),
            **({"measured": list(self.measured)} if self.measured else {}),
            **({"cpu_cache_bytes": self.cpu_cache_bytes, "cpu_cache_read_gbps": self.cpu_cache_read_gbps}
               if self.cpu_cache_read_gbps is not None else {}),
            **({"batch_step_us": self.batch_step_us} if self.batch_step_us is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: object) -> HardwareProfile:
        """Parse the ``to_dict`` schema. Omitted fields take defaults; a GPU entry may give
        only ``name`` (its bandwidths then come from the GPU table)."""
        if not isinstance(d, Mapping):
            raise ProfileError("hardware profile: expected a mapping")
        _reject_unknown("hardware profile", d, _FIELDS)
        kw: dict = {}
        for key in ("cpu_read_gbps",) + _FIXED_US + _RATES:
            if key in d:
                kw[key] = _number(f"hardware profile: {key}", d[key])
        if d.get("cpu_compute_gbps") is not None:
            kw["cpu_compute_gbps"] = _number("hardware profile: cpu_compute_gbps", d["cpu_compute_gbps"])
        if "source" in d:
            kw["source"] = str(d["source"])
        if d.get("cpu_cache_read_gbps") is not None:
            kw["cpu_cache_read_gbps"] = _number("hardware profile: cpu_cache_read_gbps", d["cpu_cache_read_gbps"])
            kw["cpu_cache_bytes"] = int(_number("hardware profile: cpu_cache_bytes", d.get("cpu_cache_bytes", 0)))
        if d.get("batch_step_us") is not None:
            kw["batch_step_us"] = _number("hardware profile: batch_step_us", d["batch_step_us"])
        if d.get("measured") is not None:
            if not isinstance(d["measured"], list) or not all(isinstance(m, str) for m in d["measured"]):
                raise ProfileError("hardware profile: measured must be a list of parameter names")
            kw["measured"] = tuple(d["measured"])
        gpus_in = d.get("gpus") or {}
        if not isinstance(gpus_in, Mapping):
            raise ProfileError("hardware profile: gpus must be a mapping of device -> settings")
        kw["gpus"] = {str(dev): _gpu_from_dict(str(dev), g) for dev, g in gpus_in.items()}
        return cls(**kw)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> HardwareProfile:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as e:
            raise ProfileError(f"hardware profile {os.fspath(path)}: {e.strerror}") from None
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" line {where.line + 1}" if where is not None else ""
            raise ProfileError(f"hardware profile {os.fspath(path)}: malformed YAML{line}") from None
        profile = cls.from_dict(data)
        return profile if "source" in (data or {}) else replace(profile, source=f"yaml: {os.fspath(path)}")


def _gpu_from_dict(dev: str, g: object) -> GpuProfile:
    if not isinstance(g, Mapping):
        raise ProfileError(f"hardware profile: gpus.{dev} must be a mapping")
    _reject_unknown(f"hardware profile: gpus.{dev}", g, _GPU_FIELDS)
    base = gpu_profile(str(g["name"])) if "name" in g else None
    if base is None and not ("read_gbps" in g and "link_gbps" in g):
        raise ProfileError(f"hardware profile: gpus.{dev} needs a name or both read_gbps and link_gbps")

    def value(key: str) -> float:
        return _number(f"hardware profile: gpus.{dev}.{key}", g[key]) if key in g else getattr(base, key)

    read, link = value("read_gbps"), value("link_gbps")
    if "source" in g:
        source = str(g["source"])
    else:
        source = base.source if base is not None and "read_gbps" not in g and "link_gbps" not in g else "user"
    return GpuProfile(str(g.get("name", dev)), read, link, source)


def _reject_unknown(what: str, d: Mapping, allowed: tuple[str, ...]) -> None:
    # A typo in a hand-written profile must not silently fall back to a default.
    unknown = sorted(str(k) for k in d if k not in allowed)
    if unknown:
        raise ProfileError(f"{what}: unknown key(s) {', '.join(unknown)} (known: {', '.join(allowed)})")


def _number(what: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProfileError(f"{what}: expected a finite number, got {v!r}")
    return float(v)


def _check_positive(what: str, v: float) -> None:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ProfileError(f"hardware profile: {what} must be a positive number, got {v!r}")


def _check_non_negative(what: str, v: float) -> None:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
        raise ProfileError(f"hardware profile: {what} must be a non-negative number, got {v!r}")


def _inv_gbps(seconds_per_byte: float, what: str) -> float:
    if not seconds_per_byte > 0:
        raise ProfileError(f"hardware profile: {what} came out as {seconds_per_byte!r} s/byte (needs > 0)")
    return 1.0 / seconds_per_byte / 1e9
