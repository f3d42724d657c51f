"""Structured output: ``response_format`` (``json_object``, ``json_schema``) and forced tool
calls as constrained decoding, by llguidance (a grammar engine over the tokenizer's vocabulary:
it compiles a JSON schema or a Lark grammar, then each step gives the bitmask of the tokens
that keep the output inside the grammar).

A ``TokenGuide`` is what ``offload.speculative.generate_step`` takes as its ``guide``: the
target's logits (and the drafter's, so no draft breaks the constraint) are masked before a
token is chosen, the matcher advances by the chosen token and rolls drafts back. Once the
grammar is complete only end-of-sequence is allowed, so generation stops there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import llguidance
import llguidance.numpy as llnp
import numpy as np

# compact JSON: the default (flexible whitespace) lets a sampled model fill its budget with blanks
JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(Exception):
    """The grammar or schema does not compile (the message says why)."""


def json_grammar(schema: dict | None) -> str:
    """llguidance's grammar for JSON matching ``schema`` (None: any JSON object)."""
    schema = {"type": "object"} if schema is None else dict(schema)
    schema["x-guidance"] = JSON_OPTIONS | schema.get("x-guidance", {})
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None


def lark_grammar(source: str) -> str:
    """llguidance's grammar for a Lark grammar (llguidance's dialect: ``%json {schema}`` rules)."""
    try:
        return llguidance.LLMatcher.grammar_from_lark(source)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from None


class Vocabulary:
    """The tokenizer as llguidance sees it (built once per model: a pass over the vocabulary)."""

    def __init__(self, tokenizer):
        self.n_vocab = tokenizer.n_vocab
        self.llt = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=self.n_vocab,
                                          eos_token=sorted(tokenizer.eos_ids))

    def check(self, grammar: str) -> None:
        """GrammarError unless ``grammar`` compiles against this vocabulary."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.llt)
        if error:
            raise GrammarError(error.splitlines()[0])

    def guide(self, grammar: str) -> "TokenGuide":
        return TokenGuide(llguidance.LLMatcher(self.llt, grammar), self.n_vocab)


@dataclass
class Cost:
    """Time spent masking, advancing and forking (a guide and its forks share one)."""
    seconds: float = 0.0


class TokenGuide:
    """One request's matcher (``offload.speculative.Guide``); ``cost``: the time it took, for
    the per-token cost in ``timings``."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int, cost: Cost | None = None):
        self.matcher, self.n_vocab = matcher, n_vocab
        self.bits = llnp.allocate_token_bitmask(1, n_vocab)
        self.cost = cost if cost is not None else Cost()

    def mask(self, logits: np.ndarray) -> np.ndarray:
        t = time.perf_counter()
        llnp.fill_next_token_bitmask(self.matcher, self.bits, 0)
        out = np.array(logits[:self.n_vocab], dtype=np.float32)[None]
        llnp.apply_token_bitmask_inplace(out, self.bits)
        if logits.shape[-1] > self.n_vocab:          # rows padded past the tokenizer's vocabulary
            out = np.concatenate([out, np.full((1, logits.shape[-1] - self.n_vocab), -np.inf, np.float32)], 1)
        self.cost.seconds += time.perf_counter() - t
        return out[0]

    def accept(self, token: int) -> bool:
        t = time.perf_counter()
        ok = self.matcher.consume_token(token)
        self.cost.seconds += time.perf_counter() - t
        return ok

    def fork(self) -> "TokenGuide":
        """A copy to draft on (the drafts never touch this one). Forking, not rolling back:
        llguidance 1.9.1's ``rollback`` left a matcher accepting what it should not (a second
        closing quote after a finished string) after some draft/rollback sequences."""
        t = time.perf_counter()
        copy = TokenGuide(self.matcher.deep_copy(), self.n_vocab, self.cost)
        self.cost.seconds += time.perf_counter() - t
        return copy

    @property
    def failed(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None
