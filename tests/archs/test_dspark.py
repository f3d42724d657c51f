"""DSpark (a ``dflash`` --draft GGUF) drafting for deepseek4 on the torch path: lossless under
exact verify at every n_max, its window rings after a run equal a fresh injection of the kept
tokens, a predictive drafter gets accepted, and bad input is one line."""
from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from offload.errors import OffloadError
from offload.sampling import Sampler
from offload.speculative import SpecOptions, generate_step, make_drafter
from tests.archs.test_deepseek4 import IDS, MTP_SPEC, load
from tests.tiny_models import write_tiny_dspark, write_tiny_model

# the MTP test's trunk (window-only, CSA and HCA blocks, 16-token window) without its head
TRUNK = replace(MTP_SPEC, nextn=False)
PROMPT = IDS[:40]
N_OUT = 16


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("dspark")
    trunk = write_tiny_model(d / "trunk.gguf", TRUNK)
    return trunk, write_tiny_dspark(d / "dspark.gguf", TRUNK)


def _load(trunk, draft):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load(trunk.path, draft=str(draft.path))


def _rings(cache) -> list[torch.Tensor]:
    """Each stage's kept window keys, by position (start..length-1)."""
    return [c.window.k[0, :c.window.length - c.window.start].float().clone() for c in cache.caches]


def test_dspark_drafting_gives_plain_greedy_tokens(pair):
    """Greedy with DSpark drafts, exact verify at n_max 1-5 and batched at 3: the plain tokens;
    blocks are drafted; after each run the drafter's rings hold exactly the injection of the
    kept tokens' taps (a fresh trunk pass + inject over them)."""
    trunk, draft = pair
    with _load(trunk, draft) as s:
        model = s.model
        assert model.dspark is not None and model.nextn is None
        plain = list(s.generate(PROMPT, max_tokens=N_OUT, stop_at_eos=False))
        for n_max, verify in [(n, "exact") for n in (1, 2, 3, 4, 5)] + [(3, "batched")]:
            out = list(s.generate(PROMPT, max_tokens=N_OUT, stop_at_eos=False, n_max=n_max, verify=verify,
                                  spec_type="dspark"))
            assert out == plain, (n_max, verify)
            assert s.stats.drafted > 0 and s.stats.spec["type"] == "dspark"
            # the same run on a state this test holds, to look at the drafter's rings after it
            with torch.inference_mode():
                state = model.new_state(model.dspark)
                options = SpecOptions(n_max=n_max, verify=verify, type="dspark")
                again = list(generate_step(model, PROMPT, state=state, sampler=Sampler(), head=model.dspark,
                                           options=options, max_tokens=N_OUT))
                assert again == plain
                kept = PROMPT + plain[:-1]
                assert state.n_past == len(kept) and state.nextn_cache.length == len(kept)
                fresh = model.dspark.new_cache()
                _, taps = model.forward(torch.tensor(kept), model.new_state(), logits="none")
                model.dspark.inject(taps, torch.arange(len(kept)), fresh)
                trunk_kv = sum(c.nbytes for c in state.caches)
                assert sum(s.memory(state)["kv"].values()) == trunk_kv + state.nextn_cache.nbytes > trunk_kv
            for got, want in zip(_rings(state.nextn_cache), _rings(fresh)):
                want = want[want.shape[0] - got.shape[0]:]       # the run's ring may have dropped old rows
                # float32, the trunk run in other batch shapes (prompt, verify steps) than one pass:
                # summation-order rounding only (~1e-6); a wrong position or a kept draft key is O(1)
                assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (n_max, verify)


