"""``offload serve`` as agents and evaluation harnesses call it: logprobs (chat and
completions, ``echo`` for the prompt's), ``n`` choices and ``seed``, structured output
(``response_format``), and lm-eval's ``local-completions`` model, through the official
``openai`` client against a real server process (the shipped model, MTP drafting with n_max 2
and batched verify, so every reported logprob comes from a verify pass and every constrained
token was drafted under the constraint too). Tool calls: ``test_serve_tools.py``.

Logprobs are held to a direct forward in this process (``Session.logits``: one fresh batch
over prompt + generated tokens) within 1e-5. Server and reference both run with an f32 KV
cache (plan ``--cache-type f32``) and float prefill activations (``--prefill-activations
float``); then the two differ only in batch shapes (the server's rows come from 1-3 token
verify batches over the cache, the reference's from one batch over the whole sequence), i.e.
in float32 summation order: measured at most 6e-6 on this model (logits of magnitude ~10,
rounding a few 1e-7 per op). With the defaults — an f16 cache and int8-quantized prefill
activations — batch shape alone moves these logprobs by 1e-3 (the cache's rounding) to 2e-2
(int8 activations): that is the runtime's precision, which logprobs report faithfully, but it
would hide the mistakes this test is for (the drafter's row instead of the target's, a position
off by one, a missed temperature: each moves a logprob by 1e-2 or more).
"""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from offload.sampling import Penalties, SamplingDefaults
from offload.server.logprobs import log_softmax

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
pytestmark = pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present")
MODEL = "tiny-glm4moe-mtp"
REQUEST_S = 120
TOL = 1e-5
CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function that reads a config file."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.serve_process import serve_with_plan
    yield from serve_with_plan(tmp_path_factory.mktemp("serve"), SHIPPED,
                               ["--prefill-activations", "float", "--log-level", "warning"],
                               plan_flags=("--cache-type", "f32"))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_S, max_retries=0)


@pytest.fixture(scope="module")
def session():
    import offload.runtime as rt
    with rt.load(SHIPPED, devices="CPU=16GiB", cache_type="f32", int8_prefill=False, quiet=True) as s:
        yield s


def chat_ids(session) -> list[int]:
    from offload.chat_template import ChatTemplate
    return ChatTemplate.for_model(session.meta, session.tokenizer).encode(CHAT, session.tokenizer)


def direct(session, ids: list[int]) -> np.ndarray:
    """log_softmax of one fresh forward over ``ids``: row i is the distribution of token i+1."""
    return np.stack([log_softmax(row) for row in session.logits(ids)])


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 7)])
def test_chat_logprobs_equal_a_direct_forward(client, session, temperature, seed):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=temperature,
                                       seed=seed, logprobs=True, top_logprobs=5,
                                       extra_body={"cache_prompt": False, "ignore_eos": True})
    ids = chat_ids(session)
    # the same tokens as the runtime's own generation (same sampler: the server's defaults for
    # the fields the request leaves out; same seed)
    sampling = SamplingDefaults().of(SimpleNamespace(temperature=temperature))
    gen = list(session.generate(ids, max_tokens=16, seed=seed, n_max=2, stop_at_eos=False, **sampling))
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [session.tokenizer.piece(t) for t in gen]
    lp = direct(session, ids + gen)
    worst = 0.0
    for j, (c, tok) in enumerate(zip(content, gen)):
        row = lp[len(ids) - 1 + j]
        worst = max(worst, abs(c.logprob - row[tok]))
        top = np.argsort(-row, kind="stable")[:5]
        assert len(c.top_logprobs) == 5
        for t, want in zip(c.top_logprobs, top):
            worst = max(worst, abs(t.logprob - row[want]))
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        if temperature == 0:
            assert c.top_logprobs[0].token == c.token
    assert worst < TOL, worst
    print(f"chat temperature {temperature}: worst |logprob - direct| = {worst:.2e}")


def test_echo_logprobs_score_the_prompt(client, session):
    """lm-eval's ``local-completions`` loglikelihood request: token ids, echo, logprobs 1, max_tokens 1."""
    ids = session.tokenize("import os\n\ndef read_config(path):\n    with open(path) as f:")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:len(ids)] == [session.tokenizer.piece(t) for t in ids]
    assert r.choices[0].text.startswith(session.detokenize(ids))
    rows = direct(session, ids)
    want = [rows[i - 1][ids[i]] for i in range(1, len(ids))] + [rows[-1].max()]     # greedy next token
    got = lp.token_logprobs[1:]
    assert np.max(np.abs(np.array(got) - np.array(want))) < TOL
    for i in range(1, len(ids)):
        (tok, top), = lp.top_logprobs[i].items()
        assert abs(top - rows[i - 1].max()) < TOL
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    text = r.choices[0].text                  # each token's text sits at its offset (BOS adds none)
    assert all(text[o:].startswith(t) for o, t in zip(lp.text_offset[1:], lp.tokens[1:]))
    # the same through a stream: the echoed prompt and its logprobs come first
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_n_choices_are_independent_and_seeded(client, server):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw, n=4, seed=11)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and len(set(texts)) > 1
    assert r.usage.completion_tokens == 4 * 12
    assert [c.message.content for c in client.chat.completions.create(**kw, n=4, seed=11).choices] == texts
    assert client.chat.completions.create(**kw, seed=11).choices[0].message.content == texts[0]
    chunks = list(client.chat.completions.create(**kw, n=4, seed=11, stream=True))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
                for i in range(4)]
    assert streamed == texts
    finals = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks
              if c.choices and c.choices[0].finish_reason]
    assert finals == [(i, "length") for i in range(4)]
    # completions too, with logprobs per choice
    d = httpx.post(f"{server}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 5, "n": 3, "seed": 2,
                                                      "logprobs": 0, "ignore_eos": True},
                   timeout=REQUEST_S).json()
    assert [len(c["logprobs"]["tokens"]) for c in d["choices"]] == [5, 5, 5]
    assert d["usage"]["completion_tokens"] == 15 and d["timings"]["predicted_n"] == 15


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                         "role": {"enum": ["admin", "user"]}}}


