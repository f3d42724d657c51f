"""Routed experts held as stacked torch tensors on one device (GPU-resident experts).

Assignments are sorted by expert so each touched expert's weights are read once per call
whatever the number of tokens (the same grouping as the CPU kernels); the Python loop runs
over touched experts, never over tokens × experts.
"""
from __future__ import annotations

import torch

from gpu.ffn import GLU
from gpu.quant import QuantTensor


def group_by_expert(ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor | None = None):
    """ids, weights: (T, k) → (token index, weight, expert) per assignment sorted by expert,
    and the (expert, start, count) runs as Python ints. ``keep``: bool (E,) filter or None."""
    t, k = ids.shape
    flat_e = ids.reshape(-1)
    flat_t = torch.arange(t, device=ids.device).repeat_interleave(k)
    flat_w = weights.reshape(-1)
    if keep is not None:
        sel = keep[flat_e]
        flat_e, flat_t, flat_w = flat_e[sel], flat_t[sel], flat_w[sel]
    order = torch.argsort(flat_e, stable=True)
    flat_e, flat_t, flat_w = flat_e[order], flat_t[order], flat_w[order]
    experts, counts = torch.unique_consecutive(flat_e, return_counts=True)
    runs, start = [], 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        runs.append((e, start, n))
        start += n
    return flat_t, flat_w, runs


class TorchExperts:
    """gate/up: (E, n_ff, n_embd), down: (E, n_embd, n_ff) — or fused gate_up (E, 2·n_ff, n_embd) —
    as raw GGUF data on one device; a touched expert's matrices are dequantized per call."""

    def __init__(self, *, down: QuantTensor, gate: QuantTensor | None = None,
                 up: QuantTensor | None = None, gate_up: QuantTensor | None = None,
                 compute_dtype: torch.dtype = torch.float32, act: str = "silu",
                 biases: dict[str, torch.Tensor] | None = None):
        """``act``: a ``gpu.ffn.GLU`` name; ``biases``: "gate"/"up" (E, n_ff), "down" (E, n_embd)
        float32 per-expert biases on the experts' device (gpt-oss), or None."""
        if gate_up is None and (gate is None or up is None):
            raise ValueError("experts need gate and up, or a fused gate_up")
        self.gate, self.up, self.gate_up, self.down = gate, up, gate_up, down
        self.device, self.dtype = down.device, compute_dtype
        self.glu, self.biases = GLU[act], biases or {}

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
        """x: (T, n_embd), ids/weights: (T, k) → Σ_k w·expert(x): (T, n_embd) on x's device."""
        home = x.device
        x = x.to(self.device)
        tok, w, runs = group_by_expert(ids.to(self.device), weights.to(self.device),
                                       None if keep is None else keep.to(self.device))
        xs = x[tok].to(self.dtype)                           # (A, n_embd), A = assignments
        ys = torch.empty_like(xs)
        for e, s, n in runs:
            xe = xs[s:s + n]
            if self.gate_up is not None:
                g, u = self.gate_up[e].linear(xe, self.dtype).chunk(2, dim=-1)
            else:
                g, u = self.gate[e].linear(xe, self.dtype), self.up[e].linear(xe, self.dtype)
            b = self.biases
            if "gate" in b:
                g, u = g + b["gate"][e].to(g.dtype), u + b["up"][e].to(u.dtype)
            y = self.down[e].linear(self.glu(g, u), self.dtype)
            ys[s:s + n] = y + b["down"][e].to(y.dtype) if "down" in b else y
        out = torch.zeros(x.shape, dtype=torch.float32, device=self.device)
        out.index_add_(0, tok, ys.float() * w[:, None])
        return out.to(home)


class ExpertSubset:
    """Some of a layer's routed experts held on one device (hot experts of a CPU-resident
    block): ``experts`` holds slices [ids] of the stacked tensors, in ``ids`` order. Called
    with the layer's global expert ids, it computes only the assignments to its experts
    (Σ over those of w·expert(x)); the caller adds the rest from wherever they live."""

    def __init__(self, experts: TorchExperts, ids, n_expert: int):
        ids = torch.as_tensor(list(ids), dtype=torch.long)
        self.experts, self.device = experts, experts.device
        # global id → local index; every other expert → one sentinel index that ``keep`` drops
        local = torch.full((n_expert,), len(ids), dtype=torch.long)
        local[ids] = torch.arange(len(ids))
        self.local = local.to(self.device)
        self.keep = torch.cat([torch.ones(len(ids), dtype=torch.bool),
                               torch.zeros(1, dtype=torch.bool)]).to(self.device)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: (T, n_embd), ids/weights: (T, k) global → (T, n_embd) on x's device."""
        return self.experts(x, self.local[ids.to(self.device)], weights, keep=self.keep)


class StreamedExperts:
    """Routed experts that live in host RAM, run on ``device`` for a large batch ("op
    offload"): each call copies the raw GGUF slices of the experts the batch touches (and
    ``owned``, when given, still holds on the host) to the device and computes them there.
    ``stages``: stage name ("gate", "up", "gate_up", "down") → (raw host array, quant type,
    shape). The copies are plain synchronous uploads (not pinned, not double-buffered)."""

    def __init__(self, stages: dict, *, device: torch.device, compute_dtype: torch.dtype,
                 owned=None):
        self.stages, self.device, self.dtype, self.owned = stages, device, compute_dtype, owned
        self.n_expert = next(iter(stages.values()))[2][0]

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        touched = torch.unique(ids.cpu())
        if self.owned is not None:
            touched = touched[torch.as_tensor(self.owned)[touched]]
        if touched.numel() == 0:
            return torch.zeros_like(x)
        sel = touched.numpy()
        parts = {s: QuantTensor.upload(data[sel], qtype, (len(sel),) + tuple(shape[1:]), self.device)
                 for s, (data, qtype, shape) in self.stages.items()}
        experts = TorchExperts(**parts, compute_dtype=self.dtype)
        return ExpertSubset(experts, sel.tolist(), self.n_expert)(x, ids, weights)
