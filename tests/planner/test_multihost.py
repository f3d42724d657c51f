"""Plans across hosts (placement.hosts, placement.multihost, plan_file's hosts section) on
real-shaped DeepSeek-V3 and Kimi-K2 headers that no single host of the split could hold."""
from __future__ import annotations

import pytest

from placement.devices import CPU, GIB, parse_devices
from placement.errors import PlacementError
from placement.hosts import Host, parse_hosts
from placement.memory import MemorySettings, kv_bytes
from placement.multihost import build_multihost_plan, make_multihost_plan, nextn_embedding, shard, split_blocks
from placement.plan_file import load_hosts_file, load_plan_file, multihost_plan_to_yaml, plan_to_yaml
from placement.planner import PlanOptions, make_plan
from placement.rules import parse_override

TWO = "a:CUDA0=24GiB,CPU=200GiB;b:CPU=256GiB"                                   # DeepSeek-V3 Q4_K_M: ~377 GiB
THREE = "a:CUDA0=24GiB,CPU=192GiB;b:CPU=256GiB;c:CUDA0=32GiB,CUDA1=32GiB,CPU=192GiB"   # Kimi-K2 Q4_K_M: ~578 GiB


def _check_partition(mplan, model, draft=None):
    """Every tensor on exactly one host, blocks contiguous in order, input layer first, output last."""
    owner = {}
    for h in mplan.hosts:
        for name in h.plan.tensors:
            assert name not in owner, f"{name} on {owner.get(name)} and {h.name}"
            owner[name] = h.name
    assert set(owner) == {t.name for t in model.tensors}
    ranges = [h.blocks for h in mplan.hosts]
    assert ranges[0].start == 0 and ranges[-1].stop == model.spec.n_layer_trunk
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    for t in model.tensors:
        if t.layer is not None:
            want = next(h.name for h in mplan.hosts if t.layer in h.blocks)
            assert owner[t.name] == want, t.name
    assert owner["token_embd.weight"] == mplan.hosts[0].name
    assert owner["output.weight"] == owner["output_norm.weight"] == mplan.hosts[-1].name
    for h in mplan.hosts:
        assert all(t.free_after_bytes >= 0 and t.above_target_bytes >= 0 for t in h.plan.totals), h.name
    assert all(not h.plan.draft_tensors for h in mplan.hosts[:-1])
    if draft is not None:
        assert set(mplan.hosts[-1].plan.draft_tensors) == {t.name for t in draft.tensors}


@pytest.mark.parametrize("name,spec", [("deepseek-v3", TWO), ("kimi-k2", THREE)])
def test_hosts_hold_together_what_none_holds_alone(models, name, spec):
    model = models[name]
    hosts = parse_hosts(spec)
    for host in hosts:                      # neither (none) of the hosts could hold the model alone
        with pytest.raises(PlacementError, match="cannot fit"):
            make_plan(model, host.devices, PlanOptions(ctx=32768))
    mplan = make_multihost_plan(model, hosts, PlanOptions(ctx=32768))
    assert mplan.host_names == [h.name for h in hosts] and mplan.settings.ctx == 32768
    _check_partition(mplan, model)
    # each host's plan is the one-box planner's plan of its shard (the same planner, not a twin)
    for i, h in enumerate(mplan.hosts):
        part = shard(model, h.blocks, first=i == 0, last=i == len(hosts) - 1)
        alone = make_plan(part, hosts[i].devices, PlanOptions(ctx=32768))
        assert alone.tensors == h.plan.tensors and alone.totals == h.plan.totals
    # the GPUs are filled by the fit, as on one box: experts of the host's last blocks first
    gpu_hosts = [h for h in mplan.hosts if any(d.is_gpu for d in h.plan.devices)]
    for h in gpu_hosts:
        for t in h.plan.totals:
            if t.name != CPU:
                assert t.weights_bytes > 0 and t.above_target_bytes < 4 * GIB, (h.name, t)


def test_kimi_k2_three_hosts_full_context(models):
    """At Kimi-K2's training context (131072, MLA cache) the three hosts still hold it."""
    model = models["kimi-k2"]
    mplan = make_multihost_plan(model, parse_hosts(THREE))
    assert mplan.settings.ctx == 131072
    _check_partition(mplan, model)
    kv = sum(t.kv_bytes for h in mplan.hosts for t in h.plan.totals)
    assert kv == sum(kv_bytes(model.spec, i, mplan.settings) for i in range(61))   # each block's cache once


