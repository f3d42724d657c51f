"""Speculative cost model (placement/footprint.py, routing.py's RoutingProfile, cost.py, cost_fit.py,
hardware.py, acceptance.py): pure math, no GPU."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import yaml
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from placement.acceptance import DEFAULT_MTP, AcceptanceProfile
from placement.cost import (
    break_even_acceptance,
    SpecProfile, best_over_p_min, forward_time, predicted_decode_tps, speculation_table, step_time,
)
from placement.cost_fit import fit_profile
from placement.devices import CPU
from placement.footprint import (
    DecodeFootprint, ExpertSlice, FootprintError, ForwardFootprint, LayerFootprint, footprint_from_tensors,
)
from placement.hardware import (
    GpuProfile, HardwareProfile, ProfileError, cpu_read_gbps_from_memory, gpu_profile,
)
from placement.routing import RoutingProfile, distinct_experts_uniform
from placement.tensors import Role, TensorInfo


# ---------------------------------------------------------------------------------------------
# A DeepSeek-V3-shaped tensor list (header only): 61 blocks, first 3 dense, 256 experts top-8,
# n_embd 7168, expert ff 2048, MLA attention, one NextN block (blk.61). Q4_K weights, Q6_K
# output, F32 norms and router, as in common Q4_K_M files.
# ---------------------------------------------------------------------------------------------

N_LAYER, N_DENSE, N_EXPERT, K_USED, N_EMBD, N_FF_EXP, N_FF, N_VOCAB = 61, 3, 256, 8, 7168, 2048, 18432, 129280


def _info(name: str, shape: tuple[int, ...], qtype: Q, role: Role, layer: int | None,
          nextn: bool = False) -> TensorInfo:
    block, type_size = GGML_QUANT_SIZES[qtype]
    n = math.prod(shape)
    assert shape[-1] % block == 0, name
    return TensorInfo(name, shape, qtype, n // block * type_size, layer, role, nextn)


def deepseek_v3_tensors() -> list[TensorInfo]:
    ts = [_info("token_embd.weight", (N_VOCAB, N_EMBD), Q.Q4_K, Role.EMBEDDING, None),
          _info("output_norm.weight", (N_EMBD,), Q.F32, Role.NORM, None),
          _info("output.weight", (N_VOCAB, N_EMBD), Q.Q6_K, Role.OUTPUT, None)]
    for i in range(N_LAYER + 1):
        nx = i == N_LAYER
        b = f"blk.{i}."

        def add(suffix, shape, qtype=Q.Q4_K, role=Role.ATTENTION):
            ts.append(_info(b + suffix, shape, qtype, role, i, nx))

        add("attn_norm.weight", (N_EMBD,), Q.F32, Role.NORM)
        add("attn_q_a.weight", (1536, N_EMBD))
        add("attn_q_a_norm.weight", (1536,), Q.F32, Role.NORM)
        add("attn_q_b.weight", (128 * 192, 1536))
        add("attn_kv_a_mqa.weight", (576, N_EMBD))
        add("attn_kv_a_norm.weight", (512,), Q.F32, Role.NORM)
        add("attn_kv_b.weight", (128 * 256, 512))
        add("attn_output.weight", (N_EMBD, 128 * 128))
        add("ffn_norm.weight", (N_EMBD,), Q.F32, Role.NORM)
        if i < N_DENSE:
            add("ffn_gate.weight", (N_FF, N_EMBD), role=Role.DENSE_FFN)
            add("ffn_up.weight", (N_FF, N_EMBD), role=Role.DENSE_FFN)
            add("ffn_down.weight", (N_EMBD, N_FF), role=Role.DENSE_FFN)
            continue
        add("ffn_gate_inp.weight", (N_EXPERT, N_EMBD), Q.F32, Role.ROUTER)
        add("exp_probs_b.bias", (N_EXPERT,), Q.F32, Role.ROUTER)
        add("ffn_gate_exps.weight", (N_EXPERT, N_FF_EXP, N_EMBD), role=Role.ROUTED_EXPERTS)
        add("ffn_up_exps.weight", (N_EXPERT, N_FF_EXP, N_EMBD), role=Role.ROUTED_EXPERTS)
        add("ffn_down_exps.weight", (N_EXPERT, N_EMBD, N_FF_EXP), role=Role.ROUTED_EXPERTS)
        add("ffn_gate_shexp.weight", (N_FF_EXP, N_EMBD), role=Role.SHARED_EXPERTS)
        add("ffn_up_shexp.weight", (N_FF_EXP, N_EMBD), role=Role.SHARED_EXPERTS)
        add("ffn_down_shexp.weight", (N_EMBD, N_FF_EXP), role=Role.SHARED_EXPERTS)
        if nx:
            add("nextn.eh_proj.weight", (N_EMBD, 2 * N_EMBD), role=Role.NEXTN)
            add("nextn.enorm.weight", (N_EMBD,), Q.F32, Role.NEXTN)
            add("nextn.hnorm.weight", (N_EMBD,), Q.F32, Role.NEXTN)
            add("nextn.shared_head_norm.weight", (N_EMBD,), Q.F32, Role.NEXTN)
    return ts


def one_gpu_map(tensors: list[TensorInfo]) -> dict[str, str]:
    """One 24 GB GPU + RAM: target routed experts on the CPU (--cpu-moe), the rest and the
    whole draft head on CUDA0, token_embd on the CPU (llama.cpp keeps the input layer there)."""
    m = {}
    for t in tensors:
        if t.role is Role.EMBEDDING or (t.role is Role.ROUTED_EXPERTS and not t.nextn):
            m[t.name] = CPU
        else:
            m[t.name] = "CUDA0"
    return m


def eight_gpu_map(tensors: list[TensorInfo]) -> dict[str, str]:
    """8 GPUs, everything on GPU: blocks 0..61 split evenly (8 per GPU, the last gets 6),
    output on the last GPU, token_embd on the CPU."""
    m = {}
    for t in tensors:
        if t.role is Role.EMBEDDING:
            m[t.name] = CPU
        elif t.layer is None:
            m[t.name] = "CUDA7"
        else:
            m[t.name] = f"CUDA{min(t.layer // 8, 7)}"
    return m


# 12 x 32 GB DDR5-4800 = 384 GB on a 12-channel server board (EPYC 9004 class).
ONE_GPU_BOX = HardwareProfile.for_devices({"CUDA0": "NVIDIA GeForce RTX 4090"},
                                          cpu_read_gbps=cpu_read_gbps_from_memory(12, 4800))
EIGHT_GPU_BOX = HardwareProfile.for_devices({f"CUDA{i}": "NVIDIA H100 80GB HBM3" for i in range(8)},
                                            cpu_read_gbps=cpu_read_gbps_from_memory(12, 4800))


# ---------------------------------------------------------------------------------------------
# Hand-computed cases.
# ---------------------------------------------------------------------------------------------

def _hand_profile(**kw) -> HardwareProfile:
    # Round numbers so every term below can be written out by hand.
    base = dict(cpu_read_gbps=10.0, gpus={"CUDA0": GpuProfile("test", 100.0, 10.0)}, link_latency_us=0.0,
                cpu_layer_us=2000.0, gpu_layer_us=1000.0, forward_us=10000.0)
    return HardwareProfile(**{**base, **kw})


def _hand_footprint() -> DecodeFootprint:
    # Two MoE layers, E = 4, k = 2: dense part on CUDA0 (1 GB read per pass), experts on the
    # CPU at 0.1 GB each; output head 2 GB on CUDA0. Draft: one layer, experts on CUDA0.
    lay = [LayerFootprint(i, "CUDA0", (("CUDA0", 10**9),), (ExpertSlice(CPU, 1e8, 4),), 4, 2) for i in (0, 1)]
    target = ForwardFootprint(CPU, tuple(lay), "CUDA0", (("CUDA0", 2 * 10**9),))
    dl = LayerFootprint(2, "CUDA0", (("CUDA0", 10**9),), (ExpertSlice("CUDA0", 1e8, 4),), 4, 2)
    draft = ForwardFootprint("CUDA0", (dl,), "CUDA0", (("CUDA0", 2 * 10**9),))
    return DecodeFootprint(target, draft, n_embd=1000, act_bytes=4)


def test_forward_time_hand_computed():
    fp, hw = _hand_footprint(), _hand_profile()
    # U(B) for E=4, k=2: B=1 -> 2, B=2 -> 4(1 - 1/4) = 3, B=3 -> 4(1 - 1/8) = 3.5.
    # Per pass: forward 0.01 + head 2 GB/100 GB/s = 0.02; per layer: dense 1 GB/100 GB/s = 0.01,
    # experts U(B) x 0.1 GB / 10 GB/s = 0.01 U(B), gpu_layer 0.001, cpu_layer 0.002;
    # copies: CPU->CUDA0 input + 2 per layer (to the CPU experts and back) = 5 copies of
    # B x 1000 x 4 bytes over 10 GB/s.
    for b, u in ((1, 2.0), (2, 3.0), (3, 3.5)):
        expected = 0.01 + 0.02 + 2 * (0.01 + 0.01 * u + 0.001 + 0.002) + 5 * b * 4000 / 10e9
        got = forward_time(fp.target, b, hw, n_embd=fp.n_embd)
        assert got == pytest.approx(expected, rel=1e-12)
    # Draft pass, one token: forward 0.01 + dense 0.01 + experts 2 x 0.1 GB / 100 GB/s = 0.002
    # + gpu_layer 0.001 + head 0.02; no copies (starts on CUDA0, stays there).
    assert forward_time(fp.draft, 1, hw, n_embd=fp.n_embd) == pytest.approx(0.043, rel=1e-12)


def test_link_latency_and_cpu_compute_terms():
    fp = _hand_footprint()
    hw = _hand_profile(link_latency_us=100.0, cpu_compute_gbps=20.0)
    base = forward_time(fp.target, 2, _hand_profile(), n_embd=fp.n_embd)
    # 5 copies x 100 us; CPU compute: the (token, expert) pairs beyond each touched expert's
    # first (its first is in the read rate): B x k - U(B) = 2 x 2 - 3 = 1 expert of 0.1 GB per
    # layer at 20 GB/s, 2 layers. At B = 1 every touched expert has one pair: no compute term.
    extra = 5 * 100e-6 + 2 * (1 * 1e8 / 20e9)
    assert forward_time(fp.target, 1, hw, n_embd=fp.n_embd) == pytest.approx(
        forward_time(fp.target, 1, _hand_profile(), n_embd=fp.n_embd) + 5 * 100e-6, rel=1e-12)
    assert forward_time(fp.target, 2, hw, n_embd=fp.n_embd) == pytest.approx(base + extra, rel=1e-12)


def test_speculation_table_hand_computed():
    fp, hw = _hand_footprint(), _hand_profile()
    acc = AcceptanceProfile(accept=(0.5, 0.5))
    tab = speculation_table(fp, hw, acceptance=acc, max_n=2)
    v = [0.01 + 0.02 + 2 * (0.01 + 0.01 * u + 0.003) + 5 * b * 4000 / 10e9
         for b, u in ((1, 2), (2, 3), (3, 3.5))]
    d = 0.043
    e = [1.0, 1.5, 1.75]                       # 1, 1 + 0.5, 1 + 0.5 + 0.25
    # The first draft pass of a step runs the 1 + accepted pairs of the previous step: a head
    # pass over b tokens reads U(b) experts on CUDA0 (0.001 s each): 0.043, 0.044, 0.0445 for
    # b = 1, 2, 3. Accepted drafts: n = 1 -> 0 or 1 (1/2 each); n = 2 -> 0, 1, 2 (1/2, 1/4, 1/4).
    first1 = 0.5 * 0.043 + 0.5 * 0.044
    first2 = 0.5 * 0.043 + 0.25 * 0.044 + 0.25 * 0.0445
    t = [v[0], first1 + v[1], first2 + d + v[2]]
    for n, row in enumerate(tab.rows):
        assert row.expected_tokens == pytest.approx(e[n], rel=1e-12)
        assert row.step_s == pytest.approx(t[n], rel=1e-12)
        assert row.tokens_per_s == pytest.approx(e[n] / t[n], rel=1e-12)
        assert row.speedup == pytest.approx(e[n] * v[0] / t[n], rel=1e-12)
    # S(1) = 1.5 x 0.096002 / 0.159504 = 0.903 < 1: expert reads grow faster than tokens gained.
    assert tab.rows[1].speedup == pytest.approx(0.9028, abs=1e-4)
    assert tab.break_even_n == 0 and tab.best.n == 0
    assert tab.draft_s == pytest.approx(d, rel=1e-12)


def test_expected_tokens_formula():
    acc = AcceptanceProfile(accept=(0.8, 0.5, 0.25))
    assert acc.expected_tokens(0) == 1.0
    assert acc.expected_tokens(1) == pytest.approx(1.8)
    assert acc.expected_tokens(2) == pytest.approx(1.8 + 0.4)
    assert acc.expected_tokens(3) == pytest.approx(2.2 + 0.1)
    assert acc.expected_tokens(4) == pytest.approx(2.3 + 0.025)   # last value reused past the list


def _flat_footprint(n_target_layers: int = 1) -> DecodeFootprint:
    # No reads at all: the target pass costs forward + n x gpu_layer, the draft pass forward.
    lays = tuple(LayerFootprint(i, "CUDA0", ()) for i in range(n_target_layers))
    return DecodeFootprint(ForwardFootprint("CUDA0", lays, "CUDA0", ()),
                           ForwardFootprint("CUDA0", (), "CUDA0", ()), n_embd=8)


def test_break_even_and_best_crafted():
    # T_verify = 1.0 s for any B, T_draft = 0.5 s; a = (1, 1, 0): E = 1, 2, 3, 3, 3, 3.
    # S(n) = E(n) / (1 + 0.5 n) = 1, 4/3, 3/2, 6/5, 1, 6/7: best n = 2, break-even n = 4 (S = 1 exactly).
    hw = _hand_profile(forward_us=5e5, gpu_layer_us=5e5)
    tab = speculation_table(_flat_footprint(), hw, max_n=5,
                            acceptance=AcceptanceProfile(accept=(1.0, 1.0, 0.0)))
    assert [r.speedup for r in tab.rows] == pytest.approx([1, 4 / 3, 3 / 2, 6 / 5, 1, 6 / 7], rel=1e-12)
    assert tab.best.n == 2
    assert tab.break_even_n == 4
    # A draft pass dearer than a verify pass with a = 0.5: speculation never pays.
    slow = speculation_table(_flat_footprint(), _hand_profile(forward_us=2e6, gpu_layer_us=0.0),
                             acceptance=AcceptanceProfile(accept=(0.5,)), max_n=4)
    assert slow.break_even_n == 0 and slow.best.n == 0


def test_first_draft_pass_runs_the_previous_steps_tokens():
    # a = (0.5, 0.5): A = 0, 1, 2 accepted with 1/2, 1/4, 1/4 at cap 2; head passes over
    # b = 1, 2, 3 tokens cost 1, 2, 3 s: first pass 0.5 + 0.5 + 0.75 = 1.75, chained 1.
    acc = AcceptanceProfile(accept=(0.5, 0.5))
    assert acc.accepted_distribution(2) == pytest.approx([0.5, 0.25, 0.25])
    assert step_time(2, draft_s=[1.0, 2.0, 3.0], verify_s=[10.0, 10.0, 10.0], acceptance=acc) == \
        pytest.approx(1.75 + 1.0 + 10.0, rel=1e-12)
    assert step_time(2, draft_s=1.0, verify_s=[10.0, 10.0, 10.0], acceptance=acc) == pytest.approx(12.0)


def test_step_time_with_p_min_early_stop():
    # cont = (1, 0.5, 1): P(D>=1) = 1, P(D>=2) = 0.5, P(D>=3) = 0.5 -> P(D=1) = P(D=3) = 0.5.
    # D = 1 with cap 3: the second draft pass ran (and fell under p_min): 2 draft passes, verify 2.
    acc = AcceptanceProfile(accept=(0.9,), cont=(1.0, 0.5, 1.0), p_min=0.3)
    verify = [1.0, 2.0, 3.0, 4.0]
    assert acc.drafted_distribution(3) == pytest.approx([0.0, 0.5, 0.0, 0.5])
    got = step_time(3, draft_s=0.25, verify_s=verify, acceptance=acc)
    assert got == pytest.approx(0.5 * (2 * 0.25 + 2.0) + 0.5 * (3 * 0.25 + 4.0), rel=1e-12)
    # p_min = 0 reduces to n T_draft + T_verify(n + 1).
    assert step_time(3, draft_s=0.25, verify_s=verify, acceptance=DEFAULT_MTP) == pytest.approx(0.75 + 4.0)


def test_best_over_p_min_crafted():
    # T_verify = 1 s for any B, T_draft = 0.5 s.
    # p_min 0, a = 0.5: S(1) = 1.5 / 1.5 = 1, S(2) = 1.75 / 2 = 0.875 -> best n 0 (tie -> shorter).
    # p_min 0.5 drafts exactly one token (cont = 1, 0), a_1 = 0.9: S(1) = 1.9 / 1.5 = 1.267;
    # with cap 2 the second draft pass still runs and stops: T = 2 x 0.5 + 1, S(2) = 1.9 / 2.
    hw = _hand_profile(forward_us=5e5, gpu_layer_us=5e5)
    plain = speculation_table(_flat_footprint(), hw, acceptance=AcceptanceProfile(accept=(0.5,)), max_n=2)
    gated = speculation_table(_flat_footprint(), hw, max_n=2,
                              acceptance=AcceptanceProfile(accept=(0.9, 0.0), cont=(1.0, 0.0), p_min=0.5))
    assert [r.speedup for r in plain.rows] == pytest.approx([1.0, 1.0, 0.875], rel=1e-12)
    assert [r.speedup for r in gated.rows] == pytest.approx([1.0, 1.9 / 1.5, 0.95], rel=1e-12)
    assert plain.best.n == 0 and gated.best.n == 1
    assert best_over_p_min([plain, gated]) is gated
    assert gated.to_dict()["p_min"] == 0.5


def test_draft_free_table_and_break_even_acceptance_hand_computed():
    """An n-gram drafter runs no weights: T(n) = T_verify(n + 1), no draft head needed.
    From the hand footprint's T_verify(1..3) (test_speculation_table_hand_computed):
    S(1) = (1 + a) v0 / v1 >= 1 from a = v1/v0 - 1; S(2) = (1 + a + a^2) v0 / v2 >= 1 from the
    root of a^2 + a - (v2/v0 - 1)."""
    fp, hw = _hand_footprint(), _hand_profile()
    headless = DecodeFootprint(fp.target, None, fp.n_embd)
    v = [0.01 + 0.02 + 2 * (0.01 + 0.01 * u + 0.003) + 5 * b * 4000 / 10e9
         for b, u in ((1, 2), (2, 3), (3, 3.5))]
    tab = speculation_table(headless, hw, acceptance=AcceptanceProfile(accept=(0.5,)), max_n=2, draft_kind="free")
    assert [r.step_s for r in tab.rows] == pytest.approx(v, rel=1e-12) and tab.draft_s == 0.0
    with pytest.raises(FootprintError):
        speculation_table(headless, hw, max_n=2)
    need = break_even_acceptance(headless, hw, max_n=2)
    c = v[2] / v[0] - 1
    assert need == pytest.approx([v[1] / v[0] - 1, (-1 + math.sqrt(1 + 4 * c)) / 2], abs=2e-3)
    # a loop that costs a second per drafting step: no acceptance makes drafting pay
    assert break_even_acceptance(headless, _hand_profile(spec_step_us=1e6), max_n=2) == [None, None]


def test_predicted_decode_tps_without_draft_head():
    fp = _hand_footprint()
    no_draft = DecodeFootprint(fp.target, None, fp.n_embd)
    assert predicted_decode_tps(no_draft, _hand_profile()) == pytest.approx(1 / 0.096002, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# Routing.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_expert,k", [(256, 8), (64, 6), (8, 2)])
def test_uniform_distinct_experts_matches_simulation(n_expert, k):
    rng = np.random.default_rng(1234)
    trials = 4000
    for b in (1, 2, 3, 5, 8):
        # each of b tokens picks k distinct experts uniformly: top-k of iid uniform scores
        picks = np.argpartition(rng.random((trials, b, n_expert)), k, axis=-1)[..., :k]
        hit = np.zeros((trials, n_expert), dtype=bool)
        np.put_along_axis(hit, picks.reshape(trials, b * k), True, axis=1)
        counts = hit.sum(axis=1)
        # Tolerance: 4 standard errors of the simulated mean (a 6e-5 two-sided miss chance
        # per check), plus 1e-9 where the count has no variance (b = 1 is exactly k).
        tol = 4 * counts.std(ddof=1) / math.sqrt(trials) + 1e-9
        assert abs(counts.mean() - distinct_experts_uniform(n_expert, k, b)) <= tol, (b, counts.mean())


def test_uniform_distinct_edge_values():
    assert distinct_experts_uniform(256, 8, 1) == pytest.approx(8)
    assert distinct_experts_uniform(8, 8, 3) == 8
    assert distinct_experts_uniform(256, 8, 10_000) == pytest.approx(256)


def test_routing_profile_used_and_extrapolated():
    # Measured overlap: 2 tokens touch 12 experts instead of uniform's 15.75.
    r = RoutingProfile((8.0, 12.0, 15.0), n_expert=256, n_expert_used=8)
    assert r.distinct_for(256, 8, 2) == 12.0
    ratio = 15.0 / distinct_experts_uniform(256, 8, 3)
    assert r.distinct_for(256, 8, 5) == pytest.approx(ratio * distinct_experts_uniform(256, 8, 5))
    assert r.distinct_for(128, 8, 2) == pytest.approx(6.0)     # same fraction of a smaller layer
    fp, hw = _hand_footprint(), _hand_profile()
    # A measured profile equal to the uniform curve must give the uniform prediction.
    uni = RoutingProfile(tuple(distinct_experts_uniform(4, 2, b) for b in (1, 2, 3)), 4, 2)
    for b in (1, 2, 3):
        assert forward_time(fp.target, b, hw, n_embd=fp.n_embd, routing=uni) == pytest.approx(
            forward_time(fp.target, b, hw, n_embd=fp.n_embd), rel=1e-12)
    # More overlap -> fewer distinct experts -> cheaper verify.
    overlap = RoutingProfile((2.0, 2.5, 3.0), 4, 2)
    assert forward_time(fp.target, 3, hw, n_embd=fp.n_embd, routing=overlap) == pytest.approx(
        forward_time(fp.target, 3, hw, n_embd=fp.n_embd) - 2 * 0.01 * 0.5, rel=1e-12)


@pytest.mark.parametrize("distinct", [(9.0,), (8.0, 7.0), (8.0, 17.0), (0.0,)])
def test_routing_profile_rejects_impossible_counts(distinct):
    with pytest.raises(ProfileError, match="routing profile"):
        RoutingProfile(distinct, n_expert=256, n_expert_used=8)


# ---------------------------------------------------------------------------------------------
# Footprint from a placed tensor list.
# ---------------------------------------------------------------------------------------------

def test_footprint_from_deepseek_v3_tensors():
    ts = deepseek_v3_tensors()
    fp = footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=K_USED)
    assert fp.n_embd == N_EMBD
    assert [lay.layer for lay in fp.target.layers] == list(range(N_LAYER))     # NextN left out
    assert fp.target.input_device == CPU and fp.target.head_home == "CUDA0"
    q4k_block, q4k_size = GGML_QUANT_SIZES[Q.Q4_K]
    per_expert = 3 * N_FF_EXP * N_EMBD // q4k_block * q4k_size                  # gate + up + down
    for lay in fp.target.layers:
        assert lay.home == "CUDA0"
        assert [dev for dev, _ in lay.reads] == ["CUDA0"]
        if lay.layer < N_DENSE:
            assert lay.experts == () and lay.n_expert == 0
        else:
            assert lay.experts == (ExpertSlice(CPU, per_expert, N_EXPERT),)
            assert (lay.n_expert, lay.n_expert_used) == (N_EXPERT, K_USED)
    # Dense bytes of layer 5 = every non-expert tensor of blk.5.
    want = sum(t.n_bytes for t in ts if t.layer == 5 and t.role is not Role.ROUTED_EXPERTS)
    assert fp.target.layers[5].reads == (("CUDA0", want),)
    # Draft: blk.61 with its experts on CUDA0; no shared_head_head, so it uses output.weight
    # with its own shared_head_norm.
    (dl,) = fp.draft.layers
    assert dl.layer == N_LAYER and dl.experts == (ExpertSlice("CUDA0", per_expert, N_EXPERT),)
    out = next(t for t in ts if t.name == "output.weight")
    norm = next(t for t in ts if t.name == "blk.61.nextn.shared_head_norm.weight")
    assert fp.draft.head_reads == (("CUDA0", out.n_bytes + norm.n_bytes),)
    dl_want = sum(t.n_bytes for t in ts if t.layer == N_LAYER and t.role is not Role.ROUTED_EXPERTS
                  and t is not norm)
    assert dl.reads == (("CUDA0", dl_want),)


def test_footprint_kv_bytes_read_on_home_device():
    ts = deepseek_v3_tensors()
    plain = footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8)
    # MLA cache at 32768 tokens: 576 f16 values per token and layer.
    kv = 32768 * 576 * 2
    with_kv = footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8,
                                     kv_bytes={i: kv for i in range(N_LAYER + 1)})
    for a, b in zip(plain.target.layers + plain.draft.layers, with_kv.target.layers + with_kv.draft.layers):
        assert b.reads == (("CUDA0", a.reads[0][1] + kv),)
    t0 = forward_time(plain.target, 1, ONE_GPU_BOX, n_embd=N_EMBD)
    t1 = forward_time(with_kv.target, 1, ONE_GPU_BOX, n_embd=N_EMBD)
    assert t1 - t0 == pytest.approx(N_LAYER * kv / (ONE_GPU_BOX.gpus["CUDA0"].read_gbps * 1e9), rel=1e-9)
    with pytest.raises(FootprintError, match="kv_bytes given for layer"):
        footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8, kv_bytes={99: 1})


def test_footprint_split_expert_matrices_and_own_draft_head():
    # -ot "blk\.(\d+)\.ffn_down_exps=CPU": up/gate stay on the GPU, down goes to the CPU.
    ts = deepseek_v3_tensors()
    ts.append(_info("blk.61.nextn.shared_head_head.weight", (N_VOCAB, N_EMBD), Q.Q6_K, Role.NEXTN, 61, True))
    ts.append(_info("blk.61.nextn.embed_tokens.weight", (N_VOCAB, N_EMBD), Q.Q4_K, Role.NEXTN, 61, True))
    m = {t.name: "CUDA0" for t in ts}
    for t in ts:
        if "ffn_down_exps" in t.name and not t.nextn:
            m[t.name] = CPU
    m["blk.61.nextn.shared_head_head.weight"] = "CUDA1"
    fp = footprint_from_tensors(ts, m, n_expert_used=K_USED)
    block, size = GGML_QUANT_SIZES[Q.Q4_K]
    one = N_FF_EXP * N_EMBD // block * size
    assert fp.target.layers[10].experts == (ExpertSlice(CPU, one, N_EXPERT),
                                            ExpertSlice("CUDA0", 2 * one, N_EXPERT))
    head = next(t for t in ts if t.name == "blk.61.nextn.shared_head_head.weight")
    norm = next(t for t in ts if t.name == "blk.61.nextn.shared_head_norm.weight")
    assert fp.draft.head_home == "CUDA1"
    assert fp.draft.head_reads == (("CUDA0", norm.n_bytes), ("CUDA1", head.n_bytes))
    # the draft's embedding table is a lookup, not a read
    emb = next(t for t in ts if t.name == "blk.61.nextn.embed_tokens.weight")
    assert sum(b for _, b in fp.draft.layers[0].reads) < emb.n_bytes


def test_footprint_bad_inputs():
    ts = deepseek_v3_tensors()
    m = one_gpu_map(ts)
    del m["blk.7.attn_q_b.weight"]
    with pytest.raises(FootprintError, match=r"blk\.7\.attn_q_b\.weight has no device"):
        footprint_from_tensors(ts, m, n_expert_used=8)
    m = one_gpu_map(ts)
    m["blk.7.attn_q_b.weight"] = "GPU0"
    with pytest.raises(FootprintError, match="unknown device 'GPU0'"):
        footprint_from_tensors(ts, m, n_expert_used=8)
    with pytest.raises(FootprintError, match="exceeds"):
        footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=300)
    no_nextn = [t for t in ts if not t.nextn]
    fp = footprint_from_tensors(no_nextn, one_gpu_map(no_nextn), n_expert_used=8)
    assert fp.draft is None
    with pytest.raises(FootprintError, match="no draft head"):
        speculation_table(fp, ONE_GPU_BOX)
    with pytest.raises(ProfileError, match="no entry for CUDA0"):
        speculation_table(footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8), HardwareProfile())


# ---------------------------------------------------------------------------------------------
# Where the experts live decides how far to draft.
# ---------------------------------------------------------------------------------------------

def test_experts_on_gpu_favour_longer_drafts_same_box():
    # Same model, same (hypothetical 400 GB) GPU and CPU: only the routed experts move.
    ts = deepseek_v3_tensors()
    hw = HardwareProfile.for_devices({"CUDA0": "NVIDIA H200"},
                                     cpu_read_gbps=cpu_read_gbps_from_memory(12, 4800))
    on_cpu = speculation_table(footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8), hw, max_n=8)
    all_gpu = {t.name: "CUDA0" for t in ts}
    on_gpu = speculation_table(footprint_from_tensors(ts, all_gpu, n_expert_used=8), hw, max_n=8)
    assert on_gpu.break_even_n > on_cpu.break_even_n
    assert on_gpu.best.n >= on_cpu.best.n
    assert on_gpu.best.speedup > on_cpu.best.speedup


def test_deepseek_v3_what_if():
    """The issue's what-if: one 24 GB GPU + 384 GB RAM vs 8 x 80 GB GPUs (see it with -s)."""
    ts = deepseek_v3_tensors()
    small = speculation_table(footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8), ONE_GPU_BOX)
    big = speculation_table(footprint_from_tensors(ts, eight_gpu_map(ts), n_expert_used=8), EIGHT_GPU_BOX)
    print("\n== DeepSeek-V3 shape, 1 x RTX 4090 (24 GB) + 384 GB DDR5 (12 ch), experts on CPU ==")
    print(small.format())
    print("== DeepSeek-V3 shape, 8 x H100 80 GB, everything on GPU ==")
    print(big.format())
    assert big.break_even_n > small.break_even_n
    assert big.plain_tps > small.plain_tps
    assert small.to_dict()["break_even_n_max"] == small.break_even_n


