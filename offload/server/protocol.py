"""The OpenAI wire format: request bodies checked field by field into a ``Request``, errors
as ``{"error": {"message", "type", "param", "code"}}``, and the response / stream-chunk
objects (with llama-server's ``timings``).

Fields this server does not know are ignored (clients send many); fields it knows but
cannot honour (``functions``, ``best_of``, ``suffix``) are refused, never silently dropped.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from offload.online_n_max import POLICIES
from offload.server.tools import Tool, ToolCall, arguments_json
from offload.server.logprobs import (MAX_TOP_LOGPROBS, Pieces, TokenLogprob, chat_content,
                                     completion_logprobs)

ROLES = ("system", "developer", "user", "assistant", "tool")
# fields that ask for what this server does not do → the values that ask for nothing
UNSUPPORTED = {"functions": (None, []), "best_of": (None, 1), "suffix": (None, "")}
MAX_N = 16                     # choices per request (generated one after another)


class APIError(Exception):
    """An error answered as an OpenAI-style body with this HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def server_busy(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="server_busy")


@dataclass(frozen=True)
class ResponseFormat:
    """``response_format`` asking for JSON: ``schema`` None = any JSON object (json_object)."""
    kind: str                                  # "json_object" | "json_schema"
    schema: dict | None = None


@dataclass
class Request:
    """One generation request, checked. ``messages`` (chat) or ``prompt`` (text or token ids)."""
    endpoint: str                              # "chat" | "completion"
    model: str | None = None
    messages: list[dict] | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None              # None: up to the context
    # sampling: None = the server's default (offload serve's flags, llama.cpp's defaults)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None        # llama-server's fields
    repeat_last_n: int | None = None
    presence_penalty: float | None = None      # OpenAI's
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    n_max: int | str | None = None             # offload: draft length for this request, or "auto" / "bandit"
    cache_prompt: bool = True                  # llama-server's: reuse the previous prompt's KV
    ignore_eos: bool = False                   # llama-server's: generate past end-of-sequence
    n: int = 1                                 # independent choices
    logprobs: int | None = None                # None: none; k: each token's logprob and the top k
    echo: bool = False                         # completions: the prompt (and its logprobs) first
    response_format: ResponseFormat | None = None   # JSON output by constrained decoding
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "none"                  # "none" | "auto" | "required" | the name of a tool to call


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Body:
    """Typed reads of a JSON object's fields; a wrong type is a 400 naming the field."""

    def __init__(self, body):
        if not isinstance(body, dict):
            raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        self.body = body

    def get(self, name, kind: str, check, default=None):
        """The field's value, or ``default`` when absent or null (as OpenAI's API treats null)."""
        value = self.body.get(name)
        if value is None:
            return default
        if not check(value):
            raise APIError(400, f"'{name}' must be {kind}, got {value!r:.80}", param=name)
        return value

    def int(self, name, *, minimum=None, default=None):
        v = self.get(name, "an integer", _is_int, default)
        if v is not None and minimum is not None and v < minimum:
            raise APIError(400, f"'{name}' must be >= {minimum}, got {v}", param=name)
        return v

    def number(self, name, lo, hi, default, *, lo_open=False):
        v = self.get(name, "a number", _is_number, default)
        if v < lo or (lo_open and v == lo) or v > hi:
            raise APIError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", param=name)
        return float(v)

    def optional_number(self, name, lo, hi, *, lo_open=False):
        """``number`` whose absence is None (the server's default applies)."""
        return None if self.body.get(name) is None else self.number(name, lo, hi, None, lo_open=lo_open)

    def bool(self, name, default):
        return self.get(name, "a boolean", lambda v: isinstance(v, bool), default)


def _stop(body: _Body) -> list[str]:
    stop = body.body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(400, f"'stop' must be a non-empty string or a list of them, got {stop!r:.80}", param="stop")
    return list(stops)


def _logprobs(body: _Body, endpoint: str) -> int | None:
    """Chat: ``logprobs`` (bool) and ``top_logprobs`` (0..20); completions: ``logprobs`` (0..20)."""
    if endpoint == "chat":
        on = body.bool("logprobs", False)
        k = body.int("top_logprobs", minimum=0)
        name = "top_logprobs"
        if k and not on:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        k = (k or 0) if on else None
    else:
        name = "logprobs"
        k = body.int("logprobs", minimum=0)
    if k is not None and k > MAX_TOP_LOGPROBS:
        raise APIError(400, f"'{name}' must be <= {MAX_TOP_LOGPROBS}, got {k}", param=name)
    return k