def test_split_is_proportional_to_what_each_host_holds(models):
    model = models["deepseek-v3"]
    s = MemorySettings(32768)
    head = sum(t.n_bytes for t in model.tensors if t.name == "token_embd.weight")
    cost = [sum(t.n_bytes for t in model.tensors if t.layer == i) + kv_bytes(model.spec, i, s) for i in range(61)]
    total = head + sum(cost) + sum(t.n_bytes for t in model.tensors if t.name.startswith("output"))
    for rooms in ([300 * GIB, 300 * GIB], [100 * GIB, 300 * GIB], [150 * GIB, 100 * GIB, 250 * GIB]):
        ranges = split_blocks(model, rooms, [f"h{i}" for i in range(len(rooms))], s)
        before = head
        for r, room, acc in zip(ranges, rooms, [sum(rooms[:i + 1]) for i in range(len(rooms))]):
            before += sum(cost[i] for i in r)
            # each cut lands within one block of the hosts' cumulative share
            assert abs(before / total - acc / sum(rooms)) <= max(cost) / total, (rooms, ranges)
    # the larger host takes the larger range
    a, b = split_blocks(model, [100 * GIB, 300 * GIB], ["a", "b"], s)
    assert len(a) < len(b)


def test_whole_does_not_fit_is_refused_before_planning(models):
    with pytest.raises(PlacementError, match=r"cannot fit across the hosts: the model needs .* GiB .* but the hosts "
                                             r"hold 256.00 GiB \(a 128.00 GiB, b 128.00 GiB\)"):
        make_multihost_plan(models["deepseek-v3"], parse_hosts("a:CPU=128GiB;b:CPU=128GiB"), PlanOptions(ctx=4096))


def test_a_host_that_cannot_hold_its_share_is_named(models):
    # the whole fits, but host a's 2 GiB GPU cannot hold its blocks' dense part even at the floor context
    hosts = parse_hosts("a:CUDA0=2GiB,CPU=200GiB;b:CPU=256GiB")
    with pytest.raises(PlacementError, match=r"^host a \(blocks 0-\d+\): cannot fit the non-expert part"):
        make_multihost_plan(models["deepseek-v3"], hosts, PlanOptions(ctx=32768))


def test_draft_head_on_the_host_holding_the_last_block(models):
    model, draft = models["deepseek-v3"], models["deepseek-v3-mtp"]
    mplan = make_multihost_plan(model, parse_hosts("a:CUDA0=24GiB,CPU=200GiB;b:CUDA0=24GiB,CPU=256GiB"),
                                PlanOptions(ctx=32768), draft=draft)
    _check_partition(mplan, model, draft)
    assert mplan.drafting == "--draft" and mplan.hosts[0].plan.drafting == "none"
    assert mplan.draft_path == draft.path


def test_context_is_the_same_on_every_host(models):
    """The fit shrinks host a's context (its 12 GiB GPU); host b is planned again at it."""
    mplan = make_multihost_plan(models["deepseek-v3"], parse_hosts("a:CUDA0=12GiB,CPU=200GiB;b:CPU=256GiB"))
    ctxs = {h.plan.settings.ctx for h in mplan.hosts}
    assert len(ctxs) == 1 and ctxs.pop() < 163840
    assert any("context" in n for n in mplan.notes)


def test_rules_count_on_the_hosts_whose_tensors_they_match(models):
    model = models["deepseek-v3"]
    hosts = parse_hosts(TWO)
    # blk.3's experts on host a's GPU: host b has no GPU, but the rule matches none of its tensors
    opts = PlanOptions(ctx=32768, fit="on", rules=tuple(parse_override(r"blk\.3\.ffn_up_exps=CUDA0")))
    mplan = make_multihost_plan(model, hosts, opts)
    assert mplan.hosts[0].plan.tensors["blk.3.ffn_up_exps.weight"] == "CUDA0"
    opts = PlanOptions(ctx=32768, fit="on", rules=tuple(parse_override(r"blk\.60\.ffn_up_exps=CUDA0")))
    with pytest.raises(PlacementError, match=r"^host b \(blocks \d+-60\): .*CUDA0"):
        make_multihost_plan(model, hosts, opts)
    with pytest.raises(PlacementError, match="--hosts cannot be combined with -ngl"):
        make_multihost_plan(model, hosts, PlanOptions(n_gpu_layers=10))
    with pytest.raises(PlacementError, match="--fit-target has 2 values for 1 GPUs across the hosts"):
        make_multihost_plan(model, hosts, PlanOptions(fit_target=(1 << 30, 2 << 30)))


def test_fit_targets_per_gpu_across_hosts(models):
    hosts = parse_hosts("a:CUDA0=24GiB,CPU=200GiB;b:CUDA0=24GiB,CPU=256GiB")
    mplan = make_multihost_plan(models["deepseek-v3"], hosts, PlanOptions(ctx=32768, fit_target=(1 << 30, 3 << 30)))
    assert [h.plan.targets["CUDA0"] for h in mplan.hosts] == [1 << 30, 3 << 30]


