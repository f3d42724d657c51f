"""``offload`` — a thin dispatcher. Each command module owns its parser and ``main(argv)``.

Adding a command is one line in ``COMMANDS``.
"""
from __future__ import annotations

import importlib
import os
import sys

from offload.errors import OffloadError, report_user_errors

COMMANDS = {
    "plan": ("offload.commands.plan", "where each tensor goes: devices, rules, auto-fit, plan YAML"),
    "run": ("offload.commands.run", "load a model by placement and generate text"),
    "bench": ("offload.commands.bench", "speculative-decoding benchmark: baseline vs MTP n_max per task"),
    "tune": ("offload.commands.tune", "measure this box, fit the cost model, run, choose n_max for a plan"),
    "serve": ("offload.commands.serve", "OpenAI-compatible HTTP server (chat templates, prompt cache, MTP drafting)"),
    "probe": ("offload.commands.probe", "measure this box's fixed costs for the plan's forecast (about 2 s, cached)"),
    "profile": ("offload.commands.profile", "count which routed experts each MoE layer picks over a prompt set"),
}

USAGE = "usage: offload COMMAND [ARGS...]\n\ncommands:\n" + "".join(
    f"  {name:<8} {summary}\n" for name, (_, summary) in COMMANDS.items()
) + "\n`offload COMMAND -h` shows a command's options.\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def run() -> int:
        if not argv or argv[0] in ("-h", "--help"):
            (sys.stdout if argv else sys.stderr).write(USAGE)
            return 0 if argv else 2
        if argv[0] not in COMMANDS:
            raise OffloadError(f"unknown command {argv[0]!r} (commands: {', '.join(COMMANDS)})")
        return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])

    try:
        return report_user_errors(run)
    except BrokenPipeError:          # `offload plan ... | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
        return 0


if __name__ == "__main__":        # python -m offload.cli (python -m offload works too)
    sys.exit(main())
