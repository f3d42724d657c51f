"""What one forward pass reads, and on which device: a placed model's footprint.

``footprint_from_tensors`` turns a tensor list and a plan's tensor name -> device map into a
``DecodeFootprint``: per layer, the bytes read once per pass on each device (dense weights,
the KV cache at a given context), the routed experts held on each device (``ExpertSlice``),
the device the hidden state lives on; the same for the output head and for one draft-head
pass. It counts bytes only; ``placement.cost`` turns a footprint into seconds.
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

from placement.devices import CPU
from placement.errors import PlacementError
from placement.tensors import Role, TensorInfo

_DEVICE = re.compile(r"CPU|CUDA\d+")


class FootprintError(PlacementError):
    """A tensor list / tensor map the cost model cannot turn into a footprint (one line)."""


@dataclass(frozen=True)
class ExpertSlice:
    """A layer's routed-expert weights held on one device.

    ``-ot`` places whole tensors, so a slice usually holds all ``n_experts`` experts but only
    the matrices (gate/up/down) that were sent there; ``bytes_per_expert`` counts those.
    Hot experts (``placement.hot_experts``) split a CPU block by expert instead: ``experts``
    names which ones the slice holds (None: any ``n_experts`` of them, in proportion).
    """

    device: str
    bytes_per_expert: float
    n_experts: int
    experts: tuple[int, ...] | None = None


@dataclass(frozen=True)
class LayerFootprint:
    layer: int
    home: str                                # device the hidden state lives on (attention's)
    reads: tuple[tuple[str, int], ...]       # (device, bytes) read once per pass, any batch
    experts: tuple[ExpertSlice, ...] = ()
    n_expert: int = 0                        # routed experts in the layer (0: dense layer)
    n_expert_used: int = 0                   # k


@dataclass(frozen=True)
class ForwardFootprint:
    """One forward pass: token input, layers in order, output head."""

    input_device: str
    layers: tuple[LayerFootprint, ...]
    head_home: str
    head_reads: tuple[tuple[str, int], ...]
    draft_head: bool = False        # the NextN head's pass (its eager ops cost apart: ``draft_pass``)


@dataclass(frozen=True)
class DecodeFootprint:
    target: ForwardFootprint
    draft: ForwardFootprint | None           # the NextN head; None when the model has none
    n_embd: int
    act_bytes: int = 4                       # bytes per hidden-state element copied between devices


def _nextn_name(tensor: MODEL_TENSOR, layer: int) -> str:
    return TENSOR_NAMES[tensor].format(bid=layer) + "."


def footprint_from_tensors(tensors: Sequence[TensorInfo], tensor_map: Mapping[str, str], *,
                           n_expert_used: int, draft_layers: Sequence[int] | None = None,
                           n_embd: int | None = None, act_bytes: int = 4,
                           kv_bytes: Mapping[int, int] | None = None,
                           hot_experts: Mapping[str, Mapping[int, Sequence[int]]] | None = None) -> DecodeFootprint:
    """Build the footprint of a placed model.

    ``tensor_map`` is the plan's tensor name -> device. NextN layers (``TensorInfo.nextn``)
    are left out of the target pass; ``draft_layers`` are the layers one draft forward runs
    (default: the first NextN layer, the one chained MTP drafting reuses). Embedding tables
    are looked up one row per token, so they count only as the pass's input device (a tied
    output head still reads ``token_embd`` whole). ``kv_bytes`` (layer -> bytes) is the KV
    cache attention reads per pass at the context the prediction is for, on that layer's
    home device; without it the prediction is for a short context. ``hot_experts`` (GPU →
    layer → expert ids, a plan's ``hot_experts``) takes those experts out of their CPU block.
    """
    if n_expert_used <= 0:
        raise FootprintError(f"n_expert_used must be positive, got {n_expert_used}")
    for t in tensors:
        dev = tensor_map.get(t.name)
        if dev is None:
            raise FootprintError(f"tensor {t.name} has no device in the tensor map")
        if not _DEVICE.fullmatch(dev):
            raise FootprintError(f"tensor {t.name}: unknown device {dev!r}")

    by_layer: dict[int, list[TensorInfo]] = defaultdict(list)
    globals_: list[TensorInfo] = []
    for t in tensors:
        (globals_ if t.layer is None else by_layer[t.layer]).append(t)
    nextn_layers = sorted(i for i, ts in by_layer.items()
                          if any(t.nextn or t.role is Role.NEXTN for t in ts))

    embd = next((t for t in globals_ if t.role is Role.EMBEDDING), None)
    out_prefix = TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + "."
    out = (next((t for t in globals_ if t.name.startswith(out_prefix)), None)   # not deepseek4's output_hc_*
           or next((t for t in globals_ if t.role is Role.OUTPUT), None) or embd)  # tied output
    norm_prefix = TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM] + "."
    out_norm = next((t for t in globals_ if t.name.startswith(norm_prefix)), None)
    if out is None:
        raise FootprintError("model has neither an output nor a token_embd tensor")
    if n_embd is None:
        if embd is None:
            raise FootprintError("no token_embd tensor: pass n_embd")
        n_embd = embd.shape[-1]                       # numpy order: (n_vocab, n_embd)
    head = (tensor_map[out.name], _reads([out, out_norm], tensor_map))
    input_device = tensor_map[embd.name] if embd is not None else head[0]

    hot: dict[int, dict[str, tuple[int, ...]]] = defaultdict(dict)
    for dev, layers in (hot_experts or {}).items():
        for layer, ids in layers.items():
            hot[layer][dev] = tuple(ids)
    kv = dict(kv_bytes or {})
    unknown = sorted(set(kv) - set(by_layer))
    if unknown:
        raise FootprintError(f"kv_bytes given for layer(s) {unknown} not in the model")
    target_layers = tuple(_layer_footprint(i, by_layer[i], tensor_map, n_expert_used, kv.get(i, 0), hot.get(i))
                          for i in sorted(by_layer) if i not in nextn_layers)
    if not target_layers:
        raise FootprintError("model has no target layers")
    target = ForwardFootprint(input_device, target_layers, *head)

    if draft_layers is None:
        draft_layers = nextn_layers[:1]
    draft = None
    if draft_layers:
        missing = [i for i in draft_layers if i not in by_layer]
        if missing:
            raise FootprintError(f"draft layer(s) {missing} not in the model")
        d_layers = tuple(_layer_footprint(i, by_layer[i], tensor_map, n_expert_used, kv.get(i, 0), hot.get(i))
                         for i in draft_layers)
        d_ts = [t for i in draft_layers for t in by_layer[i]]
        d_out = _first_named(d_ts, MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD) or out
        d_norm = _first_named(d_ts, MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM) or out_norm
        # The draft pass starts from the target's last hidden state.
        draft = ForwardFootprint(target_layers[-1].home, d_layers,
                                 tensor_map[d_out.name], _reads([d_out, d_norm], tensor_map), draft_head=True)
    return DecodeFootprint(target, draft, int(n_embd), act_bytes)


def _first_named(ts: Iterable[TensorInfo], kind: MODEL_TENSOR) -> TensorInfo | None:
    return next((t for t in ts if t.layer is not None
                 and t.name.startswith(_nextn_name(kind, t.layer))), None)


def _reads(ts: Iterable[TensorInfo | None], tensor_map: Mapping[str, str]) -> tuple[tuple[str, int], ...]:
    acc: dict[str, int] = defaultdict(int)
    for t in ts:
        if t is not None:
            acc[tensor_map[t.name]] += t.n_bytes
    return tuple(sorted(acc.items()))


# Per-layer tensors that are not read whole each pass: looked up (embeddings) or belonging
# to the draft head's output (counted in ForwardFootprint.head_reads).
_NOT_LAYER_READS = (MODEL_TENSOR.NEXTN_EMBED_TOKENS, MODEL_TENSOR.NEXTN_SHARED_HEAD_HEAD,
                    MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM)


def _layer_footprint(layer: int, ts: list[TensorInfo], tensor_map: Mapping[str, str],
                     k: int, kv_bytes: int, hot: Mapping[str, tuple[int, ...]] | None = None) -> LayerFootprint:
    skip = tuple(_nextn_name(kind, layer) for kind in _NOT_LAYER_READS)
    dense = [t for t in ts if t.role is not Role.ROUTED_EXPERTS and not t.name.startswith(skip)]
    exps = [t for t in ts if t.role is Role.ROUTED_EXPERTS]

    # Home: where the layer's attention runs (the NextN input projection for a draft layer).
    anchor = ([t for t in ts if t.name.startswith(_nextn_name(MODEL_TENSOR.NEXTN_EH_PROJ, layer))]
              or [t for t in ts if t.role is Role.ATTENTION] or dense or exps)
    home = tensor_map[max(anchor, key=lambda t: t.n_bytes).name]

    n_expert = 0
    per_dev: dict[str, float] = defaultdict(float)
    for t in exps:
        if t.n_experts == 0:
            raise FootprintError(f"{t.name}: routed-expert tensor is not 3-D (shape {t.shape})")
        if n_expert and t.n_experts != n_expert:
            raise FootprintError(f"blk.{layer}: expert tensors disagree on the expert count "
                                 f"({n_expert} vs {t.n_experts} in {t.name})")
        n_expert = t.n_experts
        per_dev[tensor_map[t.name]] += t.n_bytes / t.n_experts
    if n_expert and k > n_expert:
        raise FootprintError(f"blk.{layer}: n_expert_used {k} exceeds the {n_expert} experts")
    slices = tuple(ExpertSlice(dev, b, n_expert) for dev, b in sorted(per_dev.items()))
    if hot:
        if set(per_dev) != {CPU}:
            raise FootprintError(f"blk.{layer}: hot experts need the block's expert tensors on the CPU")
        held = sorted(e for ids in hot.values() for e in ids)
        rest = tuple(sorted(set(range(n_expert)) - set(held)))
        slices = (ExpertSlice(CPU, per_dev[CPU], len(rest), rest),) + tuple(
            ExpertSlice(dev, per_dev[CPU], len(ids), tuple(ids)) for dev, ids in sorted(hot.items()))
    reads = dict(_reads(dense, tensor_map))
    if kv_bytes:
        reads[home] = reads.get(home, 0) + kv_bytes
    return LayerFootprint(layer, home, tuple(sorted(reads.items())), slices, n_expert, k if n_expert else 0)
