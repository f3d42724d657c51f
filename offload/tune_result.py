"""What ``offload tune`` found, typed: the runs, the measured rows, the per-step terms and the
whole result (``offload.commands.tune`` fills it, prints it, and ``--json`` writes
``TuneResult.to_json()``). No torch here: the command sets up the process before torch loads.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from placement.acceptance import AcceptanceProfile
from placement.cost import FitResult, RoutingProfile, SpecTable
from placement.hardware import HardwareProfile

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
        return {"repeat": self.repeat, "prompt": self.prompt, "n_max": r.n_max, "tokens": r.produced,
                "eval_s": r.eval_s, "steps": r.steps, "drafted": r.drafted, "accepted": r.accepted,
                "draft_s": r.draft_s, "verify_s": r.verify_s}


@dataclass(frozen=True)
class MeasuredRow:
    """One n_max over all runs: tokens/s per repeat, speedup against the same repeat's baseline."""

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

    def section_dict(self) -> dict:
        """The plan's ``measured_rows`` entry (rounded; without the per-repeat speedups)."""
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items() if k != "speedups"}


@dataclass(frozen=True)
class StepTerms:
    """Per run n_max: the predicted step split into draft passes, verify pass and the loop's
    own time, beside what the runs' stats booked to each (ms)."""

    n_max: int
    draft_pred: float
    draft_meas: float
    verify_pred: float
    verify_meas: float
    loop_pred: float
    loop_meas: float


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
    acceptance: dict[float, AcceptanceProfile]   # per p_min
    fit: FitResult
    fit_free: tuple[str, ...]
    hardware: HardwareProfile
    predicted: dict[float, SpecTable]            # per p_min
    p_min: float                                 # the one run and chosen
    stages: tuple[int, ...]                      # the n_max values run
    repeats: int
    runs: tuple[RunRecord, ...]
    measured: tuple[MeasuredRow, ...]
    chosen_n_max: int
    choice: str                                  # why
    section: dict                                # the plan's ``speculative`` section
    prefill: PrefillRates | None = None          # the op-offload rates measured

    @property
    def table(self) -> SpecTable:
        return self.predicted[self.p_min]

    def to_json(self) -> dict:
        return {
            "model": self.model, "devices": self.devices, "budget_s": self.budget_s, "seconds": self.seconds,
            "load_average": list(self.load_average), "tokens_per_run": self.tokens_per_run,
            "calibration_step_ms": self.calibration_step_ms, "plain_step_ms": self.plain_step_ms,
            "loop_ms": {"step": self.loop_step_ms, "spec_step": self.loop_spec_step_ms},
            "verify_ms": self.verify_ms, "draft_ms": self.draft_ms, "terms": [asdict(t) for t in self.terms],
            "pass_spread": self.pass_spread, "pass_rounds": self.pass_rounds,
            "routing": self.routing.to_dict(), "routing_layers": list(self.routing_layers),
            "routing_uniform": list(self.routing_uniform),
            "acceptance": {str(p): a.to_dict() for p, a in self.acceptance.items()},
            "fit": {"free": list(self.fit_free), "fitted": self.fit.fitted, "rows": [list(r) for r in self.fit.rows],
                    "max_rel_error": self.fit.max_rel_error},
            "hardware": self.hardware.to_dict(),
            "predicted": {str(p): t.to_dict() for p, t in self.predicted.items()},
            "p_min": self.p_min, "stages": list(self.stages), "repeats": self.repeats,
            "runs": [r.to_json() for r in self.runs], "measured": [asdict(m) for m in self.measured],
            "chosen_n_max": self.chosen_n_max, "choice": self.choice, "section": self.section,
            "table_text": self.table.format(), "break_even_n_max": self.table.break_even_n,
            "best_n_max": self.table.best.n,
            "op_offload_rates": None if self.prefill is None else self.prefill.to_dict(),
        }