# ---------------------------------------------------------------------------------------------
# Fitting the profile to measurements.
# ---------------------------------------------------------------------------------------------

def _measure(fp: DecodeFootprint, hw: HardwareProfile, batches=range(1, 8)):
    verify = {b: forward_time(fp.target, b, hw, n_embd=fp.n_embd) for b in batches}
    return verify, forward_time(fp.draft, 1, hw, n_embd=fp.n_embd)


def test_fit_recovers_known_parameters():
    ts = deepseek_v3_tensors()
    fp = footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8)
    truth = HardwareProfile(cpu_read_gbps=40.0, gpus={"CUDA0": GpuProfile("x", 700.0, 20.0)},
                            forward_us=3000.0, link_latency_us=12.0, cpu_layer_us=70.0, gpu_layer_us=30.0)
    verify, draft = _measure(fp, truth)
    # Start from the defaults for the card; free what differs in bandwidth and per pass.
    base = HardwareProfile(gpus={"CUDA0": GpuProfile("x", 500.0, 20.0)}, link_latency_us=12.0,
                           cpu_layer_us=70.0, gpu_layer_us=30.0)
    r = fit_profile(fp, base, verify_s=verify, draft_s=draft, free=("cpu_read", "gpu_read:CUDA0", "forward"))
    # Noise-free data: exact up to float round-off in a well-conditioned 8 x 3 system.
    assert r.profile.cpu_read_gbps == pytest.approx(40.0, rel=1e-9)
    assert r.profile.gpus["CUDA0"].read_gbps == pytest.approx(700.0, rel=1e-9)
    assert r.profile.forward_us == pytest.approx(3000.0, rel=1e-9)
    assert r.max_rel_error < 1e-12
    assert r.profile.source == "measured" and r.profile.gpus["CUDA0"].source == "measured"
    # a GPU whose parameters were not fitted keeps its source
    kept = fit_profile(fp, base, verify_s=verify, draft_s=draft, free=("cpu_read", "forward"))
    assert kept.profile.gpus["CUDA0"] == base.gpus["CUDA0"]


