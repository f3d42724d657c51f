"""Routed experts held as stacked torch tensors on one device (GPU-resident experts).

Assignments are sorted by expert so each touched expert's weights are read once per call
whatever the number of tokens (the same grouping as the CPU kernels); the Python loop runs
over touched experts, never over tokens × experts.
"""
from __future__ import annotations

import numpy as np
import torch

from gpu.ffn import glu
from gpu.quant import QuantTensor
from placement.limits import staging_buffer_bytes


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
                 biases: dict[str, torch.Tensor] | None = None, limit: float | None = None):
        """``act``: a ``gpu.ffn.GLU`` name; ``biases``: "gate"/"up" (E, n_ff), "down" (E, n_embd)
        float32 per-expert biases on the experts' device (gpt-oss), or None."""
        if gate_up is None and (gate is None or up is None):
            raise ValueError("experts need gate and up, or a fused gate_up")
        self.gate, self.up, self.gate_up, self.down = gate, up, gate_up, down
        self.device, self.dtype = down.device, compute_dtype
        self.glu, self.biases = glu(act, limit), biases or {}

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


class StagingBuffers:
    """Op offload's copies, double-buffered: two device buffers of ``n_bytes`` (a chunk of the
    largest expert tensor streamed to ``device``, ``staging_buffer_bytes``), shared by every
    streamed layer there. Chunk i+1 is copied into one while chunk i is computed from the
    other. On CUDA each device buffer has a pinned host twin: the touched experts' rows are
    gathered from the mapped file into it and copied on a second stream, with events ordering
    the copy after the last compute that read the buffer and the compute after the copy. On a
    CPU-backed device (``--virtual-gpus``) the same steps run synchronously (the rows are
    gathered straight into the buffer)."""

    def __init__(self, device: torch.device, n_bytes: int):
        self.device, self.n_bytes = device, int(n_bytes)
        self.cuda = device.type == "cuda"
        self.dev = [torch.empty(self.n_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.host = ([torch.empty(self.n_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                     if self.cuda else None)
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.copied: list = [None, None]      # buffer i's host→device copy is done
        self.used: list = [None, None]        # the last compute that read buffer i is done

    @property
    def device_bytes(self) -> int:
        return 2 * self.n_bytes

    def load(self, i: int, data: np.ndarray, sel: np.ndarray) -> torch.Tensor:
        """Rows ``sel`` of ``data`` (a mapped (E, ...) tensor) into buffer i → a view on the
        device shaped (len(sel), ...) in ``data``'s dtype (ready after ``ready(i)``)."""
        shape = (len(sel),) + tuple(data.shape[1:])
        n = int(np.prod(shape)) * data.itemsize
        if n > self.n_bytes:
            raise ValueError(f"op offload: {n} bytes do not fit the {self.n_bytes}-byte staging buffer")
        dtype = torch.from_numpy(np.empty(0, dtype=data.dtype)).dtype
        if not self.cuda:
            np.take(data, sel, axis=0, out=self.dev[i][:n].numpy().view(data.dtype).reshape(shape))
            return self.dev[i][:n].view(dtype).reshape(shape)
        if self.copied[i] is not None:
            self.copied[i].synchronize()                  # the pinned twin's last copy has left
        np.take(data, sel, axis=0, out=self.host[i][:n].numpy().view(data.dtype).reshape(shape))
        with torch.cuda.stream(self.copy_stream):
            if self.used[i] is not None:
                self.copy_stream.wait_event(self.used[i])
            self.dev[i][:n].copy_(self.host[i][:n], non_blocking=True)
            self.copied[i] = torch.cuda.Event()
            self.copied[i].record(self.copy_stream)
        return self.dev[i][:n].view(dtype).reshape(shape)

    def ready(self, i: int) -> None:
        """The compute stream waits for buffer i's copy."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.copied[i])

    def release(self, i: int) -> None:
        """Buffer i's compute is queued; its next copy waits for it."""
        if self.cuda:
            self.used[i] = torch.cuda.Event()
            self.used[i].record(torch.cuda.current_stream(self.device))


class StreamedExperts:
    """Routed experts that live in host RAM, run on ``device`` for a large batch ("op
    offload"): each call copies the raw GGUF slices of the experts the batch touches (and
    ``owned``, when given, still holds on the host) to the device in chunks through
    ``StagingBuffers`` (double-buffered: the copy of the next chunk overlaps the compute of
    this one), stage by stage (gate, up, then down; or gate_up, down) over all the batch's
    assignments. ``stages``: stage name ("gate", "up", "gate_up", "down") → (raw host array,
    quant type, shape). ``staging``: the device's shared buffers (``offload.runtime`` sizes
    them for every layer streamed there); None: this layer's own."""

    def __init__(self, stages: dict, *, device: torch.device, compute_dtype: torch.dtype,
                 owned=None, staging: StagingBuffers | None = None, act: str = "silu",
                 limit: float | None = None):
        self.stages, self.device, self.dtype, self.owned = stages, device, compute_dtype, owned
        self.n_expert = next(iter(stages.values()))[2][0]
        self.order = ("gate_up", "down") if "gate_up" in stages else ("gate", "up", "down")
        self.glu = glu(act, limit)
        self.staging = staging

    @property
    def staging_bytes(self) -> int:
        """One staging buffer for this layer's largest expert tensor."""
        return max(staging_buffer_bytes(data.nbytes, self.n_expert) for data, _, _ in self.stages.values())

    def _units(self, n_sel: int, chunk_bytes: int) -> list[tuple[str, int, int]]:
        """(stage, first, end) over the touched experts: each stage's rows in chunks that fit."""
        out = []
        for stage in self.order:
            per = max(1, chunk_bytes // self.stages[stage][0][0].nbytes)     # experts per chunk
            out += [(stage, a, min(a + per, n_sel)) for a in range(0, n_sel, per)]
        return out

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: (T, n_embd), ids/weights: (T, k) global → (T, n_embd) float32 on x's device."""
        touched = torch.unique(ids.cpu())
        if self.owned is not None:
            touched = touched[torch.as_tensor(self.owned)[touched]]
        if touched.numel() == 0:
            return torch.zeros_like(x)
        if self.staging is None:
            self.staging = StagingBuffers(self.device, self.staging_bytes)
        sel, buf, dev, c = touched.numpy(), self.staging, self.device, self.dtype
        # global id → index in the staged rows; every other expert → a sentinel ``keep`` drops
        local = torch.full((self.n_expert,), len(sel), dtype=torch.long)
        local[touched] = torch.arange(len(sel))
        keep = torch.cat([torch.ones(len(sel), dtype=torch.bool), torch.zeros(1, dtype=torch.bool)])
        tok, w, runs = group_by_expert(local[ids.cpu()].to(dev), weights.to(dev), keep.to(dev))
        xs = x.to(dev)[tok].to(c)                                    # (A, n_embd), A = assignments
        acts = {st: torch.empty(xs.shape[0], self.stages[st][2][1], dtype=c, device=dev) for st in self.order}
        units = self._units(len(sel), buf.n_bytes)

        def load(j: int) -> QuantTensor:
            stage, a, b = units[j]
            data, qtype, shape = self.stages[stage]
            return QuantTensor(buf.load(j % 2, data, sel[a:b]), qtype, (b - a,) + tuple(shape[1:]))

        hidden = None
        q = load(0)
        for j, (stage, a, b) in enumerate(units):
            nxt = load(j + 1) if j + 1 < len(units) else None        # copied while this chunk computes
            buf.ready(j % 2)
            if stage == "down" and hidden is None:                   # every gate/up chunk is done
                hidden = self.glu(*(acts["gate_up"].chunk(2, dim=-1) if "gate_up" in acts
                                    else (acts["gate"], acts["up"])))
            inp = xs if stage != "down" else hidden
            for e, s, n in runs:                                     # runs are sorted by local id
                if a <= e < b:
                    acts[stage][s:s + n] = q[e - a].linear(inp[s:s + n], c)
            buf.release(j % 2)
            q = nxt
        y = torch.zeros(x.shape, dtype=torch.float32, device=dev)
        y.index_add_(0, tok, acts["down"].float() * w[:, None])
        return y.to(x.device)
