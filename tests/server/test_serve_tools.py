"""Tool calls through ``offload serve`` with the official ``openai`` client: a round trip (the
model calls a tool, the tool's result goes back as a ``role: tool`` message, the model
answers), streamed and not, on the shipped model (glm4moe) with a GLM-4.5-style chat template
(``--chat-template``: tools in the system turn, calls as ``<tool_call>NAME<arg_key>…``,
results as ``<|observation|><tool_response>…``).

A tiny random model writes no tool call of its own accord, so the call is forced
(``tool_choice`` naming the tool): the format's grammar constrains decoding, so the greedy
output is a valid call by construction; its text is then parsed back like any model's. Each
format's grammar and parser are also held to each other in-process (forced greedy output of
the tiny model parses into a call with arguments that validate).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload.server.tool_formats import FORMATS, for_model
from offload.server.tools import Tool, ToolStream

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "tiny-glm4moe-mtp.gguf"
pytestmark = pytest.mark.skipif(not SHIPPED.is_file(), reason=f"{SHIPPED.name} not present")
MODEL = "tiny-glm4moe-mtp"
REQUEST_S = 120
GLM45_TEMPLATE = """[gMASK]<sop>
{%- if tools %}<|system|>
# Tools

You may call one or more functions to assist with the user query.

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}<|system|>
{{ m.content }}
{%- elif m.role == 'user' %}<|user|>
{{ m.content }}
{%- elif m.role == 'assistant' %}<|assistant|>
{{ m.content }}
{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>
{%- endfor %}
{%- elif m.role == 'tool' %}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                        "unit": {"enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCE = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.serve_process import serve_with_plan
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "glm45.jinja"
    template.write_text(GLM45_TEMPLATE)
    yield from serve_with_plan(tmp, SHIPPED, ["--chat-template", str(template), "--log-level", "warning"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=REQUEST_S, max_retries=0)


def test_the_template_picks_the_glm45_format(server):
    meta = httpx.get(f"{server}/v1/models").json()["data"][0]["meta"]
    assert meta["tool_format"] == "glm45"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(client, stream):
    kw = dict(model=MODEL, tools=TOOLS, temperature=0, max_tokens=60)
    if stream:
        chunks = list(client.chat.completions.create(messages=ASK, tool_choice=FORCE, stream=True, **kw))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["tool_calls"] and len(calls) >= 1
        call = calls[0]
        assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
        name, arguments, call_id = call.function.name, call.function.arguments, call.id
    else:
        r = client.chat.completions.create(messages=ASK, tool_choice=FORCE, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        call = choice.message.tool_calls[0]
        name, arguments, call_id = call.function.name, call.function.arguments, call.id
    assert name == "get_weather"
    args = json.loads(arguments)
    assert isinstance(args, dict) and isinstance(args["city"], str)
    print(f"call ({'streamed' if stream else 'whole'}): {name}({arguments})")
    # the tool's result goes back; the model answers (tool_choice auto: it may write text)
    turn2 = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"temp_c": 21, "sky": "clear"})}]
    if stream:
        chunks = list(client.chat.completions.create(messages=turn2, stream=True, **kw))
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
    else:
        r2 = client.chat.completions.create(messages=turn2, **kw)
        answer, finish = r2.choices[0].message.content, r2.choices[0].finish_reason
        assert r2.usage.prompt_tokens > 20
    assert finish in ("stop", "length") and answer
    print(f"answer: {answer!r}")


def test_a_call_cut_short_is_text_marked_malformed(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=FORCE, temperature=0,
                                       max_tokens=10)
    choice = r.choices[0]
    assert choice.finish_reason == "malformed_tool_call" and not choice.message.tool_calls
    assert choice.message.content.startswith("<tool_call>")


def test_tool_choice_required_calls_one_of_the_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       temperature=0.8, seed=3, max_tokens=60)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time") and "city" in json.loads(call.function.arguments)


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rockets"}}}, "tool_choice",
     "launch_rockets"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "none, auto, required"),
    ({"tool_choice": "required"}, "tool_choice", "no 'tools'"),
    ({"tools": "get_weather"}, "tools", "list"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0]", "name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "twice"),
    ({"tools": TOOLS, "tool_choice": FORCE, "response_format": {"type": "json_object"}}, "response_format", "both"),
]


@pytest.mark.parametrize("extra,param,word", BAD, ids=range(len(BAD)))
def test_bad_tools_are_400s_naming_the_field(server, extra, param, word):
    r = httpx.post(f"{server}/v1/chat/completions", json={"messages": ASK} | extra, timeout=REQUEST_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and word in err["message"], err


# -- every format, in process: forced greedy output parses back ----------------------------

@pytest.fixture(scope="module")
def session():
    import offload.runtime as rt
    with rt.load(SHIPPED, devices="CPU=16GiB", quiet=True) as s:
        yield s


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
@pytest.mark.parametrize("forced", ["get_time", None])
def test_each_format_forced_output_parses_back(session, fmt, forced):
    jsonschema = pytest.importorskip("jsonschema")
    from offload.server.constrain import Vocabulary, lark_grammar
    tools = [Tool(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]
    vocab = Vocabulary(session.tokenizer)
    grammar = lark_grammar(fmt.grammar(tools, forced))
    vocab.check(grammar)
    ids = session.tokenize("Call a tool:\n")
    eos = session.tokenizer.eos_ids
    out = list(session.generate(ids, max_tokens=120, temperature=0.0, n_max=2, guide=vocab.guide(grammar)))
    assert out[-1] in eos, session.detokenize(out)
    text = session.tokenizer.decode([t for t in out if t not in eos], special=True)
    stream = ToolStream(fmt, {t.name for t in tools})
    assert stream.push(text) == ""            # all of it is the call
    parsed = stream.close()
    assert not parsed.malformed and len(parsed.calls) == 1, text
    call = parsed.calls[0]
    assert forced is None or call.name == forced
    tool = next(t for t in tools if t.name == call.name)
    args = json.loads(call.arguments)
    if fmt.name == "glm45":                    # values are text unless they parse as JSON
        args = {k: v if isinstance(v, str) else json.dumps(v) for k, v in args.items()}
    jsonschema.validate(args, tool.parameters)


def test_the_format_follows_the_template_else_the_architecture():
    assert for_model(GLM45_TEMPLATE, "qwen3moe").name == "glm45"
    assert for_model("{{ '<tool_call>' }}", "glm4moe").name == "hermes"
    assert for_model("{{ '<｜tool▁calls▁begin｜>' }}", None).name == "deepseek"
    assert for_model("<|channel|>", None).name == "harmony"
    assert for_model("{{ messages }}", "deepseek2").name == "deepseek"
    assert for_model("{{ messages }}", "llama") is None
