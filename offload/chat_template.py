"""Chat templates: the GGUF's ``tokenizer.chat_template`` (or ``--chat-template FILE``, or the
shipped default for models without one) rendered with jinja2 the way transformers'
``apply_chat_template`` renders them, so a template written for the Hub renders the same here.

That means: a sandboxed environment (templates are untrusted code), ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``raise_exception(msg)`` function, a
``tojson`` filter that does not HTML-escape, ``strftime_now(fmt)``, and the variables
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools`` and
``documents`` (None unless given).
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from importlib import resources
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from gguf import Keys

from offload.errors import OffloadError

DEFAULT_TEMPLATE = "chat_default.jinja"     # in offload/templates/


class TemplateRaised(Exception):
    """The template called ``raise_exception(message)``: it rejects these messages."""


class ChatTemplateError(Exception):
    """Rendering failed for another reason (a bug in the template)."""


def _raise_exception(message):
    raise TemplateRaised(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: str, *, origin: str, bos_token: str = "", eos_token: str = ""):
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise OffloadError(f"chat template ({origin}) line {exc.lineno}: {exc.message}") from None

    @classmethod
    def for_model(cls, metadata, tokenizer, path: str | None = None) -> "ChatTemplate":
        """``path`` (``--chat-template FILE``), else the GGUF's ``tokenizer.chat_template``,
        else the shipped default; ``bos_token``/``eos_token`` are the tokenizer's."""
        if path is not None:
            try:
                source, origin = Path(path).read_text(), path
            except OSError as exc:
                raise OffloadError(f"cannot read --chat-template {path}: {exc.strerror}") from None
        elif isinstance(metadata.get(Keys.Tokenizer.CHAT_TEMPLATE), str):
            source, origin = metadata[Keys.Tokenizer.CHAT_TEMPLATE], "the GGUF's tokenizer.chat_template"
        else:
            source = resources.files("offload.templates").joinpath(DEFAULT_TEMPLATE).read_text()
            origin = f"offload's default {DEFAULT_TEMPLATE} (the GGUF has no tokenizer.chat_template)"
        eos = min(tokenizer.eos_ids) if tokenizer.eos_ids else None
        return cls(source, origin=origin, bos_token=tokenizer.token_text(tokenizer.bos_id),
                   eos_token=tokenizer.token_text(eos))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text. Raises ``TemplateRaised`` when the template rejects the messages
        (``raise_exception``), ``ChatTemplateError`` when it fails otherwise."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token,
                                         **({"tools": None, "documents": None} | extra))
        except TemplateRaised:
            raise
        except Exception as exc:          # a template is code: any failure is the template's
            raise ChatTemplateError(f"chat template ({self.origin}) failed: "
                                    f"{type(exc).__name__}: {exc}") from None

    @functools.cached_property
    def object_arguments(self) -> bool:
        """Whether the template reads a tool call's ``function.arguments`` as an object
        (GLM-4.5's iterates its items) rather than the JSON text OpenAI sends (DeepSeek-V3.1's
        concatenates it): a probe conversation rendered with an object must render without
        error and show the argument's value (llama.cpp's templates probe the same way)."""
        call = {"id": "call_probe", "type": "function",
                "function": {"name": "probe_tool", "arguments": {"probe_key": "probe_value_1729"}}}
        probe = [{"role": "user", "content": "probe"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            return "probe_value_1729" in self.render(probe, add_generation_prompt=False)
        except (TemplateRaised, ChatTemplateError):
            return False

    def encode(self, messages: list[dict], tokenizer, **extra) -> list[int]:
        """Rendered (with the generation prompt; ``extra`` as ``render`` takes it, e.g. ``tools``)
        and tokenized. A template that writes the BOS itself gets no second one (transformers
        tokenizes its output without special tokens); otherwise the tokenizer adds BOS as the
        model asks."""
        text = self.render(messages, **extra)
        return tokenizer.encode(text, add_bos=not (self.bos_token and text.startswith(self.bos_token)))
