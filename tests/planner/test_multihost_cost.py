"""The forecast across hosts (placement.cost.pipeline_table, placement.speculative.predict_multihost):
hops per pass, bytes per token, and how a verify batch amortises them."""
from __future__ import annotations

import dataclasses

import pytest

from placement.acceptance import AcceptanceProfile
from placement.cost import HopLink, hop_features, pipeline_table, speculation_table
from placement.devices import CPU
from placement.footprint import ForwardFootprint, LayerFootprint
from placement.hardware import HardwareProfile, ProfileError
from placement.hosts import parse_hosts
from placement.multihost import make_multihost_plan
from placement.planner import PlanOptions
from placement.speculative import carried_bytes, plan_footprint, predict_multihost
from placement.tensors import ModelSpec

# round numbers: only the CPU read costs time (10 GB/s), no fixed costs
HW = HardwareProfile(cpu_read_gbps=10.0, link_latency_us=0.0, cpu_layer_us=0.0, gpu_layer_us=0.0, forward_us=0.0)
ACC = AcceptanceProfile(accept=(0.5,))       # a_j = 0.5 at every position


def _host(layer: int, n_bytes: int) -> ForwardFootprint:
    """One dense CPU layer reading ``n_bytes`` per pass, whatever the batch."""
    return ForwardFootprint(CPU, (LayerFootprint(layer, CPU, ((CPU, n_bytes),)),), CPU, ())


DRAFT = ForwardFootprint(CPU, (LayerFootprint(9, CPU, ((CPU, 40 * 10**6),)),), CPU, (), draft_head=True)  # 4 ms


def test_hop_features():
    # 3 hosts, 4 tokens, 28672 bytes a token: 2 boundaries carry the state, 1 hop brings 4 tokens back
    assert hop_features(3, 4, 28672) == {"hop_latency": 3.0, "hop_bytes": 2 * 4 * 28672 + 4 * 8}
    assert hop_features(1, 4, 28672) == {}          # one host: no hop


def test_carried_bytes_counts_deepseek4_streams():
    base = dict(n_layer=4, n_embd=4096, n_vocab=10, n_ctx_train=64, n_head=8, n_head_kv=(1,) * 4,
                head_dim_k=64, head_dim_v=64)
    assert carried_bytes(ModelSpec("deepseek2", **base)) == 4096 * 4
    assert carried_bytes(ModelSpec("deepseek4", **base, hc_mult=4)) == 4 * 4096 * 4


def test_a_verify_batch_amortises_the_hops_hand_computed():
    """Two hosts of 5 ms each (50 MB at 10 GB/s), a 4 ms draft pass on the last, a = 0.5.

    E(n) = 1 + 0.5 + ... + 0.5^n = 1, 1.5, 1.75, 1.875, 1.9375. T(n) = 4n ms + V, V = 10 ms plus
    the hops: 2 hops of 3 ms (bytes at 1e6 GB/s are ~1e-13 s).
    Hops free: S(n) = E(n) 10 / (10 + 4n) = 1.0714, 0.9722 -> break-even n_max 1.
    With hops:  S(n) = E(n) 16 / (16 + 4n) = 1.2, 1.1667, 1.0714, 0.96875 -> break-even n_max 3."""
    hosts = [(_host(0, 50 * 10**6), HW), (_host(1, 50 * 10**6), HW)]
    kw = dict(n_embd=8, carried_bytes=32, acceptance=ACC, max_n=4)
    free = pipeline_table(hosts, DRAFT, None, **kw)
    hops = pipeline_table(hosts, DRAFT, HopLink(latency_us=3000.0, gbps=1e6), **kw)
    e = [1.0, 1.5, 1.75, 1.875, 1.9375]
    for n in range(5):
        assert free.rows[n].step_s == pytest.approx((10 + 4 * n) * 1e-3, rel=1e-9)
        assert hops.rows[n].step_s == pytest.approx((16 + 4 * n) * 1e-3, rel=1e-9)
        assert free.rows[n].speedup == pytest.approx(e[n] * 10 / (10 + 4 * n), rel=1e-9)
        assert hops.rows[n].speedup == pytest.approx(e[n] * 16 / (16 + 4 * n), rel=1e-9)
    assert free.break_even_n == 1 and hops.break_even_n == 3
    assert hops.plain_tps == pytest.approx(1 / 0.016, rel=1e-9)
    assert hops.verify_breakdown["hops"] == pytest.approx(0.006, rel=1e-9)
    assert hops.draft_s == pytest.approx(0.004, rel=1e-12)


def test_one_host_pipeline_is_the_one_box_table(models):
    """A pipeline of one host has no hop and is exactly speculation_table (one cost model)."""
    from placement.devices import parse_devices
    from placement.planner import make_plan

    model, draft = models["deepseek-v3"], models["deepseek-v3-mtp"]
    plan = make_plan(model, parse_devices("CUDA0=24GiB,CPU=512GiB"), PlanOptions(ctx=32768), draft=draft)
    fp = plan_footprint(plan, model, draft)
    hw = HardwareProfile.for_devices({"CUDA0": "NVIDIA GeForce RTX 4090"})
    one = speculation_table(fp, hw, max_n=4)
    pipe = pipeline_table([(fp.target, hw)], fp.draft, HopLink(), n_embd=fp.n_embd,
                          carried_bytes=carried_bytes(model.spec), max_n=4)
    for a, b in zip(one.rows, pipe.rows):
        assert dataclasses.astuple(a) == pytest.approx(dataclasses.astuple(b), rel=1e-12)


def test_deepseek_v3_forecast_across_two_hosts(models):
    model, draft = models["deepseek-v3"], models["deepseek-v3-mtp"]
    mplan = make_multihost_plan(model, parse_hosts("a:CUDA0=24GiB,CPU=200GiB;b:CUDA0=24GiB,CPU=256GiB"),
                                PlanOptions(ctx=32768), draft=draft)
    tables = {us: predict_multihost(mplan, model, draft, link=HopLink(latency_us=us), max_n=6)[0]
              for us in (0.0, 100.0, 10_000.0, 100_000.0)}
    free, section = predict_multihost(mplan, model, draft, link=None, max_n=6)
    assert tables[0.0].plain_tps == pytest.approx(free.plain_tps, rel=1e-3)     # only the bytes are left
    tps = [t.plain_tps for t in tables.values()]
    assert tps == sorted(tps, reverse=True)                                       # slower with every hop
    # the hops raise every T(n) by the same amount: speedups rise, break-even never moves down
    evens = [t.break_even_n for t in tables.values()]
    assert evens == sorted(evens)
    assert all(b.speedup >= a.speedup for a, b in zip(tables[100.0].rows, tables[100_000.0].rows))
    assert section is not None and section.break_even_n_max == free.break_even_n
    # plain decoding (no draft head): one row
    plain = make_multihost_plan(model, parse_hosts("a:CUDA0=24GiB,CPU=200GiB;b:CPU=256GiB"), PlanOptions(ctx=32768))
    table, section = predict_multihost(plain, model, None, link=HopLink(), max_n=6)
    assert len(table.rows) == 1 and section is None and table.verify_breakdown["hops"] > 0


@pytest.mark.parametrize("kw,match", [({"latency_us": -1.0}, "--hop-latency-us must be a number >= 0"),
                                      ({"gbps": 0.0}, "--hop-gbps must be a number > 0"),
                                      ({"gbps": float("nan")}, "--hop-gbps must be a number > 0")])
def test_bad_hop_link(kw, match):
    with pytest.raises(ProfileError, match=match):
        HopLink(**kw)
