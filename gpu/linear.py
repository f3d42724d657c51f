"""A projection ``y = x @ W^T (+ b)`` whose weight lives on one torch device as raw GGUF
data (``QuantTensor``), dequantized per call into ``compute_dtype``.

Every projection in the model is a callable ``(x: (T, in)) -> (T, out) float32`` returning
on the input's device; this one moves the input to its weight's device and back only if
they differ (a plan may put one matrix of a layer elsewhere). Other implementations (raw
GGUF blocks in RAM through Numba) follow the same call convention.
"""
from __future__ import annotations

import torch

from gpu.quant import QuantTensor


class Linear:
    def __init__(self, weight: QuantTensor, bias: torch.Tensor | None = None, *,
                 compute_dtype: torch.dtype = torch.float32, name: str = ""):
        self.weight = weight        # (out, in)
        self.bias = bias            # (out,) float32 or None
        self.device = weight.device
        self.compute_dtype = compute_dtype
        self.name = name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        home = x.device
        y = self.weight.linear(x.to(self.device), self.compute_dtype).float()
        if self.bias is not None:
            y = y + self.bias
        return y.to(home)


class GroupedLinear:
    """A (groups·out, in) projection used as ``groups`` matrices of ``out`` rows: (T, groups,
    in) → (T, groups·out), group g through its own rows (deepseek4's ``attn_output_a``). On a
    torch device: one product of every group by the whole matrix through ``linear`` (its
    quantized kernels read the weight once, no dequantized copy is kept), then the diagonal
    blocks: groups × the flops. The CPU path has a true grouped kernel
    (``offload.cpu_ops.RawGroupedLinear``)."""

    def __init__(self, linear: Linear, groups: int):
        self.linear, self.groups, self.device = linear, groups, linear.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t, g = x.shape[0], self.groups
        y = self.linear(x.reshape(t * g, -1)).float().view(t, g, g, -1)                   # (T, g_in, g_out, out)
        return y.diagonal(dim1=1, dim2=2).transpose(1, 2).reshape(t, -1)


class Embedding:
    """Token embedding lookup over a raw table: only the looked-up rows are dequantized."""

    def __init__(self, table: QuantTensor):
        self.table = table          # (n_vocab, n_embd)
        self.device = table.device

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids.to(self.device))


class HeadLinear:
    """One projection per head over a stacked (H, out, in) raw GGUF tensor (MLA's
    ``attn_k_b`` / ``attn_v_b``): (T, H, in) → (T, H, out) float32, dequantized per call."""

    def __init__(self, weight: QuantTensor, *, compute_dtype: torch.dtype = torch.float32):
        self.weight, self.device, self.compute_dtype = weight, weight.device, compute_dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        home = x.device
        w = self.weight.dequantize(self.compute_dtype)                    # (H, out, in)
        y = torch.einsum("thi,hoi->tho", x.to(self.device, self.compute_dtype), w)
        return y.float().to(home)
