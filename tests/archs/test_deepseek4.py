"""deepseek4 (DeepSeek-V4) on the torch path, layer 3: logits against transformers'
``DeepseekV4ForCausalLM`` on the same random weights (all three attention kinds, hash and
√softplus routing, YaRN on the compressed blocks, the SwiGLU clamps engaged), a prompt in one
batch against one token at a time, exact rollback of every cache after a verify batch (the
speculative loop's contract), and the bad-input errors."""
from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import Keys

import offload.runtime as rt
from offload.errors import OffloadError
from offload.gguf_model import NewerKeys
from tests.hf_reference import hf_deepseek4
from tests.tiny_models import TinySpec, write_tiny_model

# Same weights, both sides float32: the differences are summation order and where the RMS
# scaling is applied (~1e-6 of the logit scale, measured 1.7e-6). A wrong rope slice, mixing
# direction, slot order or clamp shows up at 1e-2..1.
REL_TOL = 1e-4
# 6 blocks: window-only (hash-routed), CSA, HCA; a 16-token window; YaRN with a 64-token
# original context so its ramp covers the rope dims; SwiGLU limit 2 so the clamps bite
SPEC = TinySpec(arch="deepseek4", expert_type=Q.F32, head_dim=64, n_rot=16, n_layer=6, rms_eps=1e-6,
                compress_ratios=(0, 0, 4, 128, 4, 128), n_hash=2, window=16, yarn_factor=4.0, yarn_orig_ctx=64,
                n_expert=8, n_expert_used=2, n_ff_exp=64, swiglu_limit=2.0, indexer_top_k=128, nextn=False, seed=40)
# 300 tokens: 2 entries per HCA block, 75 per CSA block (≤ top_k 128: the indexer keeps every
# visible entry, so its ReLU-zero ties cannot pick differently)
IDS = [int(t) for t in np.random.default_rng(7).integers(0, 290, 300)]


def rel_err(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def load(path, **kw):
    """All on the CPU, float activations everywhere (a 300-token prompt would otherwise quantize
    the activations of quantized experts to int8, whose rounding the routers and the indexer
    amplify into other picks), an f32 cache."""
    return rt.load(path, devices="CPU=16GiB", cache_type="f32", quiet=True, decode_activations="float",
                   int8_prefill=False, **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ds4") / "ds4.gguf", SPEC)


def reference(tiny, ids, **override) -> np.ndarray:
    with torch.no_grad():
        return hf_deepseek4(tiny, **override)(torch.tensor([ids])).logits[0].numpy()


def test_logits_match_transformers(tiny):
    ref = reference(tiny, IDS)
    with load(tiny.path) as s:
        ours = s.logits(IDS)
    err = rel_err(ours, ref)
    print(f"\n  deepseek4 F32 experts, top_k >= entries: rel err {err:.2e}")
    assert err < REL_TOL
    assert (ours.argmax(-1) == ref.argmax(-1)).mean() >= 0.99


def _indexer_scores(model, ids) -> list[torch.Tensor]:
    """transformers' index scores of every CSA block (hooked, not replaced)."""
    got = []
    for layer in model.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            comp.indexer.scorer.register_forward_hook(lambda m, args, out: got.append(out[0].detach()))
    with torch.no_grad():
        model(torch.tensor([ids]))
    return got


def test_small_top_k_matches_transformers_where_no_tie_decides(tmp_path):
    """top_k 8 of up to 75 entries: the indexer has to choose. First the reference's scores
    are checked to leave a clear gap between the k-th and the (k+1)-th visible entry of every
    query: a tie (with 4 indexer heads the seeds tried had exact ReLU-zero ties) or a gap
    within float32 noise (~1e-6 of the scale here) would let either implementation pick. With
    16 heads and this seed the smallest gap is 7.6e-5 of the scale; the check asks 2e-5."""
    from dataclasses import replace
    tiny = write_tiny_model(tmp_path / "k8.gguf", replace(SPEC, indexer_top_k=8, indexer_n_head=16, seed=43))
    from tests.hf_reference import hf_deepseek4 as build
    hf = build(tiny)
    k = 8
    for scores in _indexer_scores(hf, IDS):                       # (T, S)
        t, s = scores.shape
        visible = torch.arange(s)[None] < ((torch.arange(t) + 1) // 4)[:, None]
        ranked = scores.masked_fill(~visible, float("-inf")).sort(-1, descending=True).values
        rows = visible.sum(-1) > k
        gap = ranked[rows, k - 1] - ranked[rows, k]
        assert rows.any() and gap.min() > 2e-5 * scores.abs().max()
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].numpy()
    with load(tiny.path) as sess:
        ours = sess.logits(IDS)
    err = rel_err(ours, ref)
    print(f"\n  deepseek4 F32 experts, top_k 8: rel err {err:.2e}")
    assert err < REL_TOL


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.MXFP4])
def test_quantized_experts_match_the_dequantized_reference(tmp_path, qtype):
    """Quantized routed experts (Q8_0; MXFP4 as V4-Flash ships them) through the CPU kernels,
    float activations, against transformers on the dequantized weights: the same bound, float
    summation order only."""
    from dataclasses import replace
    tiny = write_tiny_model(tmp_path / "q.gguf", replace(SPEC, expert_type=qtype, seed=42))
    ref = reference(tiny, IDS)
    with load(tiny.path) as s:
        ours = s.logits(IDS)
    err = rel_err(ours, ref)
    print(f"\n  deepseek4 {qtype.name} experts: rel err {err:.2e}")
    assert err < REL_TOL


