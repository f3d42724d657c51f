"""Fuzz the GGUF header reader: seeded mutants of real headers through ``open_model``.

    python -m bench.fuzz [-n 10000] [--seed 0] [--hang 5] [--sources shipped,glm-4.5-air,gpt-oss-120b]

Each mutant is one real header — the shipped model's, or a real-shaped fixture's
(``tests.fixtures.real_models``: GLM-4.5-Air in one file, gpt-oss-120b split over two, one
shard mutated) — changed once: random bits, a header field (a count, a string length, a
type, n_dims, a dimension, a data offset) set to an edge value (0, 2^31, 2^63, 2^64−1, …), a
chunk zeroed, copied over another place, deleted or duplicated, or the file cut short. The
data region is left as a sparse hole of the original size (``open_model`` reads headers
only). Every mutant then goes through ``offload.gguf_model.open_model`` (what ``offload plan``
and ``offload run`` call first), and ends as one of:

- ``parsed``: the mutant is still a readable model (e.g. a flipped bit in a float value),
  and with ``--plan`` ``offload plan`` made a plan for it (with ``--run``: it loaded and
  generated 4 tokens);
- ``refused``: a user error (``OffloadError`` / ``PlacementError``) whose message is one line;
- ``crashed``: any other exception, or a message of more than one line;
- ``hung``: still running after ``--hang`` seconds (interrupted by a timer).

``handled`` = parsed + refused. It prints the counts per source, the slowest mutant's time
and what it was, and each crash with the seed and index that reproduce it
(``--only SOURCE:INDEX``). ``tests/archs/test_gguf_fuzz.py`` runs a few hundred of the same mutants.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "models" / "tiny-glm4moe-mtp.gguf"
SOURCES = ("shipped", "glm-4.5-air", "gpt-oss-120b")
EDGE_VALUES = (0, 1, 2, 3, 4, 5, 7, 8, 31, 32, 255, 256, 0xFFFF, 2**20, 2**31 - 1, 2**31, 2**32 - 1,
               2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1)
KINDS = ("bits", "field", "field", "field", "count", "zero", "splice", "delete", "insert", "truncate")


@dataclass
class Shard:
    name: str                     # file name (split shards keep their -0000k-of-0000n names)
    header: bytes                 # bytes before the data region
    size: int                     # the whole file's size
    fields: list[tuple[int, int]]  # (offset, width) of each integer part of the header


@dataclass
class Source:
    name: str
    shards: list[Shard]
    paths: list[str]              # the unmutated files


def _fields(path: str) -> list[tuple[int, int]]:
    """Offsets and widths of every integer in the header (counts, lengths, types, dims,
    offsets, scalar values), from gguf's own reader."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    out = [(8, 8), (16, 8)]                            # tensor count, metadata count
    for f in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        off = f.offset
        for part in f.parts:
            if part.nbytes in (1, 2, 4, 8):
                out.append((off, part.nbytes))
            off += part.nbytes
    return sorted(set(out))


def load_sources(names, workdir: Path) -> list[Source]:
    """The unmutated headers (fixtures are written under ``workdir``, a few MB)."""
    from offload.gguf_header import read_header
    from offload.gguf_model import find_shards
    from tests.fixtures.real_models import ALL, write_fixture

    out = []
    for name in names:
        if name == "shipped":
            first = SHIPPED
        elif name in ALL:
            (workdir / "originals").mkdir(exist_ok=True)
            first = write_fixture(ALL[name](), workdir / "originals", tokenizer="none")
        else:
            raise SystemExit(f"unknown source {name!r} (sources: {', '.join(SOURCES)})")
        shards, paths = [], find_shards(first)
        for p in paths:
            h = read_header(p)
            with open(p, "rb") as f:
                shards.append(Shard(Path(p).name, f.read(h.data_start), h.file_size, _fields(p)))
        out.append(Source(name, shards, paths))
    return out


