"""A loading progress line on stderr over tensors and bytes (redrawn in place on a TTY,
printed once at the end otherwise, so logs stay clean)."""
from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, n_tensors: int, n_bytes: int, *, stream=None, label: str = "loading"):
        self.n_tensors, self.n_bytes, self.label = n_tensors, n_bytes, label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.done_tensors = self.done_bytes = 0
        self._last = 0.0

    def _line(self) -> str:
        pct = 100.0 * self.done_bytes / self.n_bytes if self.n_bytes else 100.0
        return (f"offload: {self.label} {self.done_tensors}/{self.n_tensors} tensors, "
                f"{self.done_bytes / 2**20:.1f}/{self.n_bytes / 2**20:.1f} MiB ({pct:.0f}%)")

    def advance(self, n_bytes: int) -> None:
        self.done_tensors += 1
        self.done_bytes += n_bytes
        now = time.monotonic()
        if self.tty and now - self._last > 0.1:
            self._last = now
            self.stream.write("\r" + self._line())
            self.stream.flush()

    def close(self) -> None:
        self.stream.write(("\r" if self.tty else "") + self._line() + "\n")
        self.stream.flush()