# --------------------------------------------------------------------------- the plan file

@pytest.mark.parametrize("name,spec,draft", [("deepseek-v3", TWO, None), ("kimi-k2", THREE, None),
                                             ("deepseek-v3", "a:CUDA0=24GiB,CPU=200GiB;b:CUDA0=24GiB,CPU=256GiB",
                                              "deepseek-v3-mtp")])
def test_yaml_round_trip_gives_the_same_maps(models, name, spec, draft):
    model = models[name]
    d = models[draft] if draft else None
    mplan = make_multihost_plan(model, parse_hosts(spec), PlanOptions(ctx=32768), draft=d)
    text = multihost_plan_to_yaml(mplan)
    pf = load_plan_file(text, "multihost.yaml")
    assert pf.placement is None and [h.name for h in pf.hosts] == mplan.host_names
    again = build_multihost_plan(model, pf.hosts, pf.settings, draft=d)
    for a, b in zip(mplan.hosts, again.hosts):
        assert (a.name, a.blocks) == (b.name, b.blocks)
        assert a.plan.tensors == b.plan.tensors and a.plan.draft_tensors == b.plan.draft_tensors
        assert a.plan.totals == b.plan.totals and a.plan.settings == b.plan.settings
    assert multihost_plan_to_yaml(again) == text            # and it writes back the same file


def test_one_box_plan_files_load_unchanged(models):
    plan = make_plan(models["deepseek-v3"], parse_devices("CUDA0=24GiB,CPU=512GiB"), PlanOptions(ctx=32768))
    pf = load_plan_file(plan_to_yaml(plan), "plan.yaml")
    assert pf.hosts is None and pf.placement == plan.placement


def _multihost_text(models) -> str:
    mplan = make_multihost_plan(models["deepseek-v3"], parse_hosts(TWO), PlanOptions(ctx=32768))
    return multihost_plan_to_yaml(mplan)


@pytest.mark.parametrize("edit,match", [
    (lambda t: t.replace("- name: b\n", "- name: a\n"), r"multihost.yaml:\d+: hosts\[1\]: host a is given twice"),
    (lambda t: t.replace("- name: b\n", "- name: 'b c'\n"), r"multihost.yaml:\d+: hosts\[1\].name: 'b c' is not a host"),
    (lambda t: t.replace("  blocks: [0, ", "  blocks: [5, "), r"host a: blocks 5-\d+ do not continue from block 0"),
    (lambda t: t.replace("  blocks: [0, ", "  blocks: [-1, "), r"multihost.yaml:\d+: hosts\[0\].blocks must be"),
    (lambda t: t.replace("- name: b\n", "- name: b\n  colour: blue\n"), r"hosts\[1\]: unknown key 'colour'"),
    (lambda t: t.replace("hosts:\n", "devices: []\nhosts:\n"), r"devices: a plan with hosts: keeps each host's devices"),
    (lambda t: t.replace("{name: CPU, budget: 274877906944", "{name: TPU0, budget: 274877906944"),
     r"hosts\[1\].devices\[0\]: unknown device 'TPU0'"),
])
def test_malformed_hosts_section_is_refused_with_its_line(models, edit, match):
    text = edit(_multihost_text(models))
    with pytest.raises(PlacementError, match=match):
        pf = load_plan_file(text, "multihost.yaml")
        build_multihost_plan(models["deepseek-v3"], pf.hosts, pf.settings)


# --------------------------------------------------------------------------- the hosts spec

def test_parse_hosts_spec():
    hosts = parse_hosts("a:cuda0=24GiB,CPU=256GiB; node-2.lan:CPU=512GiB;")
    assert [h.name for h in hosts] == ["a", "node-2.lan"]
    assert [d.name for d in hosts[0].devices] == ["CUDA0", "CPU"] and hosts[1].devices[0].budget_bytes == 512 * GIB
    assert hosts[0].room_bytes == 280 * GIB


@pytest.mark.parametrize("spec,match", [
    ("a b:CPU=1GiB", r"--hosts: 'a b' is not a host name"),
    ("-a:CPU=1GiB", r"--hosts: '-a' is not a host name"),
    ("a:CPU=1GiB;a:CPU=2GiB", r"--hosts: host a is given twice"),
    ("a:TPU0=8GiB,CPU=1GiB", r"--hosts a: unknown device 'TPU0'"),
    ("a:CUDA0=24GB,CPU=1GiB", r"--hosts a CUDA0: cannot read size '24GB'"),
    ("a:CUDA0=24GiB", r"--hosts a: the spec needs a CPU=<size> entry"),
    ("a:CPU=1GiB,CPU=2GiB", r"--hosts a: CPU is given twice"),
    ("CPU=1GiB", r"--hosts: 'CPU=1GiB' is not NAME:DEVICES"),
    (";", r"--hosts: no host given"),
])
def test_bad_hosts_spec_one_line(spec, match):
    with pytest.raises(PlacementError, match=match) as e:
        parse_hosts(spec)
    assert "\n" not in str(e.value)