def mutate(rng: np.random.Generator, shard: Shard) -> tuple[str, bytes, int]:
    """One mutation of ``shard``: (what was done, new header bytes, new file size)."""
    b = bytearray(shard.header)
    n = len(b)
    kind = KINDS[rng.integers(len(KINDS))]
    if kind == "bits":
        k = int(rng.integers(1, 5))
        for _ in range(k):
            b[int(rng.integers(n))] ^= 1 << int(rng.integers(8))
        what = f"{k} bit(s) flipped"
    elif kind in ("field", "count"):
        off, width = shard.fields[int(rng.integers(len(shard.fields)))] if kind == "field" else \
            ((8, 8), (16, 8))[int(rng.integers(2))]
        value = (int(EDGE_VALUES[rng.integers(len(EDGE_VALUES))]) if rng.random() < 0.8 else
                 int(rng.integers(0, 2**63)) * 2 + int(rng.integers(2)))
        value %= 1 << (8 * width)
        b[off:off + width] = value.to_bytes(width, "little")
        what = f"{width}-byte field at {off} = {value}"
    elif kind == "zero":
        a, k = int(rng.integers(n)), int(rng.integers(1, 257))
        b[a:a + k] = bytes(len(b[a:a + k]))
        what = f"bytes {a}..{a + k} zeroed"
    elif kind == "splice":
        src, dst, k = int(rng.integers(n)), int(rng.integers(n)), int(rng.integers(1, 65))
        chunk = bytes(b[src:src + k])
        b[dst:dst + len(chunk)] = chunk
        del b[n:]
        what = f"{len(chunk)} bytes from {src} copied to {dst}"
    elif kind == "delete":
        a, k = int(rng.integers(n)), int(rng.integers(1, 65))
        del b[a:a + k]
        what = f"bytes {a}..{a + k} deleted"
    elif kind == "insert":
        a, k = int(rng.integers(n)), int(rng.integers(1, 65))
        b[a:a] = b[a:a + k]
        what = f"bytes {a}..{a + k} duplicated"
    else:                                   # the file cut short inside the header
        cut = int(rng.integers(0, n))
        return f"cut at byte {cut}", bytes(b[:cut]), cut
    return what, bytes(b), shard.size + len(b) - n


class Hung(Exception):
    pass


def _alarm(signum, frame):
    raise Hung()


@dataclass
class Result:
    source: str
    index: int
    what: str
    outcome: str          # parsed | refused | crashed | hung
    seconds: float
    message: str = ""


PLAN_DEVICES = "CUDA0=24GiB,CUDA1=24GiB,CPU=256GiB"


def _plan(path: Path) -> None:
    """``offload plan PATH --devices PLAN_DEVICES --json`` (auto-fit + the speculation table),
    its output discarded."""
    import contextlib
    import io

    from offload.commands.plan import main as plan_main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        plan_main([str(path), "--devices", PLAN_DEVICES, "--json"])


def _run(path: Path) -> None:
    """Load the mutant for the CPU and generate 4 tokens (``offload run``'s library path)."""
    import offload.runtime as rt

    with rt.load(path, devices="CPU=64GiB", quiet=True, ctx=256) as s:
        list(s.generate([1, 2, 3], max_tokens=4, stop_at_eos=False))


def run_one(source: Source, index: int, seed: int, workdir: Path, hang_s: float, plan: bool = False,
            run: bool = False) -> Result:
    """Mutant ``index`` of ``source`` (deterministic in seed and index) through open_model
    (and, with ``plan``, through ``offload plan`` when it opens)."""
    from offload.errors import USER_ERRORS
    from offload.gguf_model import open_model

    rng = np.random.default_rng([seed, SOURCES.index(source.name) if source.name in SOURCES else 99, index])
    target = int(rng.integers(len(source.shards)))
    folder = workdir / source.name
    folder.mkdir(parents=True, exist_ok=True)
    what = ""
    for i, shard in enumerate(source.shards):
        header, size = shard.header, shard.size
        if i == target:
            what, header, size = mutate(rng, shard)
            if len(source.shards) > 1:
                what = f"shard {i + 1}: {what}"
        path = folder / shard.name
        with open(path, "wb") as f:
            f.write(header)
            if run:                          # the real data behind the header (small files only)
                with open(source.paths[i], "rb") as src:
                    src.seek(len(shard.header))
                    f.write(src.read())
        os.truncate(path, max(size, len(header)))
    first = folder / source.shards[0].name
    old = signal.signal(signal.SIGALRM, _alarm)
    t0 = time.perf_counter()
    try:
        signal.setitimer(signal.ITIMER_REAL, hang_s)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            open_model(first)
            if plan:
                _plan(first)
            if run:
                _run(first)
        outcome, message = "parsed", ""
    except Hung:
        outcome, message = "hung", f"still running after {hang_s:g} s"
    except USER_ERRORS as exc:
        message = str(exc)
        outcome = "refused" if "\n" not in message and message else "crashed"
    except Exception as exc:               # noqa: BLE001 — what the fuzzer is looking for
        outcome, message = "crashed", f"{type(exc).__name__}: {exc}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    return Result(source.name, index, what, outcome, time.perf_counter() - t0, message)


