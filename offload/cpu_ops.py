"""Tensors that stay in system RAM as raw GGUF bytes, used in place through cpu_kernels.

Nothing here copies or dequantizes a weight: the memory-mapped ``ReaderTensor.data`` is
handed to the kernels as is, so the process's anonymous memory does not grow by their size.
Projections take and return torch tensors on the caller's device (a no-op move for the
CPU, where these layers run anyway).
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from cpu_kernels import ExpertWeights, matmul, moe_ffn
from offload.profile import Profile


def to_host(x: torch.Tensor) -> np.ndarray:
    """x as a C-contiguous float32 numpy array; a view, no copy, when x already is one on
    the CPU (the all-CPU decode path calls this for every projection)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        x = x.detach().to("cpu", torch.float32)
    a = x.numpy()
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def int8_for(batch: int, int8_batch: int | None) -> bool | None:
    """Whether a batch of ``batch`` tokens uses int8 activations: from ``int8_batch`` tokens
    on (prompt prefill: llama.cpp's Q8 activations, VNNI dot products; error bound in
    ``cpu_kernels.settings``); None (no threshold) leaves it to the process setting."""
    return None if int8_batch is None else batch >= int8_batch


class RawLinear:
    """``y = x @ W^T (+ b)`` with W the raw GGUF data of a 2-D tensor; batches of at least
    ``int8_batch`` tokens use int8 activations (see ``int8_for``)."""

    def __init__(self, data: np.ndarray, qtype: GGMLQuantizationType, *, bias: torch.Tensor | None = None,
                 name: str = "", int8_batch: int | None = None):
        self.data, self.qtype, self.bias, self.name = data, qtype, bias, name
        self.int8_batch = int8_batch
        self.device = torch.device("cpu")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        home = x.device
        y = torch.from_numpy(matmul(to_host(x), self.data, self.qtype, name=self.name,
                                    int8=int8_for(x.shape[0] if x.dim() > 1 else 1, self.int8_batch)))
        if self.bias is not None:
            y += self.bias
        return y if home.type == "cpu" else y.to(home)


class RawEmbedding:
    """Row lookup in a raw (possibly quantized) ``token_embd``: only the rows asked for are
    dequantized, per call (a few rows per token)."""

    def __init__(self, data: np.ndarray, qtype: GGMLQuantizationType, n_embd: int):
        self.data, self.qtype, self.n_embd = data, qtype, n_embd
        self.device = torch.device("cpu")

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.data[ids.cpu().numpy()]
        if self.qtype != GGMLQuantizationType.F32:
            rows = dequantize(rows, self.qtype)
        return torch.from_numpy(np.asarray(rows, dtype=np.float32).reshape(-1, self.n_embd))


class CpuExperts:
    """One MoE layer's routed experts in RAM, run by ``cpu_kernels.moe_ffn`` (GIL released)."""

    def __init__(self, weights: ExpertWeights, profile: Profile, *, act: str = "silu",
                 biases: dict[str, np.ndarray] | None = None, int8_batch: int | None = None):
        """``act`` / ``biases`` ("gate", "up", "down" float32 arrays): as ``moe_ffn`` takes them;
        ``int8_batch``: batches of at least this many tokens use int8 activations."""
        self.weights, self.profile, self.int8_batch = weights, profile, int8_batch
        self.act, self.biases = act, {f"{k}_bias": v for k, v in (biases or {}).items()}
        self.device = torch.device("cpu")

    def __call__(self, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
                 owned: np.ndarray | None = None) -> np.ndarray:
        """Host arrays in, host array out — called from the worker thread."""
        with self.profile.time("cpu_experts"):
            return moe_ffn(x, ids, w, self.weights, owned=owned, act=self.act,
                           int8=int8_for(x.shape[0], self.int8_batch), **self.biases)


PAGE = mmap.PAGESIZE


def prefault(data: np.ndarray) -> None:
    """Touch one byte per page of a memory-mapped tensor so it is resident now, as
    llama.cpp's MAP_POPULATE does: loading pays for the reads, not the first tokens, and the
    process's RSS holds the CPU weights the plan counted."""
    flat = data.reshape(-1).view(np.uint8)
    int(flat[::PAGE].max())


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_MADV_DONTNEED = 4


def release(data: np.ndarray) -> None:
    """Drop the page-cache mapping of a tensor that now lives on a GPU (llama.cpp unmaps
    such fragments too), so it does not stay in this process's RSS. Only whole pages inside
    the tensor are dropped; the file is read-only, so nothing is lost (Linux only)."""
    if _libc is None or data.nbytes < PAGE:
        return
    start = data.ctypes.data
    first = -(-start // PAGE) * PAGE
    last = (start + data.nbytes) // PAGE * PAGE
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
