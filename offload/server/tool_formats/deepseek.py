"""DeepSeek-V3/V3.1/V4's tool calls, between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``:
each ``<｜tool▁call▁begin｜>`` then V3's ``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```
or V3.1's ``NAME<｜tool▁sep｜>ARGS``, then ``<｜tool▁call▁end｜>``."""
from __future__ import annotations

import re

from offload.server.tools import Parsed, Tool, ToolCall, arguments_json, lark_json, lark_string, object_or_none

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)
V3_BODY = re.compile(r"(.*?)\n```(?:json)?\n(.*?)\n```\s*$", re.S)


class DeepSeek:
    name = "deepseek"
    starts = (BEGIN,)

    def detect(self, template: str) -> bool:
        return "tool▁calls▁begin" in template

    def parse(self, text: str) -> Parsed:
        i = text.find(BEGIN)
        j = text.find(END, i)
        if j < 0 or text[j + len(END):].strip():
            return Parsed(text, [], malformed=True)
        body, calls, at = text[i + len(BEGIN):j], [], 0
        for m in CALL.finditer(body):
            if body[at:m.start()].strip():
                return Parsed(text, [], malformed=True)
            head, rest = m.group(1).strip(), m.group(2)
            if head == "function":                        # V3: the name and a json block follow the separator
                v3 = V3_BODY.match(rest)
                if v3 is None:
                    return Parsed(text, [], malformed=True)
                name, args = v3.group(1).strip(), v3.group(2)
            else:
                name, args = head, rest
            if object_or_none(args) is None or not name:
                return Parsed(text, [], malformed=True)
            calls.append(ToolCall(name, arguments_json(args.strip())))
            at = m.end()
        if not calls or body[at:].strip():
            return Parsed(text, [], malformed=True)
        return Parsed(text[:i].strip(), calls)

    def grammar(self, tools: list[Tool], name: str | None) -> str:
        """V3.1's form (what V3.1 and V4 templates write)."""
        alts = " | ".join(f'{lark_string(t.name)} "<｜tool▁sep｜>" args{k}' for k, t in enumerate(tools)
                          if name is None or t.name == name)
        rules = [f"args{k}: {lark_json(t.parameters)}" for k, t in enumerate(tools) if name is None or t.name == name]
        return "\n".join([f'start: {lark_string(BEGIN)} "<｜tool▁call▁begin｜>" ({alts}) "<｜tool▁call▁end｜>" '
                          f'{lark_string(END)}', *rules, ""])


FORMAT = DeepSeek()
