"""Stop strings cut exactly however the text arrives: every split of the text into pieces
gives the text before the first stop string, and nothing of a stop string is emitted."""
from __future__ import annotations

import random

import pytest

from offload.server.stops import StopText

CASES = [
    ("def f(x):\n    return x\n\ndef g", ["\n\n"], "def f(x):\n    return x"),
    ("abcabd", ["abd"], "abc"),                       # a false start of the stop string
    ("aaab", ["aab"], "a"),
    ("x = 1  # done", ["#", "= 1"], "x "),             # the earliest stop string wins
    ("no stop here", ["zz"], "no stop here"),          # held-back tail released at the end
    ("ends with a partial st", ["stop"], "ends with a partial st"),
    ("héllo wörld", ["wö"], "héllo "),
]


@pytest.mark.parametrize("text,stops,want", CASES)
def test_every_split_cuts_at_the_first_stop(text, stops, want):
    rng = random.Random(1234)
    splits = [[text], list(text)] + [_random_split(text, rng) for _ in range(50)]
    for pieces in splits:
        s = StopText(stops)
        out = ""
        for p in pieces:
            out += s.push(p)
            assert not any(st in out for st in stops)
            if s.stopped:
                break
        out += s.close()
        assert out == want, pieces
        assert s.stopped == (want != text)


def _random_split(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, len(text) - 1)))
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def test_no_stops_passes_text_through():
    s = StopText([])
    assert s.push("abc") == "abc" and s.close() == "" and not s.stopped
