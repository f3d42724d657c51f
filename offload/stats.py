"""Run statistics: llama.cpp-style timings on stderr and the same numbers as JSON.

Speculative decoding adds its counters (llama.cpp's names where it has them): ``drafted``,
``accepted``, per draft position the steps that drafted / accepted it, the verify steps, and
the eval time split into draft / verify / rest. Plain decoding is the n_max = 0 case of the
same loop: every step verifies one token and drafts none.
"""
from __future__ import annotations

import resource
from dataclasses import asdict, dataclass, field


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB


def add_per_position(into: list[int], more: list[int]) -> None:
    """Adds per-position counts ``more`` into ``into`` (grown to the longer of the two)."""
    into += [0] * (len(more) - len(into))
    for j, n in enumerate(more):
        into[j] += n


def per_position(accepted: list[int], drafted: list[int]) -> list[float]:
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def conditional(accepted: list[int], reached: list[int]) -> list[float]:
    return [a / r if r else 0.0 for a, r in zip(accepted, reached)]


@dataclass
class RunStats:
    n_prompt: int = 0
    n_prompt_cached: int = 0  # prompt tokens whose KV was reused (prompt cache), not evaluated
    prompt_s: float = 0.0
    n_gen: int = 0            # tokens produced (yielded)
    n_eval: int = 0           # target forward passes after the prompt (a batched verify is one)
    eval_s: float = 0.0       # wall time of everything after the prompt, yields excluded
    load_s: float = 0.0
    prompt_profile: dict = field(default_factory=dict)
    eval_profile: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    # speculative decoding (all zero for plain decoding)
    spec: dict = field(default_factory=dict)     # type, n_max, p_min, verify
    n_steps: int = 0          # verify steps (= n_eval with batched verify)
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list = field(default_factory=list)    # [j] steps that drafted position j+1
    accepted_per_position: list = field(default_factory=list)   # [j] steps that accepted it
    reached_per_position: list = field(default_factory=list)    # [j] steps that could draft it with
    #                                   positions 1..j accepted (the token budget allowing it)
    draft_s: float = 0.0      # draft-head passes, draft sampling, and the drafter taking in kept tokens
    verify_s: float = 0.0     # target passes over the pending token + drafts

    def record_step(self, n_drafted: int, n_accepted: int, n_cap: int) -> None:
        """One verify step: ``n_drafted`` drafts (at most ``n_cap``: n_max or the tokens
        still wanted), of which the first ``n_accepted`` were kept."""
        self.n_steps += 1
        self.drafted += n_drafted
        self.accepted += n_accepted
        grow = n_cap - len(self.drafted_per_position)
        if grow > 0:
            for counts in (self.drafted_per_position, self.accepted_per_position, self.reached_per_position):
                counts += [0] * grow
        for j in range(n_drafted):
            self.drafted_per_position[j] += 1
        for j in range(n_accepted):
            self.accepted_per_position[j] += 1
        for j in range(min(n_accepted + 1, n_cap)):
            self.reached_per_position[j] += 1

    @property
    def n_prompt_eval(self) -> int:
        """Prompt tokens evaluated (what the prompt time bought)."""
        return self.n_prompt - self.n_prompt_cached

    @property
    def prompt_tps(self) -> float:
        return self.n_prompt_eval / self.prompt_s if self.prompt_s else 0.0

    @property
    def n_eval_tokens(self) -> int:
        """Tokens produced after the prompt's one (what the eval time bought)."""
        return max(self.n_gen - 1, 0)

    @property
    def eval_tps(self) -> float:
        return self.n_eval_tokens / self.eval_s if self.eval_s else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """llama.cpp's per-position rate: accepted / drafted at draft position j. With p_min = 0
        every step drafts every position, so this is P(the first j drafts are accepted)."""
        return per_position(self.accepted_per_position, self.drafted_per_position)

    @property
    def acceptance_conditional(self) -> list[float]:
        """The cost model's a_j = P(position j accepted | positions < j accepted), a position
        not drafted under p_min counting as not accepted (``placement.acceptance``); steps
        whose token budget did not reach position j do not count."""
        return conditional(self.accepted_per_position, self.reached_per_position)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: 1 + accepted / steps."""
        return 1.0 + self.accepted / self.n_steps if self.n_steps else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d |= {"prompt_tokens_per_second": self.prompt_tps, "eval_tokens_per_second": self.eval_tps,
              "tokens_per_second": self.eval_tps, "acceptance": self.acceptance,
              "acceptance_per_position": self.acceptance_per_position,
              "acceptance_conditional": self.acceptance_conditional,
              "mean_accepted_length": self.mean_accepted_length,
              "rest_s": max(self.eval_s - self.draft_s - self.verify_s, 0.0)}
        return d

    def lines(self) -> list[str]:
        ms = lambda s: 1000.0 * s  # noqa: E731
        per = lambda s, n: ms(s) / n if n else 0.0  # noqa: E731
        n_tok = self.n_eval_tokens
        out = [
            f"load time        = {ms(self.load_s):10.2f} ms",
            f"prompt eval time = {ms(self.prompt_s):10.2f} ms / {self.n_prompt_eval:5d} tokens "
            f"({per(self.prompt_s, self.n_prompt_eval):8.2f} ms per token, {self.prompt_tps:8.2f} tokens per second)"
            + (f", {self.n_prompt_cached} more cached" if self.n_prompt_cached else ""),
            f"       eval time = {ms(self.eval_s):10.2f} ms / {n_tok:5d} tokens "
            f"({per(self.eval_s, n_tok):8.2f} ms per token, {self.eval_tps:8.2f} tokens per second)"
            + (f", {self.n_eval} target passes" if self.spec else ""),
            f"      total time = {ms(self.prompt_s + self.eval_s):10.2f} ms / {self.n_prompt + self.n_gen:5d} tokens",
        ]
        if self.spec:
            out += self.spec_lines()
        for phase, prof, total in (("prompt", self.prompt_profile, self.prompt_s),
                                   ("eval", self.eval_profile, self.eval_s)):
            if total <= 0:
                continue
            cpu, wait = prof.get("cpu_experts", 0.0), prof.get("cpu_wait", 0.0)
            xfer, samp = prof.get("transfer", 0.0), prof.get("sampling", 0.0)
            blocks = prof.get("cpu_block", 0.0)          # offload.compiled_block
            rest = max(total - wait - xfer - samp - blocks, 0.0)
            out.append(f"{phase:>6} split     = compiled CPU blocks {ms(blocks):.1f} ms, "
                       f"CPU experts {ms(cpu):.1f} ms (main thread waited {ms(wait):.1f} ms), "
                       f"transfers {ms(xfer):.1f} ms, sampling {ms(samp):.1f} ms, "
                       f"torch/dense part {ms(rest):.1f} ms ({100 * rest / total:.0f}%)")
        if self.memory:
            mib = lambda b: b / 2**20  # noqa: E731
            parts = [f"peak RSS {mib(self.memory['peak_rss']):.1f} MiB"]
            parts += [f"{dev} weights {mib(b):.1f} MiB" for dev, b in self.memory.get("weights", {}).items()]
            parts += [f"{dev} KV {mib(b):.2f} MiB" for dev, b in self.memory.get("kv", {}).items()]
            out.append("memory           = " + ", ".join(parts))
        return out

    def spec_lines(self) -> list[str]:
        ms = lambda s: 1000.0 * s  # noqa: E731
        pct = lambda s: 100.0 * s / self.eval_s if self.eval_s else 0.0  # noqa: E731
        s = self.spec
        rest = max(self.eval_s - self.draft_s - self.verify_s, 0.0)
        pos = " ".join(f"{a:.3f}" for a in self.acceptance_per_position) or "-"
        cond = " ".join(f"{a:.3f}" for a in self.acceptance_conditional) or "-"
        policy = s.get("n_max_policy")
        n_max = (f"{policy['policy']} (up to {s.get('n_max')}; last chose {policy['n_max_chosen']}, "
                 f"mean {policy['n_max_mean']:.2f})" if policy else s.get("n_max"))
        return [
            f"speculative           = {s.get('type', 'mtp')}, n_max {n_max}, p_min {s.get('p_min', 0.0):.2f}, "
            f"verify {s.get('verify', 'batched')}",
            f"draft acceptance rate = {self.acceptance:.5f} ({self.accepted:5d} accepted / {self.drafted:5d} drafted), "
            f"mean accepted length {self.mean_accepted_length:.3f} (1 + accepted / {self.n_steps} steps)",
            f"acceptance/pos        = {pos}  (accepted / drafted at draft position 1, 2, ...)",
            f"conditional a_j       = {cond}  (P(j accepted | 1..j-1 accepted): the cost model's a_j)",
            f"spec time split       = draft {ms(self.draft_s):.1f} ms ({pct(self.draft_s):.0f}%), "
            f"verify {ms(self.verify_s):.1f} ms ({pct(self.verify_s):.0f}%), rest {ms(rest):.1f} ms ({pct(rest):.0f}%)",
        ]
