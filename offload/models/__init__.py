"""One module per architecture; the module name is the registry key (``general.architecture``,
with "-" spelled "_": ``gpt-oss`` is ``gpt_oss``).

Each module provides ``config_from_gguf(spec, metadata) -> ModelConfig`` and
``build(config, weights, ctx, draft=None) -> CausalLM`` (``draft``: the WeightStore of a
``--draft`` file whose NextN block replaces the model's own as the draft head).
"""
from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from offload.errors import OffloadError

_NOT_ARCHITECTURES = {"shared"}   # what the architecture files share


def supported() -> list[str]:
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(__path__)
                  if m.name not in _NOT_ARCHITECTURES and not m.name.startswith("_"))


def architecture(name: str) -> ModuleType:
    if name not in supported():
        raise OffloadError(f"unsupported architecture {name!r} (supported: {', '.join(supported())})")
    return importlib.import_module(f"{__name__}.{name.replace('-', '_')}")
