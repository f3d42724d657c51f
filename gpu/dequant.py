"""GGUF tensor data dequantized once, on the host, with ``gguf.quants.dequantize``.

Used for the small float32 tensors (norms, biases) and as the fallback for a quant type
that ``gpu.quant`` has no torch dequantizer for. Large tensors are converted slice by slice
along dim 0 so the float32 temporary stays one slice big, not the whole tensor.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

_SLICE_BYTES = 64 << 20  # float32 temporary per conversion step


def dequantize_numpy(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Raw ``ReaderTensor.data`` → float32 numpy array in the tensor's logical shape."""
    if qtype == GGMLQuantizationType.F32:
        return np.asarray(data, dtype=np.float32)
    return np.asarray(dequantize(data, qtype), dtype=np.float32)


def to_torch(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], *,
             dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Dequantize ``data`` (raw GGUF bytes or a typed array) into a new tensor on ``device``.

    ``shape`` is the logical numpy-order shape (``TensorInfo.shape``). The result owns its
    memory (never aliases the memory map).
    """
    out = torch.empty(shape, dtype=dtype, device=device)
    if len(shape) <= 1 or shape[0] == 1:
        out.copy_(torch.from_numpy(np.array(dequantize_numpy(data, qtype).reshape(shape))))
        return out
    row_elems = int(np.prod(shape[1:]))
    step = max(1, _SLICE_BYTES // (4 * row_elems))
    for i in range(0, shape[0], step):
        part = dequantize_numpy(data[i:i + step], qtype).reshape((-1, *shape[1:]))
        # np.require(..., 'W'): the memory map is read-only; torch wants a writable array
        out[i:i + part.shape[0]].copy_(torch.from_numpy(np.require(part, requirements="CW")))
    return out
