"""Memory model, hand-checked: KV (plain, MLA, sliding window, NextN, quantized), compute, weights."""
from __future__ import annotations

import pytest

from placement.compute import Devices, projection
from placement.devices import CPU, parse_devices
from placement.errors import PlacementError
from placement.layers import LayerLayout
from placement.memory import MemorySettings, kv_bytes, row_bytes
from placement.plan import Placement, build_plan
from placement.rules import cpu_moe_rules
from placement.tensors import Role, TensorInfo
from gguf import GGMLQuantizationType


def test_kv_deepseek_mla_is_the_compressed_latent(models):
    spec = models["deepseek-v3"].spec
    s = MemorySettings(32768)
    # one K row of kv_lora_rank + rope dims = 576 f16 values per token, no V (V-less MLA cache)
    assert kv_bytes(spec, 10, s) == 32768 * 576 * 2
    assert sum(kv_bytes(spec, i, s) for i in range(61)) == 2_302_672_896      # 2196 MiB


def test_kv_glm_plain_and_quantized(models):
    spec = models["glm-4.5-air"].spec
    assert kv_bytes(spec, 5, MemorySettings(32768)) == 32768 * (8 * 128 * 2) * 2            # K + V, f16
    assert row_bytes(GGMLQuantizationType.Q8_0, 1024) == 1024 // 32 * 34
    assert kv_bytes(spec, 5, MemorySettings(32768, "q8_0")) == 32768 * 2 * 1088
    assert kv_bytes(spec, 5, MemorySettings(1000)) == 1024 * 8 * 128 * 2 * 2               # padded to 256 cells


def test_kv_gpt_oss_sliding_window(models):
    spec = models["gpt-oss-120b"].spec
    s = MemorySettings(131072, ubatch=512)
    assert kv_bytes(spec, 1, s) == 131072 * 2048                 # full attention: 8 heads * 64 * (K+V) * 2 B
    assert kv_bytes(spec, 0, s) == 768 * 2048                    # window 128 + ubatch 512, padded to 256


MIB = 2**20
T, E = 512, 2048                         # ubatch, Qwen3-30B-A3B's n_embd
TE = T * E * 4                           # one (T, n_embd) float32 activation: 4 MiB


def _qwen3_cpu_moe(models, settings):
    m = models["qwen3-30b-a3b"]
    devices = parse_devices("CUDA0=24GiB,CPU=64GiB")
    placement = Placement(tuple(cpu_moe_rules()), LayerLayout(48, ("CUDA0",), 49, (49.0,)))
    return m, build_plan(m, placement, settings, devices, {"CUDA0": 1 << 30}, mode="flags")


