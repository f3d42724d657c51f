"""DSpark against llama.cpp's dflash implementation (the llama.cpp llama-cpp-python 0.3.36
vendors, through its low-level ctypes API; issue 23's reference comparison): on the tiny
deepseek4 trunk + tiny dflash pair, the taps of a 40-token prompt and the draft block's logits
(base + Markov bias, chained greedily) and the confidence head's outputs for the same context,
at block sizes 5 and 2.

llama.cpp is driven as its speculative driver does (common/speculative.cpp): the target context
records the inputs of ``dflash.target_layers`` (``llama_set_embeddings_layer_inp``, C++ symbols
of src/llama-ext.h, called by their mangled names), the draft context (``ctx_other`` = the
target's) decodes the taps as an embedding batch at positions 0..P-1 (the injection), then
``[x_P, MASK × (n-1)]`` at P.. with causal attention off. Both contexts with f32 caches and
flash attention off (with it on, ggml's CPU flash attention moved the taps by 1e-3 and the block
logits by 6e-4 relative; off: 8e-7 and 7e-7)."""
from __future__ import annotations

import ctypes
import warnings

import numpy as np
import pytest
import torch

from tests.archs.test_dspark import PROMPT, TRUNK
from tests.archs.test_deepseek4 import load
from tests.llama_cpp_lib import Ext, context, load_model
from tests.tiny_models import write_tiny_dspark, write_tiny_model

# float32 both sides; summation order only (measured 7e-7). A wrong rope, mask, clamp or
# Markov chaining shows up at 1e-2..1
REL_TOL = 1e-5


def _ours(trunk, draft, n, off=0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = load(trunk, draft=str(draft))
    with s, torch.inference_mode():
        m = s.model
        state = m.new_state(m.dspark)
        logits, taps = m.forward(torch.tensor(PROMPT), state)
        x_q = int(logits[-1].argmax())
        m.dspark.inject(taps, torch.arange(len(PROMPT)), state.nextn_cache)
        out = {}
        for k in n:
            base, h = m.dspark.block([x_q] + [m.dspark.mask_id] * (k - 1), len(PROMPT), state.nextn_cache)
            state.nextn_cache.truncate(len(PROMPT))
            rows, conf, prev = [], [], x_q
            for i in range(off, k):       # off 1 (sample_from_anchor false): row 0 is no draft
                e, bias = m.dspark.markov(prev)
                col = base[i] + bias
                rows.append(col.numpy().copy())
                conf.append(m.dspark.confidence(h[i], e))
                prev = int(col.argmax())
            out[k] = np.stack(rows), np.array(conf)
        return taps.numpy(), x_q, out, m.dspark.target_layers, m.dspark.mask_id


@pytest.mark.parametrize("anchor", [None, False], ids=["sample_from_anchor absent", "sample_from_anchor false"])
def test_dspark_block_logits_match_llama_cpp(tmp_path, anchor):
    """``anchor`` None: the key absent (llama.cpp's default, true): drafts from block rows 0..;
    False (a bonus-anchor export): row 0 is no draft (llama.cpp passes its logits through
    unbiased), the Markov chain starts at row 1; rows 1.. compared."""
    l = pytest.importorskip("llama_cpp.llama_cpp")
    trunk = write_tiny_model(tmp_path / "trunk.gguf", TRUNK).path
    draft = write_tiny_dspark(tmp_path / "dspark.gguf", TRUNK, sample_from_anchor=anchor).path
    sizes = (5, 2)
    off = 0 if anchor is None else 1
    taps, x_q, ours, layers, mask = _ours(trunk, draft, sizes, off)
    p, d = len(PROMPT), TRUNK.n_embd

    ext = Ext(l)
    set_inp, get_inp = ext.set_layer_inp, ext.get_layer_inp
    set_conf = ext.set_nextn                   # the confidences, n_embd wide
    get_conf = ext.get_nextn_ith

    l.llama_backend_init()
    mt, md = load_model(l, trunk), load_model(l, draft)
    ct = context(l, mt)
    cd = context(l, md, other=ct)
    try:
        for k in layers:
            set_inp(ct, k, True)
        ids = (l.llama_token * p)(*PROMPT)
        assert l.llama_decode(ct, l.llama_batch_get_one(ids, p)) == 0
        theirs_taps = np.concatenate([np.ctypeslib.as_array(get_inp(ct, k), shape=(p, d)).copy() for k in layers], 1)
        taps_err = float(np.abs(theirs_taps - taps).max() / np.abs(taps).max())

        b = l.llama_batch_init(p, taps.shape[1], 1)          # the injection: an embedding batch
        b.n_tokens = p
        src = np.ascontiguousarray(theirs_taps, dtype=np.float32)
        ctypes.memmove(b.embd, src.ctypes.data, src.nbytes)
        for i in range(p):
            b.pos[i], b.n_seq_id[i], b.logits[i] = i, 1, 0
            b.seq_id[i][0] = 0
        assert l.llama_decode(cd, b) == 0
        l.llama_batch_free(b)
        l.llama_set_causal_attn(cd, False)
        set_conf(cd, True, False)
        errs, conf_errs = {}, {}
        for n in sizes:
            tb = l.llama_batch_init(n, 0, 1)
            tb.n_tokens = n
            for i in range(n):
                tb.token[i], tb.pos[i], tb.n_seq_id[i], tb.logits[i] = x_q if i == 0 else mask, p + i, 1, 1
                tb.seq_id[i][0] = 0
            assert l.llama_decode(cd, tb) == 0
            l.llama_batch_free(tb)
            rows, conf = ours[n]
            theirs = np.stack([np.ctypeslib.as_array(l.llama_get_logits_ith(cd, i), shape=(rows.shape[1],)).copy()
                               for i in range(off, n)])
            errs[n] = float(np.abs(theirs - rows).max() / np.abs(rows).max())
            assert theirs.argmax(1).tolist() == rows.argmax(1).tolist(), n
            got = np.array([get_conf(cd, i)[0] for i in range(off, n)])
            conf_errs[n] = float(np.abs(got - conf).max())
            l.llama_memory_seq_rm(l.llama_get_memory(cd), 0, p, -1)     # the block's keys: rolled back
    finally:
        l.llama_free(cd)
        l.llama_free(ct)
        l.llama_model_free(md)
        l.llama_model_free(mt)
    print(f"\n  DSpark vs llama.cpp (drafts from rows {off}..): taps rel err {taps_err:.1e}, block logits "
          + ", ".join(f"n={n} {e:.1e}" for n, e in errs.items())
          + "; confidences abs err " + ", ".join(f"n={n} {e:.1e}" for n, e in conf_errs.items()))
    assert taps_err < REL_TOL and all(e < REL_TOL for e in errs.values()), errs
    assert all(e < REL_TOL for e in conf_errs.values()), conf_errs     # sigmoids in (0, 1): absolute