def test_a_predictive_dspark_gets_its_drafts_accepted(pair, tmp_path):
    """Random drafter weights rarely agree with a random trunk, so this drafter is made
    predictive by construction: its Markov head (rank V) carries the target's own greedy
    bigrams (token a → the token plain decoding put after a) at a scale (50) that dominates
    the stages' base logits, so each draft chains the target's continuation. Drafts are
    accepted, and the output is still the plain one."""
    trunk, _ = pair
    with _load(trunk, pair[1]) as s:
        plain = list(s.generate(PROMPT, max_tokens=N_OUT, stop_at_eos=False))
    v = TRUNK.n_vocab
    w1, w2 = np.eye(v, dtype=np.float32) * 50.0, np.zeros((v, v), np.float32)
    seq = PROMPT[-1:] + plain
    for a, b in zip(seq, seq[1:]):
        w2[:, a] = 0.0
        w2[b, a] = 1.0              # bias(prev = a) = 50 at b: the last bigram seen wins
    draft = write_tiny_dspark(tmp_path / "bigram.gguf", TRUNK, markov=(w1, w2))
    with _load(trunk, draft) as s:
        out = list(s.generate(PROMPT, max_tokens=N_OUT, stop_at_eos=False, n_max=3, verify="exact",
                              spec_type="dspark"))
        stats = s.stats
    print(f"\n  predictive DSpark: {stats.accepted}/{stats.drafted} drafts accepted")
    assert out == plain
    assert stats.accepted > 0


def test_the_confidence_head_cuts_the_block(pair):
    """p_min above every confidence (conf_proj's bias 2 keeps sigmoid well under 1 - 1e-6):
    no draft is made; the output stays plain."""
    trunk, draft = pair
    with _load(trunk, draft) as s:
        plain = list(s.generate(PROMPT, max_tokens=6, stop_at_eos=False))
        out = list(s.generate(PROMPT, max_tokens=6, stop_at_eos=False, n_max=3, p_min=0.999999,
                              verify="exact", spec_type="dspark"))
        assert out == plain and s.stats.drafted == 0


def test_dspark_without_a_dspark_file_is_one_line(pair):
    """--spec-type dspark without a dflash --draft: one line from offload run before loading,
    and from Session.generate."""
    from tests.cli.test_cli_plan import offload
    trunk, _ = pair
    r = offload("run", str(trunk.path), "--spec-type", "dspark", "-n", "2", "-p", "hi", "--devices", "CPU=16GiB")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "needs a DSpark drafter" in r.stderr, r.stderr
    with load(trunk.path) as s:
        with pytest.raises(OffloadError, match="dspark") as err:
            list(s.generate(PROMPT[:8], max_tokens=2, n_max=2, spec_type="dspark"))
    assert "\n" not in str(err.value)


def test_dspark_drafts_when_sampling(pair):
    """Sampling (temperature 0.8, fixed seed) with DSpark drafts: the drafts are judged with
    the distribution each was drawn from; the run makes its tokens, drafts, and repeats
    itself under the same seed."""
    trunk, draft = pair
    with _load(trunk, draft) as s:
        runs = [list(s.generate(PROMPT, max_tokens=8, stop_at_eos=False, n_max=3, spec_type="dspark",
                                temperature=0.8, seed=3)) for _ in range(2)]
        assert len(runs[0]) == 8 and runs[0] == runs[1] and s.stats.drafted > 0


# a dflash header the builder cannot use: (write_tiny_dspark keywords, the key the line names)
BAD_HEADERS = {
    "no block size": (dict(block_size=None), "a DSpark drafter needs metadata key dflash.block_size"),
    "no mask token": (dict(mask_id=None), "a DSpark drafter needs metadata key tokenizer.ggml.mask_token_id"),
    "block size 0": (dict(block_size=0), "dflash.block_size is 0; it must be an integer >= 1"),
    "mask outside the vocabulary": (dict(mask_id=100000), "tokenizer.ggml.mask_token_id is 100000, not a token"),
    "a bonus-anchor block of 1": (dict(block_size=1, sample_from_anchor=False), "dflash.block_size is 1; it must "
                                  "be an integer >= 2 (dflash.sample_from_anchor is false"),
    "no stage key": (dict(meta_overrides=(("{arch}.hyper_connection.sinkhorn_iterations", None),)),
                     "the DSpark drafter's stages: missing metadata key dflash.hyper_connection.sinkhorn_iterations"),
    "no swiglu clamp": (dict(meta_overrides=(("{arch}.swiglu_clamp_exp", None),)),
                        "the DSpark drafter's stages: missing metadata key dflash.swiglu_clamp_exp"),
}


