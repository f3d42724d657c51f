"""GLM-4.5's tool calls: ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n…</tool_call>``
(a value is JSON when it parses as JSON, else a string)."""
from __future__ import annotations

import json
import re

from offload.server.tools import Parsed, Tool, ToolCall, lark_json, lark_string, parse_blocks

BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _call(body: str) -> ToolCall | None:
    """``NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>…`` → the call, or None."""
    name, _, rest = body.partition("<arg_key>")
    name = name.strip()
    rest = "<arg_key>" + rest if _ else ""
    args, at = {}, 0
    for a in ARG.finditer(rest):
        if a.start() != at:
            return None
        args[a.group(1).strip()] = _value(a.group(2))
        at = a.end()
    if not name or rest[at:].strip() or "\n" in name:
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class GLM45:
    name = "glm45"
    starts = ("<tool_call>",)

    def detect(self, template: str) -> bool:
        return "<arg_key>" in template

    def parse(self, text: str) -> Parsed:
        return parse_blocks(text, "<tool_call>", BLOCK, _call)

    def grammar(self, tools: list[Tool], name: str | None) -> str:
        """Each call: its name, then its required arguments in order; a string argument as
        text without '<' or a newline (up to its maxLength), any other as JSON of its schema."""
        rules, alts = [], []
        for k, t in enumerate(tools):
            if name is not None and t.name != name:
                continue
            props = t.parameters.get("properties", {})
            args = []
            for j, p in enumerate(t.parameters.get("required", [])):
                schema = props.get(p, {})
                if schema.get("type") == "string" and not {"enum", "const", "pattern", "format"} & set(schema):
                    n = schema.get("maxLength")
                    rules.append(f"value{k}_{j}: /[^<\\n]{{1,{n}}}/" if n else f"value{k}_{j}: /[^<\\n]+/")
                else:
                    rules.append(f"value{k}_{j}: {lark_json(schema)}")
                args.append(f'"<arg_key>" {lark_string(p)} "</arg_key>\\n<arg_value>" value{k}_{j} "</arg_value>\\n"')
            alts.append(f'{lark_string(t.name)} "\\n" {" ".join(args)}')
        return "\n".join([f'start: "<tool_call>" ({" | ".join(alts)}) "</tool_call>"', *rules, ""])


FORMAT = GLM45()
