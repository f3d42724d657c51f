"""Tool calls: the model's tool-call syntax (one module per format in
``offload.server.tool_formats``, chosen by the chat template, else by the architecture) parsed
back into OpenAI ``tool_calls``, also while streaming (``offload.server.protocol`` checks the
request's ``tools`` and ``tool_choice``).

While streaming, text is released as content until a format's call marker begins; from there
it is held, and parsed when the choice ends: the calls go out as ``tool_calls`` deltas with
``finish_reason: "tool_calls"``. A call the model wrote malformed (it does not parse, or the
budget cut it) comes back as content with ``finish_reason: "malformed_tool_call"``.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
import re
from typing import Callable, Protocol

MALFORMED = "malformed_tool_call"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict            # JSON schema of the arguments object
    description: str = ""

    def as_openai(self) -> dict:
        """As the request gave it (what chat templates render)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str              # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall]
    malformed: bool = False


class ToolFormat(Protocol):
    """One model family's tool-call syntax."""
    name: str
    starts: tuple[str, ...]     # text that begins a call (content before it is released)

    def detect(self, template: str) -> bool: ...     # the chat template writes this format

    def parse(self, text: str) -> Parsed: ...

    def grammar(self, tools: list[Tool], name: str | None) -> str | None: ...
        # a Lark grammar (llguidance) for one call to ``name`` (None: any of ``tools``), or None


def parse_blocks(text: str, start: str, block: re.Pattern, call: Callable[[str], ToolCall | None]) -> Parsed:
    """Content, then calls as consecutive ``block`` matches from the first ``start`` marker on,
    each body (the match's group 1) read by ``call`` (None: not a call). Anything but whitespace
    between or after the blocks, or a body that is not a call: the whole text, malformed."""
    i = text.find(start)
    calls, end = [], i
    for m in block.finditer(text, i):
        c = None if text[end:m.start()].strip() else call(m.group(1))
        if c is None:
            return Parsed(text, [], malformed=True)
        calls.append(c)
        end = m.end()
    if not calls or text[end:].strip():
        return Parsed(text, [], malformed=True)
    return Parsed(text[:i].strip(), calls)


def arguments_json(args) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def object_or_none(text: str) -> dict | None:
    try:
        v = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None
    return v if isinstance(v, dict) else None


def lark_string(s: str) -> str:
    """``s`` as a Lark string literal."""
    return json.dumps(s)


def lark_json(schema: dict) -> str:
    """An llguidance Lark rule body matching JSON valid under ``schema`` (compact)."""
    return "%json " + json.dumps(schema | {"x-guidance": {"whitespace_flexible": False}})


class ToolStream:
    """One choice's text → the content safe to emit now; ``close`` parses what was held."""

    def __init__(self, fmt: ToolFormat, known: set[str]):
        self.fmt, self.known = fmt, known
        self.pending = ""        # may be the start of a marker
        self.held: str | None = None    # from a marker on
        self.emitted = ""

    def push(self, text: str) -> str:
        if self.held is not None:
            self.held += text
            return ""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.fmt.starts) if i >= 0]
        if hits:
            i = min(hits)
            out, self.held, self.pending = self.pending[:i], self.pending[i:], ""
        else:
            hold = max((n for s in self.fmt.starts for n in range(min(len(s) - 1, len(self.pending)), 0, -1)
                        if self.pending.endswith(s[:n])), default=0)
            cut = len(self.pending) - hold
            out, self.pending = self.pending[:cut], self.pending[cut:]
        self.emitted += out
        return out

    def close(self) -> Parsed:
        """What is left: content not yet emitted, and the calls (``malformed`` when a call began
        but does not parse, or names a tool the request did not offer: then it is content)."""
        if self.held is None:
            rest, self.pending = self.pending, ""
            return Parsed(rest, [])
        parsed = self.fmt.parse(self.held)
        if parsed.malformed or any(c.name not in self.known for c in parsed.calls):
            return Parsed(self.held, [], malformed=True)
        return parsed
