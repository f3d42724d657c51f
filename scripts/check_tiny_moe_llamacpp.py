"""Check the shipped GGUF with llama.cpp itself (llama-cpp-python) against the float reference.

    python scripts/check_tiny_moe_llamacpp.py models/tiny-glm4moe-mtp.gguf

1. tokenizer: llama.cpp's tokenization of held-out text == the `tokenizers` BPE rebuilt from
   the file's tokenizer.ggml.* keys;
2. trunk: next-token argmax (and max |logit diff|) at every position of a few prompts;
3. NextN head: llama.cpp's own MTP graph (an LLAMA_CONTEXT_TYPE_MTP context, fed llama.cpp's
   own post-output_norm hidden states as the entry's embedding, which is how this llama.cpp
   passes h to graph_mtp) vs the reference, teacher-forced;
4. greedy continuations of the card's prompts, token by token.
Exit status 1 if any argmax differs where the reference's top-2 logit margin exceeds MARGIN and
no MoE block had a routing near-tie at that position (a real disagreement, not a tie that the
8-bit activation rounding in llama.cpp's Q8_0 matmuls may resolve the other way).
"""
from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402

from eval_tiny_moe import PROMPTS, gguf_tokenizer  # noqa: E402
from tiny_moe_data import EOT, stdlib_corpus  # noqa: E402
from tiny_moe_reference import RefGlm4Moe, Routing  # noqa: E402

# llama.cpp quantizes activations to 8 bits for Q8_0 matmuls and keeps the KV cache in F16;
# logits then differ by ~1e-2, so argmax may flip only where the top two are this close.
MARGIN = 0.1
# A near-tie in top-k expert selection (k-th vs (k+1)-th biased score closer than this) can be
# resolved differently by llama.cpp; the token then goes through another expert and its logits
# differ by up to ~1. Such positions are counted, not failed.
ROUTING_TIE = 1e-3


def _silence_llama_log(L):
    cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *a: None)
    L.llama_log_set(cb, None)
    return cb                                   # keep a reference: C holds the pointer


