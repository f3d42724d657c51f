"""Op offload: a prompt batch large enough runs the RAM-resident experts on a GPU, streaming
each touched expert over the host link, instead of on the CPU (llama.cpp does this for a
batch of at least ``GGML_OP_OFFLOAD_MIN_BATCH`` = 32 tokens; ik_llama.cpp with a fixed rule).
Here the threshold comes from the cost model, per box.

For a pass of T tokens, each MoE layer's CPU-resident experts cost

    on the CPU:   max(touched·b / cpu_read,  pairs·f / cpu_batched)
    streamed:     max(touched·b / link,      pairs·f / gpu_batched) + link latency

with b the bytes of one expert, touched the distinct experts the T tokens route to (uniform,
or per-expert hit rates from ``offload profile``), pairs = T·k of their (token, expert)
assignments, f = 2 × an expert's parameters (FLOPs per assignment); streaming is
double-buffered, so the copy of one expert overlaps the compute of the previous one. The
threshold is the smallest T at which streaming the whole model's CPU experts is faster. The
rest of a pass (dense weights, GPU-resident experts, copies, fixed costs) is the decode cost
model's ``forward_time`` plus the GPU's matmul FLOPs at ``gpu_batched`` — the same with and
without op offload. Rates: ``HardwareProfile.cpu_batched_gflops`` / ``gpu_batched_tflops``
(priors by default; a YAML overrides them), ``cpu_read_gbps``, each GPU's ``link_gbps``.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from placement.cost import expert_slice_use, forward_time
from placement.devices import CPU
from placement.footprint import ExpertSlice, ForwardFootprint, LayerFootprint
from placement.hardware import HardwareProfile
from placement.plan import Plan, PlannedModel
from placement.routing import RoutingCounts
from placement.speculative import plan_footprint
from placement.tensors import Role, TensorInfo

MODES = ("auto", "on", "off")
LLAMA_CPP_MIN_BATCH = 32         # what `on` uses: llama.cpp's GGML_OP_OFFLOAD_MIN_BATCH default
MAX_THRESHOLD = 1 << 16


@dataclass(frozen=True)
class _Layer:
    footprint: LayerFootprint
    cpu: ExpertSlice              # the layer's CPU-resident experts
    flops: float                  # per (token, expert) assignment
    gpu: str                      # where they would be streamed to


def flops_per_assignment(tensors: Sequence[TensorInfo], layer: int) -> float:
    """FLOPs of one (token, expert) assignment in ``layer``: 2 × one expert's parameters over
    its routed-expert matrices (gate/up/down, or gate_up/down)."""
    return 2.0 * sum(t.n_elements / t.shape[0] for t in tensors
                     if t.layer == layer and t.role is Role.ROUTED_EXPERTS and len(t.shape) == 3)


class PrefillModel:
    """The time of one pass of T tokens with the CPU experts on the CPU or streamed (module docstring)."""

    def __init__(self, plan: Plan, model: PlannedModel, hw: HardwareProfile, *,
                 hits: RoutingCounts | None = None):
        gpus = [d.name for d in plan.devices if d.is_gpu]
        decode = plan_footprint(plan, model, None)
        fp = decode.target
        by_layer: dict[int, list[TensorInfo]] = defaultdict(list)
        for t in model.tensors:
            if t.layer is not None:
                by_layer[t.layer].append(t)
        self.layers: list[_Layer] = []
        rest = []
        for lay in fp.layers:
            cpu = [s for s in lay.experts if s.device == CPU]
            if cpu and gpus:
                self.layers.append(_Layer(lay, cpu[0], flops_per_assignment(by_layer[lay.layer], lay.layer),
                                          lay.home if lay.home != CPU else gpus[0]))
                lay = replace(lay, experts=tuple(s for s in lay.experts if s.device != CPU))
            rest.append(lay)
        self.rest = ForwardFootprint(fp.input_device, tuple(rest), fp.head_home, fp.head_reads)
        self.n_embd, self.hw, self.hits = decode.n_embd, hw, hits
        # GPU matmul FLOPs per token: GPU-resident matrices (routed experts: k of E per token)
        k = max(model.spec.n_expert_used, 1)
        self.gpu_flops_per_token = sum(
            2.0 * t.n_elements * (k / t.shape[0] if t.role is Role.ROUTED_EXPERTS and len(t.shape) == 3 else 1)
            for t in model.tensors
            if plan.tensors.get(t.name, CPU) != CPU and len(t.shape) >= 2 and t.role not in (Role.EMBEDDING,)
            and not t.nextn)

    def expert_seconds(self, batch: int, *, streamed: bool) -> float:
        hw, total = self.hw, 0.0
        for layer in self.layers:
            touched, pairs = expert_slice_use(layer.cpu, layer.footprint, batch, None, self.hits)
            n_bytes, flops = touched * layer.cpu.bytes_per_expert, pairs * layer.flops
            if streamed:
                link = hw.gpus[layer.gpu].link_gbps * 1e9
                total += max(n_bytes / link, flops / (hw.gpu_batched_tflops * 1e12)) + hw.link_latency_us * 1e-6
            else:
                total += max(n_bytes / (hw.cpu_read_gbps * 1e9), flops / (hw.cpu_batched_gflops * 1e9))
        return total

    def pass_seconds(self, batch: int, *, streamed: bool) -> float:
        rest = forward_time(self.rest, batch, self.hw, n_embd=self.n_embd, hits=self.hits)
        gpu = batch * self.gpu_flops_per_token / (self.hw.gpu_batched_tflops * 1e12)
        return rest + gpu + self.expert_seconds(batch, streamed=streamed)

    def tokens_per_second(self, batch: int, *, streamed: bool) -> float:
        return batch / self.pass_seconds(batch, streamed=streamed)

    def threshold(self) -> int | None:
        """Smallest batch at which streaming the CPU experts beats the CPU (None: no CPU
        experts, no GPU, or not below ``MAX_THRESHOLD``). Streaming's cost grows with the batch
        more slowly than the CPU's (its copies are bounded by the experts' bytes), so one
        crossing is searched by bisection."""
        if not self.layers:
            return None
        def wins(b: int) -> bool:
            return self.expert_seconds(b, streamed=True) < self.expert_seconds(b, streamed=False)
        if not wins(MAX_THRESHOLD):
            return None
        lo, hi = 1, MAX_THRESHOLD
        while lo < hi:
            mid = (lo + hi) // 2
            if wins(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo


def choose_threshold(mode: str, model: PrefillModel | None) -> int | None:
    """``--op-offload``: off → None (never); on → llama.cpp's 32; auto → the cost model's."""
    if mode not in MODES:
        raise ValueError(f"--op-offload must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "off" or model is None or not model.layers:
        return None
    return LLAMA_CPP_MIN_BATCH if mode == "on" else model.threshold()


def batches_around(threshold: int, ubatch: int) -> Sequence[int]:
    """Batches to print predicted prefill t/s at: half and twice the threshold, and the ubatch."""
    return sorted({max(1, threshold // 2), threshold, 2 * threshold, ubatch})
