"""How far batched verification may drift from one-token decoding (``--spec-diagnose``).

A verify pass runs B = n+1 tokens through the target at once. Mathematically its logits equal
those of B one-token passes; numerically the matmuls, attention and expert kernels take other
shapes, blockings and summation orders, so the same row comes out a little different. Where
the target's top two logits are closer than that difference, greedy decoding can pick the
other token and the text takes another branch — not a bug in acceptance or rollback, but
batch-shape numerics (llama.cpp users find the same: bit-identical only at ubatch 1).
``--spec-verify exact`` verifies one token at a time and is token-identical to plain decoding.

``verify_drift`` measures it on a token sequence: the logits of every position computed in
chunks of B tokens against one token at a time (each on a fresh cache built the same way).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class Drift:
    batch: int             # tokens per target pass
    positions: int         # positions compared
    max_abs: float         # largest |logit difference| over all positions and tokens
    max_rel: float         # max_abs / largest |logit| of the one-token reference
    argmax_flips: int      # positions whose argmax differs from the one-token reference

    def as_dict(self) -> dict:
        return asdict(self)


def chunked_logits(model, ids: Sequence[int], batch: int) -> np.ndarray:
    """Logits (len(ids), V) of a fresh sequence run in consecutive chunks of ``batch`` tokens."""
    state = model.new_state()
    out = []
    with torch.inference_mode():
        for s in range(0, len(ids), batch):
            logits, _ = model.forward(torch.as_tensor(list(ids[s:s + batch])), state, logits="all")
            out.append(logits.to("cpu", torch.float32).numpy())
    return np.concatenate(out)


def verify_drift(model, ids: Sequence[int], batches: Sequence[int]) -> tuple[float, list[Drift]]:
    """→ (smallest top-1/top-2 margin of the one-token logits, one ``Drift`` per batch size).
    A drift below half that margin cannot flip a greedy token on this text (each of the two
    logits moves by at most the drift)."""
    ref = chunked_logits(model, ids, 1)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = float((top2[:, 1] - top2[:, 0]).min())
    scale = float(np.abs(ref).max()) or 1.0
    rows = []
    for b in batches:
        got = chunked_logits(model, ids, b)
        diff = float(np.abs(got - ref).max())
        flips = int((got.argmax(-1) != ref.argmax(-1)).sum())
        rows.append(Drift(b, len(ids), diff, diff / scale, flips))
    return margin, rows


def format_drift(margin: float, rows: Sequence[Drift]) -> list[str]:
    n = rows[0].positions if rows else 0
    out = [f"verify drift     = target logits of {n} positions in B-token passes vs one token at a time:"]
    for r in rows:
        out.append(f"  B = {r.batch:4d}: max |Δlogit| {r.max_abs:.3e} ({r.max_rel:.2e} of the largest logit), "
                   f"greedy flips {r.argmax_flips}")
    out.append(f"  smallest top-1/top-2 margin on this text {margin:.3e}: a drift under half of it cannot flip "
               "a greedy token here; --spec-verify exact is token-identical to plain decoding")
    return out
