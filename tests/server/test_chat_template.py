"""Chat templates render as transformers renders them (its ``render_jinja_template`` is the
reference), the shipped default template, where the template comes from, and the two ways
rendering can fail (the template rejects the messages / the template is broken)."""
from __future__ import annotations

import pytest
from gguf import Keys

from offload.chat_template import ChatTemplate, ChatTemplateError, TemplateRaised
from offload.errors import OffloadError

# ChatML, as many Hub models write it (whitespace control, loop variables, tojson, raise_exception)
CHATML = """{%- if messages[0]['role'] == 'system' %}{%- set offset = 1 %}{%- else %}{%- set offset = 0 %}{%- endif %}
{{- bos_token }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == offset) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
# block tags on their own lines (trim_blocks / lstrip_blocks decide the output), loopcontrols,
# tojson without HTML escaping, and tools/documents defined as None
BLOCKS = """{% for m in messages %}
  {% if m.role == 'system' %}
    {% continue %}
  {% endif %}
  [{{ m.role }}] {{ m.content | tojson }}
  {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{% if tools is none and documents is none %}no tools{% endif %}
{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}"""

CHATS = [
    [{"role": "user", "content": "hi <b>&</b> ü"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": " q1 "},
     {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2\nline"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}, {"role": "user", "content": "e"}],
]


@pytest.mark.parametrize("source", [CHATML, BLOCKS], ids=["chatml", "blocks"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers_does(source, add_generation_prompt):
    render_jinja_template = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    ours = ChatTemplate(source, origin="test", bos_token="<s>", eos_token="</s>")
    for chat in CHATS:
        want, _ = render_jinja_template([chat], chat_template=source, add_generation_prompt=add_generation_prompt,
                                        bos_token="<s>", eos_token="</s>")
        assert ours.render(chat, add_generation_prompt=add_generation_prompt) == want[0]


def test_raise_exception_and_broken_templates():
    t = ChatTemplate(CHATML, origin="test")
    with pytest.raises(TemplateRaised, match="roles must alternate"):
        t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    broken = ChatTemplate("{{ messages[0].content.nope() }}", origin="broken.jinja")
    with pytest.raises(ChatTemplateError, match=r"broken.jinja.*UndefinedError"):
        broken.render([{"role": "user", "content": "a"}])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", origin="evil.jinja")
    with pytest.raises(ChatTemplateError, match="evil.jinja"):
        sandboxed.render([{"role": "user", "content": "a"}])
    with pytest.raises(OffloadError, match=r"chat template \(bad.jinja\) line 1"):
        ChatTemplate("{% for %}", origin="bad.jinja")


class _Tok:
    """Just what ``for_model``/``encode`` use of offload.tokenizer.Tokenizer."""
    bos_id, eos_ids, add_bos = 1, frozenset({2}), True

    def token_text(self, i):
        return {1: "<s>", 2: "</s>"}[i]

    def encode(self, text, *, add_bos=True):
        return ([1] if add_bos and self.add_bos else []) + [ord(c) for c in text]


def test_source_order_default_and_bos(tmp_path):
    tok = _Tok()
    default = ChatTemplate.for_model({}, tok)
    assert "default" in default.origin
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert default.render(chat) == "<s>system:\ns\nuser:\nu\nassistant:\n"
    # the template writes BOS itself: no second one from the tokenizer
    assert default.encode(chat, tok) == [ord(c) for c in "<s>system:\ns\nuser:\nu\nassistant:\n"]
    # an answer sent back renders as the generation prompt + the answer (the prompt cache's prefix)
    answered = chat + [{"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
    assert default.render(answered).startswith(default.render(chat) + "a\n")
    gguf = ChatTemplate.for_model({Keys.Tokenizer.CHAT_TEMPLATE: "{{ messages[0].content }}"}, tok)
    assert gguf.render(chat) == "s" and "GGUF" in gguf.origin
    assert gguf.encode(chat, tok) == [1, ord("s")]            # no BOS in the text: the tokenizer's
    path = tmp_path / "t.jinja"
    path.write_text("{{ eos_token }}")
    from_file = ChatTemplate.for_model({Keys.Tokenizer.CHAT_TEMPLATE: "x"}, tok, str(path))
    assert from_file.render(chat) == "</s>" and from_file.origin == str(path)
    with pytest.raises(OffloadError, match="cannot read --chat-template"):
        ChatTemplate.for_model({}, tok, str(tmp_path / "missing.jinja"))
