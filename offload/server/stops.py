"""Stop strings cut exactly: text is released only when it cannot be the start of a stop
string, and generation ends at the first stop string, which is never emitted."""
from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""          # text held back: it ends with the start of a stop string
        self.stopped = False

    def push(self, text: str) -> str:
        """The part of ``pending + text`` that is safe to emit; sets ``stopped`` at a stop string."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[:min(hits)], ""
            return out
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                    if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out

    def close(self) -> str:
        """At the end of generation: what was held back (it never became a stop string)."""
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
