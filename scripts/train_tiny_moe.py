"""Train the shipped tiny glm4moe model (trunk + one NextN/MTP block) on the Python stdlib.

    python scripts/train_tiny_moe.py --out out/tiny-moe          # ~31 min on one CPU core
    python scripts/export_tiny_moe_gguf.py out/tiny-moe models/tiny-glm4moe-mtp.gguf

Deterministic: fixed seeds, fixed step count, windows drawn from a seeded numpy Generator
(bitwise repeatable for the same torch build and thread count). Writes to ``--out``:
``model.pt`` (config, state dict, expert-load stats), ``tokenizer.json``, ``train_log.txt``.

Loss = CE(trunk, t+1) + MTP_WEIGHT * CE(MTP, t+2) + AUX_WEIGHT * balance term, the
DeepSeek-V3 / GLM-4.5 recipe. Expert balance mostly comes from the aux-loss-free update of
``exp_probs_b`` (bias += gamma * sign(mean load - load) after each step, DeepSeek-V3 §2.1.2).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tiny_moe_data import encode_split, stdlib_corpus, train_tokenizer
from tiny_moe_model import TinyConfig, TinyGlm4Moe

MTP_WEIGHT = 0.3
AUX_WEIGHT = 1e-2
BIAS_GAMMA = 1e-2


class Log:
    """Print and keep every line (the log is written next to the checkpoint)."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, msg: str) -> None:
        print(msg, flush=True)
        self.lines.append(msg)


def batches(stream: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(stream) - seq, size=batch)
        yield torch.from_numpy(np.stack([stream[s:s + seq] for s in starts]).astype(np.int64))


def losses(model: TinyGlm4Moe, toks: torch.Tensor):
    V = model.cfg.n_vocab
    logits, mtp_logits, aux = model(toks)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), toks[:, 1:].reshape(-1))
    # MTP output at position t predicts toks[t+2]: valid for t <= T-3
    ce_mtp = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, V), toks[:, 2:].reshape(-1))
    return ce, ce_mtp, aux


@torch.no_grad()
def evaluate(model: TinyGlm4Moe, val_batches: list[torch.Tensor]) -> tuple[float, float]:
    model.eval()
    tot = [0.0, 0.0]
    for b in val_batches:
        ce, ce_mtp, _ = losses(model, b)
        tot[0] += ce.item()
        tot[1] += ce_mtp.item()
    model.train()
    return tot[0] / len(val_batches), tot[1] / len(val_batches)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))   # cosine to 10%


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("out/tiny-moe"))
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    # 1 thread: on a shared 2-core box, two OpenMP threads wait on each other whenever
    # another process holds a core (measured: small matmuls fall from ~95 to ~2 GFLOP/s).
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=200)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    log = Log()
    t_start = time.time()

    corpus = stdlib_corpus()
    train_texts, val_texts = corpus.texts("train"), corpus.texts("val")
    tok = train_tokenizer(train_texts, args.vocab)
    train_ids, val_ids = encode_split(tok, train_texts), encode_split(tok, val_texts)
    log(f"corpus {corpus.root}: train {len(corpus.train)} files {sum(map(len, train_texts))} chars "
        f"{len(train_ids)} tokens; val {len(corpus.val)} files {sum(map(len, val_texts))} chars "
        f"{len(val_ids)} tokens; vocab {tok.get_vocab_size()}")

    cfg = TinyConfig(n_vocab=tok.get_vocab_size(), n_ctx=args.seq)
    model = TinyGlm4Moe(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"config {cfg.to_dict()}")
    log(f"params {n_params}; steps {args.steps} x batch {args.batch} x seq {args.seq} = "
        f"{args.steps * args.batch * args.seq} tokens; threads {args.threads}; seed {args.seed}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    rng = np.random.default_rng(args.seed)
    train_iter = batches(train_ids, args.batch, args.seq, rng)
    val_rng = np.random.default_rng(args.seed + 1)
    val_batches = [next(batches(val_ids, args.batch, args.seq, val_rng)) for _ in range(4)]

    moe = model.moe_blocks()
    load_acc = torch.zeros(len(moe), cfg.n_expert)
    t0, seen = time.time(), 0
    acc = np.zeros(3)
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        toks = next(train_iter)
        ce, ce_mtp, aux = losses(model, toks)
        loss = ce + MTP_WEIGHT * ce_mtp + AUX_WEIGHT * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():   # aux-loss-free balancing: push under-loaded experts up
            for i, blk in enumerate(moe):
                load = blk.last_load.float()
                blk.exp_probs_b += BIAS_GAMMA * torch.sign(load.mean() - load)
                load_acc[i] += load
        seen += toks.numel()
        acc += (ce.item(), ce_mtp.item(), aux.item())
        if (step + 1) % 10 == 0:
            share = load_acc / load_acc.sum(1, keepdim=True) * cfg.n_expert   # 1.0 = uniform
            dt = time.time() - t0
            log(f"step {step + 1:4d} lr {opt.param_groups[0]['lr']:.2e} train ce {acc[0] / 10:.3f} "
                f"mtp {acc[1] / 10:.3f} aux {acc[2] / 10:.2f} | expert load/uniform "
                f"min {share.min().item():.2f} max {share.max().item():.2f} | "
                f"{seen / dt:.0f} tok/s {dt / 60:.1f} min")
            acc[:] = 0
            load_acc.zero_()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            v, vm = evaluate(model, val_batches)
            log(f"step {step + 1:4d} VAL ce {v:.3f} mtp(t+2) {vm:.3f}")

    train_s = time.time() - t0
    log(f"trained {args.steps} steps, {seen} tokens in {train_s / 60:.1f} min "
        f"({seen / train_s:.0f} tok/s); total with data/tokenizer {(time.time() - t_start) / 60:.1f} min")
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = args.out / "model.pt.tmp"
    torch.save({"config": cfg.to_dict(), "state_dict": model.state_dict(),
                "args": vars(args) | {"out": str(args.out)}, "train_seconds": train_s,
                "train_tokens": seen, "n_params": n_params}, tmp)
    tmp.replace(args.out / "model.pt")
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "train_log.txt").write_text("\n".join(log.lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
