"""Continuous batching on the shipped model (``offload.batching``, ``Session.generate_batch``):
several sequences generated together give each the tokens it gets alone — plain, MTP
drafting with batched verify, n-gram drafting with exact verify — with fewer slots than
prompts (a finished prompt's slot takes the next), and a sequence that stops early frees the
others at once.

Greedy decoding and fixed prompts: deterministic. The logits of each step are held to each
sequence's own in tests/archs/test_every_arch.py (every architecture); here the texts are
compared exactly: the decode steps of these runs stay within 16 rows, where the compiled
blocks compute each row as they do alone (attention per sequence, the FFN row by row), and
the prompts are evaluated with float activations (a prompt chunk beside other sequences'
decode tokens then rounds like one alone, up to float32 summation order, far below this
model's top-2 gaps on these prompts).
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

import offload.runtime as rt
from offload.errors import OffloadError

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
pytestmark = pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present")

PROMPTS = ["import os\n", "def main(argv):\n    ", "class Config:\n    ", "Once upon a time", "SELECT * FROM"]


@pytest.fixture(scope="module")
def session():
    with rt.load(SHIPPED, devices="CPU=16GiB", int8_prefill=False, quiet=True) as s:
        yield s


@pytest.mark.parametrize("spec", [{}, {"n_max": 2}, {"n_max": 3, "spec_type": "ngram", "verify": "exact"}],
                         ids=["plain", "mtp", "ngram-exact"])
def test_sequences_generated_together_give_each_its_own_text(session, spec):
    alone = [list(session.generate(p, max_tokens=16, stop_at_eos=False, **spec)) for p in PROMPTS]
    before = session._batcher.stats.steps if session._batcher is not None else 0
    together = session.generate_batch(PROMPTS, max_tokens=16, stop_at_eos=False, parallel=3, **spec)
    assert together == alone
    batcher = session._batcher
    assert batcher.stats.largest == 3                    # three at once, never more
    assert batcher.stats.steps - before < 5 * 17         # steps were shared
    assert batcher.active == 0
    assert [st.n_gen for st in session.batch_stats] == [16] * len(PROMPTS)
    if spec:
        assert sum(st.drafted for st in session.batch_stats) > 0


def test_a_sequence_that_stops_frees_the_others(session):
    """Slot 1 takes 3 tokens and closes its generation; slot 0's 24 continue without it.
    Each generation on a thread of its own, this thread running the batcher's steps."""
    alone = list(session.generate(PROMPTS[0], max_tokens=24, stop_at_eos=False))
    slots = session.slots(2)
    got, short = [], []

    def first():
        got.extend(session.generate(PROMPTS[0], max_tokens=24, stop_at_eos=False, slot=slots[0]))

    def second():
        gen = session.generate(PROMPTS[1], max_tokens=24, stop_at_eos=False, slot=slots[1])
        short.extend(next(gen) for _ in range(3))
        gen.close()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    session.batcher.run(lambda: not any(t.is_alive() for t in threads))
    for t in threads:
        t.join()
    assert got == alone
    assert short == list(session.generate(PROMPTS[1], max_tokens=3, stop_at_eos=False))
    assert slots[1].stats.n_gen == 3


def test_bad_prompts_in_a_batch_are_one_line_errors(session):
    with pytest.raises(OffloadError, match="exceed the context"):
        session.generate_batch(["x" * 10, "import os\n" * 4000], max_tokens=4)
    with pytest.raises(OffloadError, match="parallel must be >= 1"):
        session.generate_batch(PROMPTS, parallel=0)
    assert session.generate_batch([]) == []
