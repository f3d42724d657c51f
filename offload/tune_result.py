"""What ``offload tune`` found, typed: the runs, the measured rows, the per-step terms and the
whole result (``offload.commands.tune`` fills it, prints it, and ``--json`` writes
``TuneResult.to_json()``). No torch here: the command sets up the process before torch loads.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from placement.acceptance import AcceptanceProfile
from placement.cost import SpecTable
from placement.cost_fit import FitResult
from placement.hardware import HardwareProfile
from placement.routing import RoutingCounts, RoutingProfile
from placement.spec_section import SpecSection

if TYPE_CHECKING:                   # offload.tune imports torch
    from offload.tune import Decode, PrefillRates


@dataclass(frozen=True)
class RunRecord:
    """One decode run of the runs phase: which repeat and prompt, and what it measured."""

    repeat: int
    prompt: str
    run: Decode

    def to_json(self) -> dict:
        r = self.run
        return {"repeat": self.repeat, "prompt": self.prompt, "drafter": r.drafter, "n_max": r.n_max,
                "tokens": r.produced,
                "eval_s": r.eval_s, "steps": r.steps, "drafted": r.drafted, "accepted": r.accepted,
                "draft_s": r.draft_s, "verify_s": r.verify_s, "sample_s": r.sample_s}


@dataclass(frozen=True)
class MeasuredRow:
    """One (drafter, n_max) over all runs: tokens/s per repeat, speedup against the same
    repeat's baseline (drafter "none", n_max 0)."""

    n_max: int
    repeats: int
    tokens_per_s_mean: float
    tokens_per_s_std: float
    speedup_mean: float
    speedup_std: float
    speedups: tuple[float, ...]          # per repeat
    expected_tokens: float               # measured tokens per step
    step_ms: float
    draft_ms: float
    verify_ms: float
    drafter: str = "mtp"

    def section_dict(self) -> dict:
        """The plan's ``measured_rows`` entry (rounded; without the per-repeat speedups)."""
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items() if k != "speedups"}


@dataclass(frozen=True)
class StepTerms:
    """Per run (drafter, n_max): the predicted step split into draft passes, verify pass and
    the loop's own time, beside what the runs' stats booked to each (ms)."""

    n_max: int
    draft_pred: float
    draft_meas: float
    verify_pred: float
    verify_meas: float
    loop_pred: float
    loop_meas: float
    drafter: str = "mtp"


@dataclass(frozen=True)
class HotComparison:
    """The plan without and with hot experts (chosen from the routing tune measured):
    predicted plain decode t/s and break-even n_max (cost model + profile), and measured plain
    decode t/s of both plans on this box, paired per repeat."""

    hot: str                                  # what the hot plan holds ('CUDA0: 35 experts of 3 blocks (…)')
    predicted_tps: tuple[float, float]        # (without, with)
    break_even: tuple[int | None, int | None]
    measured_tps: tuple[tuple[float, ...], tuple[float, ...]]   # per repeat (without, with)
    virtual: bool                             # the GPUs are CPU-backed (--virtual-gpus)

    @property
    def measured_mean(self) -> tuple[float, float]:
        return tuple(sum(r) / len(r) for r in self.measured_tps)

    def to_dict(self) -> dict:
        return {"hot_experts": self.hot, "virtual_gpus": self.virtual,
                "predicted_plain_tps": {"without": self.predicted_tps[0], "with": self.predicted_tps[1]},
                "break_even_n_max": {"without": self.break_even[0], "with": self.break_even[1]},
                "measured_plain_tps": {"without": list(self.measured_tps[0]), "with": list(self.measured_tps[1])}}

    def format(self) -> str:
        (pw, ph), (mw, mh) = self.predicted_tps, self.measured_mean
        lines = [f"hot experts from the routing measured here ({self.hot}); plain decode, "
                 f"{len(self.measured_tps[0])} paired repeats:",
                 f"{'':<22} {'predicted t/s':>14} {'measured t/s':>13} {'break-even':>11}",
                 f"{'without hot experts':<22} {pw:>14.2f} {mw:>13.2f} {str(self.break_even[0]):>11}",
                 f"{'with hot experts':<22} {ph:>14.2f} {mh:>13.2f} {str(self.break_even[1]):>11}",
                 f"{'with / without':<22} {ph / pw:>14.3f} {mh / mw:>13.3f}"]
        if self.virtual:
            lines.append("note: the GPUs are CPU-backed (--virtual-gpus): the measured rows show what the split "
                         "runtime costs on this CPU (hot experts in torch on the CPU, after the CPU kernels), "
                         "not VRAM's speed; the predicted rows are for the profile's GPU")
        return "\n".join(lines)


