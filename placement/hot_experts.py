"""Hot experts: single routed experts of CPU-resident blocks held in the VRAM a whole-tensor
plan leaves above each GPU's target.

llama.cpp places whole expert tensors (all E experts of a block), so the last GiB above a
GPU's fit holds nothing useful once it is smaller than one more tensor. With a routing profile
(``placement.routing``) that room is filled with the hottest single experts — slice ``[e]`` of
the block's gate/up/down tensors, all of them together — in order of expected hits per byte
(p_e / slice bytes), each on its block's GPU when that has room, else on the GPU with the most.
Afterwards no expert with a hit in the profile fits on any GPU: the plan stays tight.

A hot expert's bytes count on its GPU and leave the CPU's count (the runtime never reads them
there and drops their pages). The GPU also needs room to run them: the compute of that block's
routed experts on the GPU (``placement.compute``'s ``TorchExperts`` moments, as if every
token of a ubatch went to them — an upper bound).

``HotExperts`` is device → block → expert ids (sorted).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from placement.compute import F32, INT64, op_offload_staging_bytes
from placement.devices import CPU, format_bytes
from placement.errors import PlacementError
from placement.memory import Footprint, MemorySettings, attention_device, forward_model
from placement.routing import RoutingCounts, layer_key
from placement.tensors import ModelSpec, Role, TensorInfo

HotExperts = Mapping[str, Mapping[int, tuple[int, ...]]]


def expert_tensors(tensors: Sequence[TensorInfo], layer: int) -> list[TensorInfo]:
    """A block's routed-expert tensors that hold one slice per expert (weights and biases)."""
    return [t for t in tensors if t.layer == layer and t.role is Role.ROUTED_EXPERTS and len(t.shape) >= 2]


