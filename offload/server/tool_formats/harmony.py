"""gpt-oss's harmony channels: messages ``<|channel|>NAME[ to=functions.TOOL][ <|constrain|>json]<|message|>TEXT``
ended by ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the next ``<|start|>assistant`` after an
ending). A message to ``functions.TOOL`` is a call (its text the arguments); the ``final``
channel is the content; ``analysis`` (reasoning) is dropped from it."""
from __future__ import annotations

import re

from offload.server.tools import Parsed, Tool, ToolCall, arguments_json, lark_json, lark_string, object_or_none

MESSAGE = re.compile(r"(?:<\|start\|>assistant)?<\|channel\|>(\w+)(.*?)<\|message\|>(.*?)"
                     r"(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)
RECIPIENT = re.compile(r"\s*to=functions\.([\w.-]+)\s*(?:<\|constrain\|>\s*\w+)?\s*$")


class Harmony:
    name = "harmony"
    starts = ("<|channel|>", "<|start|>")

    def detect(self, template: str) -> bool:
        return "<|channel|>" in template

    def parse(self, text: str) -> Parsed:
        content, calls, at = [], [], 0
        for m in MESSAGE.finditer(text):
            if text[at:m.start()].strip():
                return Parsed(text, [], malformed=True)
            channel, header, body = m.group(1), m.group(2), m.group(3)
            to = RECIPIENT.match(header) if header.strip() else None
            if header.strip() and to is None:
                return Parsed(text, [], malformed=True)
            if to is not None:
                if object_or_none(body) is None:
                    return Parsed(text, [], malformed=True)
                calls.append(ToolCall(to.group(1), arguments_json(body.strip())))
            elif channel == "final":
                content.append(body)
            at = m.end()
        if text[at:].strip():
            return Parsed(text, [], malformed=True)
        return Parsed("".join(content), calls)

    def grammar(self, tools: list[Tool], name: str | None) -> str:
        alts = " | ".join(f'{lark_string(" to=functions." + t.name + " <|constrain|>json<|message|>")} args{k}'
                          for k, t in enumerate(tools) if name is None or t.name == name)
        rules = [f"args{k}: {lark_json(t.parameters)}" for k, t in enumerate(tools) if name is None or t.name == name]
        return "\n".join([f'start: "<|channel|>commentary" ({alts}) "<|call|>"', *rules, ""])


FORMAT = Harmony()
