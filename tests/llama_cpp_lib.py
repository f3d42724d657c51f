"""llama.cpp's libllama (the one llama-cpp-python 0.3.36 vendors) driven through its low-level
ctypes API, for the reference comparisons: a CPU context with f32 caches and flash attention
off (ggml's f16 cache and its CPU flash attention move tiny-model logits by 1e-3..1e-2), a
batch decode that keeps every row's logits, and the staging API of ``src/llama-ext.h``
(C++ symbols, called by their mangled names)."""
from __future__ import annotations

import ctypes
import glob
import os

import numpy as np

GGML_TYPE_F32 = 0
FLASH_ATTN_DISABLED = 0
CONTEXT_TYPE_MTP = 1            # llama.h LLAMA_CONTEXT_TYPE_MTP: the model's NextN graph
PROCESS_DECODE = 1              # llama.h LLAMA_PROCESS_TYPE_DECODE


class Ext:
    """The ``llama-ext.h`` functions these tests call."""

    def __init__(self, l):
        lib = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(l.__file__), "lib", "libllama.so"))[0])
        self.set_layer_inp = lib._Z30llama_set_embeddings_layer_inpP13llama_contextjb
        self.set_layer_inp.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]
        self.get_layer_inp = lib._Z30llama_get_embeddings_layer_inpP13llama_contextj
        self.get_layer_inp.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        self.get_layer_inp.restype = ctypes.POINTER(ctypes.c_float)
        self.set_nextn = lib._Z26llama_set_embeddings_nextnP13llama_contextbb       # (ctx, on, masked)
        self.set_nextn.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool]
        self.get_nextn_ith = lib._Z30llama_get_embeddings_nextn_ithP13llama_contexti
        self.get_nextn_ith.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        self.get_nextn_ith.restype = ctypes.POINTER(ctypes.c_float)


def load_model(l, path, *, mtp: bool = False):
    mp = l.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.load_mtp = mtp
    model = l.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp could not load {path}"
    return model


def context(l, model, *, n_ctx: int = 256, other=None, mtp: bool = False):
    cp = l.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = n_ctx
    cp.n_threads = cp.n_threads_batch = 2
    cp.type_k = cp.type_v = GGML_TYPE_F32
    cp.flash_attn_type = FLASH_ATTN_DISABLED
    if mtp:                     # as common/speculative.cpp makes the draft-mtp context
        cp.ctx_type, cp.n_rs_seq = CONTEXT_TYPE_MTP, 0
    if other is not None:
        cp.ctx_other = other
    ctx = l.llama_init_from_model(model, cp)
    assert ctx
    return ctx


def n_vocab(l, model) -> int:
    return l.llama_vocab_n_tokens(l.llama_model_get_vocab(model))


def decode(l, ctx, ids, *, pos0: int = 0, n_vocab: int) -> np.ndarray:
    """Decode ``ids`` at positions pos0.. in one batch → every row's logits (T, n_vocab)."""
    n = len(ids)
    b = l.llama_batch_init(n, 0, 1)
    try:
        b.n_tokens = n
        for i, t in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, pos0 + i, 1, 1
            b.seq_id[i][0] = 0
        assert l.llama_decode(ctx, b) == 0
        return np.ctypeslib.as_array(l.llama_get_logits(ctx), shape=(n, n_vocab)).copy()
    finally:
        l.llama_batch_free(b)


def decode_with_state(l, ctx, ids, states: np.ndarray, *, pos0: int, n_vocab: int) -> np.ndarray:
    """An MTP context's batch: token i at position pos0 + i with the state row ``states[i]``
    (the extended batch API, as common/speculative.cpp's draft-mtp feeds it) → logits (T, V)."""
    states = np.ascontiguousarray(states, dtype=np.float32)
    b = l.llama_batch_ext_init(ctx)
    try:
        for i, t in enumerate(ids):
            k = l.llama_batch_ext_add_token(b, 0, int(t))
            assert k == i
            l.llama_batch_ext_set_pos(b, k, (ctypes.c_int * 4)(pos0 + i, 0, 0, 0))
            row = l.llama_embd(states[i].ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, states.shape[1])
            assert l.llama_batch_ext_set_embd_token(b, k, row)
            l.llama_batch_ext_set_output_logits(b, k, True)
        assert l.llama_process(ctx, PROCESS_DECODE, b) == 0
        return np.ctypeslib.as_array(l.llama_get_logits(ctx), shape=(len(ids), n_vocab)).copy()
    finally:
        l.llama_batch_ext_free(b)


def nextn_rows(ext: Ext, ctx, n: int, width: int) -> np.ndarray:
    """The NextN state output (``t_h_nextn``) of the last batch's n rows."""
    return np.stack([np.ctypeslib.as_array(ext.get_nextn_ith(ctx, i), shape=(width,)).copy() for i in range(n)])
