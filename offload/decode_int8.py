"""Which weight types decode with int8 activations on this CPU: measured once, cached.

Whether a type's int8 path (activations quantized per 32, integer dot products) beats its
float path at batch 1 depends on the CPU, not just the type: the built-in list
(``placement.limits.DECODE_INT8_TYPES``) was measured on a Xeon; on a Zen 4-class EPYC Q4_0
and Q4_1 decode faster with float activations, on a Zen 5 Q4_0 faster with int8, and with
AVX2's dot product (``pair8.dpbusd``) Q4_0 is 1.3-2x faster with int8. So "auto" decode
activations take the set this module measures at the first load of a model on a CPU:

- per weight type of the model's CPU routed experts with an int8 decoder, a batch-1
  ``cpu_kernels.matmul`` over ``weight_bytes()`` of random blocks (twice the last-level cache,
  so the weights stream from memory as a big model's do), float and int8 passes
  alternating, ``REPEAT`` of each, medians;
- int8 where it reads more than ``MARGIN`` faster than float (the rule the built-in list
  was made with: in noise, the float path, which is exact);
- cached per CPU model, compile target, kernel thread count and offload version
  (``offload.host_cache.cache_dir``, a YAML of GB/s per type), so a later load only reads it; a
  type not in the file is measured and added; a corrupt file is measured again.

About 0.1 s per type once the kernels are compiled (Numba's cache keeps them). Chosen once,
at load, never per call: ``cpu_kernels.settings.set_decode_int8_types``, which
``cpu_kernels.matmul.use_int8`` reads for "auto". ``OFFLOAD_DECODE_INT8=prior`` keeps the
built-in list (the test suite pins it, so its paths do not depend on a measurement; the
planner counts the int8 decode scratch with the built-in list too).
"""
from __future__ import annotations

import hashlib
import os
import sys
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import yaml
from gguf import GGMLQuantizationType as Q

from placement.devices import CPU
from placement.tensors import Role

PRIOR_ENV = "OFFLOAD_DECODE_INT8"
MARGIN = 1.05
REPEAT = 5
COLS = 2048
MIN_BYTES, MAX_BYTES = 64 << 20, 256 << 20


def weight_bytes() -> int:
    """Bytes of the measured weight: twice the last-level cache, within [64, 256] MiB."""
    from offload.host_cache import last_level_cache_bytes
    return min(MAX_BYTES, max(MIN_BYTES, 2 * last_level_cache_bytes()))


def cache_file(threads: int) -> Path:
    """This CPU's file: model name, the compile target's features (an emulated class is
    another file), the kernels' thread count and offload's version."""
    from cpu_kernels.simd import target_features
    from offload.host_cache import cache_dir, cpu_slug, offload_version
    target = hashlib.sha1(target_features().encode()).hexdigest()[:10]
    return cache_dir() / f"decode-int8-{cpu_slug()}-{target}-t{threads}-{offload_version()}.yaml"


def _read(path: Path) -> dict[str, dict]:
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(doc, dict):
        return {}
    return {k: v for k, v in doc.items()
            if isinstance(v, dict) and all(isinstance(v.get(f), (int, float)) for f in ("float_gbps", "int8_gbps"))}


def _write(path: Path, doc: dict) -> None:
    from offload.errors import OffloadError, write_atomic
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, yaml.safe_dump(doc, sort_keys=True))
    except (OSError, OffloadError):
        pass                        # an unwritable cache folder: measured again next time