def _response_format(body: _Body) -> ResponseFormat | None:
    """``{"type": "text"}``, ``{"type": "json_object"}`` (llama-server's optional ``schema``
    beside it) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``."""
    rf = body.get("response_format", "an object", lambda v: isinstance(v, dict))
    if rf is None or rf.get("type") == "text":
        return None
    kind = rf.get("type")
    if kind == "json_object":
        schema = rf.get("schema")
    elif kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(400, "'response_format.json_schema' must be an object with a 'schema'",
                           param="response_format")
        schema = spec.get("schema", {})
    else:
        raise APIError(400, f"'response_format.type' must be text, json_object or json_schema, got {kind!r:.40}",
                       param="response_format")
    if schema is not None and not isinstance(schema, dict):
        raise APIError(400, f"'response_format' schema must be a JSON object, got {schema!r:.40}",
                       param="response_format")
    return ResponseFormat(kind, schema)


def _common(body: _Body, endpoint: str) -> Request:
    n = body.int("n", minimum=1, default=1)
    if n > MAX_N:
        raise APIError(400, f"'n' must be <= {MAX_N}, got {n}", param="n")
    if endpoint == "chat" and body.body.get("echo") not in (None, False):
        raise APIError(400, "'echo' is for /v1/completions", param="echo")
    for name, harmless in UNSUPPORTED.items():
        if body.body.get(name) not in harmless:
            raise APIError(400, f"'{name}' is not supported by offload serve", param=name)
    max_tokens = body.int("max_tokens", minimum=1)
    if endpoint == "chat" and max_tokens is None:
        max_tokens = body.int("max_completion_tokens", minimum=1)
    options = body.get("stream_options", "an object", lambda v: isinstance(v, dict), {})
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise APIError(400, "'stream_options.include_usage' must be a boolean", param="stream_options")
    return Request(
        endpoint=endpoint,
        model=body.get("model", "a string", lambda v: isinstance(v, str)),
        max_tokens=max_tokens,
        temperature=body.optional_number("temperature", 0.0, 2.0),
        top_p=body.optional_number("top_p", 0.0, 1.0, lo_open=True),
        top_k=body.int("top_k", minimum=0),
        min_p=body.optional_number("min_p", 0.0, 1.0),
        repeat_penalty=body.optional_number("repeat_penalty", 0.0, 10.0, lo_open=True),
        repeat_last_n=body.int("repeat_last_n", minimum=-1),
        presence_penalty=body.optional_number("presence_penalty", -2.0, 2.0),
        frequency_penalty=body.optional_number("frequency_penalty", -2.0, 2.0),
        seed=body.int("seed", minimum=0),
        stop=_stop(body),
        stream=body.bool("stream", False),
        include_usage=include_usage,
        n_max=body.body["n_max"] if body.body.get("n_max") in POLICIES else body.int("n_max", minimum=0),
        cache_prompt=body.bool("cache_prompt", True),
        ignore_eos=body.bool("ignore_eos", False),
        n=n,
        logprobs=_logprobs(body, endpoint),
        echo=body.bool("echo", False),
        response_format=_response_format(body),
    )


def _content(message: dict, i: int) -> str:
    """A message's content as text: a string, null (an assistant turn with no text), or a
    list of ``{"type": "text", "text": ...}`` parts."""
    content = message.get("content")
    if content is None:
        if message["role"] == "assistant":
            return ""
        raise APIError(400, f"messages[{i}].content is missing", param=f"messages[{i}].content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"messages[{i}].content: only text parts are supported, got {kind!r}",
                               param=f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                   param=f"messages[{i}].content")


def check_tools(raw) -> list[Tool]:
    """``tools``: a list of ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
    if not isinstance(raw, list):
        raise APIError(400, "'tools' must be a list of tools", param="tools")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}",
                           param=f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object",
                           param=f"tools[{i}].function.parameters")
        tools.append(Tool(fn["name"], params, fn.get("description") or ""))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "'tools' names the same function twice", param="tools")
    return tools


def check_tool_choice(raw, tools: list[Tool]) -> str | None:
    """``tool_choice`` → "none" | "auto" | "required" | a tool's name (that call is forced)."""
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto", "required"):
        if raw == "required" and not tools:
            raise APIError(400, "'tool_choice' is required but no 'tools' are given", param="tool_choice")
        return raw
    name = raw.get("function", {}).get("name") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(name, str):
        raise APIError(400, "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}", param="tool_choice")
    if name not in {t.name for t in tools}:
        raise APIError(400, f"'tool_choice' names {name!r}, which is not in 'tools'", param="tool_choice")
    return name


def _tool_calls(calls, i: int) -> list[dict]:
    """An assistant turn's ``tool_calls``, checked (``function.arguments`` as sent: JSON text)."""
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise APIError(400, f"{param} must be a list", param=param)
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"{param}: each call needs function.name", param=param)
        args = fn.get("arguments", "{}")
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments_json(args)}})
    return out


