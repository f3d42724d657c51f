"""Which weight types decode with int8 activations on this CPU: measured once, cached.

Whether a type's int8 path (activations quantized per 32, integer dot products) beats its
float path at batch 1 depends on the CPU, not just the type: the built-in list
(``placement.limits.DECODE_INT8_TYPES``) was measured on a Xeon; on a Zen 4-class EPYC Q4_0
and Q4_1 decode faster with float activations, on a Zen 5 Q4_0 faster with int8, and with
AVX2's dot product (``pair8.dpbusd``) Q4_0 is 1.3-2x faster with int8. So "auto" decode
activations take the set this module measures at the first load of a model on a CPU:

- one decode token's reads of the plan's CPU weights, by part (``token_reads``): a layer's
  routed experts at the rate of one token through k random experts of their shape
  (``measure_experts``, through ``cpu_kernels.moe_ffn``), other matrices at their type's
  batch-1 ``cpu_kernels.matmul`` rate (``measure``); each over ``weight_bytes()`` of random
  blocks (twice the last-level cache, so the weights stream from memory as a big model's
  do), float and int8 passes alternating, ``REPEAT`` of each, medians;
- per type, int8 where it reads those bytes more than ``MARGIN`` faster than float (the rule
  the built-in list was made with: in noise, the float path, which is exact). The shapes
  matter: small experts are not one big matrix (``choose``);
- cached per CPU model, compile target, kernel thread count and offload version
  (``offload.host_cache.cache_dir``, a YAML of GB/s per type and per expert shape), so a
  later load only reads it; a part not in the file is measured and added; a corrupt file is
  measured again.

About 0.1 s per type and 1-2 s per expert shape once the kernels are compiled (Numba's cache keeps them). Chosen once,
at load, never per call: ``cpu_kernels.settings.set_decode_int8_types``, which
``cpu_kernels.matmul.use_int8`` reads for "auto". ``OFFLOAD_DECODE_INT8=prior`` keeps the
built-in list (the test suite pins it, so its paths do not depend on a measurement; the
planner counts the int8 decode scratch with the built-in list too).
"""
from __future__ import annotations

import os
import sys
import statistics
import time
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
    from offload.host_cache import cache_dir, cpu_slug, offload_version, target_slug
    return cache_dir() / f"decode-int8-{cpu_slug()}-{target_slug()}-t{threads}-{offload_version()}.yaml"


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
    f, i = _medians(lambda int8: matmul(x, w, qtype, int8=int8), repeat)
    return w.nbytes / f / 1e9, w.nbytes / i / 1e9