def test_json_schema_output_always_parses_and_validates(client):
    """50 sampled requests (temperature 1, MTP drafting under the constraint): every output is
    JSON that validates against the schema, and ends there (finish_reason stop)."""
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    costs, drafted = [], 0
    for seed in range(50):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}],
                                           max_tokens=200, temperature=1.0, seed=seed, response_format=fmt)
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), PERSON)
        assert r.choices[0].finish_reason == "stop", text
        t = r.model_extra["timings"]
        costs.append(t["constrain_per_token_ms"])
        drafted += t["draft_n"]
    assert drafted > 0                       # the drafter ran under the constraint
    print(f"constrained decoding: median {np.median(costs):.3f} ms per token (masking and advancing, drafts included)")


def test_json_object_output_is_an_object(client):
    for seed in range(5):
        r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, temperature=0.7, seed=seed,
                                           response_format={"type": "json_object"}, extra_body={"n_max": 0})
        text = r.choices[0].message.content
        assert text.startswith("{")
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


BAD = [
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "frob"}}}}, "response_format", "cannot be compiled"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/nowhere"}}}}, "response_format", "cannot be compiled"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format",
     "json_schema"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "<= 20"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "'logprobs': true"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", ">= 0"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs", "boolean"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo", "/v1/completions"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 17}, "n", "<= 16"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n", ">= 1"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "<= 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs", "integer"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo", "boolean"),
]


@pytest.mark.parametrize("path,body,param,word", BAD, ids=range(len(BAD)))
def test_bad_logprobs_and_n_are_400s_naming_the_field(server, path, body, param, word):
    r = httpx.post(f"{server}{path}", json=body, timeout=REQUEST_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err


LM_EVAL_TASKS = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval"


def test_lm_eval_local_completions_runs_to_a_score(server, session, tmp_path, monkeypatch):
    """lm-eval's ``local-completions`` model scores a local multiple-choice task through
    echo + logprobs (no network: the task's data is a JSONL file beside it, the tokenizer the
    GGUF's written as tokenizer.json)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    tok = tmp_path / "tokenizer"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(session.tokenizer.to_json())
    (tok / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(LM_EVAL_TASKS)          # the task's data_files are relative to it
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{server}/v1/completions", "model": MODEL, "tokenizer": str(tok),
                    "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1},
        tasks=["tiny_python"], task_manager=TaskManager(include_path=str(LM_EVAL_TASKS)))
    from lm_eval.utils import make_table
    print(make_table(out))
    res = out["results"]["tiny_python"]
    assert 0.0 <= res["acc,none"] <= 1.0 and 0.0 <= res["acc_norm,none"] <= 1.0
    assert out["n-samples"]["tiny_python"]["effective"] == 8


def test_drafting_under_a_constraint_keeps_greedy_output(session):
    """The drafter drafts within the constraint (its logits masked on a fork of the matcher):
    greedy output with drafting is token-identical to greedy output without."""
    from offload.server.constrain import Vocabulary, json_grammar
    vocab = Vocabulary(session.tokenizer)
    ids = chat_ids(session)
    outs = []
    for n_max in (0, 1, 3):
        guide = vocab.guide(json_grammar(PERSON))
        outs.append(list(session.generate(ids, max_tokens=80, temperature=0.0, n_max=n_max, guide=guide)))
    assert outs[0] == outs[1] == outs[2]
    assert session.tokenizer.eos_ids & {outs[0][-1]}
    pytest.importorskip("jsonschema").validate(json.loads(session.detokenize(outs[0])), PERSON)


def test_penalties_and_min_p_are_the_librarys(client, session):
    """(The server drafts with n_max 2, so the library does here too.) A request's llama.cpp
    sampling fields reach the sampler: greedy with a repeat and a
    presence penalty gives the library's penalised generation (which differs from plain
    greedy on this looping model), and min-p with a seed gives the library's draw."""
    ids = chat_ids(session)
    kw = dict(model=MODEL, messages=CHAT, max_tokens=24)
    extra = {"cache_prompt": False, "ignore_eos": True}
    pen = Penalties(repeat=1.5, presence=0.5)
    r = client.chat.completions.create(**kw, temperature=0, presence_penalty=0.5,
                                       extra_body={**extra, "repeat_penalty": 1.5})
    want = session.detokenize(session.generate(ids, max_tokens=24, n_max=2, stop_at_eos=False, penalties=pen))
    plain = session.detokenize(session.generate(ids, max_tokens=24, n_max=2, stop_at_eos=False))
    assert r.choices[0].message.content == want != plain
    r = client.chat.completions.create(**kw, temperature=1.0, seed=3,
                                       extra_body={**extra, "min_p": 0.2})
    sampling = SamplingDefaults().of(SimpleNamespace(min_p=0.2, temperature=1.0))
    want = session.detokenize(session.generate(ids, max_tokens=24, n_max=2, stop_at_eos=False, seed=3, **sampling))
    assert r.choices[0].message.content == want
