"""The output end of a pass on the CPU as one compiled call: ``output_norm`` + lm_head over
the raw GGUF rows (``cpu_kernels.head.output_head``), bound once.

The reference is ``CausalLM.final``'s torch path (``gpu.norm.RMSNorm``, then the
``RawLinear`` head through ``cpu_kernels.matmul``); it still runs for logits of more than
``DECODE_TOKENS`` rows (whole prompts: the kernels' batched path, int8 activations there) and
wherever the head is not a raw CPU matrix. ``OFFLOAD_BLOCKS=reference`` turns this off too.
"""
from __future__ import annotations

import numpy as np
import torch

from cpu_kernels import settings
from cpu_kernels.entry import first_call
from cpu_kernels.head import output_head
from cpu_kernels.layout import weight_bytes
from cpu_kernels.registry import get_kernel
from gpu.norm import RMSNorm
from offload.compiled_block import compiled_enabled
from offload.cpu_ops import RawLinear, compiled, to_host
from placement.limits import DECODE_TOKENS


class CompiledHead:
    """``(x, logits) -> (logits or None, h)`` as ``CausalLM.final`` returns them: h =
    output_norm(x) (T, n_embd), logits of all rows, the last, or none."""

    def __init__(self, norm: RMSNorm, output: RawLinear):
        kern = get_kernel(output.qtype, output.name)
        self.norm, self.output = norm, output          # what it was bound from
        self._tag, self._w = kern.tag, weight_bytes(output.data, kern, 2, output.name)
        self._norm_w = np.ascontiguousarray(norm.weight.detach().float().numpy())
        self._eps = float(norm.eps)
        # compile (or load from Numba's cache) now, on one zero row: not in the first token
        x0 = np.zeros((1, self._norm_w.shape[0]), np.float32)
        self._entry = first_call(output_head, self._args(x0, 0, 1)[0])[0]

    @classmethod
    def bind(cls, norm, output) -> "CompiledHead | None":
        """The compiled head for a CPU ``RMSNorm`` and a bias-free raw CPU head, else None."""
        if not compiled_enabled() or not isinstance(norm, RMSNorm) or not isinstance(output, RawLinear) or \
                output.bias is not None or norm.weight.device.type != "cpu" or output.data.ndim != 2:
            return None
        return cls(norm, output)

    def takes(self, n_rows: int, logits: str) -> bool:
        return logits != "all" or n_rows <= DECODE_TOKENS     # logit rows per call: decode and verify

    def __call__(self, x: torch.Tensor, logits: str) -> tuple[torch.Tensor | None, torch.Tensor]:
        xh = to_host(x)
        t = xh.shape[0]
        row0 = {"all": 0, "last": max(t - 1, 0), "none": t}[logits]
        args, h, out = self._args(xh, row0, t - row0)
        compiled(self._entry, *args)
        return (None if logits == "none" else torch.from_numpy(out)), torch.from_numpy(h)

    def _args(self, xh: np.ndarray, row0: int, n_rows: int) -> tuple:
        """(the entry's arguments, h, logits) for host rows xh, logits of rows row0.. (n_rows)."""
        h = np.empty_like(xh)
        out = np.empty((n_rows, self._w.shape[0]), np.float32)
        return (xh, self._eps, self._norm_w, self._tag, self._w, row0, h, out, settings.apply_threads()), h, out