def test_prompt_in_one_batch_equals_one_token_at_a_time(tiny):
    """The caches (window ring, compressed entries, indexer keys, compressor state) give the
    same logits whether the prompt comes in one batch, one token at a time, or in chunks that
    end mid-window: float32 rounding only."""
    ids = IDS[:140]
    with load(tiny.path) as s, torch.inference_mode():
        batched = s.logits(ids)
        state = s.model.new_state()
        steps = np.stack([s.model.forward(torch.tensor([t]), state)[0][0].numpy() for t in ids])
        assert state.n_past == len(ids)
        state = s.model.new_state()
        chunks = np.concatenate([s.model.forward(torch.tensor(ids[i:i + 13]), state)[0].numpy()
                                 for i in range(0, len(ids), 13)])
    assert rel_err(steps, batched) < REL_TOL
    assert rel_err(chunks, batched) < REL_TOL


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4])
def test_truncate_after_a_verify_batch_continues_bit_for_bit(tiny, n_draft):
    """At every length L from 120 to 136 (across HCA's 128-token window boundary and CSA's
    4-token ones): a copy of the state decodes token x; the state itself first takes a verify
    batch of 1 + n_draft tokens, is truncated back to L, then decodes x. The logits are equal
    bit for bit, so rollback restored every cache exactly."""
    with load(tiny.path) as s, torch.inference_mode():
        model = s.model
        state = model.new_state()
        model.forward(torch.tensor(IDS[:120]), state, logits="none")
        for length in range(120, 137):
            assert state.n_past == length
            twin = copy.deepcopy(state)
            want = model.forward(torch.tensor([IDS[length]]), twin)[0]
            model.forward(torch.tensor(IDS[length:length + 1 + n_draft][::-1]), state, logits="none")
            state.truncate(length)
            got = model.forward(torch.tensor([IDS[length]]), state)[0]
            assert torch.equal(got, want), length


