"""The hybrid MoE layer: router on the layer's device → top-k → routed experts wherever
the plan put them (+ the shared expert) → sum.

CPU-resident experts run in a worker thread through cpu_kernels (GIL released) while the
main thread runs the shared expert in torch; the two results meet at the end.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
import torch.nn.functional as F

from gpu.experts import group_by_expert
from offload.cpu_ops import CpuExperts, to_host
from offload.profile import Profile


Stage = Callable[[int], Callable[[torch.Tensor], torch.Tensor]]   # expert e → its projection


class StagedExperts:
    """Experts whose gate/up/down tensors sit on different devices (e.g. ``-ot`` moved only
    ``ffn_down_exps`` to the CPU): each stage runs where its tensor lives, looping over the
    touched experts (never over tokens). A stage maps an expert index to that expert's
    projection (a view of the stacked tensor, raw on the CPU or on a torch device)."""

    def __init__(self, *, down: Stage, gate: Stage | None = None, up: Stage | None = None,
                 gate_up: Stage | None = None):
        self.gate, self.up, self.gate_up, self.down = gate, up, gate_up, down

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tok, w, runs = group_by_expert(ids, weights)
        xs = x[tok]
        ys = torch.empty_like(xs)
        for e, s, n in runs:
            xe = xs[s:s + n]
            if self.gate_up is not None:
                g, u = self.gate_up(e)(xe).chunk(2, dim=-1)
            else:
                g, u = self.gate(e)(xe), self.up(e)(xe)
            ys[s:s + n] = self.down(e)(F.silu(g) * u)
        out = torch.zeros_like(x)
        out.index_add_(0, tok, ys * w[:, None])
        return out


class MoE:
    def __init__(self, *, router: Callable, experts, shared: Callable | None,
                 pool: ThreadPoolExecutor, profile: Profile):
        self.router, self.experts, self.shared = router, experts, shared
        self.pool, self.profile = pool, profile

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, n_embd) normalised input on the layer's device → (T, n_embd)."""
        ids, w = self.router(x)                                   # (T, k) each
        if isinstance(self.experts, CpuExperts):
            with self.profile.time("transfer"):
                xh, ih, wh = to_host(x), ids.cpu().numpy(), to_host(w)
            job = self.pool.submit(self.experts, xh, ih, wh)     # runs while torch works below
            y = self.shared(x) if self.shared is not None else torch.zeros_like(x)
            with self.profile.time("cpu_wait"):
                routed = job.result()
            with self.profile.time("transfer"):
                return y + torch.from_numpy(routed).to(x.device)
        y = self.experts(x, ids, w)
        if self.shared is not None:
            y = y + self.shared(x)
        return y
