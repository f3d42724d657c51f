"""Tool-call formats, one module per model family; ``for_model`` picks one by what the chat
template writes, else by the architecture (``ARCH_FORMAT``)."""
from __future__ import annotations

from offload.server.tool_formats import deepseek, glm45, harmony, hermes
from offload.server.tools import ToolFormat

# most specific first: GLM-4.5 writes <tool_call> too, with <arg_key> inside
FORMATS: tuple[ToolFormat, ...] = (deepseek.FORMAT, harmony.FORMAT, glm45.FORMAT, hermes.FORMAT)
ARCH_FORMAT = {"deepseek2": deepseek.FORMAT, "deepseek4": deepseek.FORMAT, "gpt-oss": harmony.FORMAT,
               "glm4moe": glm45.FORMAT, "qwen3moe": hermes.FORMAT}


def for_model(template: str, arch: str | None) -> ToolFormat | None:
    return next((f for f in FORMATS if f.detect(template)), ARCH_FORMAT.get(arch))
