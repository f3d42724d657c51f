"""Rotary position embedding, NeoX style (rotate-half) or interleaved pairs, optionally
partial, optionally YaRN-scaled.

Only the first ``n_rot`` dims of each head are rotated (GLM-4.5: ``rope.dimension_count`` =
head_dim/2), the rest pass through — the same as llama.cpp's ``LLAMA_ROPE_TYPE_NEOX`` and HF's
``apply_rotary_pos_emb`` with ``partial_rotary_factor``. cos/sin tables grow on demand and are
kept on the device, so decoding never rebuilds them.

Per-call cost matters at decode (one token, tiny tensors, every op is dispatch overhead), so a
call is three elementwise ops and one gather, ``x·C + x[perm]·S``, with per-position factor
rows C = (cos, cos, 1…) and S = (−sin, sin, 0…) over the head dim and ``perm`` swapping the
two rotated halves. That is the same arithmetic as ``(x1·cos − x2·sin, x2·cos + x1·sin, rest)``
bit for bit (``a − b·s == a + b·(−s)`` in IEEE; ``x·1 + x·0 == x``). The rows for a
``positions`` tensor are built once and reused while the same tensor object comes back — the
model passes one per forward to every layer, for q and for k.

The interleaved layout (llama.cpp's ``LLAMA_ROPE_TYPE_NORM``, DeepSeek's rope dims) rotates
adjacent pairs (x0, x1), (x2, x3), … instead of the two halves: the same three ops with C, S
and ``perm`` laid out pairwise. YaRN (``YaRN``) changes only the frequencies: each one blends
the interpolated (÷ factor) and the original frequency by a ramp over the dims between the
β_fast and β_slow correction dims — ggml's ``rope_yarn`` and HF's ``_compute_yarn_parameters``;
where a model scales the attention for YaRN, the attention does that, not the rotation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class YaRN:
    factor: float                 # rope.scaling.factor (context extension)
    original_context: int         # rope.scaling.original_context_length
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class RopeSpec:
    """What a rotary table depends on (hashable: one table per spec and device)."""
    n_rot: int
    base: float
    interleaved: bool = False
    yarn: YaRN | None = None

    def inv_freq(self) -> torch.Tensor:
        """(n_rot/2,) float64 angular frequencies."""
        n = self.n_rot
        freq = 1.0 / (self.base ** (torch.arange(0, n, 2, dtype=torch.float64) / n))
        if self.yarn is None:
            return freq
        y = self.yarn

        def corr_dim(n_rotations: float) -> float:   # the dim that turns n_rotations times
            return n * math.log(y.original_context / (n_rotations * 2 * math.pi)) / (2 * math.log(self.base))
        low = max(math.floor(corr_dim(y.beta_fast)), 0)
        high = min(math.ceil(corr_dim(y.beta_slow)), n - 1)
        ramp = ((torch.arange(n // 2, dtype=torch.float64) - low) / max(0.001, high - low)).clamp(0, 1)
        extrapolate = 1 - ramp                          # 1: keep the original frequency
        return freq / y.factor * (1 - extrapolate) + freq * extrapolate


class Rope:
    def __init__(self, n_rot: int, base: float, device: torch.device, *, interleaved: bool = False,
                 yarn: YaRN | None = None):
        if n_rot % 2:
            raise ValueError(f"rotary dims must be even, got {n_rot}")
        self.n_rot, self.interleaved = n_rot, interleaved
        self.device = device
        # float64 for the table itself so long positions keep their precision
        self.inv_freq = RopeSpec(n_rot, base, interleaved, yarn).inv_freq()
        self._cos = torch.empty(0, n_rot // 2, device=device)
        self._sin = torch.empty(0, n_rot // 2, device=device)
        self._perm: dict[int, torch.Tensor] = {}          # head_dim → (D,) index on the device
        self._rows_key: tuple | None = None               # (positions object, head_dim)
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def _ensure(self, n_pos: int) -> None:
        if n_pos <= self._cos.shape[0]:
            return
        n = max(n_pos, 2 * self._cos.shape[0], 256)
        ang = torch.arange(n, dtype=torch.float64)[:, None] * self.inv_freq[None, :]  # (n, n_rot/2)
        self._cos = ang.cos().float().to(self.device)
        self._sin = ang.sin().float().to(self.device)

    def tables(self, n_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (>= n_pos, n_rot/2) float32 on the device: angle pos·inv_freq[j]."""
        self._ensure(n_pos)
        return self._cos, self._sin

    def _factors(self, positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(C, S), each (T, 1, dim) on the device, for ``positions`` (T,)."""
        key = (positions, dim)
        if self._rows_key is not None and self._rows_key[0] is positions and self._rows_key[1] == dim:
            return self._rows
        self._ensure(int(positions.max()) + 1)
        pos = positions.to(self.device, non_blocking=True)
        cos, sin = self._cos[pos], self._sin[pos]                     # (T, n_rot/2)
        t, rest = cos.shape[0], dim - self.n_rot
        one = torch.ones(t, rest, device=self.device)
        if self.interleaved:        # pairs (2i, 2i+1): (cos_i, cos_i), (−sin_i, sin_i)
            cs = torch.stack((cos, cos), -1).reshape(t, self.n_rot)
            sn = torch.stack((-sin, sin), -1).reshape(t, self.n_rot)
        else:                       # halves: (cos…, cos…), (−sin…, sin…)
            cs, sn = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        c = torch.cat((cs, one), dim=-1)[:, None, :]                  # (T, 1, D)
        s = torch.cat((sn, torch.zeros_like(one)), dim=-1)[:, None, :]
        # the key holds a reference to ``positions``, so its identity cannot be recycled
        self._rows_key, self._rows = key, (c, s)
        return c, s

    def _swap(self, dim: int) -> torch.Tensor:
        """(D,) index: the two rotated halves (or each pair) exchanged, the pass-through
        dims in place."""
        if dim not in self._perm:
            h = self.n_rot // 2
            swap = (torch.arange(self.n_rot) ^ 1 if self.interleaved else
                    torch.cat((torch.arange(h, self.n_rot), torch.arange(0, h))))
            self._perm[dim] = torch.cat((swap, torch.arange(self.n_rot, dim))).to(self.device)
        return self._perm[dim]

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
        """x: (T, H, D) float32, positions: (T,) int64 on the host (so sizing the table never
        waits for the device) → rotated copy of x (``inverse``: rotated back, by −angle)."""
        dim = x.shape[-1]
        c, s = self._factors(positions, dim)
        if inverse:
            return x * c - x[..., self._swap(dim)] * s
        return x * c + x[..., self._swap(dim)] * s


def rope_for(spec: RopeSpec, device: torch.device) -> Rope:
    return Rope(spec.n_rot, spec.base, device, interleaved=spec.interleaved, yarn=spec.yarn)
