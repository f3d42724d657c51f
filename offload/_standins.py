"""TEMPORARY stand-ins for what the kernels branch provides (cpu_kernels). Deleted when those branches are merged; nothing public uses this name.
The kernel stand-ins dequantize with gguf (a copy) — they exist only so the runtime can be
exercised before the real Numba kernels land.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize


def _deq(w, qtype):
    return np.asarray(dequantize(w, qtype), dtype=np.float32)


def matmul(x, w, qtype, *, name=""):
    return (x @ _deq(w, qtype).T).astype(np.float32)


@dataclass(frozen=True)
class ExpertWeights:
    gate: np.ndarray | None
    up: np.ndarray | None
    down: np.ndarray
    gate_type: GGMLQuantizationType | None
    up_type: GGMLQuantizationType | None
    down_type: GGMLQuantizationType
    gate_up: np.ndarray | None = None
    gate_up_type: GGMLQuantizationType | None = None
    name: str = ""

    @property
    def n_expert(self):
        return self.down.shape[0]


def moe_ffn(x, expert_ids, expert_weights, w: ExpertWeights, *, owned=None, act="silu"):
    out = np.zeros_like(x, dtype=np.float32)
    for e in np.unique(expert_ids):
        if owned is not None and not owned[e]:
            continue
        tok, slot = np.nonzero(expert_ids == e)
        xe = x[tok]
        if w.gate_up is not None:
            gu = matmul(xe, w.gate_up[e], w.gate_up_type)
            g, u = np.split(gu, 2, axis=1)
        else:
            g, u = matmul(xe, w.gate[e], w.gate_type), matmul(xe, w.up[e], w.up_type)
        h = g / (1.0 + np.exp(-g)) * u
        y = matmul(h.astype(np.float32), w.down[e], w.down_type)
        np.add.at(out, tok, y * expert_weights[tok, slot][:, None])
    return out


def set_num_threads(n):
    pass
