"""A plan as llama.cpp flags (``offload plan --emit llama.cpp``).

The flags give llama.cpp the same tensor→device map: ``-dev`` lists the plan's GPUs in
order, ``-ngl``/``-ts`` reproduce the layer layout (the planner stores ``-ts`` as whole slot
counts, so llama.cpp's float32 split points fall exactly where ours do), and every rule becomes
one ``-ot pattern=DEVICE`` in the plan's order (llama.cpp tries them in order, first match
wins). A separate draft model gets ``-md``, ``-devd``/``-ngld`` and ``-otd``. Context, ubatch and
the KV cache type come along because they decide the memory the plan was sized for.
"""
from __future__ import annotations

import shlex

from placement.devices import CPU
from placement.draft import NGRAM_SIZE
from placement.memory import FLOAT_CACHE_TYPES, cache_type
from placement.plan import Plan

DEFAULT_UBATCH = 512
# The --spec-type llama.cpp needs to draft with a separate GGUF of these architectures' MTP
# block (deepseek4's sidecar: ``-md mtp.gguf --spec-type draft-mtp``, llama.cpp PR #25784).
DRAFT_SPEC_TYPE = {"deepseek4": "draft-mtp", "dflash": "draft-dspark"}


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def llama_cpp_args(plan: Plan, draft_arch: str | None = None) -> list[str]:
    """argv (without the program name) for llama-server / llama-cli; ``draft_arch``: the
    ``--draft`` GGUF's architecture (``DRAFT_SPEC_TYPE``)."""
    s, layout = plan.settings, plan.placement.layout
    # llama-server divides -c among its -np slots; here each sequence has the whole context
    args = ["-m", plan.model_path, "-c", str(s.ctx * s.parallel)] + (["-np", str(s.parallel)] if s.parallel > 1 else [])
    if s.ubatch != DEFAULT_UBATCH:
        args += ["-ub", str(s.ubatch)]
    if s.cache_type != "f16":
        args += ["-ctk", s.cache_type]
    if s.v_type != "f16":
        args += ["-ctv", s.v_type]
    if cache_type(s.v_type) not in FLOAT_CACHE_TYPES:
        args += ["-fa", "on"]               # llama.cpp needs flash attention for a quantized V cache
    if layout.gpus:
        args += ["-dev", ",".join(layout.gpus), "-ngl", str(layout.n_gpu_layers),
                 "-ts", ",".join(_number(x) for x in layout.tensor_split)]
    else:
        args += ["-ngl", "0"]
    for rule in plan.placement.rules:
        args += ["-ot", rule.text]
    if plan.draft_path is not None:
        args += ["-md", plan.draft_path]
        if draft_arch in DRAFT_SPEC_TYPE:
            args += ["--spec-type", DRAFT_SPEC_TYPE[draft_arch]]
        if plan.placement.draft_device == CPU:
            args += ["-ngld", "0"]
        else:
            args += ["-devd", plan.placement.draft_device, "-ngld", "999"]
        for rule in plan.placement.draft_rules:
            args += ["-otd", rule.text]
    spec = plan.speculative
    if spec is not None and spec.type == "ngram" and spec.n_max:
        # llama.cpp's nearest kind: a fixed-length lookup (offload falls back to shorter
        # matches) whose m-gram is the draft; the lookup length is offload's longest
        args += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM_SIZE),
                 "--spec-ngram-simple-size-m", str(spec.n_max)]
    return args


def format_args(args: list[str]) -> str:
    """One shell-quoted line."""
    return shlex.join(args)
