"""Build llama.cpp's libraries for one x86 class, for the benches' llama.cpp column at that
class (``bench.depth --cpu-target``): the instruction-set comparison the CPU-speed work
measures on one box, both engines compiled for the same narrower target.

    python -m bench.llama_build haswell [--sdist llama_cpp_python-0.3.36.tar.gz] [--out DIR]

The source is the llama.cpp that llama-cpp-python's sdist vendors (the bindings installed here
load the result through ``LLAMA_CPP_LIB_PATH``, so the two must be the same release: the
sdist of the installed version, fetched with ``pip download`` when ``--sdist`` is not given).
ggml is configured with ``GGML_NATIVE=OFF`` and the class's feature flags
(``GGML_FLAGS``), no AMX (its buffers crash on wide models), OpenMP as the default build;
only the ``llama`` target is built (about 9 minutes on two cores). The libraries land in
``--out`` (default ``offload.host_cache.cache_dir()``, then
``llama-<version>-<class>/``), written to a temporary folder first and renamed, so a folder
that exists is a whole build (``lib_dir``).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cpu_kernels.targets import CLASSES, resolve
from offload.host_cache import cache_dir, cpu_name

_OFF = ("GGML_AVX512", "GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX_VNNI",
        "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
_AVX2 = ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")
# ggml's CMake switches per class (cpu_kernels.targets.CLASSES: the same instruction sets).
GGML_FLAGS: dict[str, tuple[str, ...]] = {
    "haswell": _AVX2,
    "alderlake": _AVX2 + ("GGML_AVX_VNNI",),
    "cascadelake": _AVX2 + ("GGML_AVX512", "GGML_AVX512_VNNI"),
}
assert set(GGML_FLAGS) == set(CLASSES)


def installed_version() -> str:
    """The installed llama-cpp-python's version, without importing it (its import loads the
    native library)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        raise SystemExit("bench.llama_build: llama-cpp-python is not installed; the built libraries "
                         "need its bindings of the same version") from None


def lib_dir(cls: str, root: Path | None = None) -> Path:
    """Where the build for class ``cls`` (a name or alias) lives; it exists only when whole."""
    return (root or cache_dir()) / f"llama-{installed_version()}-{resolve(cls)}"


def cmake_args(cls: str) -> list[str]:
    on = GGML_FLAGS[resolve(cls)]
    flags = {f: "ON" for f in on} | {f: "OFF" for f in _OFF if f not in on}
    return ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"] + \
        [f"-D{k}={v}" for k, v in sorted(flags.items())]


def _sdist(version: str, work: Path, given: Path | None) -> Path:
    if given is not None:
        if not given.is_file():
            raise SystemExit(f"bench.llama_build: {given}: no such file")
        return given
    r = subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
                        "--no-binary", ":all:", "-d", str(work)], capture_output=True, text=True)
    found = sorted(work.glob("llama_cpp_python-*.tar.gz"))
    if r.returncode or not found:
        why = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        raise SystemExit(f"bench.llama_build: pip download llama-cpp-python=={version} failed: {why}")
    return found[0]


def build(cls: str, out: Path, sdist: Path | None = None, jobs: int | None = None, log=print) -> Path:
    """Build class ``cls``'s libraries into ``out`` (returned); an existing ``out`` is kept."""
    if out.exists():
        return out
    version = installed_version()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-build-", dir=out.parent) as tmp:
        work = Path(tmp)
        src_tar = _sdist(version, work, sdist)
        with tarfile.open(src_tar) as tar:
            tar.extractall(work, filter="data")
        src = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
        if src is None:
            raise SystemExit(f"bench.llama_build: {src_tar.name} holds no vendor/llama.cpp")
        b = work / "build"
        t0 = time.perf_counter()
        log(f"configuring llama.cpp {version} for {resolve(cls)}: {' '.join(cmake_args(cls))}")
        for cmd in (["cmake", "-S", str(src), "-B", str(b)] + cmake_args(cls),
                    ["cmake", "--build", str(b), "--target", "llama", "-j", str(jobs or os.cpu_count() or 1)]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                (work.parent / f"llama-build-{resolve(cls)}.log").write_text(r.stdout + r.stderr)
                raise SystemExit(f"bench.llama_build: {cmd[1]} {cmd[2]} failed (log: "
                                 f"{work.parent / f'llama-build-{resolve(cls)}.log'})")
        staged = work / "lib"
        staged.mkdir()
        for so in (b / "bin").glob("lib*.so*"):
            shutil.copy2(so, staged / so.name, follow_symlinks=False)
        if not any(staged.glob("libllama.so*")):
            raise SystemExit(f"bench.llama_build: the build left no libllama.so in {b / 'bin'}")
        staged.rename(out)
        log(f"built in {time.perf_counter() - t0:.0f} s: {out}")
    return out


NATIVE = "native"


def host_line() -> str:
    """This box's CPU and widest integer-dot instruction set, e.g. "AMD EPYC (AVX-512 VNNI)"."""
    import llvmlite.binding as ll

    f = ll.get_host_cpu_features()
    isa = next((name for name, keys in (("AVX-512 VNNI", ("avx512vnni",)), ("AVX-VNNI", ("avxvnni",)),
                                        ("AVX-512", ("avx512f",)), ("AVX2", ("avx2",))) if all(f.get(k) for k in keys)),
               "no AVX2")
    return f"{cpu_name()} ({isa})"


@dataclass
class TargetEnvs:
    """What each engine's process gets for a ``--cpu-target``: offload's Numba target
    (``cpu_kernels.targets.numba_env``) and llama.cpp's libraries built for the same class
    (``LLAMA_CPP_LIB_PATH``); empty for the native target. ``header``: the line the benches
    print above their tables."""
    name: str
    offload: dict[str, str]
    llama: dict[str, str]
    header: str


def target_envs(target: str, with_llama: bool, log=print) -> TargetEnvs:
    """The environments for ``target`` ("native", a class of ``cpu_kernels.targets`` or an
    alias), building llama.cpp for the class when ``with_llama`` and no build exists yet.
    ValueError (one line) for an unknown class or one this host cannot run."""
    if target == NATIVE:
        return TargetEnvs(NATIVE, {}, {}, f"CPU target: native ({host_line()})")
    from cpu_kernels.targets import numba_env
    cls = resolve(target)
    offload_env = numba_env(cls)
    llama_env = {}
    if with_llama:
        llama_env = {"LLAMA_CPP_LIB_PATH": str(build(cls, lib_dir(cls), log=log))}
    feats = ", ".join(sorted(f for f in CLASSES[cls][1] if f.startswith(("avx", "fma", "f16c"))))
    header = (f"CPU target: {cls} ({feats}), both engines compiled for it on this {host_line()}: this "
              f"measures the instruction set, not that class's cores or memory system")
    return TargetEnvs(cls, offload_env, llama_env, header)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help=f"CPU class: {', '.join(CLASSES)} (or an alias of cpu_kernels.targets)")
    ap.add_argument("--sdist", type=Path, default=None, help="llama-cpp-python sdist (default: pip download)")
    ap.add_argument("--out", type=Path, default=None, help="folder for the libraries (default: the cache)")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="build jobs (default: every core)")
    a = ap.parse_args(argv)
    try:
        resolve(a.target)
    except ValueError as e:
        print(f"bench.llama_build: {e}", file=sys.stderr)
        return 2
    out = build(a.target, a.out or lib_dir(a.target), a.sdist, a.jobs,
                log=lambda m: print(f"[llama_build] {m}", file=sys.stderr, flush=True))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
