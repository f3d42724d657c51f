"""Loading by placement: every tensor goes where the plan puts it.

``CPU`` tensors stay memory-mapped GGUF bytes (matrices and experts used in place by
cpu_kernels, embeddings dequantized a row at a time); tensors on a GPU device are
dequantized once to ``gpu_dtype`` and uploaded. Norm weights, biases and router tensors
are small and always float32 copies on their device.

``allocated`` records what each device really holds — mapped file bytes for CPU, the
uploaded tensors' bytes for GPUs — which is what the planner's estimate must match.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping

import torch

from gpu.dequant import dequantize_numpy, to_torch
from gpu.experts import TorchExperts
from gpu.linear import Linear
from offload._standins import ExpertWeights, OffloadError
from offload.cpu_ops import CpuExperts, RawEmbedding, RawLinear
from offload.devices import CPU, DeviceMap
from offload.moe import RawExpertMatrix, StagedExperts, TorchExpertMatrix
from offload.profile import Profile


class TorchEmbedding:
    def __init__(self, table: torch.Tensor):
        self.table = table  # (n_vocab, n_embd)
        self.device = table.device

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids.to(self.device)].float()


class WeightStore:
    def __init__(self, tensors: Mapping, device_of: Mapping[str, str], devices: DeviceMap, *,
                 gpu_dtype: torch.dtype, profile: Profile, progress=None):
        missing = [n for n in tensors if n not in device_of]
        if missing:
            raise OffloadError(f"the plan does not place tensor {missing[0]} "
                               f"({len(missing)} tensor(s) unplaced) — was it made for another model?")
        self.tensors, self.device_of, self.devices = tensors, device_of, devices
        self.gpu_dtype, self.profile, self.progress = gpu_dtype, profile, progress
        self.allocated: dict[str, int] = defaultdict(int)
        self.used: set[str] = set()
        self._uploaded: dict[tuple[str, torch.dtype], torch.Tensor] = {}  # shared (tied) tensors

    # -- lookup ---------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed([int(d) for d in self.tensors[name].shape]))

    def device_name(self, name: str) -> str:
        return self.device_of[name]

    def device(self, name: str) -> torch.device:
        return self.devices[self.device_of[name]]

    def unused(self) -> list[str]:
        return sorted(set(self.tensors) - self.used)

    def _take(self, name: str):
        """The tensor's reader entry; counted (progress, CPU bytes) the first time only, so a
        tensor used twice (tied embedding/output, NextN sharing token_embd) is held once."""
        if name not in self.tensors:
            raise OffloadError(f"the model file lacks tensor {name}")
        t = self.tensors[name]
        if name not in self.used:
            self.used.add(name)
            if self.progress is not None:
                self.progress.advance(int(t.n_bytes))
            if self.device_of[name] == CPU:
                self.allocated[CPU] += int(t.n_bytes)
        return t

    def _upload(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if (name, dtype) not in self._uploaded:
            t = self._take(name)
            out = to_torch(t.data, t.tensor_type, self.shape(name), dtype=dtype, device=self.device(name))
            self.allocated[self.device_of[name]] += out.numel() * out.element_size()
            self._uploaded[name, dtype] = out
        return self._uploaded[name, dtype]

    def _raw(self, name: str):
        t = self._take(name)
        return t.data, t.tensor_type

    # -- what the model asks for ----------------------------------------------------------
    def vector(self, name: str) -> torch.Tensor:
        """Small float32 tensor (norm weight, bias, router bias) on its device (a copy)."""
        if self.device_of[name] != CPU:
            return self._upload(name, torch.float32)
        t = self._take(name)   # a small copy: counted with the file bytes it mirrors
        return torch.from_numpy(dequantize_numpy(t.data, t.tensor_type).reshape(self.shape(name)).copy())

    def linear(self, name: str, bias: str | None = None, *, float32: bool = False):
        """A projection callable for the 2-D tensor ``name`` (+ optional bias tensor)."""
        b = self.vector(bias) if bias is not None and self.has(bias) else None
        if self.device_of[name] == CPU:
            data, qtype = self._raw(name)
            return RawLinear(data, qtype, bias=b, name=name, profile=self.profile)
        w = self._upload(name, torch.float32 if float32 else self.gpu_dtype)
        return Linear(w, None if b is None else b.to(w.device, w.dtype), name=name)

    def embedding(self, name: str):
        if self.device_of[name] == CPU:
            data, qtype = self._raw(name)
            return RawEmbedding(data, qtype, self.shape(name)[1])
        return TorchEmbedding(self._upload(name, self.gpu_dtype))

    def experts(self, prefix: str):
        """Routed experts ``{prefix}.ffn_{gate,up,gate_up,down}_exps.weight`` → a callable
        ``(x, ids, w) → (T, n_embd)`` (or CpuExperts, which the MoE layer runs in a thread)."""
        names = {s: f"{prefix}.ffn_{s}_exps.weight" for s in ("gate", "up", "gate_up", "down")}
        stages = ("gate_up", "down") if self.has(names["gate_up"]) else ("gate", "up", "down")
        homes = {self.device_of[names[s]] for s in stages}
        if homes == {CPU}:
            raw = {s: self._raw(names[s]) for s in stages}
            none = (None, None)
            ew = ExpertWeights(gate=raw.get("gate", none)[0], up=raw.get("up", none)[0],
                               down=raw["down"][0], gate_type=raw.get("gate", none)[1],
                               up_type=raw.get("up", none)[1], down_type=raw["down"][1],
                               gate_up=raw.get("gate_up", none)[0],
                               gate_up_type=raw.get("gate_up", none)[1], name=prefix)
            return CpuExperts(ew, self.profile)
        if len(homes) == 1:
            return TorchExperts(**{s: self._upload(names[s], self.gpu_dtype) for s in stages})
        return StagedExperts(**{s: (RawExpertMatrix(*self._raw(names[s]), names[s])
                                    if self.device_of[names[s]] == CPU else
                                    TorchExpertMatrix(self._upload(names[s], self.gpu_dtype)))
                                for s in stages})