def test_a_deep_rollback_keeps_compressing_right(tiny):
    """A prompt cache rolls a state back further than a verify batch: 16 one-token steps
    (DECODE_TOKENS, as a finished generation leaves them) then truncated back. The compressed
    entries the next steps emit must be the ones a state that never went ahead emits: the
    next 12 positions (three CSA entries) decode bit for bit as a copy made before. (The
    compressor once re-based its kept rows on a position it no longer held: the first entry
    after such a rollback came out wrong, logits off by 0.2-1.)"""
    with load(tiny.path) as s, torch.inference_mode():
        model = s.model
        state = model.new_state()
        model.forward(torch.tensor(IDS[:39]), state, logits="none")
        twin = copy.deepcopy(state)
        for t in IDS[39:55]:
            model.forward(torch.tensor([t]), state, logits="none")
        state.truncate(39)
        for pos in range(39, 51):
            want = model.forward(torch.tensor([IDS[pos]]), twin)[0]
            got = model.forward(torch.tensor([IDS[pos]]), state)[0]
            assert torch.equal(got, want), pos
        # and through the prompt cache: the second request reuses the first's prefix
        plain = list(s.generate(IDS[:40], max_tokens=16, stop_at_eos=False))
        for _ in range(2):
            assert list(s.generate(IDS[:40], max_tokens=16, stop_at_eos=False, cache_prompt=True)) == plain


def _greedy(model, prompt, n):
    state = model.new_state()
    tok = int(model.forward(torch.tensor(prompt), state)[0][-1].argmax())
    out = [tok]
    while len(out) < n:
        tok = int(model.forward(torch.tensor([tok]), state)[0][0].argmax())
        out.append(tok)
    return out


@pytest.mark.parametrize("n_draft", [1, 2, 3, 4])
def test_exact_verify_equals_plain_greedy(tiny, n_draft):
    """Drafts of n_draft tokens (some right, some wrong), verified in one batch, the accepted
    prefix kept and the state truncated behind it: the tokens are plain greedy decoding's,
    through positions 124..140 (HCA and CSA windows close inside verify batches)."""
    prompt, n = IDS[:124], 16
    with load(tiny.path) as s, torch.inference_mode():
        model = s.model
        plain = _greedy(model, prompt, n + n_draft + 1)
        rng = np.random.default_rng(n_draft)
        state = model.new_state()
        tok = int(model.forward(torch.tensor(prompt), state)[0][-1].argmax())
        out, rejected = [tok], 0
        while len(out) < n:
            at = len(out)
            draft = [plain[at + j] if rng.random() < 0.7 else (plain[at + j] + 1) % 290 for j in range(n_draft)]
            base = state.n_past
            pred = model.forward(torch.tensor([tok] + draft), state)[0].argmax(-1).tolist()
            j = 0
            while j < n_draft and draft[j] == pred[j]:
                j += 1
            rejected += n_draft - j
            state.truncate(base + 1 + j)
            out += draft[:j] + [pred[j]]
            tok = pred[j]
        assert out[:n] == plain[:n]
        assert rejected > 0
        with pytest.raises(ValueError, match="cannot roll back"):
            state.truncate(state.n_past - 40)


def _bad(tmp_path, name, **overrides):
    from dataclasses import replace
    spec = replace(SPEC, n_layer=4, compress_ratios=(0, 4, 128, 0), seed=43,
                   meta_overrides=tuple(overrides.items()))
    return write_tiny_model(tmp_path / f"{name}.gguf", spec, keep_weights=False).path


