"""Run statistics: llama.cpp-style timings on stderr and the same numbers as JSON."""
from __future__ import annotations

import resource
from dataclasses import asdict, dataclass, field


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


@dataclass
class RunStats:
    n_prompt: int = 0
    prompt_s: float = 0.0
    n_gen: int = 0            # tokens produced
    n_eval: int = 0           # single-token forward passes after the prompt
    eval_s: float = 0.0
    load_s: float = 0.0
    prompt_profile: dict = field(default_factory=dict)
    eval_profile: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt / self.prompt_s if self.prompt_s else 0.0

    @property
    def eval_tps(self) -> float:
        return self.n_eval / self.eval_s if self.eval_s else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d |= {"prompt_tokens_per_second": self.prompt_tps, "eval_tokens_per_second": self.eval_tps,
              "tokens_per_second": self.eval_tps}
        return d

    def lines(self) -> list[str]:
        ms = lambda s: 1000.0 * s  # noqa: E731
        per = lambda s, n: ms(s) / n if n else 0.0  # noqa: E731
        out = [
            f"load time        = {ms(self.load_s):10.2f} ms",
            f"prompt eval time = {ms(self.prompt_s):10.2f} ms / {self.n_prompt:5d} tokens "
            f"({per(self.prompt_s, self.n_prompt):8.2f} ms per token, {self.prompt_tps:8.2f} tokens per second)",
            f"       eval time = {ms(self.eval_s):10.2f} ms / {self.n_eval:5d} runs   "
            f"({per(self.eval_s, self.n_eval):8.2f} ms per token, {self.eval_tps:8.2f} tokens per second)",
            f"      total time = {ms(self.prompt_s + self.eval_s):10.2f} ms / {self.n_prompt + self.n_gen:5d} tokens",
        ]
        for phase, prof, total in (("prompt", self.prompt_profile, self.prompt_s),
                                   ("eval", self.eval_profile, self.eval_s)):
            if total <= 0:
                continue
            cpu, wait = prof.get("cpu_experts", 0.0), prof.get("cpu_wait", 0.0)
            xfer, samp = prof.get("transfer", 0.0), prof.get("sampling", 0.0)
            rest = max(total - wait - xfer - samp, 0.0)
            out.append(f"{phase:>6} split     = CPU experts {ms(cpu):.1f} ms (main thread waited {ms(wait):.1f} ms), "
                       f"transfers {ms(xfer):.1f} ms, sampling {ms(samp):.1f} ms, "
                       f"torch/dense part {ms(rest):.1f} ms ({100 * rest / total:.0f}%)")
        if self.memory:
            mib = lambda b: b / 2**20  # noqa: E731
            parts = [f"peak RSS {mib(self.memory['peak_rss']):.1f} MiB"]
            parts += [f"{dev} weights {mib(b):.1f} MiB" for dev, b in self.memory.get("weights", {}).items()]
            parts += [f"{dev} KV {mib(b):.2f} MiB" for dev, b in self.memory.get("kv", {}).items()]
            out.append("memory           = " + ", ".join(parts))
        return out