@dataclass
class Summary:
    results: list[Result] = field(default_factory=list)

    def counts(self, source: str | None = None) -> Counter:
        return Counter(r.outcome for r in self.results if source is None or r.source == source)

    @property
    def slowest(self) -> Result:
        return max(self.results, key=lambda r: r.seconds)

    def bad(self) -> list[Result]:
        return [r for r in self.results if r.outcome in ("crashed", "hung")]


def fuzz(sources: list[Source], n: int, seed: int, workdir: Path, hang_s: float,
         progress=None, plan: bool = False, run: bool = False) -> Summary:
    """``n`` mutants, spread round-robin over the sources."""
    out = Summary()
    for i in range(n):
        out.results.append(run_one(sources[i % len(sources)], i // len(sources), seed, workdir, hang_s,
                                   plan, run))
        if progress is not None and (i + 1) % 1000 == 0:
            progress(i + 1, out)
    return out


def report(summary: Summary, sources: list[Source], show: int) -> list[str]:
    lines = [f"{'source':<14} {'mutants':>8} {'parsed':>7} {'refused':>8} {'crashed':>8} {'hung':>5}"]
    for s in [*(x.name for x in sources), None]:
        c = summary.counts(s)
        lines.append(f"{s or 'all':<14} {sum(c.values()):>8} {c['parsed']:>7} {c['refused']:>8} "
                     f"{c['crashed']:>8} {c['hung']:>5}")
    c = summary.counts()
    lines.append(f"handled {c['parsed'] + c['refused']} / {sum(c.values())}, crashed {c['crashed']}, "
                 f"hung {c['hung']}")
    times = sorted(r.seconds for r in summary.results)
    s = summary.slowest
    lines.append(f"time per mutant: median {times[len(times) // 2] * 1e3:.1f} ms, "
                 f"p99 {times[int(len(times) * 0.99)] * 1e3:.1f} ms, slowest {s.seconds * 1e3:.1f} ms "
                 f"({s.source}:{s.index}, {s.what}: {s.outcome} {s.message[:120]})")
    for r in summary.bad()[:show]:
        lines.append(f"{r.outcome.upper()} {r.source}:{r.index} ({r.what}): {r.message[:300]}")
    refusals = Counter(_kind(r.message) for r in summary.results if r.outcome == "refused")
    lines.append("most common refusals: " + "; ".join(f"{k} ×{v}" for k, v in refusals.most_common(8)))
    return lines


def _kind(message: str) -> str:
    """A refusal message without the file name and numbers, to group alike ones."""
    text = message.split(": ", 1)[-1]
    return "".join("#" if ch.isdigit() else ch for ch in text)[:60]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", type=int, default=10_000, help="mutants (default 10000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hang", type=float, default=5.0, help="seconds after which a mutant counts as hung")
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--show", type=int, default=20, help="crashes/hangs to print")
    p.add_argument("--only", metavar="SOURCE:INDEX", help="run one mutant and print its result")
    p.add_argument("--plan", action="store_true",
                   help=f"also run `offload plan --devices {PLAN_DEVICES} --json` on mutants that open")
    p.add_argument("--run", action="store_true",
                   help="also load mutants that open on the CPU and generate 4 tokens (use --sources "
                        "shipped: the data is copied behind each mutated header)")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.sources.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="offload-fuzz-") as tmp:
        work = Path(tmp)
        if args.only:
            name, index = args.only.rsplit(":", 1)
            r = run_one(load_sources([name], work)[0], int(index), args.seed, work, args.hang, args.plan,
                        args.run)
            print(f"{r.source}:{r.index} ({r.what}): {r.outcome} in {r.seconds * 1e3:.1f} ms: {r.message}")
            return 0
        sources = load_sources(names, work)
        t0 = time.perf_counter()
        summary = fuzz(sources, args.n, args.seed, work, args.hang, plan=args.plan, run=args.run,
                       progress=lambda i, s: print(f"  {i} mutants, {len(s.bad())} crashed/hung, "
                                                   f"{time.perf_counter() - t0:.0f} s", file=sys.stderr))
        print(f"{args.n} mutants (seed {args.seed}) of {', '.join(names)} through open_model"
              f"{' and offload plan' if args.plan else ''}{' and a 4-token run' if args.run else ''} "
              f"in {time.perf_counter() - t0:.1f} s")
        for line in report(summary, sources, args.show):
            print(line)
    return 1 if summary.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