@pytest.mark.parametrize("case", BAD_HEADERS)
def test_a_bad_dflash_header_is_one_line_from_offload_plan(pair, tmp_path, capsys, case):
    """Each key the DSpark builder reads is checked with the header, before any weight: offload
    plan (in process, its CLI entry) exits 2 with one line naming the file and the key."""
    from offload.cli import main
    kw, needle = BAD_HEADERS[case]
    bad = write_tiny_dspark(tmp_path / "bad.gguf", TRUNK, **kw).path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["plan", str(pair[0].path), "--draft", str(bad), "--devices", "CPU=16GiB"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and f"{bad}: {needle}" in err, err


def test_a_bad_dflash_header_stops_offload_run_before_loading(pair, tmp_path):
    """offload run with a dflash --draft lacking dflash.block_size: status 2, one line (nothing
    was loaded: no progress line before it), no traceback."""
    from tests.cli.test_cli_plan import offload
    bad = write_tiny_dspark(tmp_path / "no-block.gguf", TRUNK, block_size=None).path
    r = offload("run", str(pair[0].path), "--draft", str(bad), "-n", "2", "-p", "hi", "--devices", "CPU=16GiB")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{bad}: a DSpark drafter needs metadata key dflash.block_size" in r.stderr


def test_sample_from_anchor_false_drafts_from_the_mask_rows(pair, tmp_path):
    """dflash.sample_from_anchor false (llama.cpp's bonus-anchor layout, i_draft_beg = 1): a
    draft of n is the block [x_Q, MASK × n]; its rows 1..n, the Markov chain started at row 1
    from x_Q, give the drafts, so a block of size 5 drafts at most 4. Greedy with exact verify
    at n_max 1-5 is still plain decoding's output."""
    trunk, _ = pair
    draft = write_tiny_dspark(tmp_path / "bonus.gguf", TRUNK, sample_from_anchor=False)
    with _load(trunk, draft) as s, torch.inference_mode():
        m = s.model
        head = m.dspark
        assert not head.sample_from_anchor and head.header.max_drafts == head.block_size - 1 == 4
        state = m.new_state(head)
        logits, taps = m.forward(torch.tensor(PROMPT), state)
        x_q = int(logits[-1].argmax())
        drafter = make_drafter(SpecOptions(n_max=5, type="dspark"), head, state, Sampler(), 64)
        drafter.prime(taps, PROMPT)
        got, _ = drafter.draft(x_q, len(PROMPT), 5)
        base, _ = head.block([x_q] + [head.mask_id] * 4, len(PROMPT), state.nextn_cache)
        state.nextn_cache.truncate(len(PROMPT))
        want, prev = [], x_q
        for i in range(1, 5):
            col = base[i] + head.markov(prev)[1]
            prev = int(col.argmax())
            want.append(prev)
        assert got == want and len(got) == 4
        plain = list(s.generate(PROMPT, max_tokens=N_OUT, stop_at_eos=False))
        for n_max in (1, 2, 3, 4, 5):
            out = list(s.generate(PROMPT, max_tokens=N_OUT, stop_at_eos=False, n_max=n_max, verify="exact",
                                  spec_type="dspark"))
            assert out == plain and s.stats.drafted > 0, n_max
            assert not any(s.stats.drafted_per_position[4:])       # the 5th position: never


@pytest.mark.parametrize("anchor, rows", [(None, 5), (False, 4)])
def test_offload_plan_forecasts_dspark_up_to_what_a_block_drafts(pair, tmp_path, capsys, anchor, rows):
    """The n_max table of a dflash --draft ends at the block's drafts (block_size 5; 4 with
    dflash.sample_from_anchor false), whatever --spec-max-n asks (6)."""
    import json

    from offload.cli import main
    draft = write_tiny_dspark(tmp_path / "d.gguf", TRUNK, sample_from_anchor=anchor).path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["plan", str(pair[0].path), "--draft", str(draft), "--devices", "CPU=16GiB", "--json",
                   "--spec-max-n", "6"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    spec = json.loads(out.out)["speculative"]
    assert spec["type"] == "dspark" and [r["n_max"] for r in spec["rows"]] == list(range(rows + 1))