class LlamaCpp:
    def __init__(self, path: str, n_ctx: int):
        import llama_cpp as L
        self.L = L
        self._log_cb = _silence_llama_log(L)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.load_mtp = True
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_embd = L.llama_model_n_embd(self.model)
        self.n_ctx = n_ctx

    def _ctx(self, mtp_of=None):
        L = self.L
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = self.n_ctx
        cp.n_threads = cp.n_threads_batch = 1
        if mtp_of is None:
            cp.embeddings = True                 # t_embd = hidden state after output_norm
        else:
            cp.ctx_type, cp.ctx_other = L.LLAMA_CONTEXT_TYPE_MTP, mtp_of
        return L.llama_init_from_model(self.model, cp)

    def tokenize(self, text: str) -> list[int]:
        L = self.L
        raw = text.encode()
        buf = (L.llama_token * (len(raw) + 8))()
        n = L.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        return list(buf[:n])

    def trunk(self, tokens: list[int]):
        """-> logits (T, V), hidden after output_norm (T, d), and the context (for MTP)."""
        L = self.L
        ctx = self._ctx()
        b = L.llama_batch_init(len(tokens), 0, 1)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, 1
            b.seq_id[i][0] = 0
        b.n_tokens = len(tokens)
        if L.llama_decode(ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        L.llama_batch_free(b)
        T = len(tokens)
        logits = np.array([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), (self.n_vocab,)) for i in range(T)])
        h = np.array([np.ctypeslib.as_array(L.llama_get_embeddings_ith(ctx, i), (self.n_embd,)) for i in range(T)])
        return logits, h, ctx

    def mtp(self, target_ctx, h: np.ndarray, next_tokens: list[int]) -> np.ndarray:
        """Row t: (h[t], token t+1) -> logits for token t+2, through llama.cpp's graph_mtp."""
        L = self.L
        mctx = self._ctx(mtp_of=target_ctx)
        batch = L.llama_batch_ext_init(mctx)
        h = np.ascontiguousarray(h, dtype=np.float32)
        for i, t in enumerate(next_tokens):
            idx = L.llama_batch_ext_add_token(batch, 0, int(t))
            pos = L.llama_pos(i)
            L.llama_batch_ext_set_pos(batch, idx, ctypes.byref(pos))
            emb = L.llama_embd(h[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self.n_embd)
            if not L.llama_batch_ext_set_embd_token(batch, idx, emb):
                raise RuntimeError("llama_batch_ext_set_embd_token refused the hidden state")
            L.llama_batch_ext_set_output_logits(batch, idx, True)
        if L.llama_process(mctx, L.LLAMA_PROCESS_TYPE_DECODE, batch) != 0:
            raise RuntimeError("llama_process (MTP) failed")
        out = np.array([np.ctypeslib.as_array(L.llama_get_logits_ith(mctx, i), (self.n_vocab,))
                        for i in range(len(next_tokens))])
        L.llama_batch_ext_free(batch)
        L.llama_free(mctx)
        return out

    def free(self, ctx) -> None:
        self.L.llama_free(ctx)


def compare(name: str, ours: np.ndarray, ref: np.ndarray, gap: np.ndarray) -> tuple[int, int, int]:
    """Print agreement; return (positions, argmax disagreements, unexplained disagreements).
    gap: per position, the smallest expert-selection gap of the reference over MoE blocks."""
    a, r = ours.argmax(-1), ref.argmax(-1)
    top2 = np.sort(ref, -1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    bad = a != r
    flip = gap < ROUTING_TIE
    unexplained = bad & (margin > MARGIN) & ~flip
    print(f"| {name} | {len(a)} | {int((~bad).sum())} | {np.abs(ours - ref).max():.4f} | "
          f"{int(flip.sum())} | {int(unexplained.sum())} |")
    return len(a), int(bad.sum()), int(unexplained.sum())


def min_gap(routing: Routing, n: int) -> np.ndarray:
    return np.min([np.concatenate(g)[:n] for g in routing.gaps.values()], axis=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf")
    ap.add_argument("--n-snippets", type=int, default=4)
    ap.add_argument("--snippet-tokens", type=int, default=200)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp (llama-cpp-python) is not installed: nothing checked", file=sys.stderr)
        return 2
    print(f"llama-cpp-python {llama_cpp.__version__}\n")

    ref = RefGlm4Moe(args.gguf)
    tok = gguf_tokenizer(ref.reader)
    eot = tok.token_to_id(EOT)
    lc = LlamaCpp(args.gguf, ref.cfg.n_ctx)

    texts = stdlib_corpus().texts("val")[:args.n_snippets]
    n_same = sum(lc.tokenize(t[:4000]) == tok.encode(t[:4000], add_special_tokens=False).ids for t in texts)
    print(f"tokenizer: llama.cpp == tokenizers on {n_same}/{len(texts)} held-out files (first 4000 chars)\n")

    prompts = {repr(p): [eot] + tok.encode(p, add_special_tokens=False).ids for p in PROMPTS}
    for i, t in enumerate(texts):
        prompts[f"val file {i} (bos + {args.snippet_tokens} tokens)"] = (
            [eot] + tok.encode(t, add_special_tokens=False).ids[:args.snippet_tokens])
    print(f"| sequence | positions | argmax equal | max abs logit diff | routing near-ties "
          f"(gap < {ROUTING_TIE}) | unequal, margin > {MARGIN}, no near-tie |")
    print("|---|---|---|---|---|---|")
    totals = np.zeros(3, int)
    for name, ids in prompts.items():
        logits, h, ctx = lc.trunk(ids)
        rt, rm = Routing(), Routing()
        h_ref, logits_ref, _ = ref.trunk(np.asarray(ids), rt)
        gap_trunk = min_gap(rt, len(ids))
        totals += compare(f"trunk {name}", logits, logits_ref, gap_trunk)
        if len(ids) > 2:
            mtp = lc.mtp(ctx, h[:-1], ids[1:])
            _, mtp_ref, _ = ref.mtp(h_ref[:-1], np.asarray(ids[1:]), rm)
            totals += compare(f"MTP {name}", mtp, mtp_ref,
                              np.minimum(min_gap(rm, len(ids) - 1), gap_trunk[:-1]))
        lc.free(ctx)

    print("\ngreedy continuations (llama.cpp vs reference, recomputed from scratch per token):")
    for p in PROMPTS:
        ids_l = ids_r = [eot] + tok.encode(p, add_special_tokens=False).ids
        for _ in range(args.greedy_tokens):
            logits, _, ctx = lc.trunk(ids_l)
            lc.free(ctx)
            ids_l = ids_l + [int(logits[-1].argmax())]
            _, lr, _ = ref.trunk(np.asarray(ids_r))
            ids_r = ids_r + [int(lr[-1].argmax())]
        same = next((i for i, (x, y) in enumerate(zip(ids_l, ids_r)) if x != y), len(ids_l))
        print(f"- {p!r}: {'identical' if ids_l == ids_r else f'diverge at token {same}'}; "
              f"llama.cpp: {tok.decode(ids_l[1:])!r}")
    print(f"\ntotal: {totals[0]} positions, {totals[1]} argmax differences, "
          f"{totals[2]} unexplained (reference margin > {MARGIN} and no routing near-tie)")
    return 1 if totals[2] else 0


if __name__ == "__main__":
    sys.exit(main())
