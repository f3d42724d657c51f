"""Tensors that stay in system RAM as raw GGUF bytes, used in place through cpu_kernels.

Nothing here copies or dequantizes a weight: the memory-mapped ``ReaderTensor.data`` is
handed to the kernels as is, so the process's anonymous memory does not grow by their size.
Projections take and return torch tensors on the caller's device (a no-op move for the
CPU, where these layers run anyway).
"""
from __future__ import annotations

import ctypes
import mmap
import sys
from contextlib import contextmanager

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from cpu_kernels import ExpertWeights, moe_ffn, settings
from cpu_kernels.entry import first_call
from cpu_kernels.head import embed_rows
from cpu_kernels.hyper import hc_pre
from cpu_kernels.kv_attention import attend_cache
from cpu_kernels.layout import weight_bytes
from cpu_kernels.matmul import BoundMatmul
from cpu_kernels.moe import int8_phases, routed_ffn_host, routed_int8_scratch, routed_scratch
from cpu_kernels.registry import get_kernel, supported_types
import gpu.attention
from gpu.hyper import HyperConnection
from offload.profile import Profile
from placement.limits import DECODE_ACTIVATIONS, DECODE_TOKENS, int8_request


def attend_quantized_cache(q: torch.Tensor, keys, values, *, scale: float | None = None,
                           sinks: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """``gpu.attention.attend`` for CPU-resident layers over quantized caches (``QuantRows``
    keys and values; MLA passes its latent as both): the compiled ``attend_cache`` reads the
    rows in place. ``install_cpu_attention`` puts it in ``gpu.attention``."""
    t, n_head, dk = q.shape
    dv = values.width
    out = np.empty((t, n_head, dv), np.float32)
    sink = None if sinks is None else np.ascontiguousarray(sinks.detach().to("cpu", torch.float32).numpy())
    attend_cache(to_host(q), get_kernel(keys.qtype).tag, keys.raw.numpy(), get_kernel(values.qtype).tag,
                 values.raw.numpy(), values.raw.shape[1], dv, dk ** -0.5 if scale is None else float(scale), sink, int(window), out)
    return torch.from_numpy(out)


def install_cpu_attention() -> None:
    """Route ``gpu.attention``'s attention over quantized caches on the CPU to
    ``attend_quantized_cache`` (gpu does not import cpu_kernels). Called where a model is
    built (``offload.runtime.load_plan``, ``offload.pipeline.load_stage``)."""
    gpu.attention.CPU_QUANTIZED_ATTEND = attend_quantized_cache


def to_host(x: torch.Tensor) -> np.ndarray:
    """x as a C-contiguous float32 numpy array; a view, no copy, when x already is one on
    the CPU (the all-CPU decode path calls this for every projection)."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.requires_grad:
        x = x.detach().to("cpu", torch.float32)
    a = x.numpy()
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def compiled(fn, *args, **kw):
    """``fn(*args, **kw)``, a call into Numba kernels, leaving torch's thread count as it was.
    Numba's OpenMP launches set the calling thread's OpenMP thread count (the one torch's own
    parallel regions read) to the kernels' count: torch, given fewer (``--torch-threads 1``),
    then ran its small ops in parallel regions that wait for a second thread (a (1, 4, 4)
    softmax of deepseek4's hyper-connections measured 15 ms on a loaded 2-core box, 4 µs
    single-threaded)."""
    n = torch.get_num_threads()
    try:
        return fn(*args, **kw)
    finally:
        torch.set_num_threads(n)


@contextmanager
def prompt_threads(n_tokens: int):
    """Torch's ops over a prompt batch (more than ``DECODE_TOKENS`` tokens: attention over the
    prompt, RoPE, norms) on as many threads as the CPU kernels (``-t``) where
    ``--torch-threads`` gives fewer (1 by default: a decode step's small ops lose more waiting
    for a second thread than they gain). Measured on bench.depth's wide model, 256-token
    prefill, 2 threads, passes alternating: 42-48 t/s with 1 torch thread, 49-50 with 2."""
    if n_tokens <= DECODE_TOKENS:           # a decode step (serving checks every step): nothing to ask
        yield
        return
    n = torch.get_num_threads()
    want = settings.apply_threads()
    if want <= n:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class RawLinear:
    """``y = x @ W^T (+ b)`` with W the raw GGUF data of a 2-D tensor; batches of at least
    ``int8_batch`` tokens use int8 activations (``placement.limits.int8_request``: prompt
    prefill, llama.cpp's Q8 activations, integer dot products; error bound in
    ``cpu_kernels.settings``)."""

    def __init__(self, data: np.ndarray, qtype: GGMLQuantizationType, *, bias: torch.Tensor | None = None,
                 name: str = "", int8_batch: int | None = None):
        self.data, self.qtype, self.bias, self.name = data, qtype, bias, name
        self.int8_batch = int8_batch
        self.device = torch.device("cpu")
        self._matmul = BoundMatmul(data, qtype, name=name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        home = x.device
        y = torch.from_numpy(compiled(self._matmul, to_host(x),
                                      int8=int8_request(x.shape[0] if x.dim() > 1 else 1, self.int8_batch)))
        if self.bias is not None:
            y += self.bias
        return y if home.type == "cpu" else y.to(home)


class RawGroupedLinear:
    """A grouped projection over the raw 2-D GGUF tensor (deepseek4's ``attn_output_a``):
    (T, groups, cols) → (T, rows), group g through rows g·rows/groups … of W
    (``cpu_kernels.grouped_matmul``)."""

    def __init__(self, data: np.ndarray, qtype: GGMLQuantizationType, groups: int, *, name: str = ""):
        self.data, self.qtype, self.groups, self.name = data, qtype, groups, name
        self.device = torch.device("cpu")
        self._matmul = BoundMatmul(data, qtype, name=name, groups=groups)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        home = x.device
        y = torch.from_numpy(compiled(self._matmul, to_host(x)))
        return y if home.type == "cpu" else y.to(home)


class CpuHyperConnection(HyperConnection):
    """``gpu.hyper.HyperConnection`` of a CPU-resident block, its mixing one compiled call
    (``cpu_kernels.hyper.hc_pre``, single-threaded: 2n + n² dot products and a 4 × 4 Sinkhorn)
    instead of ~90 torch ops of a few µs each."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._host = tuple(np.ascontiguousarray(v.cpu().numpy()) for v in (self.fn, self.base, self.scale))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xh = np.ascontiguousarray(to_host(x))
        t, n, d = xh.shape
        y, post, comb = np.empty((t, d), np.float32), np.empty((t, n), np.float32), np.empty((t, n, n), np.float32)
        hc_pre(xh, *self._host, self.iters, self.hc_eps, self.norm_eps, y, post, comb)
        return torch.from_numpy(y), torch.from_numpy(post), torch.from_numpy(comb)


class RawEmbedding:
    """Row lookup in a raw (possibly quantized) ``token_embd``: only the rows asked for are
    dequantized, per call. Decode and verify batches (up to ``DECODE_TOKENS`` ids) take one
    compiled call, ``cpu_kernels.head.embed_rows`` (the registry's decoders; its entry point
    bound at construction); prompt batches, and types without a CPU kernel, gather the rows and
    run gguf's numpy ``dequantize`` (what ``placement.compute.cpu_lookup_bytes`` counts).
    ``compiled = False`` turns the compiled lookup off (the tests' reference pass)."""

    def __init__(self, data: np.ndarray, qtype: GGMLQuantizationType, n_embd: int):
        self.data, self.qtype, self.n_embd = data, qtype, n_embd
        self.device = torch.device("cpu")
        self._tag = self._rows = self._entry = None
        self.compiled = False
        if GGMLQuantizationType(qtype) in supported_types() and data.ndim == 2 and data.flags.c_contiguous \
                and len(data):
            kern = get_kernel(qtype, "token_embd")
            self._tag, self._rows = kern.tag, weight_bytes(data, kern, 2, "token_embd")
            # compile (or load from Numba's cache) now, on row 0: not in the first token
            self._entry = first_call(embed_rows, (self._tag, self._rows, np.zeros(1, np.int64),
                                                  np.empty((1, n_embd), np.float32)))[0]
            self.compiled = True

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        idx = ids.cpu().numpy()
        if self.compiled and 0 < len(idx) <= DECODE_TOKENS:
            return torch.from_numpy(self._compiled(idx))
        rows = self.data[idx]
        if self.qtype != GGMLQuantizationType.F32:
            rows = dequantize(rows, self.qtype)
        return torch.from_numpy(np.asarray(rows, dtype=np.float32).reshape(-1, self.n_embd))

    def _compiled(self, idx: np.ndarray) -> np.ndarray:
        if idx.dtype != np.int64 or not idx.flags.c_contiguous:     # the entry's argument types
            idx = np.ascontiguousarray(idx, dtype=np.int64)
        out = np.empty((len(idx), self.n_embd), np.float32)
        bad = compiled(self._entry, self._tag, self._rows, idx, out)
        if bad >= 0:            # as numpy's gather would refuse it
            raise IndexError(f"token id {idx[bad]} is outside the vocabulary (0..{self._rows.shape[0] - 1})")
        return out


class CpuExperts:
    """One MoE layer's routed experts in RAM, run by ``cpu_kernels.moe_ffn`` (GIL released)."""

    def __init__(self, weights: ExpertWeights, profile: Profile, *, act: str = "silu",
                 biases: dict[str, np.ndarray] | None = None, int8_batch: int | None = None,
                 decode: str | None = None, limit: float | None = None):
        """``act`` / ``biases`` ("gate", "up", "down" float32 arrays): as ``moe_ffn`` takes them;
        ``int8_batch``: batches of at least this many tokens use int8 activations; ``decode``:
        the activations of decode/verify batches ("auto", "int8", "float"; see
        ``placement.limits.int8_request``)."""
        if decode is not None and decode not in DECODE_ACTIVATIONS:
            raise ValueError(f"decode activations {decode!r}: expected one of {', '.join(DECODE_ACTIVATIONS)}")
        self.weights, self.profile, self.int8_batch, self.decode = weights, profile, int8_batch, decode
        self.act, self.biases = act, {f"{k}_bias": v for k, v in (biases or {}).items()}
        self.limit = limit          # swiglu_clamp's
        self.device = torch.device("cpu")

    def __call__(self, x: np.ndarray, ids: np.ndarray, w: np.ndarray,
                 owned: np.ndarray | None = None) -> np.ndarray:
        """Host arrays in, host array out — called from the worker thread."""
        with self.profile.time("cpu_experts"):
            return compiled(moe_ffn, x, ids, w, self.weights, owned=owned, act=self.act, limit=self.limit,
                            int8=self.int8(x.shape[0]), **self.biases)

    def int8(self, batch: int) -> bool | str | None:
        """``moe_ffn``'s ``int8`` for a batch of ``batch`` tokens (``placement.limits.int8_request``)."""
        return int8_request(batch, self.int8_batch, self.decode)

    def decode_scratch(self, k: int, max_tokens: int = DECODE_TOKENS):
        """(qx, qh) int8 activation scratch of ``routed_ffn`` for decode/verify batches of up to
        ``max_tokens`` tokens with ``k`` experts each (None for a phase that runs float), bound
        once by the callers (the hybrid hand-off, the compiled block). The process setting
        (no ``decode`` mode and no ``int8_batch``) counts as float here: it is read per call."""
        mode = self.int8(max_tokens)
        return routed_int8_scratch(self.weights, max_tokens, k, False if mode is None else mode)

    def handoff(self, device: torch.device, k: int, owned: np.ndarray | None,
                max_tokens: int) -> "RoutedHandoff | None":
        """The bound hand-off for batches of up to ``max_tokens`` tokens coming from ``device``
        with ``k`` experts each, or None where only ``moe_ffn`` covers these experts
        (biases, gpt-oss's GLU: ``routed_ffn`` computes SiLU and DeepSeek-V4's clamped SwiGLU)."""
        if self.act not in ("silu", "swiglu_clamp") or self.biases:
            return None
        return RoutedHandoff(self, device, k, owned, max_tokens)


class RoutedHandoff:
    """The CPU side of one hybrid MoE layer (router on the layer's device, routed experts in
    RAM) for decode/verify batches, bound once: the compiled entry ``routed_ffn_host`` (one
    call per layer and step: grouping, gate·up, down, weighted sum), the experts' quant tags
    and raw views, and host buffers for ``max_tokens`` tokens — x, ids, weights, out and the
    kernel's scratch, int8 activations included where the decode mode takes them. Nothing is allocated per call: ``load`` copies into the buffers, ``run``
    fills ``out`` and returns a preallocated view of its first T rows.

    On CUDA the buffers are pinned and the copies ``non_blocking``; an event recorded on the
    layer's stream after the three device→host copies is waited on before the kernel reads
    them, and the caller's host→device copy of ``out`` is queued on that same stream, so the
    next ``load`` (which waits on the stream again) cannot overwrite ``out`` before it has
    been read. It ran on an H200 (bench/gpu_check.py (b), (d)): docs/gpu.md, "What has run on a
    GPU, and what has not". On the CPU device (``--virtual-gpus``, a CPU block) the copies are plain memcpy
    and it is tested."""

    def __init__(self, experts: CpuExperts, device: torch.device, k: int, owned: np.ndarray | None,
                 max_tokens: int):
        ew = experts.weights
        self.profile, self.name, self.max_tokens, self.k = experts.profile, ew.name, max_tokens, k
        self.n_expert = ew.n_expert
        (gk, gb, g0, _), (uk, ub, u0, _) = ew._parts
        dk, db = ew._down
        self._experts = experts
        qx, qh = experts.decode_scratch(k, max_tokens)
        self._modes = (qx is not None, qh is not None)     # int8 activations of gate·up, of down
        cuda = device.type == "cuda"
        buf = lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=cuda)  # noqa: E731
        m = max_tokens
        x, ids, wts, out = (buf((m, ew.n_embd), torch.float32), buf((m, k), torch.int64),
                            buf((m, k), torch.float32), buf((m, ew.n_embd), torch.float32))
        # views of the first t rows for every t, made now: a call slices nothing
        self._rows = [(x[:t], ids[:t], wts[:t], out[:t]) for t in range(m + 1)]
        self._stream = torch.cuda.current_stream(device) if cuda else None
        self._event = torch.cuda.Event() if cuda else None
        self.owned = own = None if owned is None else np.ascontiguousarray(owned, dtype=np.bool_)
        self._args = (x.numpy(), np.empty((m, ew.n_embd // 16), np.float32), ids.numpy(), wts.numpy(), own,
                      gk.tag, gb, g0, uk.tag, ub, u0, dk.tag, db,
                      np.float32(experts.limit if experts.act == "swiglu_clamp" else 0),    # 0: SiLU
                      routed_scratch(m * k, ew.n_expert, ew.n_ff, ew.n_embd, settings.max_threads()), qx, qh,
                      out.numpy())
        # compile (or load from Numba's cache) now, on an empty batch; calls use the entry point
        self._entry, _ = first_call(routed_ffn_host, (0,) + self._args + (settings.apply_threads(),))

    def takes(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether this batch fits the bound buffers and runs in the activation modes bound
        (float or int8 per phase; ``moe_ffn`` takes the others)."""
        t = x.shape[0]
        if t > self.max_tokens or ids.shape[1] != self.k:
            return False
        return int8_phases(self._experts.weights, self._experts.int8(t)) == self._modes

    def load(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> int:
        """Copy the batch into the host buffers (cast to f32 / int64 on the way); → T."""
        t = x.shape[0]
        xb, ib, wb, _ = self._rows[t]
        xb.copy_(x, non_blocking=True)
        ib.copy_(ids, non_blocking=True)
        wb.copy_(w, non_blocking=True)
        if self._event is not None:            # the kernel reads the buffers next
            self._event.record(self._stream)
            self._event.synchronize()
        return t

    def run(self, t: int) -> torch.Tensor:
        """The routed experts of the loaded batch → a view of ``out``'s first t rows (host;
        called from the worker thread or inline)."""
        with self.profile.time("cpu_experts"):
            n = torch.get_num_threads()     # kept as compiled() keeps it; its call allocates, this path must not
            bad = self._entry(t, *self._args, settings.apply_threads()) < 0
            torch.set_num_threads(n)
            if bad:
                raise ValueError(f"{self.name}: expert id outside 0..{self.n_expert - 1}")
        return self._rows[t][3]


PAGE = mmap.PAGESIZE


def prefault(data: np.ndarray) -> None:
    """Touch one byte per page of a memory-mapped tensor so it is resident now, as
    llama.cpp's MAP_POPULATE does: loading pays for the reads, not the first tokens, and the
    process's RSS holds the CPU weights the plan counted."""
    flat = data.reshape(-1).view(np.uint8)
    int(flat[::PAGE].max())


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_MADV_DONTNEED = 4


def release(data: np.ndarray) -> None:
    """Drop the page-cache mapping of a tensor that now lives on a GPU (llama.cpp unmaps
    such fragments too), so it does not stay in this process's RSS. Only whole pages inside
    the tensor are dropped; the file is read-only, so nothing is lost (Linux only)."""
    if _libc is None or data.nbytes < PAGE:
        return
    start = data.ctypes.data
    first = -(-start // PAGE) * PAGE
    last = (start + data.nbytes) // PAGE * PAGE
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)
