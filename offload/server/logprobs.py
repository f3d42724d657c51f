"""Log-probabilities as the OpenAI API reports them, from the target model's logits: the
chosen token's ``log_softmax`` and the ``k`` most likely tokens at each position.

Computed in float64 from the float32 logits row the token was chosen at (with speculation,
the verify pass's row, never the drafter's; with a ``response_format`` constraint, the row
before masking: the model's own distribution). One pass over the vocabulary per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP_LOGPROBS = 20          # OpenAI's limit for chat's top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None                   # None: the prompt's first token (nothing predicts it)
    top: tuple[tuple[int, float], ...] | None    # (token, logprob), most likely first


def log_softmax(row: np.ndarray) -> np.ndarray:
    z = np.asarray(row, dtype=np.float64)
    m = z.max()
    return z - (m + np.log(np.exp(z - m).sum()))


def score(row: np.ndarray, token: int, k: int) -> TokenLogprob:
    """``token``'s logprob under ``row``'s distribution and the top ``k``."""
    lp = log_softmax(row)
    top = ()
    if k:
        idx = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
        idx = idx[np.argsort(-lp[idx], kind="stable")]
        top = tuple((int(i), float(lp[i])) for i in idx)
    return TokenLogprob(int(token), float(lp[token]), top)


class Pieces:
    """Token ids → the strings logprobs name them by (cached: one decode per distinct id)."""

    def __init__(self, tokenizer):
        self.tokenizer, self._cache = tokenizer, {}

    def __call__(self, token: int) -> str:
        s = self._cache.get(token)
        if s is None:
            s = self._cache[token] = self.tokenizer.piece(token)
        return s


def chat_content(entries: list[TokenLogprob], piece: Pieces) -> list[dict]:
    """``choices[i].logprobs.content`` of a chat completion."""
    def one(token: int, logprob: float) -> dict:
        s = piece(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}
    return [one(e.token, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


def completion_logprobs(entries: list[TokenLogprob], piece: Pieces, offset: int = 0) -> dict:
    """``choices[i].logprobs`` of a text completion: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (``{token: logprob}``), ``text_offset`` (``offset``: the text before the
    first token); the prompt's first token under ``echo`` has null logprobs."""
    texts = [piece(e.token) for e in entries]
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None else {piece(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}