def _medians(run, repeat: int) -> tuple[float, float]:
    """(float, int8) median seconds of ``run(int8)`` over ``repeat`` passes of each, alternating,
    after one untimed pass of each (Numba compiles or loads there)."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for mode in (False, True):
        run(mode)
    for _ in range(repeat):
        for mode in (False, True):
            t0 = time.perf_counter()
            run(mode)
            times[mode].append(time.perf_counter() - t0)
    return statistics.median(times[False]), statistics.median(times[True])


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

    def run(int8: bool) -> None:
        for ids in calls:
            moe_ffn(x, ids, wts, w, int8=int8)
    read = len(calls) * k * per_expert
    f, i = _medians(run, repeat)
    return read / f / 1e9, read / i / 1e9


def token_reads(tensors, placed: dict[str, str], n_expert_used: int) -> dict[tuple, float]:
    """{part: bytes one decode token reads of it} for a plan's CPU-resident weights: a layer's
    routed experts of one type as the part (type, n_embd, n_ff, k), read at the rate of one
    token through k experts of that shape (``measure_experts``); other matrices, and expert
    groups of mixed types (Q4_K_M's Q6_K down), as (type,), read at the type's big-matrix
    rate (``measure``). k/E of a routed expert tensor, all of another matrix; none of the
    embedding rows (one a token) or of the NextN block (the drafter's, not a target token's)."""
    reads: dict[tuple, float] = {}
    layers: dict = {}               # layer -> its routed expert tensors on the CPU
    for t in tensors:
        if placed.get(t.name) != CPU or t.nextn or t.role == Role.EMBEDDING or len(t.shape) < 2:
            continue
        if t.role == Role.ROUTED_EXPERTS and t.n_experts:
            layers.setdefault(t.layer, []).append(t)
        else:
            reads[(t.ggml_type,)] = reads.get((t.ggml_type,), 0.0) + t.n_bytes
    for group in layers.values():
        down = next((t for t in group if "down" in t.name), None)
        read = {t.name: t.n_bytes * n_expert_used / t.n_experts for t in group}
        if down is not None and len({t.ggml_type for t in group}) == 1 and len(group) in (2, 3):
            part = (down.ggml_type, down.shape[1], down.shape[2], n_expert_used)
            reads[part] = reads.get(part, 0.0) + sum(read.values())
        else:
            for t in group:
                reads[(t.ggml_type,)] = reads.get((t.ggml_type,), 0.0) + read[t.name]
    return reads


def _key(part: tuple) -> str:
    """A part's entry in the cache file: its type's name, or its expert shape's."""
    return part[0].name if len(part) == 1 else f"experts {part[0].name} {part[1]}x{part[2]} k{part[3]}"


def _part_rates(reads: dict[tuple, float], threads: int, log=None, n_bytes: int | None = None, *,
                refresh: bool = False) -> dict[tuple, dict]:
    """{part: its float and int8 GB/s} for the parts (``token_reads``' keys) whose type has an
    int8 decoder, from the cache file or measured now over ``n_bytes`` (default
    ``weight_bytes()``): ``measure`` per type (every part's type), ``measure_experts`` per
    expert shape; ``refresh``: measured now even where cached; ``log``: one line per kind it
    measures."""
    from cpu_kernels.registry import get_kernel, supported_types
    known = set(supported_types())          # a type without a kernel is refused where it is loaded
    ok = {p[0] for p in reads if p[0] in known and get_kernel(p[0]).has_int8}
    wanted = sorted({(q,) for q in ok} | {p for p in reads if len(p) == 4 and p[0] in ok}, key=_key)
    path = cache_file(threads)
    doc = _read(path)
    for size, what in ((1, "decode activations"), (4, "expert reads")):
        missing = [p for p in wanted if len(p) == size and (refresh or _key(p) not in doc)]
        if not missing:
            continue
        t0 = time.perf_counter()
        for p in missing:
            f, i = measure(p[0], n_bytes) if size == 1 else measure_experts(*p, n_bytes=n_bytes)
            doc[_key(p)] = {"float_gbps": round(f, 3), "int8_gbps": round(i, 3)}
        _write(path, doc)
        if log is not None:
            log(f"{what} measured on this CPU in {time.perf_counter() - t0:.1f} s: " +
                "; ".join(f"{_key(p)} {doc[_key(p)]['float_gbps']:.1f} GB/s float, "
                          f"{doc[_key(p)]['int8_gbps']:.1f} int8" for p in missing) + f" (cached: {path})")
    return {p: doc[_key(p)] for p in reads if p[0] in ok}


def choose(reads: dict[tuple, float], threads: int, log=None, n_bytes: int | None = None) -> frozenset[Q]:
    """The weight types (with an int8 decoder) that decode one token's reads of them
    (``token_reads``: each part at its measured rate, experts at their shape's) more than
    ``MARGIN`` faster with int8 activations than with float. In the margin, float (exact).
    Judged on the model's own shapes: small experts are not one big matrix (on a Zen 4 EPYC a
    Q4_0 256 MiB matrix read 19.1 GB/s int8 against 17.5 float, its 512 x 256 experts 8.9
    against 9.2; taking int8 there cost a narrow model 18 % of its decode)."""
    return _int8_wins(reads, _part_rates(reads, threads, log, n_bytes))


def _int8_wins(reads: dict[tuple, float], rates: dict[tuple, dict]) -> frozenset[Q]:
    """``choose``'s rule on measured ``rates``: per type, the seconds its parts' reads take on
    each path."""
    seconds: dict[Q, list[float]] = {}
    for p, r in rates.items():
        s = seconds.setdefault(p[0], [0.0, 0.0])
        s[0] += reads[p] / r["float_gbps"]
        s[1] += reads[p] / r["int8_gbps"]
    return frozenset(q for q, (f, i) in seconds.items() if f > MARGIN * i)


def read_rates(reads: dict[tuple, float], threads: int, log=None, *, refresh: bool = False) -> dict[tuple, float]:
    """GB/s of each part (``token_reads``' keys) on the path a decode token takes on this CPU:
    int8 for the types ``choose`` picks (under ``OFFLOAD_DECODE_INT8=prior`` the built-in list;
    without an int8 dot product none), else float. Parts whose type has no int8 decoder are
    left out (their float path is not measured here). ``refresh``: measured again, not read
    from the cache."""
    from cpu_kernels.simd8 import has_int8_dot
    from placement.limits import AUTO, wants_int8
    rates = _part_rates(reads, threads, log, refresh=refresh)
    chosen = None if os.environ.get(PRIOR_ENV) == "prior" else _int8_wins(reads, rates)
    return {p: r["int8_gbps" if has_int8_dot() and wants_int8(AUTO, p[0], chosen) else "float_gbps"]
            for p, r in rates.items()}


def choose_decode_int8(tensors, placed: dict[str, str], n_expert_used: int, quiet: bool) -> None:
    """Fix, for this process, which weight types of the plan's CPU-resident weights decode with
    int8 activations under "auto" (``choose`` on one token's reads of them: measured on this
    CPU once, then cached; under ``OFFLOAD_DECODE_INT8=prior`` the built-in list stays). Types
    this plan does not read on the CPU keep what an earlier load chose; a type it reads takes
    this model's choice (the setting is per type, for the process)."""
    from cpu_kernels import settings
    from cpu_kernels.simd8 import has_int8_dot
    if not has_int8_dot() or os.environ.get(PRIOR_ENV) == "prior":
        return                      # float anyway; or the built-in list (settings' None)
    reads = token_reads(tensors, placed, n_expert_used)
    if not reads:
        return
    log = None if quiet else (lambda m: print(f"offload: {m}", file=sys.stderr))
    chosen = choose(reads, settings.apply_threads(), log)
    read = {p[0] for p in reads}
    before = settings.decode_int8_types()
    settings.set_decode_int8_types(chosen if before is None else (before - read) | chosen)