def parse_chat(raw) -> Request:
    body = _Body(raw)
    messages = body.body.get("messages")
    if not isinstance(messages, list):
        raise APIError(400, "'messages' must be a list of messages", param="messages")
    if not messages:
        raise APIError(400, "'messages' must not be empty", param="messages")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}].role {role!r} is not one of {', '.join(ROLES)}",
                           param=f"messages[{i}].role")
        out = {"role": role, "content": _content(m, i)}
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls"):
            out["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            out["tool_call_id"] = m["tool_call_id"]
        checked.append(out)
    request = _common(body, "chat")
    request.messages = checked
    request.tools = check_tools(body.body["tools"]) if body.body.get("tools") else []
    request.tool_choice = check_tool_choice(body.body.get("tool_choice"), request.tools)
    return request


def parse_completion(raw) -> Request:
    body = _Body(raw)
    prompt = body.body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                     # a batch of one
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        pass                                   # token ids
    elif not isinstance(prompt, str):
        raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt per request)",
                       param="prompt")
    if prompt == "":
        raise APIError(400, "'prompt' must not be empty", param="prompt")
    request = _common(body, "completion")
    if body.body.get("tools"):
        raise APIError(400, "'tools' is for /v1/chat/completions", param="tools")
    request.prompt = prompt
    return request


# -- responses ------------------------------------------------------------------------

def new_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


@dataclass
class Piece:
    """Text of choice ``index`` as it comes out, with the logprobs of the tokens it completes."""
    index: int
    text: str
    logprobs: list[TokenLogprob]
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Choice:
    """One whole choice, collected from its pieces."""
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.logprobs += piece.logprobs
        self.tool_calls += piece.tool_calls


@dataclass
class Result:
    """What a finished request reports (its choices' finish reasons came before)."""
    prompt_tokens: int
    completion_tokens: int
    timings: dict

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.timings.get("cache_n", 0)}}


class Responder:
    """Builds the objects one request answers with (ids and timestamps shared by its chunks)."""

    def __init__(self, request: Request, model: str, pieces: Pieces):
        self.request, self.model, self.pieces = request, model, pieces
        self.id, self.created = new_id(request.endpoint), int(time.time())
        self.chat = request.endpoint == "chat"
        self.offsets: dict[int, int] = {}         # completions: text so far per choice (text_offset)

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, index: int, text: str, entries: list[TokenLogprob]) -> dict | None:
        if self.request.logprobs is None:
            return None
        if self.chat:
            return {"content": chat_content(entries, self.pieces), "refusal": None}
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(text)
        return completion_logprobs(entries, self.pieces, offset)

    def response(self, choices: list[Choice], result: Result) -> dict:
        out = []
        for c in choices:
            logprobs = self._logprobs(c.index, c.text, c.logprobs)
            if self.chat:
                message = {"role": "assistant", "content": c.text}
                if c.tool_calls:
                    message = {"role": "assistant", "content": c.text or None,
                               "tool_calls": [t.as_dict() for t in c.tool_calls]}
                out.append({"index": c.index, "message": message, "finish_reason": c.finish_reason,
                            "logprobs": logprobs})
            else:
                out.append({"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                            "logprobs": logprobs})
        obj = "chat.completion" if self.chat else "text_completion"
        return self._envelope(obj, out) | {"usage": result.usage(), "timings": result.timings}

    def role_chunk(self, index: int) -> dict:
        return self._envelope("chat.completion.chunk", [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                         "finish_reason": None, "logprobs": None}])

    def chunk(self, piece: Piece) -> dict:
        logprobs = self._logprobs(piece.index, piece.text, piece.logprobs)
        if self.chat:
            delta = {"content": piece.text} if piece.text else {}
            if piece.tool_calls:
                delta["tool_calls"] = [{"index": k} | t.as_dict() for k, t in enumerate(piece.tool_calls)]
            return self._envelope("chat.completion.chunk", [{"index": piece.index, "delta": delta,
                                                             "finish_reason": None, "logprobs": logprobs}])
        return self._envelope("text_completion", [{"index": piece.index, "text": piece.text,
                                                   "finish_reason": None, "logprobs": logprobs}])

    def finish_chunk(self, index: int, finish_reason: str) -> dict:
        if self.chat:
            choice = {"index": index, "delta": {}, "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope("text_completion", [{"index": index, "text": "", "finish_reason": finish_reason,
                                                   "logprobs": None}])

    def usage_chunk(self, result: Result) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", []) | {
            "usage": result.usage(), "timings": result.timings}
