"""Measurements behind ``offload tune``: what one decode step costs on this box, how the
router spreads a verify batch over experts, and how many drafts the head gets accepted.

Each function measures one thing on a loaded ``Session`` and returns plain numbers (or a
``placement`` profile); the command (``offload.commands.tune``) sequences them within the
budget, fits the cost model (``placement.cost_fit``) and runs the real decode loop to compare.

- ``Calibration``: greedy plain decoding of the calibration prompts. Its text is what the
  timed passes feed (real tokens route like real decoding), its step time is the plain
  loop's, and a state after prompt + half the text puts the timed passes at a realistic
  context position.
- ``time_passes``: T_verify(B) (the target over B tokens, all logits, cache rolled back) and
  T_draft (the head over one chained token) in interleaved rounds; the median per kind.
- ``measure_routing``: distinct routed experts per MoE layer for windows of B tokens.
- ``measure_acceptance``: speculative decoding at n_max → conditional a_j (and c_j).
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from offload.errors import OffloadError
from offload.moe import MoE
from offload.sampling import Sampler, SamplingDefaults
from offload.speculative import SpecOptions, make_drafter
from offload.stats import conditional
from placement.acceptance import AcceptanceProfile
from placement.routing import PromptCounts, RoutingCounts, RoutingProfile


def _clock() -> float:
    return time.perf_counter()


@dataclass
class Decode:
    """One generation: the tokens and what ``RunStats`` counted."""

    prompt: list[int]
    tokens: list[int]
    n_max: int
    eval_s: float
    steps: int
    drafted: int
    accepted: int
    draft_s: float
    verify_s: float
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    reached_per_position: list[int]
    drafter: str = "none"          # what drafted: mtp, ngram, dspark; none for plain decoding
    sample_s: float = 0.0          # choosing the tokens (sampling, judging drafts): inside verify_s

    @property
    def produced(self) -> int:
        """Tokens the timed steps produced (all but the prompt's one)."""
        return max(len(self.tokens) - 1, 0)

    @property
    def step_s(self) -> float:
        return self.eval_s / self.steps if self.steps else 0.0


# what `offload run` samples with (its defaults), seeded: the decode loop's timed runs
RUN_SAMPLING = {**SamplingDefaults().of(None), "seed": 0}


def decode(session, prompt: Sequence[int], *, n_tokens: int, n_max: int = 0, p_min: float = 0.0,
           **generate) -> Decode:
    """Generation of exactly ``n_tokens`` (end-of-sequence ignored; greedy unless ``generate``
    sets sampling), as ``offload run`` does it (batched verify); ``generate``: further
    ``Session.generate`` keywords (``head``, ``verify``, ``ubatch``, ``spec_type``: the drafter,
    mtp by default; ``RUN_SAMPLING``: offload run's sampling)."""
    out = list(session.generate(list(prompt), max_tokens=n_tokens, stop_at_eos=False,
                                n_max=n_max, p_min=p_min, **{"verify": "batched", **generate}))
    s = session.stats
    return Decode(list(prompt), out, n_max, s.eval_s, s.n_steps, s.drafted, s.accepted, s.draft_s, s.verify_s,
                  list(s.accepted_per_position), list(s.drafted_per_position), list(s.reached_per_position),
                  generate.get("spec_type", "mtp") if n_max else "none", s.eval_profile.get("sampling", 0.0))


@dataclass(frozen=True)
class Batched:
    """Plain greedy decoding of ``sequences`` prompts at once (continuous batching, as
    ``offload serve -np N`` steps them): the tokens decoded after the prompts, all sequences,
    and the median sequence's decode time and steps (the sequences step together)."""

    sequences: int
    tokens: int
    eval_s: float
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.eval_s if self.eval_s else 0.0

    @property
    def step_s(self) -> float:
        return self.eval_s / self.steps if self.steps else 0.0

    def to_json(self) -> dict:
        return {"sequences": self.sequences, "tokens": self.tokens, "seconds": round(self.eval_s, 6),
                "steps": self.steps, "tokens_per_s": round(self.tokens_per_s, 3),
                "step_ms": round(self.step_s * 1e3, 4)}


def decode_batched(session, prompts: Sequence[Sequence[int]], *, sequences: int, n_tokens: int) -> Batched:
    """``sequences`` of ``prompts`` decoded together, plain and greedy, ``n_tokens`` each
    (``Session.generate_batch``). The prompts are cut to one length, so they go through the
    same step and the sequences decode in lockstep from the next (a longer prompt's chunks
    would otherwise land in the others' decode time); a prompt used again starts one token
    later, so no two sequences are the same text."""
    n = len(prompts)
    reuse = (sequences - 1) // n
    length = min(len(p) for p in prompts) - reuse
    if length < 1:
        raise OffloadError(f"prompts too short to decode {sequences} different sequences at once")
    batch = [list(prompts[i % n][i // n:i // n + length]) for i in range(sequences)]
    out = session.generate_batch(batch, max_tokens=n_tokens, stop_at_eos=False, n_max=0)
    stats = session.batch_stats
    return Batched(sequences, sum(max(len(t) - 1, 0) for t in out), statistics.median(s.eval_s for s in stats),
                   int(statistics.median(s.n_steps for s in stats)))


BATCHED_SEQUENCES = (2, 4)     # decoded at once beside one: the several-sequences forecast's own term


def decode_several(session, prompts: Sequence[Sequence[int]], *, n_tokens: int) -> list[Batched]:
    """``decode_batched`` for each of ``BATCHED_SEQUENCES``, after a short run that sets up the
    slots' caches."""
    decode_batched(session, prompts, sequences=max(BATCHED_SEQUENCES), n_tokens=4)
    return [decode_batched(session, prompts, sequences=s, n_tokens=n_tokens) for s in BATCHED_SEQUENCES]


def batch_step(batched: Sequence[Batched], fp, hw, *, routing=None) -> float:
    """``HardwareProfile.batch_step_us`` from ``decode_several``'s runs: the median over the
    counts of what each sequence adds to a batched step beyond the cost model's pass
    (``placement.concurrency.batch_step_us``)."""
    from placement.concurrency import batch_step_us
    return statistics.median(batch_step_us(fp, hw, b.sequences, b.step_s, routing=routing) for b in batched)


# ---------------------------------------------------------------------------------------------
# Pass timings.
# ---------------------------------------------------------------------------------------------

@dataclass
class PassTimes:
    verify: dict[int, list[float]] = field(default_factory=dict)   # B -> seconds of each pass
    draft: dict[int, list[float]] = field(default_factory=dict)    # B -> seconds of a head pass
    inject: dict[int, list[float]] = field(default_factory=dict)   # B -> a block drafter's injection of B
    plain: list[Decode] = field(default_factory=list)               # short plain decoding runs
    spec: list[Decode] = field(default_factory=list)                # short drafting runs at max_n
    rounds: int = 0

    def verify_s(self) -> dict[int, float]:
        return {b: statistics.median(ts) for b, ts in sorted(self.verify.items())}

    def draft_s(self) -> dict[int, float]:
        return {b: statistics.median(ts) for b, ts in sorted(self.draft.items())}

    def inject_s(self) -> dict[int, float]:
        return {b: statistics.median(ts) for b, ts in sorted(self.inject.items())}

    def spread(self) -> dict[str, float]:
        """Relative half-width of the middle 50 % per kind (how stable the medians are)."""
        def iqr(ts: list[float]) -> float:
            q = np.percentile(ts, [25, 75])
            return float((q[1] - q[0]) / 2 / np.median(ts))
        out = {f"verify B={b}": iqr(ts) for b, ts in sorted(self.verify.items())}
        out |= {f"draft B={b}": iqr(ts) for b, ts in sorted(self.draft.items())}
        out |= {f"inject B={b}": iqr(ts) for b, ts in sorted(self.inject.items())}
        return out

    def loop_overheads(self) -> tuple[float, float]:
        """(seconds per plain step outside its passes, extra seconds per drafting step): the
        loop's own time ``RunStats`` books neither to drafting nor to verifying (rollback,
        bookkeeping, the generator) and the choice of its tokens (sampling, judging drafts: timed
        inside the verify step, but no pass time ``T_verify(B)`` holds it), per step, median over
        the short runs.

        Measured directly rather than as "step time − the timed passes": on a shared box that
        difference of two noisy numbers came out anywhere between 0 and 6 ms per step."""
        def rest(r: Decode) -> float:
            return (r.eval_s - r.draft_s - r.verify_s + r.sample_s) / r.steps
        step = statistics.median(rest(r) for r in self.plain if r.steps)
        extra = [rest(r) - step for r in self.spec if r.steps]
        return max(step, 0.0), max(statistics.median(extra), 0.0) if extra else 0.0


def time_passes(session, calib: Decode, *, max_batch: int, seconds: float, min_rounds: int = 5,
                loop_tokens: int = 0, clock: Callable[[], float] = _clock) -> PassTimes:
    """T_verify(B) for B = 1..max_batch and T_draft, interleaved round by round until
    ``seconds`` are spent (at least ``min_rounds`` rounds). With ``loop_tokens``, each round
    also runs the real decode loop for that many tokens from the same position, plain and
    drafting at n_max = max_batch - 1 (with the NextN head, the DSpark drafter, or from n-grams
    when the model has neither): the loop's own per-step time is measured under the same
    conditions as the passes it is added to (``PassTimes.loop_overheads``). With a DSpark
    drafter a draft of B is its draft call (block pass, Markov chain, rollback; at most a
    block's drafts), and T_inject(B) its injection of B tokens' taps.

    The target sits after the prompt and the first half of ``calib``'s text; each round feeds
    the next B tokens of that text (logits for all B rows, as a verify pass computes them,
    one row for B = 1, as plain decoding does) and truncates the cache back. A draft pass of B
    tokens is the first head pass of a step after B - 1 accepted drafts (the B pairs of trunk
    state and next token, logits of the last row); B = 1 is also what each chained step costs.

    Why the median over interleaved rounds: on a shared box a pass is sometimes preempted,
    which lengthens a few samples by a lot; the median ignores them, and interleaving spreads
    slow phases of the machine over every B alike (the minimum, tried first, was the least
    stable of the three from run to run).
    """
    model = session.model
    head = model.nextn
    dspark = getattr(model, "dspark", None)
    seq = calib.prompt + calib.tokens
    start = len(calib.prompt) + max(len(calib.tokens) // 2 - max_batch, 0)
    ahead = seq[start:start + max_batch]
    if len(ahead) < max_batch:
        raise ValueError(f"calibration text too short for a verify batch of {max_batch}")
    # a head pass runs up to max_batch pairs; a DSpark draft call makes up to max_batch - 1 drafts
    drafter_b = range(1, (min(max_batch - 1, dspark.header.max_drafts) if dspark is not None else max_batch) + 1)
    out = PassTimes({b: [] for b in range(1, max_batch + 1)},
                    {b: [] for b in drafter_b} if head is not None or dspark is not None else {},
                    {b: [] for b in range(1, max_batch + 1)} if dspark is not None else {})
    with torch.inference_mode():
        state = model.new_state(head or dspark)
        _, hidden = model.forward(torch.as_tensor(seq[:start]), state, logits="none")   # (start, n_embd)
        cache = state.nextn_cache
        if head is not None:
            # head cache entry t = (h_t, x_{t+1}); it holds entries 0..start-2, and a pass of B
            # pairs recomputes entries start-B..start-1
            head(torch.as_tensor(seq[1:start]), hidden[:start - 1], torch.arange(1, start), cache, logits="none")
        if dspark is not None:
            # DSpark: the rings hold the taps of 0..start-1; a draft of B is the drafter's own
            # draft call (the block pass, the Markov chain, the rollback), an injection of B the
            # taps of the next B tokens (what a step that kept B tokens takes in)
            dspark.inject(hidden, torch.arange(start), cache)
            _, taps_ahead = model.forward(torch.as_tensor(ahead), state, logits="none")
            state.truncate(start)
            cache.truncate(start)
            drafter = make_drafter(SpecOptions(n_max=max(drafter_b), type="dspark"), dspark, state, Sampler(),
                                   session.plan.settings.ubatch)
        t_end = clock() + seconds
        while out.rounds < min_rounds or clock() < t_end:
            if loop_tokens:
                # untimed: the loops below start with a prompt pass over `start` tokens, whose
                # buffers evict the weights and caches from the CPU's cache; no decode step
                # follows a prompt, so the first timed pass must not either (measured on a
                # 2-core EPYC, 32 MB L3, shipped model: T_verify(1) 0.75 ms after the loops
                # against 0.50 ms without them, the plain decode step 0.55 ms)
                model.forward(torch.as_tensor(ahead[:1]), state, logits="last")
                state.truncate(start)
            for b in range(1, max_batch + 1):
                ids = torch.as_tensor(ahead[:b])
                t0 = clock()
                logits, _ = model.forward(ids, state, logits="all" if b > 1 else "last")
                logits.float().numpy()
                out.verify[b].append(clock() - t0)
                state.truncate(start)
            if dspark is not None:
                cache.truncate(start)
                for b in out.draft:
                    t0 = clock()
                    drafter.draft(ahead[0], start, b)
                    out.draft[b].append(clock() - t0)
                for b in out.inject:
                    t0 = clock()
                    dspark.inject(taps_ahead[:b], torch.arange(start, start + b), cache)
                    out.inject[b].append(clock() - t0)
                    cache.truncate(start)
            elif head is not None:
                for b in out.draft:
                    cache.truncate(start - b)
                    t0 = clock()
                    z, _ = head(torch.as_tensor(seq[start - b + 1:start + 1]), hidden[start - b:start],
                                torch.arange(start - b + 1, start + 1), cache, logits="last")
                    int(np.argmax(z[-1].numpy()))
                    out.draft[b].append(clock() - t0)
                    cache.truncate(start - 1)
            if loop_tokens:
                kind = "mtp" if head is not None else "dspark" if dspark is not None else "ngram"
                # the loop samples as `offload run` does (llama.cpp's chain): choosing a token is
                # part of a step's own time, 14 % of the shipped model's plain step
                out.plain.append(decode(session, seq[:start], n_tokens=loop_tokens, **RUN_SAMPLING))
                out.spec.append(decode(session, seq[:start], n_tokens=loop_tokens, n_max=max_batch - 1,
                                       spec_type=kind, **RUN_SAMPLING))
            out.rounds += 1
    return out


# ---------------------------------------------------------------------------------------------
# Routing.
# ---------------------------------------------------------------------------------------------

class _RecordingRouter:
    """Wraps a layer's router for the routing measurement: same outputs, ids kept."""

    def __init__(self, router):
        self.router, self.ids = router, []

    def __call__(self, x, *tokens):        # tokens: a hash router's (deepseek4's first blocks)
        ids, w = self.router(x, *tokens)
        self.ids.append(ids.detach().cpu().numpy())
        return ids, w


def moe_layers(session, devices: set[str] | None = None) -> list[int]:
    """Trunk blocks with a routed MoE; with ``devices``, those whose experts live there."""
    out = []
    for i, block in enumerate(session.model.blocks):
        if not isinstance(block.ffn, MoE):
            continue
        if devices is not None:
            where = {dev for name, dev in session.plan.tensors.items()
                     if name.startswith(f"blk.{i}.ffn_") and "_exps" in name}
            if not where & devices:
                continue
        out.append(i)
    return out


def own_nextn_layer(session) -> int | None:
    """The block index of the model's own NextN head when it routes over experts (GGUF puts
    it after the trunk: ``blk.{n_layer}``); None without one, or for a ``--draft`` file's head
    (its experts are not the model's)."""
    cfg, head = session.config, session.model.nextn
    if head is None or not cfg.n_nextn or not isinstance(getattr(head.block, "ffn", None), MoE):
        return None
    return cfg.n_layer


def routed_ids(session, texts: Sequence[Sequence[int]], layers: Sequence[int], *,
               nextn: int | None = None) -> dict[int, list[np.ndarray]]:
    """Top-k expert ids (T, k) per layer for each token sequence, from one batched pass each.
    With ``nextn`` (``own_nextn_layer``), the NextN head's block is recorded too, under that
    layer: it runs over the text's pairs (trunk state at t, token t+1), as drafting feeds it,
    the last state paired with the trunk's greedy next token (so T rows, as every layer)."""
    blocks = session.model.blocks
    head = session.model.nextn if nextn is not None else None
    ffns = {i: blocks[i].ffn for i in layers} | ({nextn: head.block.ffn} if head is not None else {})
    recorders = {i: _RecordingRouter(f.router) for i, f in ffns.items()}
    out: dict[int, list[np.ndarray]] = {i: [] for i in ffns}
    ubatch = session.plan.settings.ubatch
    try:
        for i, r in recorders.items():
            ffns[i].router = r
        with torch.inference_mode():
            for ids in texts:
                state = session.model.new_state(head)
                for r in recorders.values():
                    r.ids.clear()
                hidden, z = [], None
                for s in range(0, len(ids), ubatch):
                    last = head is not None and s + ubatch >= len(ids)
                    z, h = session.model.forward(torch.as_tensor(list(ids[s:s + ubatch])), state,
                                                 logits="last" if last else "none")
                    hidden.append(h)
                if head is not None:
                    h = torch.cat(hidden)                                   # (T, n_embd)
                    nxt = list(ids[1:]) + [int(torch.argmax(z[-1]))]        # token t+1 for every t
                    for s in range(0, len(ids), ubatch):
                        e = min(s + ubatch, len(ids))
                        head(torch.as_tensor(nxt[s:e]), h[s:e], torch.arange(s + 1, e + 1),
                             state.nextn_cache, logits="none")
                for i, r in recorders.items():
                    out[i].append(np.concatenate(r.ids))
    finally:
        for i, r in recorders.items():
            ffns[i].router = r.router
    return out


def routing_counts(session, texts: Sequence[Sequence[int]], names: Sequence[str], *, source: str, model: str,
                   max_batch: int) -> RoutingCounts:
    """Per-expert assignment counts over ``texts`` for every MoE layer (the NextN head's too),
    per prompt and summed, with the distinct experts of B = 1..max_batch consecutive tokens
    (over the trunk layers): the ``offload profile`` file (``placement.routing``)."""
    cfg = session.config
    layers = moe_layers(session)
    if not layers:
        raise ValueError("the model has no routed MoE layer")
    nextn = own_nextn_layer(session)
    routed = routed_ids(session, texts, layers, nextn=nextn)
    E = cfg.n_expert
    prompts = tuple(PromptCounts(name, len(ids), {i: tuple(float(c) for c in np.bincount(a[j].ravel(), minlength=E))
                                                  for i, a in routed.items()})
                    for j, (name, ids) in enumerate(zip(names, texts)))
    totals = {i: tuple(float(sum(p.layers[i][e] for p in prompts)) for e in range(E)) for i in routed}
    batch = min(max_batch, min(len(t) for t in texts))
    distinct = [float(np.mean(col)) for col in zip(*(distinct_per_batch(routed[i], batch) for i in layers))]
    return RoutingCounts(E, cfg.n_expert_used, sum(len(t) for t in texts), totals, source=source, model=model,
                         distinct=tuple(distinct), prompts=prompts)


def distinct_per_batch(ids: Sequence[np.ndarray], max_batch: int) -> list[float]:
    """Mean distinct experts in windows of B = 1..max_batch consecutive tokens.

    The same window starts serve every B (each B+1 window contains its B window), so the
    means are non-decreasing in B; each is at most min(E, B·k).
    """
    counts = np.zeros(max_batch)
    n = 0
    for a in ids:                                          # (T, k)
        for s in range(0, a.shape[0] - max_batch + 1):
            seen: set[int] = set()
            for b in range(max_batch):
                seen.update(int(e) for e in a[s + b])
                counts[b] += len(seen)
            n += 1
    if n == 0:
        raise ValueError(f"no window of {max_batch} tokens in the routing text")
    return [float(c / n) for c in counts]


def measure_routing(session, texts: Sequence[Sequence[int]], max_batch: int) -> tuple[RoutingProfile, list[int]]:
    """``RoutingProfile`` (measured) over the MoE layers whose experts are on the CPU (all MoE
    layers when none is), averaged over those layers; and the layers used."""
    cfg = session.config
    layers = moe_layers(session, {"CPU"}) or moe_layers(session)
    if not layers:
        raise ValueError("the model has no routed MoE layer")
    ids = routed_ids(session, texts, layers)
    per_layer = [distinct_per_batch(ids[i], max_batch) for i in layers]
    mean = [float(np.mean(col)) for col in zip(*per_layer)]
    # averages of per-layer non-decreasing sequences stay non-decreasing; clip float noise
    for b in range(1, len(mean)):
        mean[b] = max(mean[b], mean[b - 1])
    return RoutingProfile(tuple(mean), cfg.n_expert, cfg.n_expert_used, source="measured"), layers


# ---------------------------------------------------------------------------------------------
# Acceptance.
# ---------------------------------------------------------------------------------------------

def acceptance_from(runs: Sequence[Decode], n_max: int, p_min: float, *, gated: bool = False) -> AcceptanceProfile:
    """Pooled per-position counts → conditional a_j = accepted_j / reached_j and, under
    p_min (or ``gated``: a drafter that drafts only sometimes, as n-gram lookup does), c_j =
    P(position j drafted | position j-1 drafted). Positions no step reached are left out (the
    profile reuses its last value past its end)."""
    acc, reach, drafted = np.zeros(n_max), np.zeros(n_max), np.zeros(n_max)
    steps = 0
    for r in runs:
        for arr, src in ((acc, r.accepted_per_position), (reach, r.reached_per_position),
                         (drafted, r.drafted_per_position)):
            arr[:len(src)] += src[:n_max]
        steps += r.steps
    m = int(np.count_nonzero(reach))
    if m == 0:
        raise ValueError("no draft position was reached")
    accept = tuple(conditional(acc[:m].tolist(), reach[:m].tolist()))
    cont: tuple[float, ...] = (1.0,)
    if p_min > 0 or gated:
        # position 1: steps that drafted / steps that could (reached_1 counts every step
        # whose budget allowed a draft); later: drafted_j / drafted_{j-1}
        prev = np.concatenate([[reach[0]], drafted[:-1]])
        k = int(np.count_nonzero(prev))
        cont = tuple(float(min(drafted[j] / prev[j], 1.0)) for j in range(k)) or (0.0,)
    return AcceptanceProfile(accept=accept, cont=cont, p_min=p_min, source="measured")


def measure_acceptance(session, prompts: Sequence[Sequence[int]], *, n_max: int, p_min: float,
                       n_tokens: int, **generate) -> tuple[AcceptanceProfile, list[Decode]]:
    """Greedy speculative decoding at ``n_max`` on each prompt → ``AcceptanceProfile``. The
    n-gram drafter (``spec_type="ngram"``) drafts only on a match: its profile carries c_j,
    and a text with no match at all gives a profile that never drafts (a_1 = c_1 = 0)."""
    runs = [decode(session, p, n_tokens=n_tokens, n_max=n_max, p_min=p_min, **generate) for p in prompts]
    if generate.get("spec_type") != "ngram":
        return acceptance_from(runs, n_max, p_min), runs
    if not any(r.drafted for r in runs):
        return AcceptanceProfile(accept=(0.0,), cont=(0.0,), source="measured: no n-gram match in the text"), runs
    return acceptance_from(runs, n_max, p_min, gated=True), runs


# ---------------------------------------------------------------------------------------------
# The two rates ``--op-offload auto`` weighs (placement.op_offload).
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefillRates:
    """What ``--op-offload auto`` weighs, as measured here: the CPU's batched MoE rate (one
    CPU-resident layer's experts over a prompt-sized batch) and each real CUDA GPU's pinned
    host→device bandwidth. None where it could not be measured (``notes`` says why)."""

    cpu_batched_gflops: float | None
    cpu_layer: int | None                # the layer timed
    cpu_batch: int                       # tokens per timed call
    cpu_seconds: float                   # median seconds of one call
    link_gbps: dict[str, float]          # GPU → measured GB/s
    notes: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"cpu_batched_gflops": self.cpu_batched_gflops, "cpu_layer": self.cpu_layer,
                "cpu_batch": self.cpu_batch, "cpu_seconds": self.cpu_seconds,
                "link_gbps": dict(self.link_gbps), "notes": list(self.notes)}


def cpu_expert_layer(session) -> int | None:
    """The first trunk MoE layer whose routed experts all run in the CPU kernels."""
    from offload.cpu_ops import CpuExperts
    for i, block in enumerate(session.model.blocks):
        ffn = getattr(block, "ffn", None)
        if isinstance(ffn, MoE) and isinstance(ffn.experts, CpuExperts) and ffn.owned is None:
            return i
    return None


def measure_cpu_batched(session, tensors, *, batch: int, repeats: int = 3, seed: int = 0,
                        clock: Callable[[], float] = _clock) -> tuple[float, int, float] | None:
    """(GFLOP/s, layer, median seconds) of one CPU-resident MoE layer's experts (``tensors``: the
    model's ``TensorInfo`` list, for the FLOPs) over ``batch``
    tokens routed uniformly at random (at a prompt-sized batch every expert is touched, so the
    reads are the layer's bytes once and the FLOPs T·k·f dominate: what
    ``PrefillModel`` divides by ``cpu_batched_gflops``); None without such a layer."""
    from placement.op_offload import flops_per_assignment

    layer = cpu_expert_layer(session)
    if layer is None:
        return None
    cfg = session.config
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, cfg.n_embd), dtype=np.float32)
    ids = np.stack([rng.choice(cfg.n_expert, cfg.n_expert_used, replace=False) for _ in range(batch)])
    w = np.full(ids.shape, 1.0 / cfg.n_expert_used, dtype=np.float32)
    experts = session.model.blocks[layer].ffn.experts
    experts(x, ids, w)                                   # warm (compilation, page faults)
    times = []
    for _ in range(repeats):
        t0 = clock()
        experts(x, ids, w)
        times.append(clock() - t0)
    seconds = statistics.median(times)
    flops = batch * cfg.n_expert_used * flops_per_assignment(tensors, layer)
    return flops / seconds / 1e9, layer, seconds


def measure_link_gbps(device: torch.device, *, n_bytes: int = 256 << 20, repeats: int = 3) -> float:
    """Pinned host→device copy bandwidth (GB/s) of one CUDA device, timed with CUDA events."""
    host = torch.empty(n_bytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    best = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best.append(start.elapsed_time(end) / 1e3)
    return n_bytes / statistics.median(best) / 1e9


def measure_prefill_rates(session, tensors, *, batch: int) -> PrefillRates:
    """Both rates (``PrefillRates``); a plan without a CPU expert layer or without a real CUDA
    device keeps the hardware profile's value for what it cannot measure, and says so."""
    notes = []
    cpu = measure_cpu_batched(session, tensors, batch=batch)
    if cpu is None:
        notes.append("cpu_batched_gflops: no MoE layer runs all its experts on the CPU; kept the profile's")
    link: dict[str, float] = {}
    gpus = [d.name for d in session.plan.devices if d.is_gpu]
    for name in gpus:
        dev = session.devices[name]
        if dev.type == "cuda":
            link[name] = measure_link_gbps(dev)
        else:
            notes.append(f"link_gbps of {name}: not measured ({name} is CPU-backed, no CUDA device); "
                         "kept the hardware profile's")
    return PrefillRates(cpu[0] if cpu else None, cpu[1] if cpu else None, batch, cpu[2] if cpu else 0.0,
                        link, tuple(notes))
