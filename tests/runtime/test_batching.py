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


def test_groups_of_decode_rows_pack_in_order_up_to_the_compiled_limit():
    from offload.batching import decode_groups
    assert decode_groups([3] * 8) == [(0, 5), (5, 8)]          # 15 + 9 rows
    assert decode_groups([5, 9, 4, 7]) == [(0, 2), (2, 4)]
    assert decode_groups([2] * 8) is None                       # 16 rows: one compiled pass
    assert decode_groups([3, 128]) is None                      # a prompt chunk: one pass


def test_a_step_takes_its_sequences_in_one_order_whatever_order_their_passes_arrive_in():
    """The batcher orders a step's passes by sequence (its state), not by arrival: the compiled
    blocks keep the typed lists of the sequences' caches while that order holds (arrival order
    changed it in most steps, and each change rebuilt them). The model here only records what
    each step gets; the batcher is the real one, its passes posted from threads in turn."""
    import time

    import numpy as np

    from offload.batching import Batcher

    steps = []

    class Recording:
        def forward_batch(self, seqs):
            steps.append([state for _, state, _ in seqs])
            return [(None, None)] * len(seqs)

    batcher = Batcher(Recording())
    states = [object() for _ in range(3)]
    for arrival in ([0, 1, 2], [2, 1, 0], [1, 2, 0], [2, 0, 1]):
        for _ in states:
            batcher.join()
        threads = []
        for i in arrival:
            def post(state=states[i]):
                batcher.forward(np.zeros(1), state, "all")
                batcher.leave()
            threads.append(threading.Thread(target=post))
            threads[-1].start()
            while len(batcher._pending) < len(threads):       # this one posted before the next starts
                time.sleep(0.001)
        batcher.run(lambda: True)
        for t in threads:
            t.join()
    assert len(steps) == 4 and all(len(step) == 3 for step in steps)
    assert all(step == steps[0] for step in steps)


def test_split_choice_tries_both_ways_then_keeps_the_faster():
    from offload.batching import SplitChoice
    choice, seconds = SplitChoice(), {False: 0.012, True: 0.006}
    ways = []
    for _ in range(2 * SplitChoice.TRIALS + SplitChoice.RECHECK):
        way = choice.split(2)                   # steps that split into two groups
        ways.append(way)
        choice.record(2, way, seconds[way])
    trials = ways[:2 * SplitChoice.TRIALS]
    assert trials.count(True) == trials.count(False) == SplitChoice.TRIALS
    kept = ways[2 * SplitChoice.TRIALS:]
    assert kept.count(False) == 1 and kept[SplitChoice.RECHECK - 1] is False   # the one re-check
    assert choice.split(3) is False and SplitChoice().split(2) is False        # another group count starts over


def test_a_step_past_the_compiled_limit_split_in_groups_gives_each_sequence_its_own_logits(session):
    """Eight sequences of three rows (24, past the compiled blocks' 16): the grouped way (each
    group compiled) gives each sequence the logits of its own pass to float32 summation order;
    one pass (the reference path past 16 rows) agrees to 1e-4 of the logit scale."""
    import numpy as np
    import torch

    from offload.batching import decode_groups
    m = session.model
    prompts = [session.tokenize(p) for p in PROMPTS + ["Hello", "x = [", "# TODO"]]
    steps = [[7 + i, 11, 13 + i] for i in range(len(prompts))]

    def states():
        out = []
        for ids in prompts:
            st = m.new_state(None)
            with torch.inference_mode():
                m.forward(torch.tensor(ids), st, logits="none")
            out.append(st)
        return out

    with torch.inference_mode():
        alone = [m.forward(torch.tensor(ids), st, logits="all")[0].numpy() for ids, st in zip(steps, states())]
        seqs = [(torch.tensor(ids), st, "all") for ids, st in zip(steps, states())]
        grouped = [r for lo, hi in decode_groups([3] * len(seqs)) for r in m.forward_batch(seqs[lo:hi])]
        seqs = [(torch.tensor(ids), st, "all") for ids, st in zip(steps, states())]
        one = m.forward_batch(seqs)
    scale = max(np.abs(a).max() for a in alone)
    for a, g, o in zip(alone, grouped, one):
        assert np.abs(g[0].numpy() - a).max() <= 1e-5 * scale
        assert np.abs(o[0].numpy() - a).max() <= 1e-4 * scale


def test_steps_past_the_compiled_limit_time_both_ways(session):
    """Eight prompts with MTP drafts of 2 (verify steps of 3 rows each: 24 rows) run their steps
    both ways; the batcher keeps the times per group count, and every prompt gets its tokens."""
    prompts = PROMPTS + ["Hello", "x = [", "# TODO"]
    out = session.generate_batch(prompts, max_tokens=24, stop_at_eos=False, n_max=2)
    assert [len(t) for t in out] == [24] * len(prompts)
    times = session._batcher.splits._times
    assert any(split for _, split in times) and any(not split for _, split in times)
