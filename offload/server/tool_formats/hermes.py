"""Qwen3's (Hermes) tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
one block per call, content before them."""
from __future__ import annotations

import re

from offload.server.tools import Parsed, Tool, ToolCall, arguments_json, lark_json, object_or_none

BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class Hermes:
    name = "hermes"
    starts = ("<tool_call>",)

    def detect(self, template: str) -> bool:
        return "<tool_call>" in template

    def parse(self, text: str) -> Parsed:
        i = text.find("<tool_call>")
        calls, end = [], i
        for m in BLOCK.finditer(text, i):
            if text[end:m.start()].strip():
                return Parsed(text, [], malformed=True)
            obj = object_or_none(m.group(1))
            args = obj.get("arguments", {}) if obj is not None else None
            if obj is None or not isinstance(obj.get("name"), str) or not isinstance(args, (dict, str)):
                return Parsed(text, [], malformed=True)
            calls.append(ToolCall(obj["name"], arguments_json(args)))
            end = m.end()
        if not calls or text[end:].strip():
            return Parsed(text, [], malformed=True)
        return Parsed(text[:i].strip(), calls)

    def grammar(self, tools: list[Tool], name: str | None) -> str:
        schema = {"oneOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                             "properties": {"name": {"const": t.name}, "arguments": t.parameters}}
                            for t in tools if name is None or t.name == name]}
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {lark_json(schema)}\n'


FORMAT = Hermes()
