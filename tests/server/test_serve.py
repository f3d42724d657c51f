"""``offload serve`` end to end: one real server process (``python -m offload.cli serve``) on
127.0.0.1 and a free port with the shipped model, talked to with the official ``openai``
client and with raw HTTP (httpx).

The server runs from a plan file whose ``speculative.n_max`` is 2 (MTP drafting, batched
verify), with ``--max-queue 4`` and a chat template file that behaves like the default one
but rejects ``tool`` messages (``raise_exception``) and is broken for ``developer`` messages
(an undefined call), so both kinds of template failure are exercised. Greedy answers are compared with the runtime run
in this process (same code path, same model, no prompt cache): the tokens must be equal.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest


httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
pytestmark = pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present")
MODEL = "tiny-glm4moe-mtp"
TEMPLATE = """{{ bos_token }}
{%- for message in messages %}
{% if message['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}
{% if message['role'] == 'developer' %}{{ message.content.no_such_method() }}{% endif %}
{{ message['role'] }}:
{{ message['content'] }}
{% endfor %}
{%- if add_generation_prompt %}
assistant:
{% endif %}
"""
REQUEST_S = 120        # no single request may take longer (a hang fails the test)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.serve_process import serve_with_plan
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "chat.jinja"
    template.write_text(TEMPLATE)
    # a plan file whose speculative section says n_max 2 (as offload tune writes it)
    yield from serve_with_plan(tmp, SHIPPED, ["--max-queue", "4", "--chat-template", str(template),
                                              "--log-level", "warning"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_S, max_retries=0)


@pytest.fixture(scope="module")
def session():
    import offload.runtime as rt
    with rt.load(SHIPPED, devices="CPU=16GiB", quiet=True) as s:
        yield s


def post(server, path, body, **kw):
    return httpx.post(f"{server}{path}", json=body, timeout=REQUEST_S, **kw)


def sse(lines) -> list:
    """``data:`` payloads of a server-sent event stream, ``[DONE]`` kept as a string."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def metric(server, name: str) -> float:
    text = httpx.get(f"{server}/metrics", timeout=REQUEST_S).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(f"offload_{name}") and line[len(f"offload_{name}")] in " {")


CHAT = [{"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Write a function that reads a config file."}]


def local_greedy(session, ids, n) -> str:
    return session.detokenize(session.generate(ids, max_tokens=n, n_max=2, verify="batched"))


def test_health_models_metrics(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    models = httpx.get(f"{server}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["meta"]["n_ctx"] == 512 and models["data"][0]["meta"]["n_max"] == 2
    slots = httpx.get(f"{server}/slots").json()          # one slot (no -np): its context, idle
    assert [(s["id"], s["n_ctx"], s["is_processing"]) for s in slots] == [(0, 512, False)]
    text = httpx.get(f"{server}/metrics").text
    for name in ("requests_total", "prompt_tokens_total", "tokens_predicted_total", "predicted_tokens_seconds",
                 "draft_tokens_total", "draft_tokens_accepted_total", "requests_deferred"):
        assert f"# TYPE offload_{name} " in text


def test_chat_with_the_openai_client_equals_the_runtime(client, server, session):
    from offload.chat_template import ChatTemplate
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                       extra_body={"cache_prompt": False})
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    template = ChatTemplate(TEMPLATE, origin="test", bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    ids = template.encode(CHAT, session.tokenizer)
    assert choice.message.content == local_greedy(session, ids, 12)
    assert r.usage.prompt_tokens == len(ids) and 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = r.model_extra["timings"]
    assert timings["predicted_n"] == r.usage.completion_tokens and timings["n_max"] == 2
    assert 0 <= timings["draft_n_accepted"] <= timings["draft_n"]


def test_chat_stream_with_the_openai_client(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_body={"cache_prompt": False})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_completion_raw_http_stream_and_not(server, session):
    body = {"model": MODEL, "prompt": "import os\n\ndef main(", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "cache_prompt": False}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] == "length"
    assert d["choices"][0]["text"] == session.detokenize(
        session.generate("import os\n\ndef main(", max_tokens=16, stop_at_eos=False, n_max=2))
    assert d["usage"]["completion_tokens"] == 16
    with httpx.stream("POST", f"{server}/v1/completions", json=body | {"stream": True}, timeout=REQUEST_S) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = sse(s.iter_lines())
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == d["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and "timings" in events[-2]
    # token ids as the prompt
    ids = session.tokenize("import os\n\ndef main(")
    r = post(server, "/v1/completions", body | {"prompt": ids})
    assert r.json()["choices"][0]["text"] == d["choices"][0]["text"]


def test_stop_strings_are_cut_exactly(server, client):
    body = {"model": MODEL, "prompt": "class Parser:\n    def __init__(self", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    full = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert len(full) > 30
    for start, length in ((12, 3), (20, 5), (5, 1)):
        stop = full[start:start + length]
        want = full[:full.index(stop)]
        d = post(server, "/v1/completions", body | {"stop": [stop, "never appears ~~~"]}).json()
        assert d["choices"][0]["text"] == want and d["choices"][0]["finish_reason"] == "stop", stop
        with httpx.stream("POST", f"{server}/v1/completions", json=body | {"stop": stop, "stream": True},
                          timeout=REQUEST_S) as s:
            events = sse(s.iter_lines())
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    d = post(server, "/v1/completions", body | {"stop": ["never appears ~~~"]}).json()
    assert d["choices"][0]["text"] == full and d["choices"][0]["finish_reason"] == "length"
    # through the openai client, chat
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0)
    text = r.choices[0].message.content
    if len(text) > 8:
        stop = text[4:7]
        r2 = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0, stop=[stop])
        assert r2.choices[0].message.content == text[:text.index(stop)]
        assert r2.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=1.0, top_p=0.95)
    a = [client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (1, 2, 3)]
    b = [client.chat.completions.create(**kw, seed=s).choices[0].message.content for s in (1, 2, 3)]
    assert a == b
    assert len(set(a)) > 1                 # the seed matters (fixed seeds: deterministic)
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**kw, seed=2, stream=True) if c.choices)
    assert streamed == a[1]


