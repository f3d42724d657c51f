"""The hybrid MoE layer: router on the layer's device → top-k → routed experts wherever
the plan put them (+ the shared expert) → sum.

CPU-resident experts run in a worker thread through cpu_kernels (GIL released) while the
main thread runs the shared expert on a GPU; the two results meet at the end. When the
shared expert computes on the CPU too (all-CPU plans, ``--virtual-gpus``, or there is none)
nothing would overlap — both share the same cores — so the experts run inline on the main
thread: the hand-off (a thread wake-up per layer and token, worst on a loaded machine) costs
more than it hides (measured with ``bench.runtime_decode`` on the shipped model).

Decode and verify batches (up to ``placement.limits.DECODE_TOKENS`` tokens, SiLU experts without
biases, float activations) hand the CPU side over through a ``RoutedHandoff`` bound on the
layer's first such call: host buffers (pinned on CUDA) and one compiled call for grouping,
gate·up, down and the weighted sum. Larger batches and the other cases keep ``moe_ffn``.
``OFFLOAD_HANDOFF=reference`` (or ``MoE.compiled_handoff = False``) keeps ``moe_ffn`` always.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from gpu.experts import group_by_expert
from gpu.ffn import silu_glu
from offload.cpu_ops import CpuExperts, RoutedHandoff, to_host
from offload.profile import Profile
from placement.limits import DECODE_TOKENS


HANDOFF_ENV = "OFFLOAD_HANDOFF"    # "reference": moe_ffn for every batch (the old hand-off)

Stage = Callable[[int], Callable[[torch.Tensor], torch.Tensor]]   # expert e → its projection


class StagedExperts:
    """Experts whose gate/up/down tensors sit on different devices (e.g. ``-ot`` moved only
    ``ffn_down_exps`` to the CPU): each stage runs where its tensor lives, looping over the
    touched experts (never over tokens). A stage maps an expert index to that expert's
    projection (a view of the stacked tensor, raw on the CPU or on a torch device)."""

    def __init__(self, *, down: Stage, gate: Stage | None = None, up: Stage | None = None,
                 gate_up: Stage | None = None, glu: Callable = silu_glu):
        self.gate, self.up, self.gate_up, self.down = gate, up, gate_up, down
        self.glu = glu              # (g, u) → h: the experts' gated activation (gpu.ffn.glu)

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
            ys[s:s + n] = self.down(e)(self.glu(g, u))
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
        self.compiled_handoff = os.environ.get(HANDOFF_ENV, "compiled").lower() != "reference"
        self._handoff: RoutedHandoff | None | bool = False     # False: not bound yet
        # the worker thread pays off only when the shared expert (or a hot expert) runs on a GPU meanwhile
        self.overlap = (shared is not None and runs_off_cpu(shared)) or any(
            h.device.type != "cpu" for h in self.hot)

    def _bound_handoff(self, x: torch.Tensor, ids: torch.Tensor) -> RoutedHandoff | None:
        """The compiled hand-off when it takes this batch (bound on the first decode-sized
        call: the layer learns its device from x), else None (``moe_ffn``)."""
        if not self.compiled_handoff:
            return None
        if self._handoff is False:
            if x.shape[0] > DECODE_TOKENS:
                return None
            with torch.inference_mode(False):     # plain tensors: usable in and out of inference mode
                self._handoff = self.experts.handoff(x.device, ids.shape[1], self.owned, DECODE_TOKENS)
        fast = self._handoff
        return fast if fast is not None and fast.takes(x, ids) else None

    def _gpu_side(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The shared expert and the hot experts: what runs in torch beside the CPU experts."""
        y = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        for h in self.hot:
            y = y + h(x, ids, w)
        return y

    def __call__(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, n_embd) normalised input on the layer's device → (T, n_embd). ``tokens``
        (T,): the token ids, for a router that routes by them (DeepSeek-V4's hash blocks)."""
        ids, w = self.router(x) if tokens is None else self.router(x, tokens)     # (T, k) each
        if self.stream is not None and x.shape[0] >= self.stream_min:
            with self.profile.time("op_offload"):                # the CPU experts, streamed to a GPU
                return self._gpu_side(x, ids, w) + self.stream(x, ids, w).to(x.device)
        if isinstance(self.experts, CpuExperts):
            fast = self._bound_handoff(x, ids)
            with self.profile.time("transfer"):
                if fast is not None:
                    run, args = fast.run, (fast.load(x, ids, w),)
                else:
                    run, args = self.experts, (to_host(x), ids.cpu().numpy(), to_host(w), self.owned)
            if self.overlap:
                job = self.pool.submit(run, *args)      # runs while torch works below
                y = self._gpu_side(x, ids, w)
                with self.profile.time("cpu_wait"):
                    routed = job.result()
            else:                       # inline: the main thread waits for all of it
                with self.profile.time("cpu_wait"):
                    routed = run(*args)
                y = self._gpu_side(x, ids, w)
            with self.profile.time("transfer"):
                if fast is None:
                    return y + torch.from_numpy(routed).to(x.device)
                return y + routed.to(x.device, non_blocking=True)   # pinned → device, stream-ordered
        y = self.experts(x, ids, w)
        if self.shared is not None:
            y = y + self.shared(x)
        return y
