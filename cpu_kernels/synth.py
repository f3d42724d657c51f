"""Valid random GGUF weight data for tests and benchmarks.

Every bit pattern of a block's quant fields is a valid block; only its floating-point
scales need care (no inf/NaN, no absurd magnitudes). ``random_blocks`` fills the quant
fields with random bytes and writes sane scales, which covers the K- and IQ-types that
``gguf.quants.quantize`` cannot produce. The result has the dtype and shape
``gguf.GGUFReader`` gives for that type, so it can be fed to the kernels or written to a
GGUF file with ``GGUFWriter.add_tensor(..., raw_dtype=qtype)``.
"""
from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

# Byte offsets of each block's f16 scale fields (ggml block layouts, see the decoders).
_F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,),
    T.IQ3_XXS: (0,), T.IQ3_S: (0,), T.IQ1_S: (0,),
}
# IQ1_M has no d field: its f16 scale is the top nibbles of the u16 at these offsets.
_F16_NIBBLES = {T.IQ1_M: (48, 50, 52, 54)}
_E8M0_FIELDS = {T.MXFP4: (0,)}


def reader_shape(qtype: T, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of ``GGUFReader``'s ``data`` for a tensor of logical ``shape`` (numpy order)."""
    if qtype in (T.F32, T.F16):
        return tuple(shape)
    block, size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise ValueError(f"{qtype.name}: row of {shape[-1]} is not a multiple of {block}")
    return (*shape[:-1], shape[-1] // block * size)


def random_blocks(qtype: T, shape: tuple[int, ...], rng: np.random.Generator,
                  scale: float = 0.01) -> np.ndarray:
    """Random weights of logical ``shape`` in ``qtype``'s GGUF form.

    Quantized types: random quant bytes, scales of magnitude ~``scale`` (random sign for
    the main scale, positive for mins/e8m0). Float types: Gaussian values times ``scale``.
    """
    if qtype in (T.F32, T.F16, T.BF16):
        v = (rng.standard_normal(shape, dtype=np.float32) * np.float32(scale))
        if qtype == T.F32:
            return v
        if qtype == T.F16:
            return v.astype(np.float16)
        bits = v.view(np.uint32)
        return ((bits + 0x8000) >> 16).astype(np.uint16).view(np.uint8).reshape(reader_shape(qtype, shape))
    rshape = reader_shape(qtype, shape)
    data = rng.integers(0, 256, size=rshape, dtype=np.uint8)
    set_scales(data, qtype, rng, scale)
    return data


def set_scales(data: np.ndarray, qtype: T, rng: np.random.Generator, scale: float = 0.01) -> None:
    """Overwrite the scale fields of every block in ``data`` (uint8, raw blocks, in place)
    with sane random values, leaving the quant bytes as they are."""
    if qtype not in _F16_FIELDS and qtype not in _E8M0_FIELDS and qtype not in _F16_NIBBLES:
        raise ValueError(f"set_scales: no layout for {qtype.name}")
    size = GGML_QUANT_SIZES[qtype][1]
    blocks = data.reshape(-1, size)
    n = blocks.shape[0]
    for i, off in enumerate(_F16_FIELDS.get(qtype, ())):
        mag = rng.uniform(0.5, 1.5, n).astype(np.float32) * np.float32(scale)
        if i == 0:
            mag *= rng.choice(np.array([-1.0, 1.0], np.float32), n)
        blocks[:, off:off + 2] = mag.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if qtype in _F16_NIBBLES:
        mag = rng.uniform(0.5, 1.5, n).astype(np.float32) * np.float32(scale)
        mag *= rng.choice(np.array([-1.0, 1.0], np.float32), n)
        bits = mag.astype(np.float16).view(np.uint16)
        for i, off in enumerate(_F16_NIBBLES[qtype]):
            u = blocks[:, off:off + 2].copy().view(np.uint16)[:, 0]
            u = (u & np.uint16(0x0FFF)) | (((bits >> np.uint16(4 * i)) & np.uint16(15)) << np.uint16(12))
            blocks[:, off:off + 2] = u.astype(np.uint16).view(np.uint8).reshape(-1, 2)
    for off in _E8M0_FIELDS.get(qtype, ()):
        # e8m0 scale 2**(e - 128) (ggml's half scale): around `scale`.
        e0 = int(np.round(np.log2(scale))) + 128
        blocks[:, off] = rng.integers(e0 - 2, e0 + 3, n).astype(np.uint8)


def finite_floats(data: np.ndarray, qtype: T) -> None:
    """Make random bytes (uint8, in place) valid F32/F16/BF16 values of magnitude about
    1/16 by fixing each value's exponent: a fast fill for benchmarks."""
    if qtype == T.F32:
        v = data.view(np.uint32)
        v &= np.uint32(0x807FFFFF)
        v |= np.uint32(0x3D800000)
    elif qtype == T.F16:
        v = data.view(np.uint16)
        v &= np.uint16(0x83FF)
        v |= np.uint16(0x2C00)
    elif qtype == T.BF16:
        v = data.view(np.uint16)
        v &= np.uint16(0x807F)
        v |= np.uint16(0x3D80)
    else:
        raise ValueError(f"finite_floats: {qtype.name} is not a float type")