def test_fit_recovers_cpu_compute_where_routing_saturates():
    # With E = 4, k = 2 the distinct-expert curve saturates (2, 3, 3.5, 3.75 ...) while the
    # per-token compute keeps growing with B, so the two CPU terms separate cleanly.
    fp = _hand_footprint()
    truth = _hand_profile(cpu_read_gbps=25.0, cpu_compute_gbps=60.0, forward_us=4000.0)
    verify = {b: forward_time(fp.target, b, truth, n_embd=fp.n_embd) for b in range(1, 7)}
    r = fit_profile(fp, _hand_profile(), verify_s=verify, free=("cpu_read", "cpu_compute", "forward"))
    assert r.profile.cpu_read_gbps == pytest.approx(25.0, rel=1e-9)
    assert r.profile.cpu_compute_gbps == pytest.approx(60.0, rel=1e-9)
    assert r.profile.forward_us == pytest.approx(4000.0, rel=1e-9)


def test_fit_with_noisy_measurements():
    ts = deepseek_v3_tensors()
    fp = footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8)
    truth = HardwareProfile(cpu_read_gbps=40.0, gpus={"CUDA0": GpuProfile("x", 700.0, 20.0)},
                            forward_us=3000.0)
    verify, _ = _measure(fp, truth)
    rng = np.random.default_rng(7)
    noisy = {b: t * (1 + 0.01 * rng.standard_normal()) for b, t in verify.items()}     # 1% timing noise
    base = HardwareProfile(gpus={"CUDA0": GpuProfile("x", 700.0, 20.0)})
    r = fit_profile(fp, base, verify_s=noisy, free=("cpu_read", "forward"))
    # The CPU expert read is >= 90% of every row here, so its fitted bandwidth is off by about
    # the noise level; 3% is three times the 1% noise. The 3 ms per-pass cost is lost in the
    # noise of 300+ ms rows, so only the predictions are checked, against the noise-free truth.
    assert r.profile.cpu_read_gbps == pytest.approx(40.0, rel=0.03)
    for b, t in verify.items():
        assert forward_time(fp.target, b, r.profile, n_embd=fp.n_embd) == pytest.approx(t, rel=0.02)


