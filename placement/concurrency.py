"""Several sequences at once (llama-server's ``-np N``): aggregate throughput and break-even
n_max as functions of the number of active sequences, from the same pass costs as the
one-sequence n_max table (``placement.cost``).

With S sequences decoding in one batch, a step verifies every sequence's pending token and
drafts together: S·(1 + n) tokens through the trunk in one pass, whose weights and touched
experts are read once for all of them, and the drafter's passes batched across the S
sequences too. So batching and speculation compete for the same verify batch: the more
sequences, the more experts a plain step touches already, the less a draft adds for free.

Assumptions, stated: the sequences draft in lockstep with the same acceptance profile; the
loop's own per-step time (``step``, ``spec_step``: sampling, the generation loop, handing
text on) is paid by every sequence, once per step each — each sequence runs its own loop
(``offload.batching``; measured with ``bench.parallel``, where counting it once per step
forecast 3.9x the measured aggregate at 8 sequences); batched, a sequence's share is
``batch_step_us`` where ``offload tune`` or ``offload probe`` measured it (its loop plus the
hand-offs to the batcher's thread: one sequence's loop alone left the forecast 2.6x the
measured aggregate); KV reads are not costed (as in the one-sequence table: decode at short
context); the tokens of different sequences route independently (``routing``/``hits`` as
given)."""
from __future__ import annotations

from dataclasses import dataclass

from placement.acceptance import AcceptanceProfile
from placement.cost import pass_time, spec_rows
from placement.footprint import DecodeFootprint, FootprintError, ForwardFootprint
from placement.hardware import HardwareProfile
from placement.routing import RoutingCounts, RoutingProfile

SEQUENCES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ConcurrencyRow:
    sequences: int
    plain_tps: float           # aggregate tokens/s over all sequences, no drafting
    best_n: int                # the n_max that gives the most aggregate tokens/s
    best_tps: float
    break_even_n: int          # largest n_max that does not lose against plain decoding

    @property
    def speedup(self) -> float:
        return self.best_tps / self.plain_tps

    def to_dict(self) -> dict:
        return {"sequences": self.sequences, "plain_tps": round(self.plain_tps, 4), "best_n_max": self.best_n,
                "best_tps": round(self.best_tps, 4), "speedup": round(self.speedup, 4),
                "break_even_n_max": self.break_even_n}


def concurrency_table(fp: DecodeFootprint, hw: HardwareProfile, *, acceptance: AcceptanceProfile, max_n: int,
                      routing: RoutingProfile | None = None, hits: RoutingCounts | None = None,
                      draft_kind: str = "chain", inject: ForwardFootprint | None = None,
                      sequences: tuple[int, ...] = SEQUENCES) -> tuple[ConcurrencyRow, ...]:
    """One row per number of active sequences (see the module's assumptions)."""
    if fp.draft is None and draft_kind != "free":
        raise FootprintError("model has no draft head (no NextN layer): nothing to speculate with")
    params = hw.linear_params()
    kw = dict(params=params, n_embd=fp.n_embd, act_bytes=fp.act_bytes, routing=routing, hits=hits)
    out = []
    for s in sequences:
        if s < 1:
            raise ValueError(f"sequences must be >= 1, got {s}")
        sizes = [s * b for b in range(1, max_n + 2)]          # s sequences of b tokens each
        verify = [pass_time(fp.target, b, **kw) for b in sizes]
        drafts = [0.0] * len(sizes) if draft_kind == "free" else [pass_time(fp.draft, b, **kw) for b in sizes]
        injects = None if inject is None else [pass_time(inject, b, **kw) for b in sizes]
        per_seq = dict(params, step=s * sequence_step_s(hw, s), spec_step=s * params["spec_step"])
        rows = spec_rows(verify, drafts, acceptance, per_seq, draft_kind=draft_kind, inject_s=injects)
        best = max(rows, key=lambda r: (r.speedup, -r.n))
        even = max(r.n for r in rows if r.speedup >= 1.0)
        out.append(ConcurrencyRow(s, s * rows[0].tokens_per_s, best.n, s * best.tokens_per_s, even))
    return tuple(out)


def sequence_step_s(hw: HardwareProfile, sequences: int) -> float:
    """What each of ``sequences`` sequences adds to a step outside the pass: one sequence's
    loop alone; batched, the measured ``batch_step_us`` where there is one."""
    if sequences > 1 and hw.batch_step_us is not None:
        return hw.batch_step_us * 1e-6
    return hw.step_us * 1e-6


def batch_step_us(fp: DecodeFootprint, hw: HardwareProfile, sequences: int, step_s: float, *,
                  routing: RoutingProfile | None = None) -> float:
    """``batch_step_us`` from a measured plain step of ``sequences`` batched sequences
    (``step_s``: wall time per step, each sequence one token): what is left of it after the
    cost model's pass of that many rows, per sequence (0 when the pass alone explains it)."""
    params = hw.linear_params()
    pass_s = pass_time(fp.target, sequences, params=params, n_embd=fp.n_embd, act_bytes=fp.act_bytes,
                       routing=routing)
    return max(0.0, (step_s - pass_s) / sequences) * 1e6


def format_concurrency(rows: tuple[ConcurrencyRow, ...]) -> str:
    lines = ["several sequences at once (forecast; aggregate t/s over all sequences):",
             f"{'seqs':>5} {'plain t/s':>10} {'best n_max':>10} {'best t/s':>9} {'speedup':>8} {'break-even':>10}"]
    for r in rows:
        lines.append(f"{r.sequences:>5} {r.plain_tps:>10.2f} {r.best_n:>10} {r.best_tps:>9.2f} "
                     f"{r.speedup:>7.2f}x {r.break_even_n:>10}")
    return "\n".join(lines)
