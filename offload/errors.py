"""User-facing errors: one mechanism for every command.

Raise ``OffloadError("what is wrong, naming the file/flag/value")`` anywhere below a command.
``report_user_errors`` (used by ``offload.cli.main``) prints it as one line,
``offload: error: <message>``, on stderr and returns exit status 2 — no traceback. The
lower packages cannot import ``offload`` and carry their own error types; they are listed in
``USER_ERRORS`` so that they are reported the same way. Argument-parsing mistakes go through
the same path (``ArgumentParser`` below), so they too are one line and status 2.

Commands write output files with ``write_atomic`` (temp file + rename) so a failure never
leaves a half-written file behind.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

from gpu.errors import GpuSettingError
from placement.errors import PlacementError

EXIT_USER_ERROR = 2


class OffloadError(Exception):
    """Bad input: the message is one line that names the problem."""


USER_ERRORS: tuple[type[BaseException], ...] = (OffloadError, PlacementError, GpuSettingError)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is an ``OffloadError`` (one line, status 2)."""

    def error(self, message: str):  # type: ignore[override]
        raise OffloadError(f"{self.prog}: {message}")


def _format_warning(message, category, filename, lineno, line=None) -> str:
    return f"offload: warning: {message}\n"


def report_user_errors(main: Callable[[], int]) -> int:
    """Run ``main``; a user error becomes one stderr line and status 2."""
    warnings.formatwarning = _format_warning
    try:
        return main()
    except USER_ERRORS as exc:
        print(f"offload: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return 130


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and a rename."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise OffloadError(f"cannot write {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        os.unlink(tmp)
        raise OffloadError(f"cannot write {path}: {exc.strerror}") from None