def test_fit_refuses_what_it_cannot_determine():
    ts = deepseek_v3_tensors()
    fp = footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8)
    verify, draft = _measure(fp, ONE_GPU_BOX)
    # per-pass and per-GPU-layer costs are both constant in B: inseparable without the draft pass
    with pytest.raises(ProfileError, match="cannot be separated"):
        fit_profile(fp, ONE_GPU_BOX, verify_s=verify, free=("forward", "gpu_layer"))
    with pytest.raises(ProfileError, match="unknown parameter"):
        fit_profile(fp, ONE_GPU_BOX, verify_s=verify, free=("cpu_bandwidth",))
    with pytest.raises(ProfileError, match="no effect"):
        fit_profile(_flat_footprint(), _hand_profile(), verify_s={1: 1.0, 2: 1.0}, free=("cpu_read",))
    with pytest.raises(ProfileError, match="positive"):
        fit_profile(fp, ONE_GPU_BOX, verify_s={1: 0.05, 2: -1.0})


# ---------------------------------------------------------------------------------------------
# Profiles: defaults, dict / YAML round trips, bad input.
# ---------------------------------------------------------------------------------------------

def test_gpu_defaults_by_nvml_name():
    assert gpu_profile("NVIDIA GeForce RTX 4090").read_gbps == pytest.approx(1008 * 0.8)
    assert gpu_profile("NVIDIA GeForce RTX 3090 Ti").read_gbps == pytest.approx(1008 * 0.8)
    assert gpu_profile("NVIDIA GeForce RTX 3090").read_gbps == pytest.approx(936 * 0.8)
    assert gpu_profile("NVIDIA A100 80GB PCIe").read_gbps == pytest.approx(1935 * 0.8)
    assert gpu_profile("NVIDIA A100-SXM4-80GB").read_gbps == pytest.approx(2039 * 0.8)
    assert gpu_profile("NVIDIA A100-PCIE-40GB").read_gbps == pytest.approx(1555 * 0.8)
    assert gpu_profile("NVIDIA H100 80GB HBM3").read_gbps == pytest.approx(3350 * 0.8)
    assert gpu_profile("NVIDIA H100 PCIe").read_gbps == pytest.approx(2000 * 0.8)
    assert gpu_profile("NVIDIA L40S").read_gbps == pytest.approx(864 * 0.8)
    assert gpu_profile("NVIDIA RTX 6000 Ada Generation").read_gbps == pytest.approx(960 * 0.8)
    pro = gpu_profile("NVIDIA RTX PRO 6000 Blackwell Workstation Edition")
    assert pro.read_gbps == pytest.approx(1792 * 0.8) and pro.link_gbps == pytest.approx(63.0 * 0.8)
    assert gpu_profile("NVIDIA H200").link_gbps == pytest.approx(63.0 * 0.8)
    odd = gpu_profile("Some Future GPU")
    assert "unknown GPU" in odd.source and odd.read_gbps > 0
    assert cpu_read_gbps_from_memory(8, 3200, efficiency=1.0) == pytest.approx(204.8)


