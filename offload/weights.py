"""Loading by placement: every tensor goes where the plan puts it.

- ``CPU``: tensors stay memory-mapped GGUF bytes — matrices and experts used in place by
  cpu_kernels, embedding rows dequantized per lookup. Nothing is copied.
- a GPU device: the tensor's raw GGUF bytes are uploaded unchanged (``gpu.quant.QuantTensor``)
  and dequantized per call into the device's compute dtype — so the device holds exactly the
  bytes the planner counts. Only a quant type without a torch dequantizer is dequantized once
  at load instead (to float16 on CUDA, float32 on a CPU-backed device), with a notice naming
  the extra bytes.
- norm weights, biases and router biases are small: float32 copies on their device.

``allocated`` records what each device holds for weights (mapped file bytes for CPU).
"""
from __future__ import annotations

import sys
from collections import defaultdict
from typing import Mapping

import torch

from gpu.dequant import dequantize_numpy, to_torch
from gpu.experts import TorchExperts
from gpu.linear import Embedding, Linear
from gpu.quant import QuantTensor, supported
from offload._standins import ExpertWeights, OffloadError
from offload.cpu_ops import CpuExperts, RawEmbedding, RawLinear
from offload.devices import CPU, DeviceMap
from offload.moe import RawExpertMatrix, StagedExperts, TorchExpertMatrix
from offload.profile import Profile
from gguf import GGMLQuantizationType as Q


class WeightStore:
    def __init__(self, tensors: Mapping, device_of: Mapping[str, str], devices: DeviceMap, *,
                 compute_dtype: Mapping[str, torch.dtype], profile: Profile, progress=None):
        missing = [n for n in tensors if n not in device_of]
        if missing:
            raise OffloadError(f"the plan does not place tensor {missing[0]} "
                               f"({len(missing)} tensor(s) unplaced) — was it made for another model?")
        self.tensors, self.device_of, self.devices = tensors, device_of, devices
        self.compute_dtype, self.profile, self.progress = compute_dtype, profile, progress
        self.allocated: dict[str, int] = defaultdict(int)
        self.used: set[str] = set()
        self._uploaded: dict[str, QuantTensor] = {}     # shared (tied) tensors upload once

    # -- lookup ---------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(reversed([int(d) for d in self.tensors[name].shape]))

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

    def _upload(self, name: str) -> QuantTensor:
        if name not in self._uploaded:
            t = self._take(name)
            dev_name, dev = self.device_of[name], self.device(name)
            if supported(t.tensor_type):
                q = QuantTensor.upload(t.data, t.tensor_type, self.shape(name), dev)
            else:
                dtype = torch.float32 if dev.type == "cpu" else torch.float16
                q = QuantTensor(to_torch(t.data, t.tensor_type, self.shape(name), dtype=dtype, device=dev),
                                Q.F32 if dtype == torch.float32 else Q.F16, self.shape(name))
                print(f"offload: note: {name} is {t.tensor_type.name}, which has no torch dequantizer: "
                      f"held dequantized on {dev_name} ({q.nbytes - int(t.n_bytes):+,} bytes vs the plan)",
                      file=sys.stderr)
            self.allocated[dev_name] += q.nbytes
            self._uploaded[name] = q
        return self._uploaded[name]

    def _raw(self, name: str):
        t = self._take(name)
        return t.data, t.tensor_type

    def _dtype(self, name: str) -> torch.dtype:
        return self.compute_dtype[self.device_of[name]]

    # -- what the model asks for ----------------------------------------------------------
    def vector(self, name: str) -> torch.Tensor:
        """Small float32 tensor (norm weight, bias, router bias) on its device (a copy)."""
        t = self._take(name)
        out = torch.from_numpy(dequantize_numpy(t.data, t.tensor_type).reshape(self.shape(name)).copy())
        if self.device_of[name] != CPU:
            out = out.to(self.device(name))
            self.allocated[self.device_of[name]] += out.numel() * 4
        return out

    def linear(self, name: str, bias: str | None = None, *, float32: bool = False):
        """A projection callable for the 2-D tensor ``name`` (+ optional bias tensor).
        ``float32``: compute in float32 whatever the device (routers)."""
        b = self.vector(bias) if bias is not None and self.has(bias) else None
        if self.device_of[name] == CPU:
            data, qtype = self._raw(name)
            return RawLinear(data, qtype, bias=b, name=name, profile=self.profile)
        w = self._upload(name)
        return Linear(w, None if b is None else b.to(w.device),
                      compute_dtype=torch.float32 if float32 else self._dtype(name), name=name)

    def embedding(self, name: str):
        if self.device_of[name] == CPU:
            data, qtype = self._raw(name)
            return RawEmbedding(data, qtype, self.shape(name)[1])
        return Embedding(self._upload(name))

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
            return TorchExperts(**{s: self._upload(names[s]) for s in stages},
                                compute_dtype=self._dtype(names["down"]))
        return StagedExperts(**{s: (RawExpertMatrix(*self._raw(names[s]), names[s])
                                    if self.device_of[names[s]] == CPU else
                                    TorchExpertMatrix(self._upload(names[s]), self._dtype(names[s])))
                                for s in stages})
