"""Qwen3's (Hermes) tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
one block per call, content before them."""
from __future__ import annotations

import re

from offload.server.tools import Parsed, Tool, ToolCall, arguments_json, lark_json, object_or_none, parse_blocks

BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _call(body: str) -> ToolCall | None:
    """``{"name": ..., "arguments": {...}}`` → the call, or None."""
    obj = object_or_none(body)
    args = obj.get("arguments", {}) if obj is not None else None
    if obj is None or not isinstance(obj.get("name"), str) or not isinstance(args, (dict, str)):
        return None
    return ToolCall(obj["name"], arguments_json(args))


class Hermes:
    name = "hermes"
    starts = ("<tool_call>",)

    def detect(self, template: str) -> bool:
        return "<tool_call>" in template

    def parse(self, text: str) -> Parsed:
        return parse_blocks(text, "<tool_call>", BLOCK, _call)

    def grammar(self, tools: list[Tool], name: str | None) -> str:
        schema = {"oneOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                             "properties": {"name": {"const": t.name}, "arguments": t.parameters}}
                            for t in tools if name is None or t.name == name]}
        return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: {lark_json(schema)}\n'


FORMAT = Hermes()