BAD = {
    "gating": ({Keys.LLM.EXPERT_GATING_FUNC: 2}, r"deepseek4: expert_gating_func is 2; only 4 \(sqrt-softplus\)"),
    "missing-sinkhorn": ({NewerKeys.HC_SINKHORN_ITERATIONS: None},
                         r"^deepseek4: missing metadata key deepseek4\.hyper_connection\.sinkhorn_iterations$"),
    "hc-count": ({NewerKeys.HC_COUNT: 2}, r"hc_attn_fn\.weight.*hyper_connection\.count"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_line(tmp_path, case):
    overrides, message = BAD[case]
    path = _bad(tmp_path, case, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OffloadError, match=message) as err:
            rt.load(path, devices="CPU=16GiB", quiet=True)
    assert "\n" not in str(err.value)


def test_offload_run_refuses_bad_input_in_one_line(tmp_path, capsys):
    from offload.cli import main
    for overrides in ({Keys.LLM.EXPERT_GATING_FUNC: 1}, {NewerKeys.COMPRESS_RATIOS: [0, 4, 64, 0]}):
        path = _bad(tmp_path, "run", **overrides)
        rc = main(["run", str(path), "-p", "def", "-n", "2"])
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert rc == 2 and out.out == "" and "Traceback" not in out.err
        assert lines[-1].startswith("offload: error:") and "deepseek4" in lines[-1], out.err


def reference_clamped_moe(x, ids, wts, gate, up, down, limit):
    """float64: Σ_k w · down_e · (silu(min(g, limit)) · clamp(u, ±limit))."""
    y = np.zeros((x.shape[0], down.shape[1]))
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], wts[t]):
            g = np.minimum(gate[e] @ x[t], limit)
            u = np.clip(up[e] @ x[t], -limit, limit)
            y[t] += wt * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return y


# float activations: only summation order differs from float64 (1e-5 of the output scale)
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.MXFP4])
def test_cpu_and_torch_experts_clamp_like_float64(qtype):
    """The ``swiglu_clamp`` activation of the CPU kernels (``moe_ffn``) and of torch experts
    (``gpu.ffn.glu``) against float64, with gate and up past the limit on both sides."""
    from cpu_kernels import ExpertWeights
    from cpu_kernels.moe import moe_ffn
    from gpu.ffn import glu
    from tests.tiny_models import random_tensor
    rng = np.random.default_rng(0)
    n_exp, d, f, b, k, limit = 6, 64, 96, 5, 2, 1.5
    raws, deq = {}, {}
    for name, shape, std in (("gate", (n_exp, f, d), 0.6), ("up", (n_exp, f, d), 0.6), ("down", (n_exp, d, f), 0.2)):
        raws[name], _, deq[name] = random_tensor(rng, shape, qtype, std)
    x = (rng.standard_normal((b, d)) * 2).astype(np.float32)
    ids = np.stack([rng.choice(n_exp, k, replace=False) for _ in range(b)])
    wts = rng.uniform(0.1, 1, (b, k)).astype(np.float32)
    g = np.einsum("tkfd,td->tkf", deq["gate"][ids], x)
    u = np.einsum("tkfd,td->tkf", deq["up"][ids], x)
    assert (g > limit).any() and (u > limit).any() and (u < -limit).any()
    ref = reference_clamped_moe(x.astype(np.float64), ids, wts, *(deq[n].astype(np.float64) for n in
                                ("gate", "up", "down")), limit)
    raw = lambda a: a if qtype == Q.F32 else a.view(np.uint8)  # noqa: E731
    w = ExpertWeights(gate=raw(raws["gate"]), up=raw(raws["up"]), down=raw(raws["down"]),
                      gate_type=qtype, up_type=qtype, down_type=qtype, name="blk.0")
    got = moe_ffn(x, ids, wts, w, act="swiglu_clamp", limit=limit, int8=False)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-5
    act = glu("swiglu_clamp", limit)
    torch_y = sum(wts[:, j, None] * np.stack([
        deq["down"][ids[t, j]] @ act(torch.from_numpy(deq["gate"][ids[t, j]] @ x[t]),
                                     torch.from_numpy(deq["up"][ids[t, j]] @ x[t])).numpy()
        for t in range(b)]) for j in range(k))
    assert np.abs(torch_y - ref).max() / np.abs(ref).max() < 1e-5
    with pytest.raises(ValueError, match="limit"):
        moe_ffn(x, ids, wts, w, act="swiglu_clamp")