def test_profile_dict_and_yaml_round_trip(tmp_path):
    hw = HardwareProfile.for_devices({"CUDA0": "NVIDIA GeForce RTX 4090", "CUDA1": "NVIDIA GeForce RTX 3090"},
                                     cpu_read_gbps=95.5, cpu_layer_us=33.0)
    hw = dataclasses.replace(hw, cpu_compute_gbps=150.0)
    assert HardwareProfile.from_dict(hw.to_dict()) == hw
    path = tmp_path / "box.yaml"
    path.write_text(yaml.safe_dump(hw.to_dict()))
    assert HardwareProfile.from_yaml(path) == hw
    acc = AcceptanceProfile(accept=(0.8, 0.6), cont=(1.0, 0.7), p_min=0.5, source="measured")
    assert AcceptanceProfile.from_dict(acc.to_dict()) == acc
    rout = RoutingProfile((8.0, 14.5, 20.0), 256, 8)
    spec = SpecProfile(hw, acc, rout)
    assert SpecProfile.from_dict(yaml.safe_load(yaml.safe_dump(spec.to_dict()))) == spec
    assert SpecProfile.from_dict({"hardware": hw.to_dict()}) == SpecProfile(hw, DEFAULT_MTP, None)


def test_user_yaml_with_names_only(tmp_path):
    path = tmp_path / "box.yaml"
    path.write_text("cpu_read_gbps: 120\ngpus:\n  CUDA0: {name: NVIDIA GeForce RTX 5090}\n"
                    "  CUDA1: {read_gbps: 500, link_gbps: 12}\n")
    hw = HardwareProfile.from_yaml(path)
    assert hw.cpu_read_gbps == 120.0
    assert hw.gpus["CUDA0"].read_gbps == pytest.approx(1792 * 0.8)
    assert hw.gpus["CUDA1"] == GpuProfile("CUDA1", 500.0, 12.0, "user")
    assert hw.source == f"yaml: {path}"