def slice_bytes(tensors: Sequence[TensorInfo], layer: int) -> int:
    """Bytes of one expert's slice [e] of all the block's expert tensors (rows are whole blocks)."""
    return sum(t.n_bytes // t.shape[0] for t in expert_tensors(tensors, layer))


def cpu_expert_layers(tensors: Sequence[TensorInfo], tensor_map: Mapping[str, str]) -> list[int]:
    """Blocks whose routed-expert tensors are all on the CPU (the only ones hot experts may come from)."""
    layers = sorted({t.layer for t in tensors if t.role is Role.ROUTED_EXPERTS and t.layer is not None})
    return [i for i in layers if all(tensor_map[t.name] == CPU for t in expert_tensors(tensors, i))]


def hot_bytes(hot: HotExperts, tensors: Sequence[TensorInfo]) -> dict[str, int]:
    per_layer: dict[int, int] = {}
    out: dict[str, int] = defaultdict(int)
    for dev, layers in hot.items():
        for layer, experts in layers.items():
            if layer not in per_layer:
                per_layer[layer] = slice_bytes(tensors, layer)
            out[dev] += per_layer[layer] * len(experts)
    return dict(out)


def check_hot(hot: HotExperts, tensors: Sequence[TensorInfo], tensor_map: Mapping[str, str],
              devices: Sequence[str]) -> None:
    """Refuse hot experts the plan cannot hold: a non-GPU device, a block whose experts are not
    all on the CPU, an expert id out of range or held twice."""
    open_layers = set(cpu_expert_layers(tensors, tensor_map))
    seen: dict[tuple[int, int], str] = {}
    for dev, layers in hot.items():
        if dev == CPU or dev not in devices:
            raise PlacementError(f"hot experts on {dev}: not one of the plan's GPUs "
                                 f"({', '.join(d for d in devices if d != CPU) or 'none'})")
        for layer, experts in layers.items():
            if layer not in open_layers:
                raise PlacementError(f"hot experts of {layer_key(layer)}: its expert tensors are not all "
                                     "on the CPU (a hot expert is a slice of a CPU-resident block)")
            n = expert_tensors(tensors, layer)[0].shape[0]
            for e in experts:
                if not 0 <= e < n:
                    raise PlacementError(f"hot expert {e} of {layer_key(layer)}: the block has {n} experts")
                if (layer, e) in seen:
                    raise PlacementError(f"hot expert {e} of {layer_key(layer)} is held by both "
                                         f"{seen[layer, e]} and {dev}")
                seen[layer, e] = dev


class HotCompute:
    """What running a block's hot experts adds to a GPU's compute: ``placement.compute``'s
    moments of ``gpu.experts.TorchExperts`` on that GPU for the block, at a full ubatch, plus
    the FFN's own activations when the block computes there, plus op offload's staging
    buffers on that GPU (allocated beside every moment)."""

    def __init__(self, spec: ModelSpec, tensors: Sequence[TensorInfo], tensor_map: Mapping[str, str],
                 settings: MemorySettings):
        self.fm = forward_model(spec, tensors, settings)
        self.tensors, self.tensor_map, self.spec, self.T = tensors, tensor_map, spec, settings.ubatch
        self._cache: dict[tuple[int, str], int] = {}
        # op offload's staging buffers stay allocated beside any moment (placement.compute)
        self.staging = op_offload_staging_bytes(tensors, lambda t: tensor_map[t.name], settings.host_backed)

    def peak(self, layer: int, gpu: str) -> int:
        if (layer, gpu) not in self._cache:
            home = attention_device([t for t in self.tensors if t.layer == layer], self.tensor_map) or gpu
            moments, _ = self.fm.routed(self.fm.blocks[layer], home, lambda _t: gpu)
            te = self.T * self.spec.n_embd * F32
            ffn_base = 3 * te + self.T * max(1, self.spec.n_expert_used) * (INT64 + F32) if home == gpu else 0
            self._cache[layer, gpu] = ffn_base + max(m.get(gpu, 0) for m in moments) + self.staging.get(gpu, 0)
        return self._cache[layer, gpu]


def hot_footprint(use: Mapping[str, Footprint], hot: HotExperts, spec: ModelSpec,
                  tensors: Sequence[TensorInfo], tensor_map: Mapping[str, str],
                  settings: MemorySettings) -> dict[str, Footprint]:
    """Per-device weights and compute with the hot experts moved from the CPU to their GPUs."""
    out = dict(use)
    moved = hot_bytes(hot, tensors)
    compute = HotCompute(spec, tensors, tensor_map, settings)
    for dev, n_bytes in moved.items():
        f = out.get(dev, Footprint())
        peak = max((compute.peak(layer, dev) for layer in hot[dev]), default=0)
        out[dev] = Footprint(f.weights_bytes + n_bytes, f.kv_bytes, max(f.compute_bytes, peak))
        c = out.get(CPU, Footprint())
        out[CPU] = Footprint(c.weights_bytes - n_bytes, c.kv_bytes, c.compute_bytes)
    return out


def choose_hot_experts(*, spec: ModelSpec, tensors: Sequence[TensorInfo], tensor_map: Mapping[str, str],
                       settings: MemorySettings, rooms: Mapping[str, int], computes: Mapping[str, int],
                       counts: RoutingCounts) -> dict[str, dict[int, tuple[int, ...]]]:
    """Fill each GPU's ``rooms`` (bytes above its target; ``computes``: its compute bytes now)
    with the experts of CPU-resident blocks by hits per byte (module docstring)."""
    gpus = [g for g in rooms if g != CPU]
    if not gpus:
        return {}
    layers = [i for i in cpu_expert_layers(tensors, tensor_map) if i in counts.layers]
    sizes = {i: slice_bytes(tensors, i) for i in layers}
    homes = {i: attention_device([t for t in tensors if t.layer == i], tensor_map) for i in layers}
    cands = [(float(p) / sizes[i], i, e) for i in layers for e, p in enumerate(counts.hit_rates(i)) if p > 0]
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    room = dict(rooms)
    compute = {g: computes.get(g, 0) for g in gpus}
    peaks = HotCompute(spec, tensors, tensor_map, settings)
    chosen: dict[str, dict[int, list[int]]] = {g: defaultdict(list) for g in gpus}
    left = cands
    while left:                     # a second pass: a GPU's compute may have grown enough to make room
        rest = []
        for c in left:
            _, layer, e = c
            order = sorted(gpus, key=lambda g: (g != homes[layer], -room[g]))
            for g in order:
                extra = sizes[layer] + max(0, peaks.peak(layer, g) - compute[g])
                if extra <= room[g]:
                    room[g] -= extra
                    compute[g] = max(compute[g], peaks.peak(layer, g))
                    chosen[g][layer].append(e)
                    break
            else:
                rest.append(c)
        if len(rest) == len(left):
            break
        left = rest
    return {g: {i: tuple(sorted(es)) for i, es in sorted(ls.items())} for g, ls in chosen.items() if ls}


def describe(hot: HotExperts, tensors: Sequence[TensorInfo]) -> str:
    """'CUDA0: 312 experts of 45 blocks (1.20 GiB)' per GPU, for the table."""
    sizes = hot_bytes(hot, tensors)
    return "; ".join(f"{dev}: {sum(len(es) for es in ls.values())} experts of {len(ls)} blocks "
                     f"({format_bytes(sizes.get(dev, 0))})" for dev, ls in sorted(hot.items()))


def to_json(hot: HotExperts) -> dict[str, dict[str, list[int]]]:
    return {dev: {layer_key(i): list(es) for i, es in sorted(ls.items())} for dev, ls in sorted(hot.items())}


def from_json(d: object, where: str) -> dict[str, dict[int, tuple[int, ...]]]:
    """The ``hot_experts`` mapping as ``to_json`` writes it (plan file, ``--json``)."""
    if d is None:
        return {}
    if not isinstance(d, Mapping):
        raise PlacementError(f"{where} must be a mapping DEVICE -> {{blk.N: [expert, ...]}}")
    out: dict[str, dict[int, tuple[int, ...]]] = {}
    for dev, layers in d.items():
        if not isinstance(layers, Mapping):
            raise PlacementError(f"{where}.{dev} must be a mapping blk.N -> [expert, ...]")
        out[str(dev)] = {}
        for key, experts in layers.items():
            text = str(key)
            if not text.startswith("blk.") or not text[4:].isdigit():
                raise PlacementError(f"{where}.{dev}: {text!r} is not blk.N")
            if not isinstance(experts, list) or not all(isinstance(e, int) and not isinstance(e, bool)
                                                        for e in experts):
                raise PlacementError(f"{where}.{dev}.{text} must be a list of expert numbers")
            out[str(dev)][int(text[4:])] = tuple(sorted(experts))
    return out
