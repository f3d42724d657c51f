"""Compile the kernels for another x86 class than this host's: Numba's target CPU and feature
string for a named class, so one box can run (and test) the code another class gets.

Numba needs both ``NUMBA_CPU_NAME`` and ``NUMBA_CPU_FEATURES``: with the name alone it still
compiles with the host's features while ``simd.target_features()`` reports none, which is
neither that class's code nor its path. The feature string lists every feature LLVM knows
on this host, ``+`` for those the class has and ``-`` for the rest; the host must have every
``+`` feature to run the result (it is a narrower target, not an emulator).

    eval "$(python -m cpu_kernels.targets haswell)"     # then run anything: tests, benches

Each class also answers to the instruction set it stands for (``ALIASES``: avx2, avx-vnni,
avx512), the names the benches' ``--cpu-target`` takes.

Classes:
- ``haswell``: AVX2 + FMA + F16C, no AVX-512, no VNNI (Zen 2/3 servers, most desktops).
- ``alderlake``: ``haswell`` plus AVX-VNNI (256-bit u8 x s8 dot products).
- ``cascadelake``: AVX-512 F/BW/VL/DQ/CD + VNNI, no GFNI, no VBMI.
"""
from __future__ import annotations

import sys

# LLVM feature names (llvmlite's host feature keys) each class has.
_HASWELL = frozenset({
    "64bit", "cmov", "cx8", "cx16", "fxsr", "mmx", "sahf", "sse", "sse2", "sse3", "ssse3", "sse4.1",
    "sse4.2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi", "bmi2", "lzcnt", "movbe", "aes", "pclmul",
    "rdrnd", "fsgsbase", "invpcid", "xsave", "xsaveopt", "crc32", "x87", "nopl",
})
CLASSES: dict[str, tuple[str, frozenset[str]]] = {
    "haswell": ("haswell", _HASWELL),
    "alderlake": ("alderlake", _HASWELL | {"avxvnni"}),
    "cascadelake": ("cascadelake", _HASWELL | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd",
                                               "avx512vnni", "adx", "rdseed", "clflushopt", "clwb"}),
}

ALIASES = {"avx2": "haswell", "avx-vnni": "alderlake", "avx512": "cascadelake"}


def resolve(name: str) -> str:
    """The class ``name`` (a class or an alias) stands for; ValueError naming it when unknown."""
    name = ALIASES.get(name, name)
    if name not in CLASSES:
        raise ValueError(f"unknown CPU class {name!r}: expected one of {', '.join([*CLASSES, *ALIASES])}")
    return name


def numba_env(name: str, runnable: bool = True) -> dict[str, str]:
    """``{"NUMBA_CPU_NAME": ..., "NUMBA_CPU_FEATURES": ...}`` for class ``name`` (or an alias);
    ValueError naming the class when it is unknown or (``runnable``) this host cannot run
    its code. ``runnable=False``: for compiling only (``dispatcher.compile``, never a call)."""
    import llvmlite.binding as ll
    name = resolve(name)
    cpu, feats = CLASSES[name]
    host = ll.get_host_cpu_features()
    missing = sorted(f for f in feats if f in host and not host[f]) + \
        sorted(f for f in ("avx2", "fma", "f16c") if f in feats and f not in host)
    if missing and runnable:
        raise ValueError(f"this CPU cannot run code compiled for {name}: it lacks {', '.join(missing)}")
    features = ",".join(("+" if k in feats else "-") + k for k in sorted(set(host) | (feats if not runnable else set())))
    return {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": features}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m cpu_kernels.targets {{{','.join([*CLASSES, *ALIASES])}}}", file=sys.stderr)
        return 2
    try:
        env = numba_env(argv[0])
    except ValueError as e:
        print(f"cpu_kernels.targets: {e}", file=sys.stderr)
        return 2
    for k, v in env.items():
        print(f"export {k}='{v}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
