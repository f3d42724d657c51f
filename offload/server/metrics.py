"""``GET /metrics``: the server's counters in Prometheus' text format (llama-server's
``llamacpp:*`` set, named ``offload_*``, plus speculative decoding per draft position)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from offload.stats import RunStats, add_per_position, per_position


@dataclass
class Metrics:
    requests: Counter = field(default_factory=Counter)     # (endpoint, status) → count
    rejected: int = 0                 # 503: queue full or still loading
    cancelled: int = 0                # the client left before the end
    prompt_tokens: int = 0            # evaluated
    prompt_tokens_cached: int = 0     # reused from the prompt cache
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    predicted_seconds: float = 0.0    # eval time of the tokens after each prompt's first
    tokens_predicted_timed: int = 0   # the tokens that time bought
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list = field(default_factory=list)
    accepted_per_position: list = field(default_factory=list)
    queued: int = 0
    processing: int = 0

    def record(self, st: RunStats) -> None:
        self.prompt_tokens += st.n_prompt_eval
        self.prompt_tokens_cached += st.n_prompt_cached
        self.prompt_seconds += st.prompt_s
        self.tokens_predicted += st.n_gen
        self.tokens_predicted_timed += st.n_eval_tokens
        self.predicted_seconds += st.eval_s
        self.drafted += st.drafted
        self.accepted += st.accepted
        add_per_position(self.drafted_per_position, st.drafted_per_position)
        add_per_position(self.accepted_per_position, st.accepted_per_position)

    def render(self) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help: str, samples) -> None:
            out.append(f"# HELP offload_{name} {help}")
            out.append(f"# TYPE offload_{name} {kind}")
            for labels, value in samples:
                out.append(f"offload_{name}{labels} {value:g}" if isinstance(value, float) else
                           f"offload_{name}{labels} {value}")

        metric("requests_total", "counter", "Requests answered, by endpoint and HTTP status.",
               [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())])
        metric("requests_rejected_total", "counter", "Requests answered 503 (queue full, or loading).",
               [("", self.rejected)])
        metric("requests_cancelled_total", "counter", "Generations stopped because the client left.",
               [("", self.cancelled)])
        metric("prompt_tokens_total", "counter", "Prompt tokens evaluated.", [("", self.prompt_tokens)])
        metric("prompt_tokens_cached_total", "counter", "Prompt tokens reused from the prompt cache.",
               [("", self.prompt_tokens_cached)])
        metric("prompt_seconds_total", "counter", "Prompt evaluation time.", [("", float(self.prompt_seconds))])
        metric("tokens_predicted_total", "counter", "Tokens generated.", [("", self.tokens_predicted)])
        metric("tokens_predicted_seconds_total", "counter", "Generation time after each prompt's first token.",
               [("", float(self.predicted_seconds))])
        metric("prompt_tokens_seconds", "gauge", "Prompt tokens evaluated per second, all requests.",
               [("", self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0)])
        metric("predicted_tokens_seconds", "gauge", "Tokens generated per second, all requests.",
               [("", self.tokens_predicted_timed / self.predicted_seconds if self.predicted_seconds else 0.0)])
        metric("draft_tokens_total", "counter", "Tokens drafted by the MTP head.", [("", self.drafted)])
        metric("draft_tokens_accepted_total", "counter", "Drafted tokens accepted.", [("", self.accepted)])
        metric("draft_acceptance", "gauge", "Accepted / drafted, all requests.",
               [("", self.accepted / self.drafted if self.drafted else 0.0)])
        metric("draft_acceptance_per_position", "gauge", "Accepted / drafted at draft position j, all requests.",
               [(f'{{position="{j + 1}"}}', float(a))
                for j, a in enumerate(per_position(self.accepted_per_position, self.drafted_per_position))])
        metric("requests_deferred", "gauge", "Requests waiting in the queue.", [("", self.queued)])
        metric("requests_processing", "gauge", "Requests being generated.", [("", self.processing)])
        return "\n".join(out) + "\n"
