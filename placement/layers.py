"""The layer layout: where a tensor goes when no override rule matches (``-ngl``, ``-ts``).

Same arithmetic as llama.cpp's ``llama_model::load_tensors``:

* the model has ``n_layer + 1`` *slots*: blocks ``0 … n_layer-1`` (GGUF ``block_count``,
  NextN blocks included) and the output layer as slot ``n_layer``;
* ``-ngl N`` puts the last ``N`` slots on GPUs: slot ``il`` is on a GPU when
  ``il >= n_layer + 1 - N``;
* those slots are split across the GPUs by the cumulative, normalized ``-ts`` fractions:
  slot ``il`` goes to the first GPU whose cumulative fraction is greater than
  ``(il - first_gpu_slot) / n_gpu_slots`` (``std::upper_bound``);
* the input layer (``token_embd`` and any other tensor outside the blocks and the output
  layer) always stays on the CPU.

We compute the split points with exact fractions; llama.cpp uses float32. The two agree
whenever ``-ts`` holds integers that sum to the number of GPU slots, which is what the
auto-fit emits; for arbitrary user fractions a slot sitting exactly on a split point could
round differently.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from placement.devices import CPU
from placement.errors import PlacementError
from placement.tensors import Role, TensorInfo


def output_slot_member(t: TensorInfo) -> bool:
    """``output.weight`` and ``output_norm`` form llama.cpp's output layer; so does a block
    drafter's glue outside its blocks (DSpark's fc, enc.output_norm, Markov and confidence
    heads: ``LLM_TENSOR_LAYER_OUTPUT`` in llama.cpp's llama-arch.cpp)."""
    return t.layer is None and (t.role in (Role.OUTPUT, Role.NEXTN) or t.name.startswith("output_norm."))


def input_layer(t: TensorInfo) -> bool:
    """llama.cpp's input layer (``token_embd`` and any other tensor outside the blocks and
    the output layer): always on the CPU."""
    return t.layer is None and not output_slot_member(t)


@dataclass(frozen=True)
class LayerLayout:
    n_layer: int                    # GGUF block_count (the output layer is slot n_layer)
    gpus: tuple[str, ...]           # GPU names, in -ts order
    n_gpu_layers: int               # -ngl, clamped to n_layer + 1
    tensor_split: tuple[float, ...]  # one non-negative weight per GPU

    def __post_init__(self) -> None:
        if len(self.tensor_split) != len(self.gpus):
            raise PlacementError(
                f"-ts has {len(self.tensor_split)} values but there are {len(self.gpus)} GPUs")
        if any(x < 0 for x in self.tensor_split):
            raise PlacementError(f"-ts values must be >= 0, got {list(self.tensor_split)}")
        if self.gpus and sum(self.tensor_split) <= 0:
            raise PlacementError("-ts values must not all be zero")
        if self.n_gpu_layers < 0:
            raise PlacementError(f"-ngl must be >= 0 (or -1 for all), got {self.n_gpu_layers}")
        # cumulative, normalized split points (llama.cpp's `splits`)
        total = sum(Fraction(x) for x in self.tensor_split)
        cumulative, acc = [], Fraction(0)
        for x in self.tensor_split:
            acc += Fraction(x)
            cumulative.append(acc / total)
        object.__setattr__(self, "_split_points", tuple(cumulative))

    @property
    def n_slots(self) -> int:
        return self.n_layer + 1

    @property
    def gpu_slots(self) -> int:
        return min(self.n_gpu_layers, self.n_slots) if self.gpus else 0

    @property
    def first_gpu_slot(self) -> int:
        return self.n_slots - self.gpu_slots

    def slot_device(self, slot: int) -> str:
        if slot < self.first_gpu_slot or not self.gpus:
            return CPU
        pos = Fraction(slot - self.first_gpu_slot, self.gpu_slots)
        return self.gpus[min(bisect_right(self._split_points, pos), len(self.gpus) - 1)]

    def device_of(self, t: TensorInfo) -> str:
        if t.layer is not None:
            return self.slot_device(t.layer)
        if output_slot_member(t):
            return self.slot_device(self.n_layer)
        return CPU  # input layer: llama.cpp never offloads it

    def slots_per_gpu(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {g: [] for g in self.gpus}
        for slot in range(self.first_gpu_slot, self.n_slots):
            out[self.slot_device(slot)].append(slot)
        return out


def layout_from_flags(n_layer: int, gpus: Sequence[str], n_gpu_layers: int | None,
                      tensor_split: Sequence[float] | None, default_split: Sequence[float]) -> LayerLayout:
    """``-ngl`` / ``-ts`` as llama.cpp reads them: ``n_gpu_layers`` None or -1 = every slot; no
    ``-ts`` = ``default_split`` (llama.cpp: the GPUs' free memory); a short ``-ts`` is padded with
    zeros. Stored with the split as whole slot counts: the same slots land on the same GPUs, and
    the emitted ``-ts`` needs no float rounding in llama.cpp."""
    ngl = n_layer + 1 if n_gpu_layers is None or n_gpu_layers == -1 else n_gpu_layers
    if ngl < 0:
        raise PlacementError(f"-ngl must be >= 0 or -1 (all), got {ngl}")
    split = list(default_split if tensor_split is None else tensor_split)
    if len(split) > len(gpus):
        raise PlacementError(f"-ts has {len(split)} values but there are {len(gpus)} GPUs "
                             f"({', '.join(gpus) or 'none'})")
    split += [0.0] * (len(gpus) - len(split))
    layout = LayerLayout(n_layer, tuple(gpus), min(ngl, n_layer + 1), tuple(split))
    counts = tuple(float(len(v)) for v in layout.slots_per_gpu().values())
    if not gpus:
        return layout
    return LayerLayout(n_layer, tuple(gpus), layout.n_gpu_layers, counts if sum(counts) else (1.0,) * len(gpus))