@pytest.mark.parametrize("text,match", [
    ("cpu_read_gbps: [1, 2\n", "malformed YAML line"),
    ("cpu_read_gpbs: 100\n", "unknown key.*cpu_read_gpbs"),
    ("cpu_read_gbps: -5\n", "cpu_read_gbps must be a positive number"),
    ("cpu_read_gbps: fast\n", "expected a finite number"),
    ("gpus:\n  GPU0: {name: NVIDIA H200}\n", "unknown device 'GPU0'"),
    ("gpus:\n  CUDA0: {read_gbps: 500}\n", "needs a name or both"),
    ("- 1\n- 2\n", "expected a mapping"),
])
def test_bad_hardware_yaml(tmp_path, text, match):
    path = tmp_path / "box.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=match) as e:
        HardwareProfile.from_yaml(path)
    assert "\n" not in str(e.value)


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ProfileError, match="No such file"):
        HardwareProfile.from_yaml(tmp_path / "nope.yaml")


@pytest.mark.parametrize("d,match", [
    ({"accept": [0.8, 1.2]}, r"in \[0, 1\]"),
    ({"accept": []}, "non-empty"),
    ({}, "missing 'accept'"),
    ({"accept": [0.5], "pmin": 0.1}, "unknown key"),
    ({"accept": [0.5], "p_min": 1.5}, "p_min"),
])
def test_bad_acceptance_profile(d, match):
    with pytest.raises(ProfileError, match=match):
        AcceptanceProfile.from_dict(d)