def test_n_max_override_and_prompt_cache(server):
    body = {"model": MODEL, "prompt": "def parse(text):\n", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/v1/completions", body | {"n_max": 0}).json()["timings"]
    assert plain["draft_n"] == 0 and plain["n_max"] == 0
    spec = post(server, "/v1/completions", body | {"n_max": 3}).json()["timings"]
    assert spec["draft_n"] > 0 and len(spec["draft_acceptance_per_position"]) <= 3
    # a conversation that grows: the second turn reuses the first turn's KV
    turn1 = [{"role": "user", "content": "Parse a config file."}]
    a = post(server, "/v1/chat/completions", {"messages": turn1, "max_tokens": 10, "temperature": 0}).json()
    turn2 = turn1 + [a["choices"][0]["message"], {"role": "user", "content": "Now write tests for it."}]
    b = post(server, "/v1/chat/completions", {"messages": turn2, "max_tokens": 10, "temperature": 0}).json()
    assert b["timings"]["cache_n"] >= a["usage"]["prompt_tokens"] - 1
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == b["timings"]["cache_n"]
    assert b["timings"]["prompt_n"] == b["usage"]["prompt_tokens"] - b["timings"]["cache_n"]
    c = post(server, "/v1/chat/completions",
             {"messages": turn2, "max_tokens": 10, "temperature": 0, "cache_prompt": False}).json()
    assert c["timings"]["cache_n"] == 0 and c["choices"][0]["message"] == b["choices"][0]["message"]


def test_twenty_concurrent_clients_each_answered_or_503(server):
    results: list = [None] * 20
    body = {"model": MODEL, "prompt": "import sys\n", "max_tokens": 24, "temperature": 0.8, "seed": 5,
            "ignore_eos": True}

    def one(i):
        t = time.perf_counter()
        try:
            r = post(server, "/v1/completions", body)
            results[i] = (r.status_code, r.json(), time.perf_counter() - t)
        except Exception as exc:              # recorded: a transport error fails the test below
            results[i] = (None, repr(exc), time.perf_counter() - t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=REQUEST_S + 10)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert time.perf_counter() - t0 < REQUEST_S
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 503}, results
    answered = [d for s, d, _ in results if s == 200]
    assert answered and all(d["usage"]["completion_tokens"] == 24 for d in answered)
    assert len({d["choices"][0]["text"] for d in answered}) == 1       # same seed, same text
    for s, d, _ in results:
        if s == 503:
            assert d["error"]["code"] == "server_busy" and "--max-queue 4" in d["error"]["message"]
    assert post(server, "/v1/completions", body).status_code == 200


