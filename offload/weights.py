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
import warnings
from collections import defaultdict
from typing import Mapping

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from cpu_kernels import ExpertWeights, supported_types
from gpu.dequant import dequantize_numpy, to_torch
from gpu.experts import ExpertSubset, StreamedExperts, TorchExperts
from gpu.ffn import glu
from gpu.linear import Embedding, GroupedLinear, HeadLinear, Linear
from gpu.quant import QuantTensor, supported
from offload.cpu_ops import CpuExperts, RawEmbedding, RawGroupedLinear, RawLinear, prefault, release
from offload.devices import CPU, DeviceMap
from offload.errors import OffloadError
from offload.gguf_model import ModelFile
from offload.moe import StagedExperts
from offload.profile import Profile
from placement.memory import attention_device


class WeightStore:
    """The model's tensors on the plan's devices. ``device_of``: tensor name → plan device
    (``Plan.tensors``)."""

    def __init__(self, model: ModelFile, device_of: Mapping[str, str], devices: DeviceMap, *,
                 compute_dtype: Mapping[str, torch.dtype], profile: Profile, progress=None,
                 hot_experts: Mapping[str, Mapping[int, tuple[int, ...]]] | None = None,
                 int8_batch: int | None = None, decode_activations: str | None = None):
        self.tensors = {t.name: t for t in model.tensors}
        missing = [n for n in self.tensors if n not in device_of]
        if missing:
            raise OffloadError(f"the plan does not place tensor {missing[0]} "
                               f"({len(missing)} tensor(s) unplaced) — was it made for another model?")
        self.model, self.device_of, self.devices = model, device_of, devices
        self.compute_dtype, self.profile, self.progress = compute_dtype, profile, progress
        self.int8_batch = int8_batch     # CPU matmuls: int8 activations from this batch on
        self.decode_activations = decode_activations    # CPU routed experts' decode batches (limits.int8_request)
        self.allocated: dict[str, int] = defaultdict(int)
        self.used: set[str] = set()
        self._uploaded: dict[tuple[str, str], QuantTensor] = {}   # (name, device): upload once
        self._counted: set[tuple[str, str]] = set()
        self._hot: dict[int, dict[str, tuple[int, ...]]] = defaultdict(dict)   # block → device → experts
        self._act: dict[str, dict] = {}        # experts prefix → their activation (act, limit)
        for dev, layers in (hot_experts or {}).items():
            for layer, ids in layers.items():
                self._hot[layer][dev] = tuple(ids)

    # -- lookup ---------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def device_name(self, name: str) -> str:
        """The plan device of ``name``; a tensor the file lacks is refused in one line."""
        if name not in self.tensors:
            raise OffloadError(f"the model file lacks tensor {name}")
        return self.device_of[name]

    def device(self, name: str) -> torch.device:
        return self.devices[self.device_of[name]]

    def home(self, layer: int) -> str:
        """The plan device where block ``layer`` computes and keeps its KV cache: the
        planner's rule (with its largest attention tensor), so the KV bytes land where the
        plan counted them."""
        home = attention_device([t for t in self.tensors.values() if t.layer == layer], self.device_of)
        if home is None:
            raise OffloadError(f"the model file lacks tensor blk.{layer}.attn_q.weight "
                               f"(block {layer} has no attention tensors)")
        return home

    def unused(self) -> list[str]:
        return sorted(set(self.tensors) - self.used)

    def _take(self, name: str, dev_name: str | None = None):
        """The tensor's info. Progress counts each tensor once; ``allocated`` counts each
        (tensor, device) once, so a tied tensor used twice on one device is held once."""
        dev_name = dev_name or self.device_name(name)
        t = self.tensors[name]
        if name not in self.used:
            self.used.add(name)
            if self.progress is not None:
                self.progress.advance(t.n_bytes)
        if dev_name == CPU and (name, CPU) not in self._counted:
            self._counted.add((name, CPU))
            self.allocated[CPU] += t.n_bytes
        return t

    def _upload(self, name: str, on: str | None = None) -> QuantTensor:
        """The tensor on device ``on`` (default: where the plan put it), uploaded once."""
        dev_name = on or self.device_of[name]
        if (name, dev_name) not in self._uploaded:
            t = self._take(name, dev_name)
            dev, data = self.devices[dev_name], self.model.tensor_data(name)
            if supported(t.ggml_type):
                q = QuantTensor.upload(data, t.ggml_type, t.shape, dev)
            else:
                dtype = torch.float32 if dev.type == "cpu" else torch.float16
                q = QuantTensor(to_torch(data, t.ggml_type, t.shape, dtype=dtype, device=dev),
                                Q.F32 if dtype == torch.float32 else Q.F16, t.shape)
                print(f"offload: note: {name} is {t.ggml_type.name}, which has no torch dequantizer: "
                      f"held dequantized on {dev_name} ({q.nbytes - t.n_bytes:+,} bytes vs the plan)",
                      file=sys.stderr)
            if self.device_of[name] != CPU:
                release(data)           # the copy on the device is the one the plan counts
            self.allocated[dev_name] += q.nbytes
            self._uploaded[name, dev_name] = q
        return self._uploaded[name, dev_name]

    def _raw(self, name: str):
        """The memory-mapped data, used in place on the CPU (made resident once)."""
        first = (name, CPU) not in self._counted
        t = self._take(name, CPU)
        data = self.model.tensor_data(name)
        if first:
            prefault(data)
        return data, t.ggml_type

    def _cpu_matrix(self, name: str):
        """``_raw`` for a matrix the CPU kernels will multiply: refuse, at load and naming the
        tensor, a quant type that has no kernel (instead of failing mid-generation)."""
        qtype = self.tensors[name].ggml_type if name in self.tensors else None
        if qtype is not None and qtype not in supported_types():
            raise OffloadError(
                f"{name} is {qtype.name}, which has no CPU kernel (CPU kernels: "
                f"{', '.join(q.name for q in supported_types())}); place it on a GPU with -ot or "
                "use a file quantized to a supported type")
        return self._raw(name)

    def _dtype(self, dev_name: str) -> torch.dtype:
        return self.compute_dtype[dev_name]

    # -- what the model asks for ----------------------------------------------------------
    def vector(self, name: str) -> torch.Tensor:
        """Small float32 tensor (norm weight, bias, router bias) on its device (a copy)."""
        t = self._take(name)
        out = torch.from_numpy(dequantize_numpy(self.model.tensor_data(name), t.ggml_type).reshape(t.shape).copy())
        if self.device_of[name] != CPU:
            out = out.to(self.device(name))
            self.allocated[self.device_of[name]] += out.numel() * 4
        return out

    def table(self, name: str) -> torch.Tensor:
        """An integer lookup table (deepseek4's ``ffn_gate_tid2eid``) as stored, int32, on its
        plan device (``check_shapes`` refused any other type at load)."""
        t = self._take(name)
        out = torch.from_numpy(np.array(self.model.tensor_data(name), dtype=np.int32).reshape(t.shape))
        if self.device_of[name] != CPU:
            out = out.to(self.device(name))
            self.allocated[self.device_of[name]] += out.numel() * 4
        return out

    def linear(self, name: str, bias: str | None = None, *, float32: bool = False, on: str | None = None):
        """A projection callable for the 2-D tensor ``name`` (+ optional bias tensor), on
        its plan device or on ``on``. ``float32``: compute in float32 (routers)."""
        b = self.vector(bias) if bias is not None and self.has(bias) else None
        dev_name = on or self.device_name(name)
        if dev_name == CPU:
            data, qtype = self._cpu_matrix(name)
            return RawLinear(data, qtype, bias=b, name=name, int8_batch=self.int8_batch)
        w = self._upload(name, dev_name)
        return Linear(w, None if b is None else b.to(w.device),
                      compute_dtype=torch.float32 if float32 else self._dtype(dev_name), name=name)

    def grouped_linear(self, name: str, groups: int):
        """The 2-D tensor ``name`` as ``groups`` stacked matrices: (T, groups, in) → (T, rows)
        (``gpu.linear.GroupedLinear``; on the CPU one grouped kernel call)."""
        if self.device_name(name) == CPU:
            data, qtype = self._cpu_matrix(name)
            return RawGroupedLinear(data, qtype, groups, name=name)
        return GroupedLinear(self.linear(name), groups)

    def embedding(self, name: str):
        if self.device_name(name) == CPU:
            data, qtype = self._raw(name)
            return RawEmbedding(data, qtype, self.shape(name)[1])
        return Embedding(self._upload(name))

    def experts(self, prefix: str, *, act: str = "silu", limit: float | None = None):
        """Routed experts ``{prefix}.ffn_{gate,up,gate_up,down}_exps.weight`` (+ their
        ``.bias`` per expert where the file has them, gpt-oss) → a callable ``(x, ids, w) →
        (T, n_embd)`` (or CpuExperts, which the MoE layer runs in a thread). ``act``: the
        gated activation (``gpu.ffn.GLU`` / ``cpu_kernels.moe_ffn`` names), ``limit`` its clamp
        (swiglu_clamp)."""
        names, stages = self._expert_stages(prefix)
        self._act[prefix] = dict(act=act, limit=limit)      # the hot and streamed copies compute the same
        homes = {self.device_of[names[s]] for s in stages}
        biases = self._expert_biases(prefix, stages)
        if biases and len(homes) > 1:
            raise OffloadError(f"{prefix}: experts with biases split across devices are not supported; "
                               "keep ffn_*_exps of a block on one device")
        if homes == {CPU}:
            raw = {s: self._cpu_matrix(names[s]) for s in stages}
            none = (None, None)
            ew = ExpertWeights(gate=raw.get("gate", none)[0], up=raw.get("up", none)[0],
                               down=raw["down"][0], gate_type=raw.get("gate", none)[1],
                               up_type=raw.get("up", none)[1], down_type=raw["down"][1],
                               gate_up=raw.get("gate_up", none)[0],
                               gate_up_type=raw.get("gate_up", none)[1], name=prefix)
            return CpuExperts(ew, self.profile, act=act, biases={k: b.cpu().numpy() for k, b in biases.items()},
                              int8_batch=self.int8_batch, decode=self.decode_activations, limit=limit)
        if len(homes) == 1:
            return TorchExperts(**{s: self._upload(names[s]) for s in stages},
                                compute_dtype=self._dtype(self.device_of[names["down"]]), act=act, limit=limit,
                                biases={k: b.to(self.device(names["down"])) for k, b in biases.items()})
        return StagedExperts(**{s: self._per_expert(names[s]) for s in stages}, glu=glu(act, limit))

    def _expert_stages(self, prefix: str) -> tuple[dict[str, str], tuple[str, ...]]:
        """Block ``prefix``'s expert tensor names by stage, and the stages it has (a fused
        ``gate_up`` or separate ``gate`` and ``up``, then ``down``)."""
        names = {s: f"{prefix}.ffn_{s}_exps.weight" for s in ("gate", "up", "gate_up", "down")}
        return names, (("gate_up", "down") if self.has(names["gate_up"]) else ("gate", "up", "down"))

    def _expert_biases(self, prefix: str, stages) -> dict[str, torch.Tensor]:
        """{"gate", "up", "down"} → (E, rows) float32 biases where the file has all of them."""
        names = {s: f"{prefix}.ffn_{s}_exps.bias" for s in ("gate", "up", "down")}
        have = [s for s, n in names.items() if self.has(n)]
        if not have:
            return {}
        if "gate_up" in stages or len(have) != 3:
            raise OffloadError(f"{prefix}: expert biases need ffn_gate_exps/ffn_up_exps/ffn_down_exps.bias "
                               f"with separate gate and up (found {', '.join(have)})")
        return {s: self.vector(n) for s, n in names.items()}

    def per_head(self, name: str):
        """A (H, out, in) tensor as one projection per head: (T, H, in) → (T, H, out). On the
        CPU the mapped bytes are dequantized by torch per call, all heads in one pass (one
        CPU-kernel call per head costs more in call overhead than the small matrices do)."""
        dev_name = self.device_of[name]
        if dev_name != CPU:
            return HeadLinear(self._upload(name), compute_dtype=self._dtype(dev_name))
        data, qtype = self._raw(name)
        if supported(qtype):
            with warnings.catch_warnings():      # read-only map: torch warns; nothing writes it
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.from_numpy(data)
            return HeadLinear(QuantTensor(raw, qtype, self.shape(name)))
        heads = [self._per_expert(name)(h) for h in range(self.shape(name)[0])]
        return lambda x: torch.stack([p(x[:, h].contiguous()) for h, p in enumerate(heads)], dim=1)

    def hot_experts(self, prefix: str):
        """The plan's hot experts of block ``prefix`` (its expert tensors are on the CPU): per
        device, slices [ids] of its expert tensors uploaded there as raw GGUF bytes
        (``gpu.experts.ExpertSubset``), and the CPU kernels' ``owned`` mask without them. The
        CPU's count drops by their bytes and their pages are released: the CPU side never reads
        them. → (tuple of callables, owned mask or None)."""
        layer = int(prefix.split(".")[1])
        if not self._hot.get(layer):
            return (), None
        names, stages = self._expert_stages(prefix)
        n_expert = self.shape(names["down"])[0]
        owned = np.ones(n_expert, dtype=bool)
        out = []
        for dev_name, ids in sorted(self._hot[layer].items()):
            parts = {}
            for s in stages:
                t, data = self.tensors[names[s]], self.model.tensor_data(names[s])
                if self.device_of[t.name] != CPU:
                    raise OffloadError(f"hot experts of {prefix}: {t.name} is not on the CPU")
                parts[s] = QuantTensor.upload(data[list(ids)], t.ggml_type, (len(ids),) + t.shape[1:],
                                              self.devices[dev_name])
                self.allocated[dev_name] += parts[s].nbytes
                for e in ids:
                    self.allocated[CPU] -= data[e].nbytes
                    release(data[e])
            owned[list(ids)] = False
            out.append(ExpertSubset(TorchExperts(**parts, compute_dtype=self._dtype(dev_name),
                                                 **self._act.get(prefix, {})), ids, n_expert))
        return tuple(out), owned

    def streamed_experts(self, prefix: str, on: str, owned=None):
        """Block ``prefix``'s CPU-resident experts as ``gpu.experts.StreamedExperts`` computing
        on device ``on`` (op offload): the same mapped bytes, copied per call."""
        names, stages = self._expert_stages(prefix)
        parts = {s: (self.model.tensor_data(names[s]), self.tensors[names[s]].ggml_type,
                     self.tensors[names[s]].shape) for s in stages}
        return StreamedExperts(parts, device=self.devices[on], compute_dtype=self._dtype(on), owned=owned,
                               **self._act.get(prefix, {}))

    def _per_expert(self, name: str):
        """Expert e → a projection over ``name[e]`` where the plan put ``name``."""
        if self.device_of[name] == CPU:
            data, qtype = self._cpu_matrix(name)
            return lambda e: RawLinear(data[e], qtype, name=name, int8_batch=self.int8_batch)
        w, dtype = self._upload(name), self._dtype(self.device_of[name])
        return lambda e: Linear(w[e], compute_dtype=dtype, name=name)