def test_compute_formula_qwen3(models):
    """--cpu-moe on one CUDA GPU at ubatch 512, ctx 8192, f16 cache, by hand.

    GPU (bf16, c = 2): the largest moment is the output layer: x and output_norm(x) (2 TE)
    while output.weight (Q6_K, 151936 x 2048) is dequantized for the last row, a chunk of
    16 Mi values = 8192 rows at a time, 18.375 B per value; the attention's largest is the
    o-projection (Q4_K 2048 x 4096, whole, 12.375 B/value) beside q/k/v, mask and output.
    CPU: block 0's routed experts: the embedding's output (block 0's input, still referenced
    on the CPU where the lookup ran), the host copies of x, ids and weights for the experts
    thread, and moe_ffn's buffers in that thread (A = T·k = 4096 pairs); plus the int8
    decode scratch every CPU expert layer binds at load.
    """
    _, plan = _qwen3_cpu_moe(models, MemorySettings(8192, ubatch=512))
    gpu, cpu = plan.totals
    out_chunk = 8192 * 2048 * 18.375                              # 294 MiB of dequant scratch
    out_proj = 1 * 2048 * 2 + max(out_chunk + 151936 * 2 + 8192 * 2,   # x.to(bf16); chunk + out + chunk out
                                  151936 * 2 + 151936 * 4)              # or out + float copy
    output = 2 * TE + out_proj
    o_proj = T * 4096 * 2 + max(2048 * 4096 * 12.375 + T * 2048 * 2, T * 2048 * (2 + 4))
    qkv = 2 * TE + T * (4096 + 512 + 512) * 4                      # x, attn_norm(x), q, k, v
    mask = T * 8192 + (T + 8192) * 8                               # bool mask + index vectors
    attention = qkv + mask + T * 4096 * 4 + o_proj                 # ... + SDPA output, o-projection
    assert attention == 141_627_392 and output == 316_994_304
    # op offload's staging (placement.compute.op_offload_staging_bytes): two buffers, each a
    # 256 MiB chunk of the largest RAM-resident expert tensor (ffn_down_exps, Q6_K: 210 bytes
    # per 256 values, 157.5 MiB: the whole tensor)
    staging = 2 * min(256 << 20, 128 * 2048 * 768 * 210 // 256)
    assert gpu.compute_bytes == max(output, attention) + staging
    A, n_ff = T * 8, 768
    # a 512-token batch of quantized experts takes int8 activations: per row of X (2048)
    # codes + 64 pad, then float32 scales per 32 (+16), sums per 16, sums per 4 and their
    # scales (+16 each); likewise per row of H (768)
    x8 = 2048 + 64 + 4 * (64 + 16 + 128 + 2 * (512 + 16))          # 7168 B
    h8 = 768 + 64 + 4 * (24 + 16 + 48 + 2 * (192 + 16))            # 2848 B
    # the prompt batch's GEMM packs X per assignment into tiles of 16 (each of the 128 experts'
    # last tile padded: 4096 + 15 * 128 lanes): codes, scales per 32, sums per 16, a row index
    # (2048 + 4 * 64 + 4 * 128 + 8 B a lane), then H alike (smaller): the larger counts
    gemm = (A + 15 * 128) * (2048 + 4 * 64 + 4 * 128 + 8)
    worker = TE + A * n_ff * 4 + A * E * 4 + T * x8 + A * h8 + A * 64 + gemm
    copies = TE + T * 8 * (8 + 4)                                  # x, ids (int64), weights (f32)
    assert worker == 82_918_400
    # bound at load for the whole run (placement.compute.decode_int8_scratch_bytes): each of
    # the 48 layers' routed experts (Q4_K gate/up, Q6_K down: int8 at decode) holds int8
    # activations of 16 rows of X and 16·k = 128 rows of H
    decode8 = 48 * (16 * x8 + 16 * 8 * h8)
    assert decode8 == 23_003_136
    assert cpu.compute_bytes == TE + copies + worker + decode8 == 114_359_296  # 109.1 MiB


def test_cpu_projection_counts_int8_activations_of_prompt_batches_only():
    """A CPU projection holds its float32 result and what the kernel derives from the input:
    int8 activations for a prompt batch (more than 16 tokens, placement.limits.DECODE_TOKENS) of
    a quantized type, and their copy packed into the GEMM's tiles of 16; the float path's sums of 16 for a decode/verify batch, a float type, or
    with int8 off (``Devices(int8_from=None)``)."""
    q8 = TensorInfo("blk.0.attn_q.weight", (4096, 2048), GGMLQuantizationType.Q8_0, 4096 * 2176, 0, Role.ATTENTION)
    f16 = TensorInfo("blk.0.attn_q.weight", (4096, 2048), GGMLQuantizationType.F16, 4096 * 4096, 0, Role.ATTENTION)
    kinds, flt = Devices("auto", ()), Devices("auto", (), int8_from=None)
    x8 = 2048 + 64 + 4 * (64 + 16 + 128 + 2 * (512 + 16))          # one row's int8 activations
    lane = 2048 + 4 * 64 + 4 * 128 + 8                             # and one lane of its GEMM tiles
    bsums, y = 2048 // 16 * 4, 4096 * 4                            # one row's sums / result
    assert projection(q8, CPU, CPU, 17, kinds) == {CPU: 17 * (x8 + y) + 32 * lane}   # 17 tokens: two tiles
    assert projection(q8, CPU, CPU, 16, kinds) == {CPU: 16 * (bsums + y)}
    assert projection(f16, CPU, CPU, 512, kinds) == {CPU: 512 * (bsums + y)}
    assert projection(q8, CPU, CPU, 512, flt) == {CPU: 512 * (bsums + y)}
    # called from a GPU home: the host copy of the input too, the result moved home
    assert projection(q8, CPU, "CUDA0", 512, kinds) == {CPU: 512 * (x8 + lane + 2048 * 4 + y), "CUDA0": 512 * y}


def test_compute_host_backed_gpu_computes_like_the_cpu(models):
    """The same plan with CUDA0 backed by host RAM (--virtual-gpus): f32 dequantization, the
    f16 cache upcast to float32 for the CPU's attention kernel; the host's joint compute is
    the largest moment of CUDA0 + CPU, not the sum of their peaks."""
    from placement.plan import host_footprint
    m, cuda = _qwen3_cpu_moe(models, MemorySettings(8192))
    _, host = _qwen3_cpu_moe(models, MemorySettings(8192, host_backed=("CUDA0",)))
    assert host.totals[0].compute_bytes != cuda.totals[0].compute_bytes
    # the output layer in f32: 8192 rows x 2048 x 18.375 B, out 151936 x 4 (no cast, no float copy)
    out_proj = max(8192 * 2048 * 18.375 + 151936 * 4 + 8192 * 4, 151936 * 4)
    assert host.totals[0].compute_bytes == 2 * TE + out_proj
    joint = host_footprint(host, m).compute_bytes
    separate = sum(t.compute_bytes for t in host.totals)
    assert max(t.compute_bytes for t in host.totals) <= joint < separate


def test_plan_totals_qwen3_cpu_moe(models):
    """-ngl all + --cpu-moe on one GPU: every number in the table, by hand."""
    m = models["qwen3-30b-a3b"]
    devices = parse_devices("CUDA0=24GiB,CPU=64GiB")
    placement = Placement(tuple(cpu_moe_rules()), LayerLayout(48, ("CUDA0",), 49, (49.0,)))
    plan = build_plan(m, placement, MemorySettings(8192), devices, {"CUDA0": 1 << 30}, mode="flags")
    gpu, cpu = plan.totals
    experts = sum(t.n_bytes for t in m.tensors if "_exps" in t.name)
    embd = m.tensor("token_embd.weight").n_bytes
    assert m.tensor("blk.0.ffn_gate_exps.weight").n_bytes == 128 * 768 * 2048 // 256 * 144
    assert embd == 151936 * 2048 // 256 * 144
    assert cpu.weights_bytes == experts + embd
    assert gpu.weights_bytes == sum(t.n_bytes for t in m.tensors) - experts - embd
    assert gpu.kv_bytes == 48 * 8192 * 4 * 128 * 2 * 2 and cpu.kv_bytes == 0
    assert gpu.compute_bytes == 316_994_304 + 330_301_440             # test_compute_formula_qwen3 (+ staging)
    assert gpu.free_after_bytes == 24 * 2**30 - gpu.weights_bytes - gpu.kv_bytes - gpu.compute_bytes
    assert gpu.above_target_bytes == gpu.free_after_bytes - 2**30


def test_nextn_cache_counted_only_when_drafting_with_it(models, fixture_paths):
    glm = models["glm-4.5-air"]
    devices = parse_devices("CUDA0=200GiB,CPU=64GiB")
    placement = Placement((), LayerLayout(47, ("CUDA0",), 48, (48.0,)))
    plan = build_plan(glm, placement, MemorySettings(32768), devices, {}, mode="flags")
    assert plan.drafting == "in-model NextN"
    assert plan.totals[0].kv_bytes == 47 * 32768 * (8 * 128 * 2) * 2   # 47 blocks of 128 MiB
    # with a separate draft the in-model NextN block does not draft: 46 trunk blocks + the draft's one
    ds, draft = models["deepseek-v3"], models["deepseek-v3-mtp"]
    placement = Placement((), LayerLayout(61, ("CUDA0",), 62, (62.0,)), (), "CUDA0")
    plan = build_plan(ds, placement, MemorySettings(32768), parse_devices("CUDA0=900GiB,CPU=64GiB"), {},
                      mode="flags", draft=draft)
    assert plan.drafting == "--draft" and plan.totals[0].kv_bytes == 62 * 32768 * 576 * 2
    assert plan.totals[0].weights_bytes == sum(t.n_bytes for t in ds.tensors if t.name != "token_embd.weight") \
        + sum(t.n_bytes for t in draft.tensors)


def test_parallel_sequences_count_a_cache_each(models):
    """-np N: N sequences, each with caches of the whole context; the rest of the plan is the
    same, and a count whose caches do not fit is refused in one line."""
    glm = models["glm-4.5-air"]
    devices = parse_devices("CUDA0=200GiB,CPU=64GiB")
    placement = Placement((), LayerLayout(47, ("CUDA0",), 48, (48.0,)))
    one = build_plan(glm, placement, MemorySettings(32768), devices, {}, mode="flags")
    four = build_plan(glm, placement, MemorySettings(32768, parallel=4), devices, {}, mode="flags")
    assert four.totals[0].kv_bytes == 4 * one.totals[0].kv_bytes == 4 * 47 * 32768 * (8 * 128 * 2) * 2
    assert four.totals[0].weights_bytes == one.totals[0].weights_bytes
    with pytest.raises(PlacementError, match=r"the plan does not fit: CUDA0 needs .* \(weights .* \+ KV 376.00 GiB"):
        build_plan(glm, placement, MemorySettings(32768, parallel=64), devices, {}, mode="flags").check_fits()
    with pytest.raises(PlacementError, match=r"-np \(sequences at once\) must be >= 1"):
        MemorySettings(4096, parallel=0)


def test_settings_reject():
    with pytest.raises(PlacementError, match="unknown --cache-type 'q3'"):
        MemorySettings(4096, "q3")
    with pytest.raises(PlacementError, match="must be >= 1"):
        MemorySettings(0)
    with pytest.raises(PlacementError, match="unknown GPU compute dtype 'fp8'"):
        MemorySettings(4096, gpu_dtype="fp8")


def test_tied_embeddings_pay_a_copy_on_the_output_device(models):
    """No output.weight: logits use token_embd, which llama.cpp copies to the output layer's device."""
    from dataclasses import dataclass

    from placement.devices import CPU
    from placement.fit import fit

    @dataclass(frozen=True)
    class Tied:
        path: str
        spec: object
        tensors: tuple

    qwen = models["qwen3-30b-a3b"]
    m = Tied("tied.gguf", qwen.spec, tuple(t for t in qwen.tensors if t.name != "output.weight"))
    embd = qwen.tensor("token_embd.weight").n_bytes
    devices = parse_devices("CUDA0=24GiB,CPU=64GiB")
    placement = Placement((), LayerLayout(48, ("CUDA0",), 49, (49.0,)))
    plan = build_plan(m, placement, MemorySettings(4096), devices, {}, mode="flags")
    gpu = plan.totals[0]
    assert plan.tensors["token_embd.weight"] == CPU
    assert gpu.weights_bytes == sum(t.n_bytes for t in m.tensors if t.name != "token_embd.weight") + embd
    # the logits are computed there: token_embd (Q4_K) dequantized 8192 rows at a time
    assert gpu.compute_bytes == 2 * TE + 2048 * 2 + 8192 * 2048 * 12.375 + 151936 * 2 + 8192 * 2
    fitted = fit(m, parse_devices("CUDA0=10GiB,CPU=64GiB"), {"CUDA0": 1 << 30}, MemorySettings(4096))
    assert fitted.totals[0].above_target_bytes >= 0   # the fit's own accounting includes the copy
