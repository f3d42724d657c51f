"""Each tool-call format's parser on the text its models write (calls, content beside them,
malformed and cut-short calls), the streaming split between content and held call text, and
``tools`` rendered through a chat template as transformers renders them."""
from __future__ import annotations

import json

import pytest

from offload.server.tool_formats import deepseek, glm45, harmony, hermes
from offload.server.tools import ToolStream

WEATHER = {"city": "Paris", "days": 3}
# (format, model output, content, [(name, arguments)]) — arguments compared as JSON
GOOD = [
    (hermes, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
     "Let me check.", [("get_weather", WEATHER)]),
    (hermes, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {"x": 1}}\n'
             '</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    (glm45, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
            "<arg_value>3</arg_value>\n</tool_call>", "", [("get_weather", WEATHER)]),
    (glm45, "Checking.<tool_call>now\n</tool_call>", "Checking.", [("now", {})]),
    (deepseek, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
               '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [("get_weather", WEATHER)]),
    (deepseek, 'Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 3}'
               '<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
     "Sure.", [("get_weather", WEATHER), ("now", {})]),
    (harmony, "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant<|channel|>commentary "
              'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>', "",
     [("get_weather", WEATHER)]),
    (harmony, "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 21 °C.",
     "It is 21 °C.", []),
]
BAD = [
    (hermes, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),          # cut short
    (hermes, "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),                     # not JSON
    (hermes, '<tool_call>\n{"arguments": {}}\n</tool_call>'),                             # no name
    (glm45, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"),
    (glm45, "<tool_call>get_weather\ncity=Paris\n</tool_call>"),
    (deepseek, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": <｜tool▁call▁end｜>"
               "<｜tool▁calls▁end｜>"),
    (deepseek, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}"),
    (harmony, "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{city: Paris}<|call|>"),
    (harmony, "<|channel|>commentary to=somewhere<|message|>{}<|call|>"),
]


@pytest.mark.parametrize("module,text,content,calls", GOOD, ids=range(len(GOOD)))
def test_calls_parse(module, text, content, calls):
    parsed = module.FORMAT.parse(text)
    assert not parsed.malformed and parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("module,text", BAD, ids=range(len(BAD)))
def test_malformed_calls_are_text(module, text):
    stream = ToolStream(module.FORMAT, {"get_weather"})
    stream.push(text)
    parsed = stream.close()
    assert parsed.malformed and parsed.calls == [] and text.endswith(parsed.content)


def test_stream_releases_content_until_a_marker_then_holds():
    stream = ToolStream(hermes.FORMAT, {"get_weather"})
    out = [stream.push(p) for p in ["Let me ", "check. <tool", "_call>\n{\"name\": \"get_weather\", ",
                                    "\"arguments\": {}}\n</tool_call>"]]
    assert out == ["Let me ", "check. ", "", ""]           # "<tool" is held until it is known
    parsed = stream.close()
    assert [c.name for c in parsed.calls] == ["get_weather"] and parsed.content == ""
    # a call to a tool the request did not offer is text too
    stream = ToolStream(hermes.FORMAT, {"get_time"})
    stream.push('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert stream.close().malformed
    # text that only looked like the start of a marker is released at the end
    stream = ToolStream(hermes.FORMAT, {"get_time"})
    assert stream.push("a <tool") == "a " and stream.close().content == "<tool"


def test_tools_render_as_transformers_renders_them():
    render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    from offload.chat_template import ChatTemplate
    from tests.server.test_serve_tools import ASK, GLM45_TEMPLATE, TOOLS
    chat = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"temp_c": 21}'}]
    want, _ = render_jinja_template([chat], tools=TOOLS, chat_template=GLM45_TEMPLATE, add_generation_prompt=True)
    ours = ChatTemplate(GLM45_TEMPLATE, origin="test").render(chat, tools=TOOLS)
    assert ours == want[0]
    assert "<arg_key>city</arg_key>" in ours and '"name": "get_weather"' in ours and "<tool_response>" in ours


# a DeepSeek-V3.1-style template: the call's arguments are concatenated as text
DEEPSEEK_STYLE = """{{ bos_token }}{% for m in messages %}
{%- if m.role == 'user' %}{{ '<｜User｜>' + m.content }}
{%- elif m.role == 'assistant' and m.tool_calls %}{{ '<｜Assistant｜><｜tool▁calls▁begin｜>' }}
{%- for tc in m.tool_calls %}{{ '<｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' + tc.function.arguments
    + '<｜tool▁call▁end｜>' }}{% endfor %}{{ '<｜tool▁calls▁end｜><｜end▁of▁sentence｜>' }}
{%- elif m.role == 'tool' %}{{ '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}
{%- endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"""


def test_arguments_reach_each_template_as_it_reads_them():
    """GLM-4.5's template iterates the arguments (an object), DeepSeek-V3.1's concatenates them
    (the JSON text): a probe decides which the template gets; either way the call it renders
    parses back into the same call."""
    from offload.chat_template import ChatTemplate
    from offload.server.engine import template_messages
    from offload.server.protocol import parse_chat
    from tests.server.test_serve_tools import GLM45_TEMPLATE
    body = {"messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function",
                              "function": {"name": "get_weather", "arguments": json.dumps(WEATHER)}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "21"}]}
    messages = parse_chat(body).messages
    for source, module, objects in ((GLM45_TEMPLATE, glm45, True), (DEEPSEEK_STYLE, deepseek, False)):
        template = ChatTemplate(source, origin="test")
        assert template.object_arguments is objects
        text = template.render(template_messages(messages, template))
        start = text.index(module.FORMAT.starts[0])
        end = text.index("</tool_call>") + len("</tool_call>") if module is glm45 else \
            text.index("<｜tool▁calls▁end｜>") + len("<｜tool▁calls▁end｜>")
        parsed = module.FORMAT.parse(text[start:end])
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", WEATHER)], text