def test_table_dict_and_text():
    ts = deepseek_v3_tensors()
    fp = footprint_from_tensors(ts, one_gpu_map(ts), n_expert_used=8)
    tab = speculation_table(fp, ONE_GPU_BOX, max_n=4)
    d = tab.to_dict()
    assert [r["n_max"] for r in d["rows"]] == [0, 1, 2, 3, 4]
    assert d["best_n_max"] == tab.best.n and d["break_even_n_max"] == tab.break_even_n
    assert d["predicted_plain_tps"] == pytest.approx(1 / tab.rows[0].step_s, rel=1e-4)
    assert d["rows"][0]["speedup"] == 1.0
    yaml.safe_dump(d)    # plain types only
    text = tab.format()
    assert text.count("\n") == 3 + 5 and "break-even n_max" in text


# ---------------------------------------------------------------------------------------------
# The decode loop's own per-step time (measured by offload tune).
# ---------------------------------------------------------------------------------------------

def test_step_overheads_enter_every_step_hand_computed():
    # T_verify = 1 s for any B, T_draft = 0.5 s (as in test_break_even_and_best_crafted), plus
    # 0.2 s per step and 0.3 s more per drafting step. a = (1, 1, 0): E = 1, 2, 3.
    # T(0) = 1.2; T(1) = 0.5 + 1 + 0.5 = 2.0; T(2) = 1 + 1 + 0.5 = 2.5.
    hw = _hand_profile(forward_us=5e5, gpu_layer_us=5e5, step_us=2e5, spec_step_us=3e5)
    tab = speculation_table(_flat_footprint(), hw, max_n=2, acceptance=AcceptanceProfile(accept=(1.0, 1.0, 0.0)))
    assert [r.step_s for r in tab.rows] == pytest.approx([1.2, 2.0, 2.5], rel=1e-12)
    assert [r.speedup for r in tab.rows] == pytest.approx([1.0, 2 * 1.2 / 2.0, 3 * 1.2 / 2.5], rel=1e-12)
    assert tab.verify_breakdown["step"] == pytest.approx(0.2, rel=1e-12)
    assert predicted_decode_tps(_flat_footprint(), hw) == pytest.approx(1 / 1.2, rel=1e-12)
    back = HardwareProfile.from_dict(yaml.safe_load(yaml.safe_dump(hw.to_dict())))
    assert (back.step_us, back.spec_step_us) == (2e5, 3e5)
    assert hw.with_linear_params({"step": 1e-3}, source="m").step_us == pytest.approx(1000.0)
    with pytest.raises(ProfileError, match="step_us"):
        HardwareProfile(step_us=-1.0)


def test_fit_keeps_a_bandwidth_the_data_show_no_cost_for():
    # Times with no CPU-read cost at all, only the per-pass and the compute term's (the pairs
    # beyond each touched expert's first: B·k − U(B) = 0, 1, 2.5, 4.25 experts for E = 4, k = 2):
    # cpu_read would fit to 1/0 GB/s; it keeps the base value and the others are fitted
    # without it.
    fp = _hand_footprint()
    base = _hand_profile()
    verify = {b: 0.05 + 0.001 * (2 * b - u) for b, u in ((1, 2.0), (2, 3.0), (3, 3.5), (4, 3.75))}
    r = fit_profile(fp, base, verify_s=verify, free=("cpu_read", "cpu_compute", "forward"))
    assert "cpu_read" not in r.fitted and r.profile.cpu_read_gbps == base.cpu_read_gbps


