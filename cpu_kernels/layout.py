"""Turning a GGUF tensor's data (as ``gguf.GGUFReader`` returns it) into the raw byte view
the kernels read, without copying, plus activation preparation shared by the drivers."""
from __future__ import annotations

import numpy as np

from .registry import QuantKernel


def weight_bytes(w, kern: QuantKernel, ndim: int, name: str) -> np.ndarray:
    """A read-only uint8 view ``[..., row_bytes]`` of ``w`` (a memmap or array, used in
    place). F32/F16 readers give typed arrays, the rest uint8 rows of raw blocks."""
    if not isinstance(w, np.ndarray):
        raise TypeError(f"{name or 'weight'}: expected a numpy array, got {type(w).__name__}")
    if w.ndim != ndim:
        raise ValueError(f"{name or 'weight'}: expected {ndim} dims, got shape {w.shape}")
    if not w.flags.c_contiguous:
        raise ValueError(f"{name or 'weight'}: data must be C-contiguous (as GGUFReader maps it)")
    b = np.asarray(w).view(np.uint8)         # no copy: same buffer, bytes as the last axis
    if b.shape[-1] % kern.type_size and kern.elem is None:
        raise ValueError(f"{name or 'weight'}: row of {b.shape[-1]} bytes is not a whole number "
                         f"of {kern.qtype.name} blocks ({kern.type_size} bytes)")
    b = b.view()
    b.flags.writeable = False                # one Numba signature for memmaps and arrays
    return b


def row_cols(row_bytes: int, kern: QuantKernel) -> int:
    """Logical columns of a row of ``row_bytes`` bytes."""
    return row_bytes * kern.block_size // kern.type_size


def activations(x: np.ndarray, cols: int, what: str) -> np.ndarray:
    """float32 C-contiguous [B, cols] (a copy only if x is not already that)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"{what}: activations of shape {x.shape}, expected [B, {cols}]")
    return x


def bsums_of(x: np.ndarray) -> np.ndarray:
    """float32 [B, cols // 16]: sums of each 16-column group (for the decoders' offsets)."""
    n = x.shape[1] // 16 * 16
    return np.ascontiguousarray(x[:, :n].reshape(x.shape[0], -1, 16).sum(-1, dtype=np.float32))


def bsums_for(x: np.ndarray, *kerns) -> np.ndarray:
    """``bsums_of(x)`` for the float path of weights of these types, or zeros where none of
    them has offsets (``QuantKernel.has_min`` False: the kernels multiply the sums by m = 0).
    Saves a numpy reduction per call: about a tenth of a small matmul call's time."""
    if any(k.has_min for k in kerns):
        return bsums_of(x)
    return np.zeros((x.shape[0], x.shape[1] // 16), np.float32)
