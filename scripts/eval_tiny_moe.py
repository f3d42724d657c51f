"""Evaluate the shipped GGUF with the float reference forward (dequantized weights).

    python scripts/eval_tiny_moe.py models/tiny-glm4moe-mtp.gguf [--json out/eval.json]

Prints markdown for the model card:
- validation cross-entropy of the trunk vs a bigram baseline on the same (context, target)
  pairs (additive smoothing, alpha picked on the validation split itself: favours the baseline);
- MTP head: cross-entropy and top-1 accuracy for token t+2 (teacher-forced: it sees the trunk
  state at t and the true token t+1) vs bigram P(x[t+2] | x[t+1]) and skip-bigram P(x[t+2] | x[t]);
- chained-draft acceptance under greedy verification: at every position t of held-out text the
  trunk's greedy continuation g[t+1..t+4] is computed (KV-cached continuation), the MTP head
  drafts d1 from (h_t, g[t+1]), d2 from (h_mtp1, d1), d3 from (h_mtp2, d2); draft i is accepted
  iff it equals g[t+1+i] and all earlier drafts were accepted. Reported per position, both
  conditional (a_i) and cumulative, for the interface's chaining (pre-norm h_mtp) and for
  llama.cpp's (h_mtp after shared_head_norm);
- expert usage: load per expert vs uniform, distinct experts touched by B consecutive tokens
  vs the uniform-routing formula E*(1-(1-k/E)^B);
- greedy samples from a few prompts.
The tokenizer is rebuilt from the GGUF's own tokenizer.ggml.* keys.
"""
from __future__ import annotations

import os

# one BLAS thread: on the shared 2-core box a second OpenMP thread mostly waits (see trainer)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from gguf import GGUFReader  # noqa: E402

from tiny_moe_data import EOT, encode_split, stdlib_corpus, tokenizer_from_vocab  # noqa: E402
from tiny_moe_reference import KV, RefGlm4Moe, Routing  # noqa: E402

ALPHAS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)
PROMPTS = ("def ", "class ", "import ")
# the same without the trailing space: GPT-2 splitting makes "def " end in a lone " " token,
# a context the training text almost never has ("def" is followed by " name" as one token)
SAMPLE_PROMPTS = PROMPTS + tuple(p.rstrip() for p in PROMPTS)


def gguf_tokenizer(reader: GGUFReader):
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    merges = list(reader.fields["tokenizer.ggml.merges"].contents())
    return tokenizer_from_vocab(tokens, merges)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class Bigram:
    """Counts of (a -> b) on the train stream; additive smoothing."""

    def __init__(self, stream: np.ndarray, V: int, gap: int = 1):
        a, b = stream[:-gap].astype(np.int64), stream[gap:].astype(np.int64)
        self.c = np.bincount(a * V + b, minlength=V * V).reshape(V, V).astype(np.float64)
        self.V = V

    def ce(self, ctx: np.ndarray, tgt: np.ndarray) -> tuple[float, float]:
        """Best mean CE over ALPHAS on these pairs, and that alpha."""
        row = self.c.sum(1)
        best = min((float(np.mean(-np.log((self.c[ctx, tgt] + al) / (row[ctx] + al * self.V)))), al)
                   for al in ALPHAS)
        return best

    def top1(self, ctx: np.ndarray, tgt: np.ndarray) -> float:
        return float(np.mean(self.c.argmax(1)[ctx] == tgt))


def chain_acceptance(ref: RefGlm4Moe, win: np.ndarray, h, logits, kvs, kv_mtp, n_draft: int,
                     normed_chain: bool):
    """win: W+1 tokens. Returns accepted[i, j] (row t of the window, draft j) as bool."""
    W = len(win) - 1
    greedy = [logits.argmax(-1)]                       # g[t+1] per row
    ext: list[list[KV]] = []
    for s in range(n_draft):                           # g[t+2 .. t+1+n_draft]
        _, lg, kv = ref.trunk_continue(greedy[-1], kvs, ext)
        ext.append(kv)
        greedy.append(lg.argmax(-1))
    hn_name = f"blk.{ref.cfg.n_layer}.nextn.shared_head_norm.weight"
    h_prev, tok, mext = h, greedy[0], []
    ok = np.ones(W, bool)
    acc = np.zeros((W, n_draft), bool)
    for j in range(n_draft):
        h_mtp, lg, kv = ref.mtp_chain_step(h_prev, tok, kv_mtp, mext)
        mext.append(kv)
        d = lg.argmax(-1)
        ok &= d == greedy[j + 1]
        acc[:, j] = ok
        h_prev, tok = (ref.rms(h_mtp, hn_name) if normed_chain else h_mtp), d
    return acc