@pytest.mark.parametrize("t", [1, 5])
def test_compiled_hyper_connection_is_the_torch_one(t):
    """A CPU block's mHC mixing (``cpu_kernels.hyper.hc_pre``, one compiled call) against
    ``gpu.hyper.HyperConnection``: y, post and the Sinkhorn-normalised comb, float32 order only."""
    from gpu.hyper import HyperConnection
    from offload.cpu_ops import CpuHyperConnection
    g = torch.Generator().manual_seed(t)
    n, d = 4, 96
    fn = torch.randn(24, n * d, generator=g) * 0.1
    base, scale = torch.randn(24, generator=g), torch.randn(3, generator=g)
    kw = dict(n_streams=n, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6)
    x = torch.randn(t, n, d, generator=g)
    for want, got in zip(HyperConnection(fn, base, scale, **kw)(x), CpuHyperConnection(fn, base, scale, **kw)(x)):
        assert got.shape == want.shape and rel_err(got.numpy(), want.numpy()) < 1e-6


def test_caches_hold_the_planned_rows_through_micro_batches(tiny):
    """300 tokens in 16-token micro-batches (the window ring drops rows past the window,
    compressed entries fill to ceil(ctx / r)): each block's cache holds exactly the bytes
    ``placement.memory.kv_bytes`` counts, and the logits are the one-batch ones."""
    from offload.gguf_model import open_model
    from placement.memory import kv_bytes
    with load(tiny.path, ctx=300, ubatch=16) as s, torch.inference_mode():
        whole = s.logits(IDS)
        state = s.model.new_state()
        chunks = np.concatenate([s.model.forward(torch.tensor(IDS[i:i + 16]), state)[0].numpy()
                                 for i in range(0, len(IDS), 16)])
        spec, settings = open_model(tiny.path).spec, s.plan.settings
        for i, cache in enumerate(state.caches):
            assert cache.nbytes == kv_bytes(spec, i, settings), i
            assert cache.window.start > 0 and cache.length == len(IDS)
    assert rel_err(chunks, whole) < REL_TOL


MTP_SPEC = TinySpec(arch="deepseek4", expert_type=Q.F32, head_dim=64, n_rot=16, n_layer=4, rms_eps=1e-6,
                    compress_ratios=(0, 4, 128, 4), n_hash=1, window=16, yarn_factor=4.0, yarn_orig_ctx=64,
                    n_expert=8, n_expert_used=2, n_ff_exp=64, swiglu_limit=2.0, nextn=True, seed=45)


@pytest.fixture(scope="module")
def mtp_tiny(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("ds4mtp") / "mtp.gguf", MTP_SPEC)


def test_mtp_head_matches_a_transformers_built_reference(mtp_tiny):
    """The bundled MTP head (``blk.4.nextn.*`` with its own ``nextn.hc_head_*``) fed the
    trunk's streams at t and the token at t+1 (position t+1), against the same head built
    from transformers' V4 layer, hyper head and norms on transformers' own trunk streams; and
    a chained step from the head's own streams."""
    from tests.hf_reference import hf_deepseek4_mtp
    ids = IDS[:150]
    hf = hf_deepseek4(mtp_tiny)
    seen = []
    hf.model.hc_head.register_forward_pre_hook(lambda mod, args: seen.append(args[0][0].detach()))
    mtp = hf_deepseek4_mtp(mtp_tiny)
    t = len(ids)
    with torch.no_grad():
        hf(torch.tensor([ids]))
        ref, ref_streams = mtp(torch.tensor(ids[1:]), seen[0][:-1], torch.arange(1, t))
        ref_chain, _ = mtp(torch.tensor(ids[2:]), ref_streams[:-1], torch.arange(2, t))
    with load(mtp_tiny.path) as s, torch.inference_mode():
        model = s.model
        state = model.new_state()
        _, hidden = model.forward(torch.tensor(ids), state, logits="none")
        assert hidden.shape == (t, MTP_SPEC.hc_mult * MTP_SPEC.n_embd)
        assert rel_err(hidden.view(t, MTP_SPEC.hc_mult, -1).numpy(), seen[0].numpy()) < REL_TOL
        logits, h_mtp = model.nextn(torch.tensor(ids[1:]), hidden[:-1], torch.arange(1, t), state.nextn_cache)
        chained, _ = model.nextn(torch.tensor(ids[2:]), h_mtp[:-1], torch.arange(2, t), model.nextn.new_cache())
    err, chain_err = rel_err(logits.numpy(), ref.numpy()), rel_err(chained.numpy(), ref_chain.numpy())
    print(f"\n  deepseek4 MTP head: rel err {err:.2e}, chained {chain_err:.2e}")
    assert err < REL_TOL and chain_err < REL_TOL
    assert len(state.nextn_cache) == t - 1


