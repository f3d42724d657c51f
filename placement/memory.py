"""Memory per device: weights, KV cache, compute buffers.

**Weights** — the exact byte size of every tensor placed on the device (GGUF header sizes).
A model without ``output.weight`` (tied embeddings) also pays a copy of ``token_embd`` on the
device of the output layer when that is not token_embd's device, as llama.cpp does.

**KV cache** — per block, on the device of the block's attention weights (its largest
attention tensor)::

    kv(block) = cells × (row_bytes(cache_type, n_head_kv·head_dim_k)
                         + row_bytes(cache_type, n_head_kv·head_dim_v))

* ``cells`` = the context rounded up to a multiple of 256 (llama.cpp pads the cache); for a
  sliding-window block ``min(cells, pad256(sliding_window + ubatch))``.
* MLA GGUFs (``attention.key_length_mla`` present, DeepSeek-V2/V3, Kimi): the cache holds the
  compressed latent only — one K row of ``kv_lora_rank + rope dims`` (= ``key_length``, with
  ``head_count_kv`` = 1) and no V, as llama.cpp's V-less MLA cache.
* NextN blocks: counted only when drafting with them (the draft head keeps its own cache
  over the whole context). A ``--draft`` GGUF's blocks likewise.
* ``row_bytes(t, n) = n / block_size(t) × type_size(t)`` (ggml_row_size).

**Compute buffer** — f32 activations for ``ubatch`` tokens through the widest block part
placed on the device (the buffer is reused block to block, so the widest one sizes it)::

    compute = 4 B × ubatch × (max over blocks on the device of width(block part)
                              + n_vocab + n_embd  if it holds the output layer (logits)
                              + n_embd    if it holds token_embd)
    width = 4·n_embd                                          (residual, norms, in/out)
          + [attention here]  n_head·head_dim_k + n_head_kv·(head_dim_k + head_dim_v)
                              + n_head·256                    (one flash-attention score tile)
          + [routed experts   3·n_expert_used·n_ff_exp        (gate, up, activation; the
             or the router]                                   router's device gathers them)
          + [shared experts]  3·n_expert_shared·n_ff_shexp
          + [dense FFN]       3·n_ff
          + [NextN glue]      2·n_embd                        (concat[enorm(e), hnorm(h)])

This is an estimate of the activations, not of a particular backend's allocator; the fit
target (default 1 GiB per GPU) is the margin that absorbs the difference.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from placement.devices import Device
from placement.errors import PlacementError
from placement.layers import output_slot_member
from placement.tensors import ModelSpec, Role, TensorInfo

F32_BYTES = 4
CACHE_PAD = 256          # llama.cpp pads the KV cache to a multiple of 256 cells
FLASH_ATTN_TILE = 256    # keys per flash-attention score tile

# The KV cache types llama.cpp's -ctk/-ctv accept.
CACHE_TYPES: dict[str, GGMLQuantizationType] = {
    t.name.lower(): t for t in (
        GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1)
}


def cache_type(name: str) -> GGMLQuantizationType:
    try:
        return CACHE_TYPES[name.lower()]
    except KeyError:
        raise PlacementError(
            f"unknown --cache-type {name!r} (one of {', '.join(CACHE_TYPES)})") from None


def row_bytes(qtype: GGMLQuantizationType, n: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    if n % block:
        raise PlacementError(f"a KV row of {n} values is not a multiple of {qtype.name}'s block of {block}")
    return n // block * size


def pad(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class MemorySettings:
    ctx: int
    cache_type: str = "f16"
    ubatch: int = 512

    def __post_init__(self) -> None:
        cache_type(self.cache_type)
        if self.ctx < 1 or self.ubatch < 1:
            raise PlacementError(f"context and ubatch must be >= 1 (got {self.ctx}, {self.ubatch})")


def kv_cells(spec: ModelSpec, layer: int, s: MemorySettings) -> int:
    cells = pad(s.ctx, CACHE_PAD)
    if spec.is_swa_layer(layer) and spec.sliding_window:
        cells = min(cells, pad(spec.sliding_window + s.ubatch, CACHE_PAD))
    return cells


def kv_bytes(spec: ModelSpec, layer: int, s: MemorySettings) -> int:
    """KV cache bytes of one block at ``s.ctx`` (see the module docstring)."""
    t = cache_type(s.cache_type)
    n_kv = spec.n_head_kv[layer]
    per_cell = row_bytes(t, n_kv * spec.head_dim_k)
    if not spec.is_mla:  # MLA: V is a view of the latent K row
        per_cell += row_bytes(t, n_kv * spec.head_dim_v)
    return kv_cells(spec, layer, s) * per_cell


def block_width(spec: ModelSpec, roles: set[Role]) -> int:
    """f32 values per token of one block's part that holds tensors of ``roles``."""
    width = 0
    if Role.ATTENTION in roles:
        width += (spec.n_head * spec.head_dim_k
                  + spec.n_head_kv[0] * (spec.head_dim_k + spec.head_dim_v)
                  + spec.n_head * FLASH_ATTN_TILE)
    if Role.ROUTED_EXPERTS in roles or Role.ROUTER in roles:
        # the router's device gathers the k expert outputs, wherever the experts ran
        width += 3 * spec.n_expert_used * spec.n_ff_exp
    if Role.SHARED_EXPERTS in roles:
        width += 3 * max(spec.n_expert_shared, 1) * (spec.n_ff_shexp or spec.n_ff_exp)
    if Role.DENSE_FFN in roles:
        width += 3 * spec.n_ff
    if Role.NEXTN in roles:
        width += 2 * spec.n_embd
    return width + 4 * spec.n_embd if width else 0