HOSTS_YAML = """\
hosts:
- name: a
  devices: [{name: CUDA0, budget: 24GiB, target: 2GiB}, {name: CPU, budget: 256GiB}]
- name: b
  devices:
  - {name: CPU, budget: 512GiB}
"""


def test_hosts_yaml():
    hosts = load_hosts_file(HOSTS_YAML, "hosts.yaml")
    assert hosts == (Host("a", tuple(parse_devices("CUDA0=24GiB,CPU=256GiB", what="the plan file")),
                          {"CUDA0": 2 * GIB}),
                     Host("b", tuple(parse_devices("CPU=512GiB", what="the plan file"))))
    assert hosts[0].room_bytes == 278 * GIB


@pytest.mark.parametrize("text,match", [
    ("hosts: [oops\n", r"hosts.yaml:2: malformed YAML"),
    ("- a\n", r"hosts.yaml:1: a hosts file is a YAML mapping with one key"),
    ("hosts: []\n", r"hosts.yaml:1: hosts must list at least one host"),
    (HOSTS_YAML.replace("name: b", "name: a"), r"hosts.yaml:4: hosts\[1\]: host a is given twice"),
    (HOSTS_YAML.replace("name: b", "name: 'b/c'"), r"hosts.yaml:4: hosts\[1\].name: 'b/c' is not a host name"),
    (HOSTS_YAML.replace("budget: 512GiB", "budget: 512GB"), r"hosts.yaml:6: .*cannot read size '512GB'"),
    (HOSTS_YAML.replace("name: CUDA0", "name: GPU0"), r"hosts.yaml:3: hosts\[0\].devices\[0\]: unknown device"),
    (HOSTS_YAML.replace("- name: b\n", "- name: b\n  rack: 3\n"), r"hosts.yaml:4: hosts\[1\]: unknown key 'rack'"),
    (HOSTS_YAML.replace("budget: 512GiB}", "budget: 512GiB, target: 1GiB}"), r"hosts.yaml:6: .*a CPU target is not used"),
    (HOSTS_YAML.replace("  - {name: CPU, budget: 512GiB}\n", "  - {name: CUDA0, budget: 8GiB}\n"),
     r"hosts.yaml:6: hosts\[1\].devices: the host needs a CPU entry"),
])
def test_malformed_hosts_yaml_one_line_with_its_line(text, match):
    with pytest.raises(PlacementError, match=match) as e:
        load_hosts_file(text, "hosts.yaml")
    assert "\n" not in str(e.value)


def test_the_last_host_holds_token_embd_when_the_nextn_head_embeds_with_it(models):
    """The shipped model's NextN block (GLM-4.5's layout without ``nextn.embed_tokens``) embeds
    drafted tokens with ``token_embd``: the last host, which drafts, holds a second copy, counted
    in its plan; a NextN block with its own ``embed_tokens`` needs none."""
    from offload.gguf_model import open_model
    from offload.probe import SHIPPED_MODEL

    model = open_model(str(SHIPPED_MODEL))
    assert nextn_embedding(model).name == "token_embd.weight"
    mplan = make_multihost_plan(model, parse_hosts("a:CPU=1GiB;b:CPU=1GiB"))
    first, last = mplan.hosts[0].plan, mplan.hosts[-1].plan
    assert "token_embd.weight" in first.tensors and "token_embd.weight" in last.tensors
    assert last.drafting == "in-model NextN"
    held = sum(t.n_bytes for t in shard(model, mplan.hosts[-1].blocks, first=False, last=True).tensors)
    assert sum(t.weights_bytes for t in last.totals) == held
    again = load_plan_file(multihost_plan_to_yaml(mplan), "multihost.yaml")
    assert build_multihost_plan(model, again.hosts, again.settings).hosts[-1].plan.tensors == last.tensors
    assert nextn_embedding(models["glm-4.5-air"]) is None


def test_several_sequences_across_hosts_are_refused(models):
    """The pipeline carries one sequence: a -np plan across hosts could not run."""
    with pytest.raises(PlacementError, match=r"^--hosts cannot be combined with -np 2"):
        make_multihost_plan(models["glm-4.5-air"], parse_hosts("a:CPU=512GiB;b:CPU=512GiB"),
                            PlanOptions(ctx=4096, parallel=2))