def distinct_experts(ids: np.ndarray, E: int, B: int) -> float:
    """Mean number of distinct experts touched by B consecutive tokens (ids: (N, k))."""
    n = (len(ids) // B) * B
    g = ids[:n].reshape(-1, B * ids.shape[1])
    onehot = np.zeros((len(g), E), bool)
    np.put_along_axis(onehot, g, True, 1)
    return float(onehot.sum(1).mean())


def greedy_sample(ref: RefGlm4Moe, tok, prompt: str, n_new: int) -> str:
    eot = tok.token_to_id(EOT)
    ids = [eot] + tok.encode(prompt, add_special_tokens=False).ids
    for _ in range(n_new):
        _, lg, _ = ref.trunk(np.asarray(ids[-ref.cfg.n_ctx:]))
        nxt = int(lg[-1].argmax())
        if nxt == eot:
            break
        ids.append(nxt)
    return tok.decode(ids[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--max-windows", type=int, default=0, help="0 = the whole validation split")
    ap.add_argument("--n-draft", type=int, default=3)
    ap.add_argument("--sample-tokens", type=int, default=64)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    t0 = time.time()

    ref = RefGlm4Moe(args.gguf)
    c = ref.cfg
    tok = gguf_tokenizer(ref.reader)
    V = tok.get_vocab_size()
    corpus = stdlib_corpus()
    train_ids = encode_split(tok, corpus.texts("train"))
    val_ids = encode_split(tok, corpus.texts("val"))
    W = c.n_ctx - args.n_draft - 1                     # continuations stay inside n_ctx

    starts = list(range(0, len(val_ids) - W - 1, W))
    if args.max_windows:
        starts = starts[:args.max_windows]
    routing = Routing()
    tr_ctx, tr_tgt, tr_lp, tr_top = [], [], [], []
    m_ctx, m_prev, m_tgt, m_lp, m_top = [], [], [], [], []
    acc_pre, acc_norm = [], []
    for wi, s in enumerate(starts):
        win = val_ids[s:s + W + 1].astype(np.int64)
        h, logits, kvs = ref.trunk(win[:W], routing)
        lp = log_softmax(logits)
        tr_ctx.append(win[:W]); tr_tgt.append(win[1:W + 1])
        tr_lp.append(lp[np.arange(W), win[1:W + 1]]); tr_top.append(logits.argmax(-1) == win[1:W + 1])
        _, mlog, kv_mtp = ref.mtp(h, win[1:W + 1], routing)
        mlp = log_softmax(mlog[:W - 1])
        m_prev.append(win[:W - 1]); m_ctx.append(win[1:W]); m_tgt.append(win[2:W + 1])
        m_lp.append(mlp[np.arange(W - 1), win[2:W + 1]]); m_top.append(mlog[:W - 1].argmax(-1) == win[2:W + 1])
        acc_pre.append(chain_acceptance(ref, win, h, logits, kvs, kv_mtp, args.n_draft, False))
        acc_norm.append(chain_acceptance(ref, win, h, logits, kvs, kv_mtp, args.n_draft, True))
        if (wi + 1) % 20 == 0:
            print(f"  window {wi + 1}/{len(starts)} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)

    cat = np.concatenate
    res: dict = {"gguf": args.gguf, "val_tokens_scored": int(sum(map(len, tr_tgt))), "window": W}
    big1, big2 = Bigram(train_ids, V, 1), Bigram(train_ids, V, 2)
    res["trunk_ce"] = float(-cat(tr_lp).mean())
    res["trunk_top1"] = float(cat(tr_top).mean())
    res["bigram_ce"], res["bigram_alpha"] = big1.ce(cat(tr_ctx), cat(tr_tgt))
    res["bigram_top1"] = big1.top1(cat(tr_ctx), cat(tr_tgt))
    res["mtp_ce"] = float(-cat(m_lp).mean())
    res["mtp_top1"] = float(cat(m_top).mean())
    res["mtp_bigram_ce"], res["mtp_bigram_alpha"] = big1.ce(cat(m_ctx), cat(m_tgt))
    res["mtp_bigram_top1"] = big1.top1(cat(m_ctx), cat(m_tgt))
    res["mtp_skipbigram_ce"], res["mtp_skipbigram_alpha"] = big2.ce(cat(m_prev), cat(m_tgt))
    res["mtp_skipbigram_top1"] = big2.top1(cat(m_prev), cat(m_tgt))
    for key, acc in (("accept_prenorm_chain", cat(acc_pre)), ("accept_normed_chain", cat(acc_norm))):
        cum = acc.mean(0)
        cond = [float(cum[0])] + [float(cum[j] / cum[j - 1]) if cum[j - 1] else 0.0
                                  for j in range(1, len(cum))]
        res[key] = {"cumulative": [float(x) for x in cum], "conditional": cond,
                    "expected_tokens_per_step": [1.0 + float(cum[:n].sum()) for n in range(len(cum) + 1)]}
    k = c.n_expert_used
    usage = {}
    for b, lst in sorted(routing.ids.items()):
        ids = cat(lst)
        share = np.bincount(ids.ravel(), minlength=c.n_expert) / ids.size * c.n_expert
        usage[f"blk.{b}"] = {
            "tokens": int(len(ids)), "load_min": float(share.min()), "load_max": float(share.max()),
            "load_cv": float(share.std()),
            "distinct": {B: distinct_experts(ids, c.n_expert, B) for B in (1, 2, 4, 8, 16)}}
    res["uniform_distinct"] = {B: c.n_expert * (1 - (1 - k / c.n_expert) ** B) for B in (1, 2, 4, 8, 16)}
    res["expert_usage"] = usage
    res["samples"] = {p: greedy_sample(ref, tok, p, args.sample_tokens) for p in SAMPLE_PROMPTS}
    res["eval_seconds"] = time.time() - t0
    print_report(res, c)
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return 0


def print_report(r: dict, c) -> None:
    p = print
    p(f"Scored {r['val_tokens_scored']} validation tokens (windows of {r['window']}), "
      f"float reference over the dequantized GGUF, {r['eval_seconds']:.0f} s.\n")
    p("| | cross-entropy (nats/token) | top-1 |\n|---|---|---|")
    p(f"| trunk, next token | {r['trunk_ce']:.3f} | {r['trunk_top1']:.3f} |")
    p(f"| bigram baseline, next token (alpha {r['bigram_alpha']}) | {r['bigram_ce']:.3f} | {r['bigram_top1']:.3f} |")
    p(f"| MTP head, token t+2 | {r['mtp_ce']:.3f} | {r['mtp_top1']:.3f} |")
    p(f"| bigram P(x[t+2] \\| x[t+1]) (alpha {r['mtp_bigram_alpha']}) | {r['mtp_bigram_ce']:.3f} | {r['mtp_bigram_top1']:.3f} |")
    p(f"| skip-bigram P(x[t+2] \\| x[t]) (alpha {r['mtp_skipbigram_alpha']}) | {r['mtp_skipbigram_ce']:.3f} | {r['mtp_skipbigram_top1']:.3f} |")
    p("\nChained MTP drafts under greedy verification (every held-out position):\n")
    p("| chaining | a_1 | a_2 | a_3 | P(1 acc) | P(2 acc) | P(3 acc) | E[tokens/step] n=1,2,3 |")
    p("|---|---|---|---|---|---|---|---|")
    for key, label in (("accept_prenorm_chain", "h_mtp pre-norm (offload interface)"),
                       ("accept_normed_chain", "h_mtp after shared_head_norm (llama.cpp)")):
        a = r[key]
        cond = " | ".join(f"{x:.3f}" for x in a["conditional"])
        cum = " | ".join(f"{x:.3f}" for x in a["cumulative"])
        e = ", ".join(f"{x:.2f}" for x in a["expected_tokens_per_step"][1:])
        p(f"| {label} | {cond} | {cum} | {e} |")
    p("\nExpert usage on the validation windows (load = share of routed slots x n_expert; 1.0 = uniform):\n")
    Bs = list(r["uniform_distinct"])
    p("| block | load min | load max | load std | " + " | ".join(f"distinct B={B}" for B in Bs) + " |")
    p("|---|---|---|---|" + "---|" * len(Bs))
    for b, u in r["expert_usage"].items():
        p(f"| {b} | {u['load_min']:.2f} | {u['load_max']:.2f} | {u['load_cv']:.2f} | "
          + " | ".join(f"{u['distinct'][B]:.1f}" for B in Bs) + " |")
    p("| uniform routing | 1 | 1 | 0 | " + " | ".join(f"{r['uniform_distinct'][B]:.1f}" for B in Bs) + " |")
    p("\nGreedy samples (bos + prompt):\n")
    for prompt, text in r["samples"].items():
        p(f"prompt {prompt!r}:\n```python\n{text}\n```")


if __name__ == "__main__":
    sys.exit(main())
