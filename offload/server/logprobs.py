"""Log-probabilities as the OpenAI API reports them, from the target model's logits: the
chosen token's ``log_softmax`` and the ``k`` most likely tokens at each position.

Computed from the float32 logits row the token was chosen at (with speculation,
the verify pass's row, never the drafter's; with a ``response_format`` constraint, the row
before masking: the model's own distribution). One pass over the vocabulary per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_TOP_LOGPROBS = 20          # OpenAI's limit for chat's top_logprobs


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None                   # None: the prompt's first token (nothing predicts it)
    top: tuple[tuple[int, float], ...] | None    # (token, logprob), most likely first


def logsumexp(row: np.ndarray) -> float:
    """log Σ exp(row), shifted by the max (exp in float32, the sum in float64)."""
    m = float(row.max())
    return m + float(np.log(np.exp(row - np.float32(m)).sum(dtype=np.float64)))


def log_softmax(row: np.ndarray) -> np.ndarray:
    z = np.asarray(row, dtype=np.float64)
    return z - logsumexp(z)


def score(row: np.ndarray, token: int, k: int) -> TokenLogprob:
    """``token``'s logprob under ``row``'s distribution and the top ``k``: one pass for the
    normalizer, one selection for the top k (on the logits: the order is the same)."""
    row = np.asarray(row, dtype=np.float32)
    lse = logsumexp(row)
    top = ()
    if k == 1:
        i = int(row.argmax())
        top = ((i, float(row[i]) - lse),)
    elif k:             # torch's top-k: a tenth of numpy's argpartition over a 150k vocabulary
        values, idx = torch.topk(torch.from_numpy(row), min(k, row.size))
        top = tuple((int(i), float(v) - lse) for v, i in zip(values.tolist(), idx.tolist()))
    return TokenLogprob(int(token), float(row[token]) - lse, top)


class Pieces:
    """Token ids → the strings logprobs name them by (cached: one decode per distinct id)."""

    def __init__(self, tokenizer):
        self.tokenizer, self._cache, self._width = tokenizer, {}, {}

    def __call__(self, token: int) -> str:
        s = self._cache.get(token)
        if s is None:
            s = self._cache[token] = self.tokenizer.piece(token)
        return s

    def width(self, token: int) -> int:
        """The characters ``token`` adds to a response's text (0 for a control token such as BOS)."""
        w = self._width.get(token)
        if w is None:
            w = self._width[token] = len(self.tokenizer.decode([token]))
        return w


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
    for e in entries:
        offsets.append(at)
        at += piece.width(e.token)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None else {piece(t): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}