@dataclass(frozen=True)
class TuneResult:
    model: str
    devices: str
    budget_s: float
    seconds: float
    load_average: tuple[float, float]        # at the start and at the end
    tokens_per_run: int
    calibration_step_ms: float
    plain_step_ms: float                     # the decode loop's step in the pass rounds
    loop_step_ms: float                      # the loop's own time per step ...
    loop_spec_step_ms: float                 # ... and its extra per drafting step
    verify_ms: dict[int, float]              # B → T_verify(B)
    draft_ms: dict[int, float]               # B → T_draft(B)
    terms: tuple[StepTerms, ...]
    pass_spread: dict[str, float]
    pass_rounds: int
    routing: RoutingProfile
    routing_layers: tuple[int, ...]
    routing_uniform: tuple[float, ...]
    acceptance: dict[float, AcceptanceProfile]   # the MTP head's per p_min (none without a head)
    fit: FitResult
    fit_free: tuple[str, ...]
    hardware: HardwareProfile
    predicted: dict[float, SpecTable]            # the MTP head's per p_min
    p_min: float                                 # the one run and chosen
    stages: tuple[tuple[str, int], ...]          # the (drafter, n_max) runs; ("none", 0) the baseline
    repeats: int
    runs: tuple[RunRecord, ...]
    measured: tuple[MeasuredRow, ...]
    chosen_n_max: int
    choice: str                                  # why this n_max (of the chosen drafter)
    section: SpecSection                         # the plan's ``speculative`` section
    prefill: PrefillRates | None = None          # the op-offload rates measured
    routing_counts: RoutingCounts | None = None  # per-expert counts (written into the plan)
    hot: HotComparison | None = None             # without vs with hot experts
    hot_note: str = ""                           # why there is no comparison
    tables: dict[str, SpecTable] | None = None   # drafter -> the table its runs were chosen from
    chosen_drafter: str = "mtp"
    drafter_choices: dict[str, tuple[int, str]] | None = None   # drafter -> (its n_max, why)
    runner_up: dict | None = None                # the other drafter's best: type, n_max, speedup, margin
    head_drafter: str | None = "mtp"             # the drafter with weights (mtp | dspark) p_min is for
    inject_ms: dict[int, float] = field(default_factory=dict)   # B → a block drafter's injection of B tokens
    # several sequences at once (-np), forecast from the fitted costs and the chosen drafter's
    # measured acceptance (placement.concurrency)
    concurrency: tuple = ()
    # plain decoding of several sequences at once (``offload.tune.Batched``), which the
    # concurrency forecast's per-sequence term comes from
    batched: tuple = ()

    @property
    def table(self) -> SpecTable:
        """The chosen drafter's table."""
        return (self.tables or {}).get(self.chosen_drafter) or self.predicted[self.p_min]

    def to_json(self) -> dict:
        return {
            "model": self.model, "devices": self.devices, "budget_s": self.budget_s, "seconds": self.seconds,
            "load_average": list(self.load_average), "tokens_per_run": self.tokens_per_run,
            "calibration_step_ms": self.calibration_step_ms, "plain_step_ms": self.plain_step_ms,
            "loop_ms": {"step": self.loop_step_ms, "spec_step": self.loop_spec_step_ms},
            "verify_ms": self.verify_ms, "draft_ms": self.draft_ms, "inject_ms": self.inject_ms,
            "terms": [asdict(t) for t in self.terms],
            "pass_spread": self.pass_spread, "pass_rounds": self.pass_rounds,
            "routing": self.routing.to_dict(), "routing_layers": list(self.routing_layers),
            "routing_uniform": list(self.routing_uniform),
            "acceptance": {str(p): a.to_dict() for p, a in self.acceptance.items()},
            "fit": {"free": list(self.fit_free), "fitted": self.fit.fitted, "rows": [list(r) for r in self.fit.rows],
                    "max_rel_error": self.fit.max_rel_error},
            "hardware": self.hardware.to_dict(),
            "predicted": {str(p): t.to_dict() for p, t in self.predicted.items()},
            "p_min": self.p_min, "head_drafter": self.head_drafter, "stages": [list(st) for st in self.stages],
            "repeats": self.repeats,
            "runs": [r.to_json() for r in self.runs], "measured": [asdict(m) for m in self.measured],
            "chosen_drafter": self.chosen_drafter, "chosen_n_max": self.chosen_n_max, "choice": self.choice,
            "drafters": {k: {"n_max": n, "choice": why, "table": (self.tables or {})[k].to_dict()}
                         for k, (n, why) in (self.drafter_choices or {}).items()},
            "runner_up": self.runner_up, "section": self.section.to_dict(),
            "table_text": self.table.format(), "break_even_n_max": self.table.break_even_n,
            "best_n_max": self.table.best.n,
            "concurrency_forecast": [r.to_dict() for r in self.concurrency],
            "batched_measured": [b.to_json() for b in self.batched],
            "op_offload_rates": None if self.prefill is None else self.prefill.to_dict(),
            "routing_counts": None if self.routing_counts is None else self.routing_counts.to_dict(),
            "hot_experts": self.hot.to_dict() if self.hot is not None else {"skipped": self.hot_note},
        }
