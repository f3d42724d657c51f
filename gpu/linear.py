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