def compute_bytes_from_roles(spec: ModelSpec, block_roles: Iterable[set[Role]],
                             global_roles: set[Role], s: MemorySettings) -> int:
    """The compute formula, from the roles each block has on the device (and the global ones)."""
    width = max((block_width(spec, roles) for roles in block_roles), default=0)
    if Role.OUTPUT in global_roles:
        width += spec.n_vocab + spec.n_embd
    if Role.EMBEDDING in global_roles:
        width += spec.n_embd
    return F32_BYTES * s.ubatch * width


def compute_bytes(spec: ModelSpec, tensors: Iterable[TensorInfo], s: MemorySettings) -> int:
    """Compute buffer for a device holding ``tensors`` of a model with ``spec``."""
    roles_by_block: dict[int, set[Role]] = defaultdict(set)
    global_roles: set[Role] = set()
    for t in tensors:
        if t.layer is None:
            global_roles.add(t.role)
        else:
            roles_by_block[t.layer].add(t.role)
    return compute_bytes_from_roles(spec, roles_by_block.values(), global_roles, s)


def attention_device(block_tensors: Iterable[TensorInfo], placement: Mapping[str, str]) -> str | None:
    """Where a block's KV cache lives: with its largest attention tensor."""
    attn = [t for t in block_tensors if t.role is Role.ATTENTION]
    if not attn:
        return None
    return placement[max(attn, key=lambda t: t.n_bytes).name]


def tied_output(tensors: Sequence[TensorInfo]) -> TensorInfo | None:
    """A model without ``output.weight`` computes its logits with ``token_embd`` (tied
    embeddings); llama.cpp loads a second copy on the output layer's device. Returned as a
    stand-in OUTPUT tensor of the same size, or None for an untied model."""
    if any(t.role is Role.OUTPUT for t in tensors):
        return None
    embd = next((t for t in tensors if t.role is Role.EMBEDDING and t.name == "token_embd.weight"), None)
    return None if embd is None else replace(embd, name="output.weight (tied to token_embd)", role=Role.OUTPUT)


@dataclass(frozen=True)
class Footprint:
    weights_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0


def footprint(spec: ModelSpec, tensors: list[TensorInfo], placement: Mapping[str, str],
              s: MemorySettings, *, kv_blocks: Iterable[int]) -> dict[str, Footprint]:
    """Per-device weights / KV / compute of one model under ``placement`` (name → device).

    ``kv_blocks`` are the blocks that keep a KV cache (the trunk, plus NextN blocks when
    drafting with them).
    """
    weights: dict[str, int] = defaultdict(int)
    on_device: dict[str, list[TensorInfo]] = defaultdict(list)
    by_block: dict[int, list[TensorInfo]] = defaultdict(list)
    for t in tensors:
        dev = placement[t.name]
        weights[dev] += t.n_bytes
        on_device[dev].append(t)
        if t.layer is not None:
            by_block[t.layer].append(t)
    tied = tied_output(tensors)
    out_dev = next((placement[t.name] for t in tensors if output_slot_member(t)), None)
    if tied is not None and out_dev is not None:
        on_device[out_dev].append(tied)                  # the logits are computed there
        if out_dev != placement["token_embd.weight"]:
            weights[out_dev] += tied.n_bytes             # a second copy, off token_embd's device
    kv: dict[str, int] = defaultdict(int)
    for layer in kv_blocks:
        dev = attention_device(by_block.get(layer, ()), placement)
        if dev is not None:
            kv[dev] += kv_bytes(spec, layer, s)
    devices = set(weights) | set(kv)
    return {d: Footprint(weights[d], kv[d], compute_bytes(spec, on_device[d], s)) for d in devices}


def add_footprints(*parts: Mapping[str, Footprint]) -> dict[str, Footprint]:
    """Sum per-device footprints (model + a separate draft model, which has its own buffers)."""
    out: dict[str, Footprint] = {}
    for part in parts:
        for dev, f in part.items():
            o = out.get(dev, Footprint())
            out[dev] = Footprint(o.weights_bytes + f.weights_bytes, o.kv_bytes + f.kv_bytes,
                                 o.compute_bytes + f.compute_bytes)
    return out


@dataclass(frozen=True)
class DeviceTotals:
    """One row of the plan's table (all in bytes)."""

    name: str
    budget_bytes: int
    target_bytes: int
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes

    @property
    def free_after_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    @property
    def above_target_bytes(self) -> int:
        return self.free_after_bytes - self.target_bytes


def device_totals(devices: Iterable[Device], targets: Mapping[str, int],
                  use: Mapping[str, Footprint]) -> list[DeviceTotals]:
    out = []
    for d in devices:
        f = use.get(d.name, Footprint())
        out.append(DeviceTotals(d.name, d.budget_bytes, targets.get(d.name, 0),
                                f.weights_bytes, f.kv_bytes, f.compute_bytes))
    return out