def test_drafting_gives_plain_greedy_tokens(mtp_tiny):
    """Speculative decoding with the MTP head (chained drafts) and with n-grams of the
    context, greedy, exact verify at every n_max 1-5 and batched at 3: the same tokens as
    plain decoding, across the HCA window boundary at 128."""
    prompt = IDS[:120]
    with load(mtp_tiny.path) as s:
        plain = list(s.generate(prompt, max_tokens=24, stop_at_eos=False))
        runs = [(kind, n, "exact") for kind in ("mtp", "ngram") for n in (1, 2, 3, 4, 5)]
        for kind, n_max, verify in runs + [("mtp", 3, "batched"), ("ngram", 3, "batched")]:
            spec = list(s.generate(prompt, max_tokens=24, stop_at_eos=False, n_max=n_max, verify=verify,
                                   spec_type=kind))
            assert spec == plain, (kind, n_max, verify)
            assert s.stats.drafted > 0 or kind == "ngram"
            assert s.stats.spec["type"] == kind


def test_mtp_sidecar_drafts_as_the_bundled_head(mtp_tiny, tmp_path):
    """The bundled file split into a trunk and a mainline-layout MTP sidecar (``--draft``,
    the head's hc head as the sidecar's root ``output_hc_*``): the same trunk logits and the
    same draft logits as the bundled file, and speculative greedy == plain greedy."""
    from tests.nextn_split import split_deepseek4_mtp
    trunk, draft = tmp_path / "trunk.gguf", tmp_path / "mtp.gguf"
    assert split_deepseek4_mtp(mtp_tiny.path, trunk, draft) == MTP_SPEC.n_layer
    ids, t = IDS[:60], 60

    def run(path, **kw):
        with load(path, **kw) as s, torch.inference_mode():
            state = s.model.new_state()
            logits, hidden = s.model.forward(torch.tensor(ids), state)
            drafted, _ = s.model.nextn(torch.tensor(ids[1:]), hidden[:-1], torch.arange(1, t), state.nextn_cache)
            return logits, drafted, list(s.generate(IDS[:120], max_tokens=12, stop_at_eos=False, n_max=2))
    bundled, split = run(mtp_tiny.path), run(trunk, draft=str(draft))
    assert torch.equal(bundled[0], split[0]) and torch.equal(bundled[1], split[1])
    assert bundled[2] == split[2]


def test_a_routing_table_that_is_not_i32_is_refused(tmp_path):
    """``ffn_gate_tid2eid`` must stay I32 (llama-quantize skips integer tensors); a file whose
    table has another type (here F32) is refused at load, in one line naming the tensor."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    src = _bad(tmp_path, "src")
    r = GGUFReader(str(src))
    bad = tmp_path / "f32-table.gguf"
    w = GGUFWriter(str(bad), "deepseek4")
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == Keys.General.ARCHITECTURE:
            continue
        sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        data = t.data.astype(np.float32) if t.name.endswith("tid2eid.weight") else t.data
        w.add_tensor(t.name, data, raw_dtype=None if t.tensor_type in (Q.F32, Q.F16, Q.I32) else t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(OffloadError, match=r"blk\.0\.ffn_gate_tid2eid\.weight is F32") as err:
            rt.load(bad, devices="CPU=16GiB", quiet=True)
    assert "\n" not in str(err.value)
