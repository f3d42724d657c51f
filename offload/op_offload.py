"""``--op-offload`` wiring: RAM-resident experts get a streamed copy on a GPU for large
passes (llama.cpp's op offload); the threshold comes from ``placement.op_offload``.
"""
from __future__ import annotations

from gpu.experts import StagingBuffers
from offload.cpu_ops import CpuExperts
from offload.errors import OffloadError
from offload.gguf_model import ModelFile
from offload.models.shared.base import CausalLM
from offload.moe import MoE
from offload.weights import WeightStore
from placement.footprint import FootprintError
from placement.op_offload import MODES, PrefillModel, choose_threshold
from placement.plan import Plan
from placement.speculative import plan_profile


def enable_op_offload(net: CausalLM, weights: WeightStore, plan: Plan, model: ModelFile, mode: str, *,
                      virtual: bool) -> tuple[int | None, str]:
    """``--op-offload``: give each trunk MoE layer whose experts are all in RAM a streamed copy
    of them on a GPU (its own when it computes on one, else the plan's first), used for passes
    of at least the threshold (``placement.op_offload``: ``on`` llama.cpp's 32, ``auto`` the
    cost model's choice for the plan's hardware profile; on ``--virtual-gpus`` ``auto`` stays
    off: a CPU-backed device gains nothing). → (threshold or None, a line saying what was chosen)."""
    if mode not in MODES:
        raise OffloadError(f"--op-offload must be one of {', '.join(MODES)}, got {mode!r}")
    gpus = [d.name for d in plan.devices if d.is_gpu]
    if mode == "off":
        return None, "op offload: off"
    if not gpus:
        if mode == "on":
            raise OffloadError("--op-offload on: the plan has no GPU to stream the RAM-resident experts to")
        return None, "op offload: off (no GPU)"
    if mode == "auto" and virtual:
        return None, "op offload: off (auto does not stream to CPU-backed --virtual-gpus; use on)"
    hw = plan_profile(plan).hardware
    try:
        prefill = PrefillModel(plan, model, hw)
    except FootprintError as exc:
        if mode == "on":
            raise OffloadError(f"--op-offload on: {exc}") from None
        return None, f"op offload: off (the cost model cannot read this model: {exc})"
    threshold = choose_threshold(mode, prefill)
    if threshold is None:
        return None, "op offload: off (no RAM-resident experts, or streaming never pays on this box)"
    streamed: dict[str, list] = {}
    skipped = []
    for i, block in enumerate(net.blocks):
        moe = getattr(block, "ffn", None)
        if isinstance(moe, MoE) and isinstance(moe.experts, CpuExperts):
            if moe.experts.act != "silu" or moe.experts.biases:     # the streamed path computes plain SwiGLU
                skipped.append(i)
                continue
            on = block.device_name if block.device_name != "CPU" else gpus[0]
            moe.stream, moe.stream_min = weights.streamed_experts(f"blk.{i}", on, moe.owned), threshold
            streamed.setdefault(on, []).append(moe.stream)
    # one pair of staging buffers per GPU, a chunk of the largest expert tensor streamed there
    # (placement.compute.op_offload_staging_bytes counts them in the plan)
    for on, streams in streamed.items():
        staging = StagingBuffers(weights.devices[on], max(st.staging_bytes for st in streams))
        for st in streams:
            st.staging = staging
    n = sum(len(v) for v in streamed.values())
    why = "llama.cpp's default" if mode == "on" else f"cost model, profile {hw.source}"
    return threshold, (f"op offload: passes of >= {threshold} tokens stream the RAM-resident experts of "
                       f"{n} layers to a GPU ({mode}: {why}; pinned, double-buffered staging)"
                       + (f"; not blk.{','.join(map(str, skipped))} (expert biases or a non-SwiGLU "
                          "activation: the streamed path does not compute them)" if skipped else ""))
