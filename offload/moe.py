"""The hybrid MoE layer: router on the layer's device → top-k → routed experts wherever
the plan put them (+ the shared expert) → sum.

CPU-resident experts run in a worker thread through cpu_kernels (GIL released) while the
main thread runs the shared expert on a GPU; the two results meet at the end. When the
shared expert computes on the CPU too (all-CPU plans, ``--virtual-gpus``, or there is none)
nothing would overlap — both share the same cores — so the experts run inline on the main
thread: the hand-off (a thread wake-up per layer and token, worst on a loaded machine) costs
more than it hides (measured with ``bench.runtime_decode`` on the shipped model).
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


def runs_off_cpu(ffn) -> bool:
    """Whether any projection of ``ffn`` (a SwiGLU) computes on a non-CPU torch device."""
    return any(getattr(getattr(ffn, n, None), "device", torch.device("cpu")).type != "cpu"
               for n in ("gate", "up", "down"))


class MoE:
    """``hot`` (with CPU experts only): callables ``(x, ids, w) → (T, n_embd)`` for the hot
    experts held on GPUs (``gpu.experts.ExpertSubset``); ``owned`` the CPU kernels' mask of
    the experts they still hold, so they never read the hot ones. Both sides' sums add up."""

    def __init__(self, *, router: Callable, experts, shared: Callable | None,
                 pool: ThreadPoolExecutor, profile: Profile, hot: tuple = (), owned=None):
        self.router, self.experts, self.shared = router, experts, shared
        self.pool, self.profile = pool, profile
        self.hot, self.owned = tuple(hot), owned
        self.stream, self.stream_min = None, None     # op offload (offload.runtime sets them)
        # the worker thread pays off only when the shared expert (or a hot expert) runs on a GPU meanwhile
        self.overlap = (shared is not None and runs_off_cpu(shared)) or any(
            h.device.type != "cpu" for h in self.hot)

    def _gpu_side(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The shared expert and the hot experts: what runs in torch beside the CPU experts."""
        y = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        for h in self.hot:
            y = y + h(x, ids, w)
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, n_embd) normalised input on the layer's device → (T, n_embd)."""
        ids, w = self.router(x)                                   # (T, k) each
        if self.stream is not None and x.shape[0] >= self.stream_min:
            with self.profile.time("op_offload"):                # the CPU experts, streamed to a GPU
                return self._gpu_side(x, ids, w) + self.stream(x, ids, w).to(x.device)
        if isinstance(self.experts, CpuExperts):
            with self.profile.time("transfer"):
                xh, ih, wh = to_host(x), ids.cpu().numpy(), to_host(w)
            if self.overlap:
                job = self.pool.submit(self.experts, xh, ih, wh, self.owned)   # runs while torch works below
                y = self._gpu_side(x, ids, w)
                with self.profile.time("cpu_wait"):
                    routed = job.result()
            else:                       # inline: the main thread waits for all of it
                with self.profile.time("cpu_wait"):
                    routed = self.experts(xh, ih, wh, self.owned)
                y = self._gpu_side(x, ids, w)
            with self.profile.time("transfer"):
                return y + torch.from_numpy(routed).to(x.device)
        y = self.experts(x, ids, w)
        if self.shared is not None:
            y = y + self.shared(x)
        return y