def test_client_leaving_stops_its_generation(server):
    body = {"model": MODEL, "prompt": "def f():\n", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    before_cancelled, before_tokens = metric(server, "requests_cancelled_total"), metric(server, "tokens_predicted_total")
    with httpx.stream("POST", f"{server}/v1/completions", json=body | {"stream": True}, timeout=REQUEST_S) as s:
        for i, _ in enumerate(s.iter_lines()):
            if i >= 4:
                break                          # leave mid-stream: the connection closes
    deadline = time.monotonic() + 30
    while metric(server, "requests_cancelled_total") == before_cancelled:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert metric(server, "tokens_predicted_total") - before_tokens < 480
    # a client waiting for a whole answer that times out and leaves
    before_cancelled = metric(server, "requests_cancelled_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(REQUEST_S, read=0.05))
    deadline = time.monotonic() + 30
    while metric(server, "requests_cancelled_total") == before_cancelled:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    r = post(server, "/v1/completions", body | {"max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


TOO_LONG = "context_length_exceeded"
# (path, body, HTTP status, the error's param, a word of its message or its code)
BAD = [
    ("/v1/chat/completions", b'{"messages": [', 400, None, "not valid JSON"),
    ("/v1/chat/completions", b'\xff\xfe', 400, None, "not valid JSON"),
    ("/v1/chat/completions", [1, 2], 400, None, "JSON object"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages", "list"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "empty"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "wizard"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0].content", "missing"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": "10"}, 400, "max_tokens", "integer"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -5}, 400, "max_tokens", ">= 1"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature", "number"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 3}, 400, "temperature", "[0.0, 2.0]"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": "yes"}, 400, "stream", "boolean"),
    ("/v1/chat/completions", {"messages": CHAT, "min_p": 1.5}, 400, "min_p", "[0.0, 1.0]"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 3}, 400, "presence_penalty", "[-2.0, 2.0]"),
    ("/v1/chat/completions", {"messages": CHAT, "repeat_penalty": 0}, 400, "repeat_penalty", "(0.0, 10.0]"),
    ("/v1/chat/completions", {"messages": CHAT, "repeat_last_n": -2}, 400, "repeat_last_n", ">= -1"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 1.5}, 400, "seed", "integer"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": -1}, 400, "seed", ">= 0"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": [""]}, 400, "stop", "non-empty"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 17}, 400, "n", "<= 16"),
    ("/v1/chat/completions", {"messages": CHAT, "n_max": -1}, 400, "n_max", ">= 0"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]}, 400, "messages", TOO_LONG),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 500}, 400, "messages", TOO_LONG),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, 400, "messages",
     "tool messages are not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "developer", "content": "hi"}]}, 500, None, "UndefinedError"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"prompt": 7}, 400, "prompt", "string"),
    ("/v1/completions", {}, 400, "prompt", "string"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "vocabulary"),
    ("/v1/completions", {"prompt": "x " * 600}, 400, "prompt", TOO_LONG),
]


@pytest.mark.parametrize("path,body,status,param,word", BAD, ids=range(len(BAD)))
def test_bad_input_is_an_openai_error_and_the_server_keeps_serving(server, path, body, status, param, word):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server}{path}", timeout=REQUEST_S, headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    assert err["param"] == param
    assert word in err["message"] or word == err["code"], err
    assert httpx.get(f"{server}/health").status_code == 200


def test_bad_input_through_the_openai_client_and_unknown_routes(client, server):
    with pytest.raises(openai.BadRequestError, match="must not be empty"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)
    r = httpx.get(f"{server}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(f"{server}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).choices[0].message is not None
