"""An independent transcription of how llama.cpp places tensors, for checking our flags.

``-ot``/``-otd``: comma lists of PATTERN=BUFT, tried in order with std::regex_search, first
match wins. Otherwise the layer's device: ``-ngl``/``-ts`` with float32 split points
(llama_model::load_tensors); ``token_embd`` (input layer) on the CPU; ``output``/``output_norm``
in the output layer (slot n_layer). A draft model (``-md``) uses ``-otd``, then ``-devd`` when
``-ngld`` > 0, else the CPU; its input layer (a sidecar's ``token_embd``) on the CPU like any
model's (llama-model.cpp: ``dev_input = { cpu_dev, … }``, "always keep it on the CPU").
"""
from __future__ import annotations

import bisect
import re

import numpy as np


def slot_device(slot, n_layer, ngl, split, gpus):
    i_gpu_start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1) if gpus else 0
    if slot < i_gpu_start or slot - i_gpu_start >= act:
        return "CPU"
    s = np.float32(0)
    cum = []
    for x in split:
        s = np.float32(s + np.float32(x))
        cum.append(s)
    cum = [np.float32(c / s) for c in cum]
    pos = np.float32(np.float32(slot - i_gpu_start) / np.float32(act))
    return gpus[bisect.bisect_right(cum, pos)]


def _overrides(values):
    rules = []
    for value in values:
        for item in value.split(","):
            pattern, _, buft = item.partition("=")
            rules.append((re.compile(pattern), buft))
    return rules


def apply_flags(argv, tensor_names, n_layer, draft_names=()):
    """argv as emitted (no program name) → ({name: device}, {draft name: device})."""
    opts: dict[str, list[str]] = {}
    it = iter(argv)
    for flag in it:
        opts.setdefault(flag, []).append(next(it))
    gpus = opts["-dev"][0].split(",") if "-dev" in opts else []
    ngl = int(opts["-ngl"][0]) if "-ngl" in opts else 0
    split = [float(x) for x in opts["-ts"][0].split(",")] if "-ts" in opts else [1.0] * len(gpus)
    rules = _overrides(opts.get("-ot", []))
    out = {}
    for name in tensor_names:
        hit = next((dev for rx, dev in rules if rx.search(name)), None)
        if hit is None:
            m = re.match(r"blk\.(\d+)\.", name)
            if m:
                hit = slot_device(int(m.group(1)), n_layer, ngl, split, gpus)
            elif name.startswith("output"):
                hit = slot_device(n_layer, n_layer, ngl, split, gpus)
            else:
                hit = "CPU"
        out[name] = hit
    draft_rules = _overrides(opts.get("-otd", []))
    draft_default = opts["-devd"][0] if "-devd" in opts and int(opts.get("-ngld", ["0"])[0]) > 0 else "CPU"
    draft = {n: next((dev for rx, dev in draft_rules if rx.search(n)),
                     draft_default if n.startswith(("blk.", "output")) else "CPU")   # input layer: CPU
             for n in draft_names}
    return out, draft