def measure(qtype: Q, n_bytes: int | None = None, repeat: int = REPEAT) -> tuple[float, float]:
    """(float GB/s, int8 GB/s) of a batch-1 ``cpu_kernels.matmul`` over ``n_bytes`` of random
    ``qtype`` blocks, passes alternating, medians of ``repeat``."""
    from gguf import GGML_QUANT_SIZES

    from cpu_kernels import matmul
    from cpu_kernels.synth import random_blocks
    block, size = GGML_QUANT_SIZES[qtype]
    rows = max(4, (n_bytes or weight_bytes()) // (COLS // block * size))
    rng = np.random.default_rng(0)
    w = random_blocks(qtype, (rows, COLS), rng)
    x = rng.standard_normal((1, COLS)).astype(np.float32)
    times: dict[bool, list[float]] = {False: [], True: []}
    for mode in (False, True):
        matmul(x, w, qtype, int8=mode)                 # compiled (or loaded) outside the timing
    for _ in range(repeat):
        for mode in (False, True):
            t0 = time.perf_counter()
            matmul(x, w, qtype, int8=mode)
            times[mode].append(time.perf_counter() - t0)
    return tuple(w.nbytes / statistics.median(times[m]) / 1e9 for m in (False, True))


def _measured(types: Iterable[Q], threads: int, log=None, n_bytes: int | None = None) -> dict[Q, dict]:
    """{type: its float and int8 GB/s} for the types among ``types`` with an int8 decoder,
    from the cache or measured now over ``n_bytes`` (default ``weight_bytes()``; ``log``: one
    line when it measures)."""
    from cpu_kernels.registry import get_kernel, supported_types
    known = set(supported_types())          # a type without a kernel is refused where it is loaded
    wanted = sorted({t for t in types if t in known and get_kernel(t).has_int8}, key=lambda t: t.name)
    path = cache_file(threads)
    doc = _read(path)
    missing = [t for t in wanted if t.name not in doc]
    if missing:
        t0 = time.perf_counter()
        for t in missing:
            f, i = measure(t, n_bytes)
            doc[t.name] = {"float_gbps": round(f, 3), "int8_gbps": round(i, 3)}
        _write(path, doc)
        if log is not None:
            log(f"decode activations measured on this CPU in {time.perf_counter() - t0:.1f} s: " +
                "; ".join(f"{t.name} {doc[t.name]['float_gbps']:.1f} GB/s float, {doc[t.name]['int8_gbps']:.1f} int8"
                          for t in missing) + f" (cached: {path})")
    return {t: doc[t.name] for t in wanted}


def measure_experts(qtype: Q, n_embd: int, n_ff: int, k: int, n_bytes: int | None = None,
                    repeat: int = REPEAT) -> tuple[float, float]:
    """(float GB/s, int8 GB/s) of one token through ``cpu_kernels.moe_ffn``: k random
    experts of shape gate/up (n_ff, n_embd), down (n_embd, n_ff) among ``n_bytes`` of them,
    the touched experts' bytes per second. Small experts stream slower than one big matrix
    (their rows split over the threads, a kernel call each): a 768 x 2048 Q4_0 expert reads at
    17 GB/s where a 64 MiB Q4_0 matrix reads at 22."""
    from gguf import GGML_QUANT_SIZES

    from cpu_kernels.moe import ExpertWeights, moe_ffn
    from cpu_kernels.synth import random_blocks
    block, size = GGML_QUANT_SIZES[qtype]
    per_expert = 3 * n_embd * n_ff // block * size
    n_expert = max(2 * k, (n_bytes or weight_bytes()) // per_expert)
    rng = np.random.default_rng(0)
    w = ExpertWeights(random_blocks(qtype, (n_expert, n_ff, n_embd), rng),
                      random_blocks(qtype, (n_expert, n_ff, n_embd), rng),
                      random_blocks(qtype, (n_expert, n_embd, n_ff), rng), qtype, qtype, qtype)
    x = rng.standard_normal((1, n_embd)).astype(np.float32)
    calls = [rng.choice(n_expert, k, replace=False)[None, :] for _ in range(max(1, n_expert // k))]
    wts = np.full((1, k), 1.0 / k, np.float32)
    times: dict[bool, list[float]] = {False: [], True: []}
    for mode in (False, True):
        moe_ffn(x, calls[0], wts, w, int8=mode)          # compiled (or loaded) outside the timing
    for _ in range(repeat):
        for mode in (False, True):
            t0 = time.perf_counter()
            for ids in calls:
                moe_ffn(x, ids, wts, w, int8=mode)
            times[mode].append(time.perf_counter() - t0)
    return tuple(len(calls) * k * per_expert / statistics.median(times[m]) / 1e9 for m in (False, True))


def expert_rates(shapes: Iterable[tuple[Q, int, int, int]], threads: int, log=None) -> dict[tuple, float]:
    """GB/s of one decode token's routed experts per (type, n_embd, n_ff, k) on the path this
    CPU decodes the type with (``path_rates``' choice), from the same cache file as the
    types' rates (``measure_experts`` for a shape not in it)."""
    shapes = sorted(set(shapes), key=str)
    types = _measured({s[0] for s in shapes}, threads, log)
    path = cache_file(threads)
    doc = _read(path)
    key = lambda s: f"experts {s[0].name} {s[1]}x{s[2]} k{s[3]}"      # noqa: E731
    missing = [s for s in shapes if key(s) not in doc and s[0] in types]
    if missing:
        t0 = time.perf_counter()
        for s in missing:
            f, i = measure_experts(*s)
            doc[key(s)] = {"float_gbps": round(f, 3), "int8_gbps": round(i, 3)}
        _write(path, doc)
        if log is not None:
            log(f"expert reads measured on this CPU in {time.perf_counter() - t0:.1f} s: " +
                "; ".join(f"{key(s)} {doc[key(s)]['float_gbps']:.1f} GB/s float, "
                          f"{doc[key(s)]['int8_gbps']:.1f} int8" for s in missing))
    return {s: doc[key(s)]["int8_gbps" if _takes_int8(s[0], types[s[0]]) else "float_gbps"]
            for s in shapes if s[0] in types and key(s) in doc}


def _int8_wins(rates: dict) -> bool:
    return rates["int8_gbps"] > MARGIN * rates["float_gbps"]


def choose(types: Iterable[Q], threads: int, log=None, n_bytes: int | None = None) -> frozenset[Q]:
    """The types among ``types`` (those with an int8 decoder) that decode faster with int8
    activations on this CPU, from the cache or measured now over ``n_bytes`` (default
    ``weight_bytes()``; ``log``: one line when it measures)."""
    return frozenset(t for t, r in _measured(types, threads, log, n_bytes).items() if _int8_wins(r))


def path_rates(types: Iterable[Q], threads: int, log=None) -> dict[Q, float]:
    """GB/s of each type's batch-1 ``matmul`` from memory on the path a decode token takes
    on this CPU: int8 where ``choose`` (or, under ``OFFLOAD_DECODE_INT8=prior`` or without an
    int8 dot product, the built-in list) picks it, else float. Types without an int8 decoder
    are left out (their float path is not measured here)."""
    return {t: r["int8_gbps" if _takes_int8(t, r) else "float_gbps"]
            for t, r in _measured(types, threads, log).items()}


def _takes_int8(qtype: Q, rates: dict) -> bool:
    """Whether "auto" decodes ``qtype`` (measured ``rates``) with int8 activations here: the
    kernels' rule (``placement.limits.wants_int8`` on the set ``choose_decode_int8`` would fix,
    the built-in one under ``OFFLOAD_DECODE_INT8=prior``) where the CPU has an int8 dot product."""
    from cpu_kernels.simd8 import has_int8_dot
    from placement.limits import AUTO, wants_int8
    chosen = None if os.environ.get(PRIOR_ENV) == "prior" else frozenset({qtype} if _int8_wins(rates) else ())
    return has_int8_dot() and wants_int8(AUTO, qtype, chosen)


def choose_decode_int8(tensors, placed: dict[str, str], quiet: bool) -> None:
    """Fix, for this process, which weight types of the CPU-resident routed experts decode
    with int8 activations under "auto" (``offload.decode_int8``: measured on this CPU once,
    then cached; under ``OFFLOAD_DECODE_INT8=prior`` the built-in list stays). Other types
    keep what an earlier load chose: a type's choice (at one thread count) is the same for
    every model in a process, so sessions loaded side by side agree."""
    from cpu_kernels import settings
    from cpu_kernels.simd8 import has_int8_dot
    if not has_int8_dot() or os.environ.get(PRIOR_ENV) == "prior":
        return                      # float anyway; or the built-in list (settings' None)
    routed = {t.ggml_type for t in tensors if t.role == Role.ROUTED_EXPERTS and placed.get(t.name) == CPU}
    if not routed:
        return
    log = None if quiet else (lambda m: print(f"offload: {m}", file=sys.stderr))
    chosen = choose(routed, settings.apply_threads(), log)
    before = settings.decode_int8_types()
    settings.set_decode_int8_types(chosen if before is None else (before - routed) | chosen)