def test_hot_layer_overlaps_its_cpu_and_gpu_experts_hand_computed():
    """A hot layer (experts split by expert between the CPU and CUDA0): offload.moe.MoE runs the
    CPU experts in its worker thread while CUDA0 runs the hot ones, so the pass pays
    max(CPU part, GPU part) for the experts, plus the serial hand-off (copies, cpu_layer)."""
    from placement.cost import overlap_credit

    hw = _hand_profile()
    params = hw.linear_params()
    # E = 4, k = 2, 0.1 GB per expert; experts 0, 1 hot on CUDA0 (100 GB/s), 2, 3 on the CPU (10 GB/s)
    hot = (ExpertSlice(CPU, 1e8, 2, (2, 3)), ExpertSlice("CUDA0", 1e8, 2, (0, 1)))
    lay = LayerFootprint(0, "CUDA0", (("CUDA0", 10**9),), hot, 4, 2)
    fp = ForwardFootprint("CUDA0", (lay,), "CUDA0", ())
    for b, u in ((1, 2.0), (2, 3.0)):
        cpu, gpu = u / 2 * 1e8 / 10e9, u / 2 * 1e8 / 100e9        # half the U(B) distinct experts each side
        assert overlap_credit(fp, b, params) == pytest.approx(min(cpu, gpu), rel=1e-12)
        # forward 0.01, dense 1 GB at 100 GB/s, max of the two expert parts, gpu/cpu_layer,
        # the hand-off: 2 copies of B x 1000 x 4 bytes over CUDA0's 10 GB/s link
        expected = 0.01 + 0.01 + max(cpu, gpu) + 0.001 + 0.002 + 2 * b * 4000 / 10e9
        assert forward_time(fp, b, hw, n_embd=1000) == pytest.approx(expected, rel=1e-12)
    # a whole-tensor split (-ot moving one projection: no expert ids) runs stage after stage: the sum
    staged = LayerFootprint(0, "CUDA0", (("CUDA0", 10**9),), (ExpertSlice(CPU, 5e7, 4), ExpertSlice("CUDA0", 5e7, 4)), 4, 2)
    assert overlap_credit(ForwardFootprint("CUDA0", (staged,), "CUDA0", ()), 2, params) == 0.0
    # all experts on one side: nothing to overlap
    assert overlap_credit(_hand_footprint().target, 2, params) == 0.0


def test_fit_recovers_parameters_on_a_hot_footprint():
    """Synthetic pass times made with the overlap (max, not sum) are fitted back exactly: the
    fit adds back what the base profile says hot layers hide (here the base is the truth)."""
    from placement.cost import overlap_credit

    truth = _hand_profile(cpu_read_gbps=12.0, forward_us=7000.0)
    hot = (ExpertSlice(CPU, 1e8, 2, (2, 3)), ExpertSlice("CUDA0", 1e8, 2, (0, 1)))
    lays = tuple(LayerFootprint(i, "CUDA0", (("CUDA0", 10**9),), hot, 4, 2) for i in (0, 1))
    target = ForwardFootprint("CUDA0", lays, "CUDA0", (("CUDA0", 2 * 10**9),))
    fp = DecodeFootprint(target, None, n_embd=1000)
    verify = {b: forward_time(target, b, truth, n_embd=1000) for b in (1, 2, 3, 4)}
    assert overlap_credit(target, 2, truth.linear_params()) > 0
    base = dataclasses.replace(truth, forward_us=1000.0)
    fit = fit_profile(fp, base, verify_s=verify, free=("cpu_read", "forward"))
    assert fit.fitted["forward"] == pytest.approx(7000e-6, rel=1e-9)
    assert fit.fitted["cpu_read"] == pytest.approx(1 / 12e9, rel=1e-9)
    assert fit.max_rel_error < 1e-9


def test_block_drafter_step_time_hand_computed():
    """A block drafter (DSpark) pays one pass over the n tokens of its block and the injection
    of the previous step's 1 + accepted tokens: a = (0.5, 0.5) accepts 0, 1, 2 with 1/2, 1/4,
    1/4 at n = 2, so injection costs 0.5 i1 + 0.25 i2 + 0.25 i3; under p_min the block is still
    computed whole and only the verify batch shrinks."""
    acc = AcceptanceProfile(accept=(0.5, 0.5))
    draft, verify, inject = [1.0, 2.0, 3.0], [10.0, 20.0, 30.0], [0.1, 0.2, 0.3]
    got = step_time(2, draft_s=draft, verify_s=verify, acceptance=acc, kind="block", inject_s=inject)
    assert got == pytest.approx(2.0 + 30.0 + 0.5 * 0.1 + 0.25 * 0.2 + 0.25 * 0.3, rel=1e-12)
    # n = 1: the block is one token
    assert step_time(1, draft_s=draft, verify_s=verify, acceptance=acc, kind="block") == pytest.approx(1.0 + 20.0)
    # p_min: cont = (1, 0.5): D = 1 or 2 with 1/2 each; the block pass over 2 tokens either way
    gated = AcceptanceProfile(accept=(0.9, 0.5), cont=(1.0, 0.5), p_min=0.3)
    assert step_time(2, draft_s=draft, verify_s=verify, acceptance=gated, kind="block") == \
        pytest.approx(2.0 + 0.5 * 20.0 + 0.5 * 30.0, rel=1e-12)
    # the same block with a chained head instead: first pass (0.5 x 1 + 0.25 x 2 + 0.25 x 3) + one chained pass
    assert step_time(2, draft_s=draft, verify_s=verify, acceptance=acc) == pytest.approx(1.75 + 1.0 + 30.0)
    with pytest.raises(ValueError):
        step_time(2, draft_s=draft, verify_s=verify, acceptance=acc, kind="tree")


def test_dspark_prior_reproduces_its_source():
    """The DSpark prior's E(5) is the tokens per step of the run it comes from (llama.cpp PR
    25784: 1,038 accepted over 447 steps at n_max 5), to the rounding of its two-digit a_j."""
    from placement.acceptance import DEFAULT_DSPARK
    assert DEFAULT_DSPARK.expected_tokens(5) == pytest.approx(1 + 1038 / 447, abs=0.02)
