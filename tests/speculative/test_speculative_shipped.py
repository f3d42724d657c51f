"""Speculative decoding on the shipped model (models/tiny-glm4moe-mtp.gguf) with its real
NextN head:

- exact verify: greedy output with drafting == plain greedy, token for token;
- n_max = 0 is plain decoding (checked against an independent one-token loop, greedy and
  seeded sampling) and never touches the head;
- the target itself as the draft head is accepted at every position (greedy and sampling);
- after generation every cache (trunk and head) equals a fresh run over the kept tokens;
- a separate ``--draft`` GGUF holding only the NextN block drafts exactly as the in-model one;
- the n-gram drafter with exact verify is plain greedy too, at every n_max 1-5;
- ``offload run`` / ``offload bench`` flags, stats and bad input.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import offload.runtime as rt
from offload.bench_tasks import TASKS
from offload.sampling import Sampler
from offload.speculative import SpecOptions, generate_step
from offload.stats import RunStats
from tests.nextn_split import split_nextn

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
pytestmark = pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present")
PROMPTS = [TASKS["code"], TASKS["story"], "import os\nimport sys\n\n\ndef main(argv):\n    "]


@pytest.fixture(scope="module")
def session():
    with rt.load(SHIPPED, devices="CPU=16GiB", quiet=True) as s:
        yield s


def plain_loop(model, ids, n, sampler):
    """Plain decoding written out independently: prompt in one pass, then one token per pass."""
    with torch.inference_mode():
        state = model.new_state()
        logits, _ = model.forward(torch.tensor(ids), state, logits="last")
        out = [sampler(logits[-1].numpy())]
        while len(out) < n:
            logits, _ = model.forward(torch.tensor(out[-1:]), state, logits="last")
            out.append(sampler(logits[-1].numpy()))
    return out


def test_exact_verify_greedy_equals_plain_greedy(session):
    for prompt in PROMPTS:
        plain = list(session.generate(prompt, max_tokens=48, stop_at_eos=False))
        for n_max, p_min in ((1, 0.0), (2, 0.0), (4, 0.0), (3, 0.3)):
            got = list(session.generate(prompt, max_tokens=48, stop_at_eos=False, n_max=n_max, p_min=p_min,
                                        verify="exact"))
            assert got == plain, (prompt, n_max, p_min)
            st = session.stats
            assert st.drafted > 0 and 0 < st.accepted <= st.drafted
            assert len(st.acceptance_per_position) <= n_max
            assert st.mean_accepted_length == pytest.approx(1 + st.accepted / st.n_steps)


def test_n_max_0_is_plain_decoding(session):
    ids = session.tokenize(PROMPTS[0])
    for temperature, seed in ((0.0, None), (0.9, 11)):
        want = plain_loop(session.model, ids, 24, Sampler(temperature=temperature, top_k=40, seed=seed))
        got = list(session.generate(ids, max_tokens=24, stop_at_eos=False, temperature=temperature, top_k=40,
                                    seed=seed, n_max=0))
        assert got == want
        st = session.stats
        assert st.drafted == 0 and st.n_eval == 23 and st.draft_s == 0.0 and st.spec == {}


class TargetAsHead:
    """A stand-in draft head that is the target itself: its "cache" is a trunk state that
    holds x_0 .. x_{t+1} once it has t+1 entries; on the pair (h_t, x_{t+1}) it runs x_{t+1}
    through the trunk, one token at a time, and returns the target's own logits for x_{t+2}.
    (The trunk state's hidden input is ignored.)"""

    def __init__(self, model, first_token: int):
        self.model, self.first = model, first_token

    def new_cache(self):
        return _TrunkCache(self.model, self.first)

    def __call__(self, tokens, hidden, positions, cache, *, logits="all"):
        rows, hs = [], []
        for tok in tokens.tolist():
            z, h = self.model.forward(torch.tensor([tok]), cache.state, logits="last")
            rows.append(z)
            hs.append(h)
        z = torch.cat(rows)
        return (z if logits == "all" else z[-1:] if logits == "last" else None), torch.cat(hs)


class _TrunkCache:
    def __init__(self, model, first: int):
        self.state = model.new_state(head=None)
        with torch.inference_mode():
            model.forward(torch.tensor([first]), self.state, logits="none")

    @property
    def length(self) -> int:
        return self.state.n_past - 1

    def truncate(self, n: int) -> None:
        self.state.truncate(n + 1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_target_as_its_own_draft_is_accepted_everywhere(session, temperature):
    """With one-token passes everywhere (prompt ubatch 1, exact verify) the stand-in sees
    bit-identical logits, so every draft is accepted: greedy (same argmax) and sampling
    (q = p, so min(1, p/q) = 1)."""
    ids = session.tokenize(PROMPTS[2])
    got = list(session.generate(ids, max_tokens=30, stop_at_eos=False, temperature=temperature, seed=3,
                                n_max=3, verify="exact", ubatch=1, head=TargetAsHead(session.model, ids[0])))
    st = session.stats
    assert st.acceptance_per_position == [1.0, 1.0, 1.0] and st.drafted == st.accepted > 0
    assert st.mean_accepted_length == pytest.approx(4.0, abs=0.5)   # the last step is budget-capped
    if temperature == 0.0:
        assert got == list(session.generate(ids, max_tokens=30, stop_at_eos=False))


def test_ngram_exact_verify_greedy_equals_plain_greedy(session):
    """The n-gram drafter at every n_max 1-5 with exact verify: the greedy text is plain
    decoding's; the shipped model's greedy output loops, so drafts are made and accepted."""
    drafted = 0
    for prompt in PROMPTS:
        plain = list(session.generate(prompt, max_tokens=48, stop_at_eos=False))
        for n_max in (1, 2, 3, 4, 5):
            got = list(session.generate(prompt, max_tokens=48, stop_at_eos=False, n_max=n_max,
                                        spec_type="ngram", verify="exact"))
            assert got == plain, (prompt, n_max)
            st = session.stats
            assert st.spec["type"] == "ngram" and st.accepted <= st.drafted
            assert st.mean_accepted_length == pytest.approx(1 + st.accepted / st.n_steps)
            drafted += st.drafted
    assert drafted > 0


def _kv(cache):
    return cache.k[:, :cache.length], cache.v[:, :cache.length]


@pytest.mark.parametrize("verify", ["exact", "batched"])
def test_rollback_leaves_caches_as_a_fresh_run(session, verify):
    """After a run (and after stopping a run early) the trunk cache holds the prompt and the
    yielded tokens but the last, the head cache the pairs (h_t, x_{t+1}) of a prefix of them,
    each equal to a fresh computation: bit for bit where the fresh run repeats the same pass
    shapes (exact verify: prompt pass + one-token passes), else within batch-shape rounding:
    max |diff| <= 2e-3 of the largest entry — float32 sums in another order differ ~1e-6
    relative, which can move an entry of the f16 cache by one f16 step (2^-10 relative at
    most); a stale or misplaced entry differs by O(1)."""
    m = session.model
    ids = session.tokenize(PROMPTS[0])
    for stop in (40, 7):
        state = m.new_state()
        gen = generate_step(m, ids, state=state, sampler=Sampler(), head=m.nextn,
                            options=SpecOptions(n_max=3, verify=verify), max_tokens=40, stats=RunStats())
        out = [t for _, t in zip(range(stop), gen)]
        gen.close()
        seq = ids + out[:-1]
        assert state.n_past == len(seq)
        n_head = state.nextn_cache.length
        assert len(seq) - 5 <= n_head <= len(seq)
        with torch.inference_mode():
            fresh = m.new_state()
            _, h0 = m.forward(torch.tensor(ids), fresh, logits="none")
            hs = [h0] + [m.forward(torch.tensor([t]), fresh, logits="none")[1] for t in seq[len(ids):]]
            h = torch.cat(hs)
            head_cache = m.nextn.new_cache()
            m.nextn(torch.tensor(seq[1:n_head + 1]), h[:n_head], torch.arange(1, n_head + 1), head_cache)
        for got, want in zip(state.caches + [state.nextn_cache], fresh.caches + [head_cache]):
            for a, b in zip(_kv(got), _kv(want)):
                assert a.shape == b.shape
                if verify == "exact" and got is not state.nextn_cache:
                    assert torch.equal(a, b)
                else:
                    assert (a.float() - b.float()).abs().max() <= 2e-3 * b.float().abs().max()


def test_multi_device_plan_drafts_and_verifies(session):
    """Trunk blocks on two (CPU-backed) GPUs, some experts on the CPU, the head on CUDA1:
    exact verify still equals that placement's plain greedy output, and the head's cache
    lives on the head's device."""
    prompt = PROMPTS[2]
    with rt.load(SHIPPED, devices="CUDA0=8GiB,CUDA1=8GiB,CPU=8GiB", tensor_split="1,1", n_cpu_moe=2,
                 virtual_gpus=True, quiet=True) as s:
        assert s.model.nextn.block.device_name == "CUDA1"
        plain = list(s.generate(prompt, max_tokens=32, stop_at_eos=False))
        exact = list(s.generate(prompt, max_tokens=32, stop_at_eos=False, n_max=3, verify="exact"))
        assert exact == plain and s.stats.accepted > 0
        list(s.generate(prompt, max_tokens=32, stop_at_eos=False, n_max=3))
        assert s.stats.accepted > 0 and s.stats.memory["kv"]["CUDA1"] > 0


@pytest.fixture(scope="module")
def split_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("nextn_split")
    trunk, draft = d / "trunk.gguf", d / "mtp-only.gguf"
    assert split_nextn(SHIPPED, trunk, draft) == 4
    return trunk, draft


def test_separate_draft_gguf_drafts_like_the_in_model_head(session, split_files):
    trunk, draft = split_files
    with rt.load(trunk, devices="CPU=16GiB", draft=str(draft), quiet=True) as s:
        assert s.plan.drafting == "--draft" and s.model.nextn is not None
        assert all(name.startswith("blk.4.") for name in s.plan.draft_tensors)
        for prompt in PROMPTS[:2]:
            got = list(s.generate(prompt, max_tokens=40, stop_at_eos=False, n_max=3))
            want = list(session.generate(prompt, max_tokens=40, stop_at_eos=False, n_max=3))
            assert got == want
            assert (s.stats.drafted, s.stats.accepted_per_position) == \
                (session.stats.drafted, session.stats.accepted_per_position)


# -- the CLI ---------------------------------------------------------------------------

def cli(capsys, *args):
    from offload.cli import main
    rc = main([*map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_run_speculative_flags_stats_and_plan_default(capsys, tmp_path, session):
    stats = tmp_path / "stats.json"
    rc, out, err = cli(capsys, "run", SHIPPED, "--devices", "CPU=16GiB", "-p", PROMPTS[2], "-n", "30",
                       "--ignore-eos", "--temp", "0", "--spec-n-max", "2", "--spec-diagnose", "--stats-json", stats)
    assert rc == 0, err
    d = json.loads(stats.read_text())
    assert d["drafted"] > 0 and len(d["acceptance_per_position"]) == 2 and d["tokens_per_second"] > 0
    assert d["mean_accepted_length"] == pytest.approx(1 + d["accepted"] / d["n_steps"])
    assert d["spec"] == {"type": "mtp", "n_max": 2, "p_min": 0.0, "verify": "batched"}
    assert [r["batch"] for r in d["drift"]["rows"]][:4] == [2, 3, 4, 5] and d["drift"]["min_top2_margin"] > 0
    assert "draft acceptance" in err and "n_max 2 (from --spec-n-max)" in err and "verify drift" in err
    assert out == session.detokenize(session.generate(PROMPTS[2], max_tokens=30, stop_at_eos=False, n_max=2)) + "\n"
    # no speculative section in an on-the-fly plan: plain decoding, said on stderr
    rc, _, err = cli(capsys, "run", SHIPPED, "--devices", "CPU=16GiB", "-n", "4")
    assert rc == 0 and "speculative decoding off: n_max 0 (the plan has no speculative section" in err
    # a plan file's speculative.n_max is the default; --spec-type none overrides it
    plan = tmp_path / "plan.yaml"
    assert cli(capsys, "plan", SHIPPED, "--devices", "CPU=16GiB", "-o", plan)[0] == 0
    import yaml
    doc = yaml.safe_load(plan.read_text())
    doc["speculative"]["n_max"] = 2
    plan.write_text(yaml.safe_dump(doc))
    rc, _, err = cli(capsys, "run", "--placement", plan, "-n", "12", "--ignore-eos", "--stats-json", stats)
    assert rc == 0 and "n_max 2 (from the plan's speculative.n_max" in err, err
    assert json.loads(stats.read_text())["spec"]["n_max"] == 2
    rc, _, err = cli(capsys, "run", "--placement", plan, "-n", "4", "--spec-type", "none")
    assert rc == 0 and "speculative decoding off (--spec-type none)" in err


def test_run_with_the_ngram_drafter(capsys, tmp_path):
    """``--spec-type`` in llama.cpp's spelling drafts from the context; its stats name it; the
    model's head is not needed (a NextN-less trunk drafts too)."""
    stats, trunk = tmp_path / "s.json", tmp_path / "trunk.gguf"
    rc, out, err = cli(capsys, "run", SHIPPED, "--devices", "CPU=16GiB", "-p", TASKS["extract"], "-n", "32",
                       "--ignore-eos", "--temp", "0", "--spec-type", "ngram-simple", "--stats-json", stats)
    assert rc == 0, err
    d = json.loads(stats.read_text())
    assert d["spec"] == {"type": "ngram", "n_max": 3, "p_min": 0.0, "verify": "batched", "ngram_size": 12}
    assert "ngram from the context (longest lookup 12), n_max 3 (from the default for --spec-type ngram)" in err
    assert d["drafted"] > 0
    split_nextn(SHIPPED, trunk, tmp_path / "mtp.gguf")
    rc, out, err = cli(capsys, "run", trunk, "--devices", "CPU=16GiB", "-n", "8", "--spec-type", "ngram",
                       "--spec-n-max", "2", "--spec-ngram-size-n", "4")
    assert rc == 0 and "ngram from the context (longest lookup 4), n_max 2 (from --spec-n-max)" in err, err
    rc, out, err = cli(capsys, "run", trunk, "--devices", "CPU=16GiB", "-n", "8", "--spec-type", "eagle3")
    assert rc == 2 and "--spec-type" in err and "eagle3" in err and "Traceback" not in err


def test_run_with_a_separate_draft_file(capsys, split_files, tmp_path):
    trunk, draft = split_files
    stats = tmp_path / "s.json"
    rc, _, err = cli(capsys, "run", trunk, "--draft", draft, "--devices", "CPU=16GiB", "-n", "16",
                     "--spec-n-max", "2", "--stats-json", stats)
    assert rc == 0, err
    assert f"the NextN head of {draft}" in err and json.loads(stats.read_text())["drafted"] > 0
    # a plan file remembers the draft and its model: `run --placement` needs neither again
    plan = tmp_path / "plan.yaml"
    assert cli(capsys, "plan", trunk, "--draft", draft, "--devices", "CPU=16GiB", "-o", plan)[0] == 0
    rc, _, err = cli(capsys, "run", "--placement", plan, "-n", "8", "--spec-n-max", "2")
    assert rc == 0 and f"the NextN head of {draft}" in err, err


def test_speculative_bad_input_is_one_line_and_status_2(capsys, split_files, tmp_path):
    trunk, _ = split_files
    never = tmp_path / "never.json"
    cases = [
        (("run", SHIPPED, "--spec-n-max", "-1"), "--spec-n-max"),
        (("run", SHIPPED, "--spec-p-min", "1.5", "--spec-n-max", "2"), "--spec-p-min"),
        (("run", SHIPPED, "--spec-verify", "lazy"), "--spec-verify"),
        (("run", trunk, "--spec-type", "mtp", "--stats-json", never), "no NextN"),
        (("run", trunk, "--spec-n-max", "2", "--stats-json", never), "no NextN"),
        (("bench", SHIPPED, "--n-max", "0", "--jsonl", never), "--n-max"),
        (("bench", SHIPPED, "--tasks", "poetry", "--jsonl", never), "poetry"),
    ]
    for args, needle in cases:
        rc, out, err = cli(capsys, *args, "--devices", "CPU=16GiB")
        lines = err.strip().splitlines()
        assert rc == 2 and lines[-1].startswith("offload: error:") and needle in lines[-1], (args, err)
        assert "Traceback" not in err and out == ""
    assert not never.exists()


def test_bench_runs_baseline_and_each_n_max_and_writes_jsonl(capsys, tmp_path):
    jsonl = tmp_path / "bench.jsonl"
    rc, out, err = cli(capsys, "bench", SHIPPED, "--devices", "CPU=16GiB", "--tasks", "code,extract",
                       "--n-max", "1,3", "--repeat", "2", "-n", "24", "--jsonl", jsonl)
    assert rc == 0, err
    recs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    runs = [r for r in recs if r["kind"] == "run"]
    sums = [r for r in recs if r["kind"] == "summary"]
    # the default drafters: the MTP head, and n-gram self-drafting
    assert len(runs) == 2 * 2 * 5 and all(r["tokens"] == 24 for r in runs)
    assert [(s["task"], s["drafter"], s["n_max"]) for s in sums] == [
        (t, d, n) for t in ("code", "extract") for d, n in ((None, 0), ("mtp", 1), ("mtp", 3), ("ngram", 1), ("ngram", 3))]
    for s in sums:
        assert s["runs"] == 2 and s["tokens_per_second_mean"] > 0
        if s["n_max"]:
            assert len(s["acceptance_per_position"]) == s["n_max"]
        if s["drafter"] == "mtp" or (s["drafter"] == "ngram" and s["task"] == "extract"):
            # the shipped model's greedy text loops within 24 tokens: the n-gram drafter finds it
            assert s["drafted"] > 0 and s["mean_accepted_length"] > 1.0
    assert "drafter mtp:" in out and "drafter ngram:" in out and "ngram n=3" in out
    assert "mtp n=3" in out and "acceptance per position" in out and "load average" in out
