"""This host as the caches see it: the CPU's model name and last-level cache, offload's
version, and the folder that per-CPU measurements are cached in (``OFFLOAD_CACHE_DIR``,
else ``$XDG_CACHE_HOME/offload`` or ``~/.cache/offload``): the probe's fixed costs
(``offload.probe``), the decode-activation choice (``offload.decode_int8``), the benches'
llama.cpp builds (``bench.llama_build``)."""
from __future__ import annotations

import hashlib
import os
import platform
import re
from pathlib import Path

CACHE_ENV = "OFFLOAD_CACHE_DIR"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def last_level_cache_bytes() -> int:
    """Size of CPU 0's largest cache level (Linux sysfs); 0 when unknown."""
    best = (0, 0)
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", size)
        if m:
            best = max(best, (level, int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]))
    return best[1]


def target_slug() -> str:
    """A short digest of the features the CPU kernels are compiled for (an emulated class,
    ``NUMBA_CPU_NAME``/``NUMBA_CPU_FEATURES``, is another one): what a measurement of the
    kernels' speed is keyed by beside the CPU model."""
    from cpu_kernels.simd import target_features
    return hashlib.sha1(target_features().encode()).hexdigest()[:10]


def offload_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("offload")
    except PackageNotFoundError:
        return "unknown"


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "offload"


def cpu_slug(cpu: str | None = None) -> str:
    """``cpu`` (default this host's model name) as a file-name part."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", cpu_name() if cpu is None else cpu).strip("-")[:80] or "cpu"
