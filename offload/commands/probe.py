"""``offload probe``: measure this box's fixed costs for the plan's forecast (about 2 s).

    offload probe [--write PROFILE.yaml|NAME] [--refresh] [-t THREADS]

Prints the CPU terms the forecast of ``offload plan`` needs (read rate, fixed cost per CPU
block and per forward pass, the decode loop's own time per step; ``offload.probe``), from the
cache when this CPU and offload version were probed before. ``--write`` saves them as a
hardware profile: run it on the box a plan is for, copy the file, and give it to
``offload plan --hw-profile`` there (the CPU part of a ``bench/profiles/*.yaml``; add the
box's ``gpus:``).
"""
from __future__ import annotations

import argparse
import sys

import yaml

from offload.errors import ArgumentParser, OffloadError, write_atomic
from offload.probe import CACHE_ENV, PROBE_SECONDS, calibrate, named_profile_target


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="offload probe", description=__doc__.split("\n\n")[0].replace("``", ""),
                       epilog=__doc__.split("\n\n", 2)[2].replace("``", ""),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", metavar="PROFILE.yaml|NAME",
                   help="write the measured terms as a hardware profile: a file, or NAME for "
                        "~/.config/offload/profiles/NAME.yaml (`offload plan --hw-profile NAME` reads it)")
    p.add_argument("--refresh", action="store_true",
                   help=f"measure again instead of reading the cache (${CACHE_ENV} relocates it)")
    p.add_argument("--seconds", type=float, default=PROBE_SECONDS,
                   help=f"timed part of the probe (default {PROBE_SECONDS:g}; load and compile not counted)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="threads for the CPU kernels (default: numba's, all cores; as offload run)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None and args.threads < 1:
        raise OffloadError(f"--threads must be >= 1, got {args.threads}")
    if not args.seconds > 0:
        raise OffloadError(f"--seconds must be > 0, got {args.seconds}")
    from offload.commands.run import runtime_process_settings

    runtime_process_settings()
    result, how = calibrate(refresh=args.refresh, seconds=args.seconds, threads=args.threads)
    print(f"offload probe: {result.cpu}, offload {result.version}, {result.threads} threads; {how}")
    print(f"measured: {result.describe()}")
    if args.write:
        target = named_profile_target(args.write)
        header = (f"# offload probe on {result.cpu} ({result.threads} threads, offload {result.version}, "
                  f"{result.date}): give to `offload plan --hw-profile`; add this box's gpus: by name\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, header + yaml.safe_dump(result.hardware.to_dict(), sort_keys=False))
        print(f"offload probe: wrote {target}" + (f" (plan with --hw-profile {args.write})"
                                                  if str(target) != args.write else ""), file=sys.stderr)
    return 0
