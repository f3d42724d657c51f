"""``moe_ffn``: the routed-expert FFN of one MoE layer for a token batch, from raw GGUF
expert tensors, with tokens grouped by expert.

Grouping is what makes a verify batch cheap on the CPU: every (token, expert) pair is
sorted by expert, so each touched expert's gate/up/down rows are streamed once and
applied to all of that expert's tokens (``rowdot``) — time grows with the number of
distinct experts touched, not with B * k.

``routed_ffn``: the same step for decode/verify batches (SiLU or DeepSeek-V4's clamped
SwiGLU, no biases; float or int8 activations per phase) as one compiled call that writes only
into the caller's arrays (a counting sort instead of argsort; scratch from ``routed_scratch``
and ``routed_int8_scratch``, allocated once): the CPU side of the hybrid hand-off
(``offload.cpu_ops.RoutedHandoff``) and of a compiled block's routed step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from numba import njit, prange

from placement.limits import DECODE_TOKENS, GEMM_MIN_LANES

from . import settings
from .gemm8 import LANES, decode4, pack_tiles, row_buffers, tile4
from .layout import activations, bsums_for, row_cols, weight_bytes
from .registry import get_kernel, source_digest
from .matmul import int8_rows, quantized_activations, use_int8
from .rowdot import dot4
from .rowdot8 import dot4_i8, quantize_rows
from .simd import vlane, vsilu_glu

f32 = np.float32
TOKEN_TILE = 16
# silu and swiglu_clamp (with its limit, swiglu_clamp_exp) run in the fused gate·up phase;
# swiglu_oai and any biased experts beside the kernels (_biased_glu)
ACTIVATIONS = frozenset({"silu", "swiglu_oai", "swiglu_clamp"})
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = f32(1.702), f32(7.0)    # gpt-oss (llama.cpp's constants)


@dataclass(frozen=True, eq=False)
class ExpertWeights:
    """One MoE layer's routed experts as raw GGUF data (``ReaderTensor.data``), in place.

    ``gate``/``up``: ``ffn_gate_exps``/``ffn_up_exps`` [E, n_ff, ...]; or ``gate_up``:
    a fused ``ffn_gate_up_exps`` [E, 2 * n_ff, ...] whose first n_ff rows are the gate.
    ``down``: ``ffn_down_exps`` [E, n_embd, ...]. ``name`` (e.g. "blk.3") goes into errors.
    """

    gate: np.ndarray | None
    up: np.ndarray | None
    down: np.ndarray
    gate_type: GGMLQuantizationType | None
    up_type: GGMLQuantizationType | None
    down_type: GGMLQuantizationType
    gate_up: np.ndarray | None = None
    gate_up_type: GGMLQuantizationType | None = None
    name: str = ""

    def __post_init__(self):
        # Resolve kernels and byte views once; errors name the tensor.
        p = f"{self.name}." if self.name else ""
        down_k = get_kernel(self.down_type, f"{p}ffn_down_exps")
        down_b = weight_bytes(self.down, down_k, 3, f"{p}ffn_down_exps")
        n_expert, n_embd = down_b.shape[:2]
        n_ff = row_cols(down_b.shape[2], down_k)
        if self.gate_up is not None:
            if self.gate is not None or self.up is not None:
                raise ValueError(f"{p}ffn_gate_up_exps given together with separate gate/up")
            gu_k = get_kernel(self.gate_up_type, f"{p}ffn_gate_up_exps")
            gu_b = weight_bytes(self.gate_up, gu_k, 3, f"{p}ffn_gate_up_exps")
            parts = ((gu_k, gu_b, 0, "ffn_gate_up_exps"), (gu_k, gu_b, n_ff, "ffn_gate_up_exps"))
            want_rows = 2 * n_ff
        else:
            if self.gate is None or self.up is None:
                raise ValueError(f"{p}experts need ffn_gate_exps and ffn_up_exps (or ffn_gate_up_exps)")
            g_k = get_kernel(self.gate_type, f"{p}ffn_gate_exps")
            u_k = get_kernel(self.up_type, f"{p}ffn_up_exps")
            parts = ((g_k, weight_bytes(self.gate, g_k, 3, f"{p}ffn_gate_exps"), 0, "ffn_gate_exps"),
                     (u_k, weight_bytes(self.up, u_k, 3, f"{p}ffn_up_exps"), 0, "ffn_up_exps"))
            want_rows = n_ff
        for kern, b, _, tname in parts:
            if b.shape[0] != n_expert or b.shape[1] != want_rows or row_cols(b.shape[2], kern) != n_embd:
                raise ValueError(f"{p}{tname}: raw shape {b.shape} does not match "
                                 f"ffn_down_exps ({n_expert} experts, n_embd {n_embd}, n_ff {n_ff})")
        object.__setattr__(self, "_parts", parts)
        object.__setattr__(self, "_down", (down_k, down_b))
        object.__setattr__(self, "_dims", (n_expert, n_embd, n_ff))

    @property
    def n_expert(self) -> int:
        return self._dims[0]

    @property
    def n_embd(self) -> int:
        return self._dims[1]

    @property
    def n_ff(self) -> int:
        return self._dims[2]


TINY = np.float32(np.finfo(np.float32).tiny)


@njit(error_model="numpy")
def _silu_glu(g, u, clamp):
    """SiLU-gated, silu(g) * u; ``clamp`` > 0 (a float32 limit): DeepSeek-V4's clamped SwiGLU,
    g ≤ limit and |u| ≤ limit first (llama.cpp's order); ``clamp`` 0: none. exp() only of
    non-positive numbers (no overflow under fast-math, which assumes no infinities), and
    results below float32's smallest normal flushed to 0: subnormal activations make every
    FMA of the down projection take a slow microcode path on x86 (seen: 8x slower with silu
    of large negative gates)."""
    if clamp > 0:
        lim = f32(clamp)
        g = min(g, lim)
        u = min(max(u, -lim), lim)
    if g >= 0:
        sg = g / (f32(1) + np.exp(-g))
    elif g > f32(-80):
        e = np.exp(g)
        sg = g * e / (f32(1) + e)
    else:
        sg = f32(0)
    h = sg * u
    return h if abs(h) >= TINY else f32(0)


@njit(nogil=True, cache=True, error_model="numpy")
def phase_pads(pieces):
    """Per-piece scratch of the expert phases, allocated once where a caller keeps it:
    (acc, cacc, gate rows / down rows, up rows, sc, token ids), ``pieces`` rows each."""
    return (np.empty((pieces, TOKEN_TILE * 64), f32), np.empty((pieces, TOKEN_TILE * 4), f32),
            np.empty((pieces, TOKEN_TILE, 4), f32), np.empty((pieces, TOKEN_TILE, 4), f32),
            np.empty((pieces, 64), f32), np.empty((pieces, TOKEN_TILE), np.int64))


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def bsums_of_rows(x, n_rows, out):
    """out[t, g] = sum of x[t, 16 g : 16 g + 16] for rows t < n_rows (``layout.bsums_of`` into a
    preallocated array: the decoders' offsets multiply these)."""
    for t in range(n_rows):
        for g in range(out.shape[1]):
            s = f32(0)
            for c in range(16 * g, 16 * g + 16):
                s += x[t, c]
            out[t, g] = s


@njit(nogil=True, cache=True, error_model="numpy")
def counting_sort_by_expert(n_tok, ids, wts, owned, count, slot_expert, slot_start, assign_tok, assign_w):
    """Counting sort of the (token t < n_tok, j) assignments by expert, stable (token order
    within an expert, as ``moe_ffn``'s argsort); experts outside ``owned`` (bool [E], or None
    for all) are skipped. ``count``: int64 scratch [E + 1]. Fills slot_expert[s] (the s-th
    touched expert), slot_start[s]..slot_start[s + 1] (its assignments), assign_tok/assign_w
    (token and router weight per assignment). Returns the number of slots, or -1 when an id
    is outside 0..E-1 (nothing written past the arrays)."""
    n_expert = count.shape[0] - 1
    k = ids.shape[1]
    count[:] = 0
    for t in range(n_tok):
        for j in range(k):
            e = ids[t, j]
            if e < 0 or e >= n_expert:
                return -1
            keep = True
            if owned is not None:
                keep = owned[e]
            if keep:
                count[e + 1] += 1
    for e in range(n_expert):
        count[e + 1] += count[e]
    n_slots = 0
    for e in range(n_expert):
        if count[e + 1] > count[e]:
            slot_expert[n_slots] = e
            slot_start[n_slots] = count[e]
            n_slots += 1
    slot_start[n_slots] = count[n_expert]
    for t in range(n_tok):
        for j in range(k):
            e = ids[t, j]
            keep = True
            if owned is not None:
                keep = owned[e]
            if keep:
                assign_tok[count[e]] = t
                assign_w[count[e]] = wts[t, j]
                count[e] += 1
    return n_slots


@njit(nogil=True, cache=True, error_model="numpy")
def routed_scratch(n_assign, n_expert, n_ff, n_embd, chunks):
    """Scratch for ``routed_ffn`` with room for ``n_assign`` (token, expert) assignments
    (tokens x k) and ``chunks`` parallel pieces: (count, slot_expert, slot_start, assign_tok,
    assign_w, H, h_bsums, Ya, phase pads). Callable from Python (allocate once, at load) and
    from jitted code."""
    return (np.empty(n_expert + 1, np.int64), np.empty(n_assign, np.int64),
            np.empty(n_assign + 1, np.int64), np.empty(n_assign, np.int64),
            np.empty(n_assign, f32), np.empty((n_assign, n_ff), f32),
            np.empty((n_assign, n_ff // 16), f32), np.empty((n_assign, n_embd), f32),
            phase_pads(max(1, chunks)))


def int8_phases(w: ExpertWeights, int8: bool | str | None) -> tuple[bool, bool]:
    """(gate·up, down): whether each phase over ``w`` takes int8 activations for ``int8``
    (``use_int8`` per weight; gate·up only when gate and up both do)."""
    (gk, _, _, _), (uk, _, _, _) = w._parts
    return use_int8(gk, int8) and use_int8(uk, int8), use_int8(w._down[0], int8)


def routed_int8_scratch(w: ExpertWeights, n_tok: int, k: int, int8: bool | str | None):
    """(qx, qh) for ``routed_ffn`` over ``w`` for up to ``n_tok`` tokens with ``k`` experts
    each: ``int8_rows`` of X (n_tok rows of n_embd) where gate and up both take int8
    activations (``use_int8``), of H (n_tok * k rows of n_ff) where down does; None where
    the phase runs float (as ``moe_ffn`` decides per phase). Allocated here, once: callers
    bind the pair at load."""
    int8_x, int8_h = int8_phases(w, int8)
    return (int8_rows(n_tok, w.n_embd) if int8_x else None,
            int8_rows(n_tok * k, w.n_ff) if int8_h else None)


def _build(salt):
    # Each phase is written once for both activation modes: passing None for the int8
    # arrays makes Numba prune the int8 branch at compile time (and vice versa), so each
    # mode compiles only its own inner routine.

    @njit(parallel=True, nogil=True, cache=True, fastmath=True, error_model="numpy")
    def gate_up_rows(gtag, gw, g0, utag, uw, u0, X, bsums, xq, dx, xs4, dx8, slot_expert, slot_start,
                     assign_tok, H, chunks, clamp, pads):
        """H[a] = silu(gate_e . x) * (up_e . x), clamped first where ``clamp`` > 0 (``_silu_glu``);
        work items = (slot, 4 rows of n_ff).
        X/bsums (float path: xq, dx, xs4, dx8 None) or xq/dx/bsums/xs4/dx8 (int8 path).
        ``pads``: ``phase_pads`` with a row per piece (at least min(chunks, items))."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        n_ff = H.shape[1]
        cols = X.shape[1]
        ges, grs = gw.strides[0], gw.strides[1]
        ues, urs = uw.strides[0], uw.strides[1]
        gwf, uwf = gw.reshape(-1), uw.reshape(-1)      # flat bytes (rowdot.dot4)
        groups = (n_ff + 3) // 4
        items = slot_expert.shape[0] * groups
        pieces = max(1, min(items, chunks))
        for ch in prange(pieces):
            acc, cacc, rg, ru = pads[0][ch], pads[1][ch], pads[2][ch], pads[3][ch]
            sc, toks = pads[4][ch], pads[5][ch]
            for it in range(ch * items // pieces, (ch + 1) * items // pieces):
                s = it // groups
                r0 = 4 * (it % groups)
                e = slot_expert[s]
                nr = min(4, n_ff - r0)
                last = n_ff - 1
                rr1, rr2, rr3 = min(r0 + 1, last), min(r0 + 2, last), min(r0 + 3, last)
                gb = e * ges + g0 * grs
                ub = e * ues + u0 * urs
                for a0 in range(slot_start[s], slot_start[s + 1], TOKEN_TILE):
                    nt = min(TOKEN_TILE, slot_start[s + 1] - a0)
                    # Copied, not sliced: a slice is a new array whose reference count
                    # is an atomic (a full memory fence) per tile.
                    for i in range(nt):
                        toks[i] = assign_tok[a0 + i]
                    if xq is not None:
                        dot4_i8(gtag, gwf, gb + r0 * grs, gb + rr1 * grs, gb + rr2 * grs, gb + rr3 * grs,
                                cols, xq, dx, bsums, xs4, dx8, toks, nt, acc, cacc, rg)
                        dot4_i8(utag, uwf, ub + r0 * urs, ub + rr1 * urs, ub + rr2 * urs, ub + rr3 * urs,
                                cols, xq, dx, bsums, xs4, dx8, toks, nt, acc, cacc, ru)
                    else:
                        dot4(gtag, gwf, gb + r0 * grs, gb + rr1 * grs, gb + rr2 * grs, gb + rr3 * grs,
                             cols, X, bsums, toks, nt, acc, cacc, rg, sc)
                        dot4(utag, uwf, ub + r0 * urs, ub + rr1 * urs, ub + rr2 * urs, ub + rr3 * urs,
                             cols, X, bsums, toks, nt, acc, cacc, ru, sc)
                    for i in range(nt):
                        for r in range(nr):
                            H[a0 + i, r0 + r] = _silu_glu(rg[i, r], ru[i, r], clamp)

    @njit(parallel=True, nogil=True, cache=True, fastmath=True, error_model="numpy")
    def down_rows(dtag, dw, H, h_bsums, hq, hdx, hxs4, hdx8, slot_expert, slot_start, out, chunks, pads):
        """out[a] = down_e . H[a]; work items = (slot, 4 rows of n_embd).
        H/h_bsums (float path: hq, hdx, hxs4, hdx8 None) or hq/hdx/h_bsums/hxs4/hdx8 (int8 path).
        ``pads`` as gate_up_rows'."""
        _salt = salt  # noqa: F841
        n_ff = H.shape[1]
        n_embd = out.shape[1]
        des, drs = dw.strides[0], dw.strides[1]
        dwf = dw.reshape(-1)                           # flat bytes (rowdot.dot4)
        groups = (n_embd + 3) // 4
        items = slot_expert.shape[0] * groups
        pieces = max(1, min(items, chunks))
        for ch in prange(pieces):
            acc, cacc, res, sc, toks = pads[0][ch], pads[1][ch], pads[2][ch], pads[4][ch], pads[5][ch]
            for it in range(ch * items // pieces, (ch + 1) * items // pieces):
                s = it // groups
                r0 = 4 * (it % groups)
                db = slot_expert[s] * des
                nr = min(4, n_embd - r0)
                last = n_embd - 1
                ro1, ro2, ro3 = min(r0 + 1, last), min(r0 + 2, last), min(r0 + 3, last)
                for a0 in range(slot_start[s], slot_start[s + 1], TOKEN_TILE):
                    nt = min(TOKEN_TILE, slot_start[s + 1] - a0)
                    for i in range(nt):
                        toks[i] = a0 + i
                    if hq is not None:
                        dot4_i8(dtag, dwf, db + r0 * drs, db + ro1 * drs, db + ro2 * drs, db + ro3 * drs,
                                n_ff, hq, hdx, h_bsums, hxs4, hdx8, toks, nt, acc, cacc, res)
                    else:
                        dot4(dtag, dwf, db + r0 * drs, db + ro1 * drs, db + ro2 * drs, db + ro3 * drs,
                             n_ff, H, h_bsums, toks, nt, acc, cacc, res, sc)
                    for i in range(nt):
                        for r in range(nr):
                            out[a0 + i, r0 + r] = res[i, r]
    @njit(parallel=True, nogil=True, cache=True, fastmath=True, error_model="numpy")
    def gate_up_gemm_rows(gtag, gw, g0, utag, uw, u0, xq, dx, bsums, xs4, dx8, slot_expert, slot_start,
                          assign_tok, H, chunks, clamp, min_lanes):
        """gate_up_rows' int8 path for a prompt batch: each slot's tokens packed into tiles of
        16 lanes (``gemm8``), a slot's last tile too when it has at least ``min_lanes`` tokens
        (fewer: dot4_i8, token by token); work items = (slot, 4 rows of n_ff)."""
        _salt = salt  # noqa: F841
        n_ff = H.shape[1]
        cols = bsums.shape[1] * 16
        ges, grs = gw.strides[0], gw.strides[1]
        ues, urs = uw.strides[0], uw.strides[1]
        gwf, uwf = gw.reshape(-1), uw.reshape(-1)
        tile_start = slot_tiles(slot_start, min_lanes)
        xt, dt, bt, sx, sd, sb = pack_tiles(xq, dx, bsums, tile_lanes(slot_start, tile_start, assign_tok))
        groups = (n_ff + 3) // 4
        items = slot_expert.shape[0] * groups
        pieces = max(1, min(items, chunks))
        pads = phase_pads(pieces)           # the token routines' scratch (a slot's last few tokens)
        for ch in prange(pieces):
            cwg, sdg, skg = row_buffers(cols)
            cwu, sdu, sku = row_buffers(cols)
            acc, cacc, rg, ru, toks = pads[0][ch], pads[1][ch], pads[2][ch], pads[3][ch], pads[5][ch]
            for it in range(ch * items // pieces, (ch + 1) * items // pieces):
                s = it // groups
                r0 = 4 * (it % groups)
                e = slot_expert[s]
                nr = min(4, n_ff - r0)
                last = n_ff - 1
                rr1, rr2, rr3 = min(r0 + 1, last), min(r0 + 2, last), min(r0 + 3, last)
                gb = e * ges + g0 * grs
                ub = e * ues + u0 * urs
                a_end = slot_start[s + 1]
                a0 = slot_start[s]
                if tile_start[s + 1] > tile_start[s]:
                    decode4(gtag, gwf, gb + r0 * grs, gb + rr1 * grs, gb + rr2 * grs, gb + rr3 * grs, cols,
                            cwg, sdg, skg)
                    decode4(utag, uwf, ub + r0 * urs, ub + rr1 * urs, ub + rr2 * urs, ub + rr3 * urs, cols,
                            cwu, sdu, sku)
                    for j in range(tile_start[s], tile_start[s + 1]):
                        ag = tile4(gtag, cols, cwg, sdg, skg, xt, j * sx, dt, j * sd, bt, j * sb)
                        au = tile4(utag, cols, cwu, sdu, sku, xt, j * sx, dt, j * sd, bt, j * sb)
                        nt = min(LANES, a_end - a0)
                        for r in range(nr):
                            h = vsilu_glu(ag[r], au[r], clamp)
                            for i in range(nt):
                                H[a0 + i, r0 + r] = vlane(h, i)
                        a0 += nt
                if a0 < a_end:               # a slot's last few tokens
                    nt = a_end - a0
                    for i in range(nt):
                        toks[i] = assign_tok[a0 + i]
                    dot4_i8(gtag, gwf, gb + r0 * grs, gb + rr1 * grs, gb + rr2 * grs, gb + rr3 * grs,
                            cols, xq, dx, bsums, xs4, dx8, toks, nt, acc, cacc, rg)
                    dot4_i8(utag, uwf, ub + r0 * urs, ub + rr1 * urs, ub + rr2 * urs, ub + rr3 * urs,
                            cols, xq, dx, bsums, xs4, dx8, toks, nt, acc, cacc, ru)
                    for i in range(nt):
                        for r in range(nr):
                            H[a0 + i, r0 + r] = _silu_glu(rg[i, r], ru[i, r], clamp)

    @njit(parallel=True, nogil=True, cache=True, fastmath=True, error_model="numpy")
    def down_gemm_rows(dtag, dw, hq, hdx, h_bsums, hxs4, hdx8, slot_expert, slot_start, out, chunks, min_lanes):
        """down_rows' int8 path for a prompt batch, tiled as gate_up_gemm_rows."""
        _salt = salt  # noqa: F841
        n_ff = h_bsums.shape[1] * 16
        n_embd = out.shape[1]
        des, drs = dw.strides[0], dw.strides[1]
        dwf = dw.reshape(-1)
        tile_start = slot_tiles(slot_start, min_lanes)
        xt, dt, bt, sx, sd, sb = pack_tiles(hq, hdx, h_bsums, tile_lanes(slot_start, tile_start, None))
        groups = (n_embd + 3) // 4
        items = slot_expert.shape[0] * groups
        pieces = max(1, min(items, chunks))
        pads = phase_pads(pieces)
        for ch in prange(pieces):
            cw, sdr, skr = row_buffers(n_ff)
            acc, cacc, res, toks = pads[0][ch], pads[1][ch], pads[2][ch], pads[5][ch]
            for it in range(ch * items // pieces, (ch + 1) * items // pieces):
                s = it // groups
                r0 = 4 * (it % groups)
                db = slot_expert[s] * des
                nr = min(4, n_embd - r0)
                last = n_embd - 1
                ro1, ro2, ro3 = min(r0 + 1, last), min(r0 + 2, last), min(r0 + 3, last)
                a_end = slot_start[s + 1]
                a0 = slot_start[s]
                if tile_start[s + 1] > tile_start[s]:
                    decode4(dtag, dwf, db + r0 * drs, db + ro1 * drs, db + ro2 * drs, db + ro3 * drs, n_ff,
                            cw, sdr, skr)
                    for j in range(tile_start[s], tile_start[s + 1]):
                        a = tile4(dtag, n_ff, cw, sdr, skr, xt, j * sx, dt, j * sd, bt, j * sb)
                        nt = min(LANES, a_end - a0)
                        for r in range(nr):
                            for i in range(nt):
                                out[a0 + i, r0 + r] = vlane(a[r], i)
                        a0 += nt
                if a0 < a_end:
                    nt = a_end - a0
                    for i in range(nt):
                        toks[i] = a0 + i
                    dot4_i8(dtag, dwf, db + r0 * drs, db + ro1 * drs, db + ro2 * drs, db + ro3 * drs,
                            n_ff, hq, hdx, h_bsums, hxs4, hdx8, toks, nt, acc, cacc, res)
                    for i in range(nt):
                        for r in range(nr):
                            out[a0 + i, r0 + r] = res[i, r]
    return gate_up_rows, down_rows, gate_up_gemm_rows, down_gemm_rows


_gate_up_rows, _down_rows, _gate_up_gemm_rows, _down_gemm_rows = _build(source_digest())


@njit(nogil=True, error_model="numpy")
def slot_tiles(slot_start, min_lanes):
    """tile_start [n_slots + 1]: the GEMM tiles of slot s are tile_start[s] .. tile_start[s + 1]
    - 1: its tokens 16 at a time, a last partial tile only with at least ``min_lanes``."""
    n = slot_start.shape[0] - 1
    out = np.empty(n + 1, np.int64)
    out[0] = 0
    for s in range(n):
        m = slot_start[s + 1] - slot_start[s]
        out[s + 1] = out[s] + m // LANES + (1 if m % LANES >= min_lanes else 0)
    return out


@njit(nogil=True, error_model="numpy")
def tile_lanes(slot_start, tile_start, assign_tok):
    """The rows ``gemm8.pack_lanes`` packs: lane i of slot s's tile j is assignment
    slot_start[s] + 16 (j - tile_start[s]) + i, as its token (``assign_tok``) or itself
    (None); -1 past the slot's end."""
    src = np.full(tile_start[-1] * LANES, -1, np.int64)
    for s in range(slot_start.shape[0] - 1):
        for j in range(tile_start[s], tile_start[s + 1]):
            for i in range(LANES):
                a = slot_start[s] + LANES * (j - tile_start[s]) + i
                if a < slot_start[s + 1]:
                    src[LANES * j + i] = a if assign_tok is None else assign_tok[a]
    return src


def _build_drivers(salt):
    # Jitted callers of the phases carry the digest too: Numba links the phases' code into
    # theirs, and its cache only notices edits to the caller's own file. routed_ffn_host calls
    # routed_ffn as a module global, not a closure variable (see block._build_entries: a
    # closure over a dispatcher misses Numba's cache in every new process).
    global routed_ffn

    @njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
    def gate_up_phase(gtag, gw, g0, utag, uw, u0, X, bsums, xq, dx, xs4, dx8, slot_expert, slot_start,
                      assign_tok, H, chunks, clamp):
        """``gate_up_rows`` with its scratch allocated for this call."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        _gate_up_rows(gtag, gw, g0, utag, uw, u0, X, bsums, xq, dx, xs4, dx8, slot_expert, slot_start,
                      assign_tok, H, chunks, clamp, phase_pads(max(1, chunks)))

    @njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
    def down_phase(dtag, dw, H, h_bsums, hq, hdx, hxs4, hdx8, slot_expert, slot_start, out, chunks):
        """``down_rows`` with its scratch allocated for this call."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        _down_rows(dtag, dw, H, h_bsums, hq, hdx, hxs4, hdx8, slot_expert, slot_start, out, chunks,
                   phase_pads(max(1, chunks)))

    @njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
    def routed_ffn(n_tok, X, bsums, ids, wts, owned, tg, wg, g0, tu, wu, u0, td, wd, clamp, scratch, qx, qh, Y,
                   chunks):
        """Y[t] = sum_j wts[t, j] * down_e(silu(gate_e . X[t]) * (up_e . X[t])), e = ids[t, j],
        for rows t < n_tok, over the experts in ``owned`` (None: all): the routed part of an MoE
        layer (``clamp``, a float32: 0 for SiLU, a limit > 0 for DeepSeek-V4's clamped SwiGLU,
        ``_silu_glu``; no biases) as one compiled step, everything written into the caller's
        arrays — grouping by expert, the gate·up phase, the down phase, the weighted sum in
        ``moe_ffn``'s order (assignments sorted by expert).

        X (>= n_tok, n_embd) and ``bsums`` its ``bsums_of`` rows; ids int64 / wts float32 (>= n_tok,
        k); tg/wg/g0, tu/wu/u0, td/wd: ``ExpertWeights._parts`` / ``_down`` (QTag, raw view, first
        row); ``scratch`` from ``routed_scratch`` for >= n_tok * k assignments (its pads bound
        the parallel pieces); ``qx`` / ``qh``: ``routed_int8_scratch``'s pair — int8 activations
        of X for the gate·up phase / of H for the down phase (quantized here, as ``moe_ffn``
        does), or None for float activations (Numba prunes the other branch); Y (>= n_tok,
        n_embd). Returns the number of touched experts, or -1 (Y untouched) for an id outside
        0..E-1. Rows past n_tok are neither read nor written."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        count, slot_expert, slot_start, assign_tok, assign_w, H, h_bsums, Ya, pads = scratch
        chunks = max(1, min(chunks, pads[0].shape[0]))
        n_slots = counting_sort_by_expert(n_tok, ids, wts, owned, count, slot_expert, slot_start,
                                          assign_tok, assign_w)
        if n_slots < 0:
            return n_slots
        Y[:n_tok] = 0
        if n_slots == 0:
            return 0
        n_a = slot_start[n_slots]
        se, ss = slot_expert[:n_slots], slot_start[:n_slots + 1]
        if qx is not None:
            xq, dx, qs16, xs4, dx8 = qx
            quantize_rows(X[:n_tok], xq, dx, qs16, xs4, dx8)
            _gate_up_rows(tg, wg, g0, tu, wu, u0, X, qs16, xq, dx, xs4, dx8, se, ss, assign_tok, H,
                          chunks, clamp, pads)
        else:
            _gate_up_rows(tg, wg, g0, tu, wu, u0, X, bsums, None, None, None, None, se, ss, assign_tok, H,
                          chunks, clamp, pads)
        if qh is not None:
            hq, hdx, qhs16, hxs4, hdx8 = qh
            quantize_rows(H[:n_a], hq, hdx, qhs16, hxs4, hdx8)
            _down_rows(td, wd, H, qhs16, hq, hdx, hxs4, hdx8, se, ss, Ya, chunks, pads)
        else:
            bsums_of_rows(H, n_a, h_bsums)
            _down_rows(td, wd, H, h_bsums, None, None, None, None, se, ss, Ya, chunks, pads)
        n_embd = Y.shape[1]
        for a in range(n_a):
            t = assign_tok[a]
            wa = assign_w[a]
            for c in range(n_embd):
                Y[t, c] += wa * Ya[a, c]
        return n_slots

    @njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
    def routed_ffn_host(n_tok, X, bsums, ids, wts, owned, tg, wg, g0, tu, wu, u0, td, wd, clamp, scratch, qx, qh,
                        Y, chunks):
        """``routed_ffn`` with ``bsums`` computed here: the CPU side of a hybrid MoE layer (block
        on a GPU, experts in RAM) as one compiled call over host buffers bound at load."""
        _salt = salt  # noqa: F841  (cache key: see registry.source_digest)
        if qx is None:
            bsums_of_rows(X, n_tok, bsums)
        return routed_ffn(n_tok, X, bsums, ids, wts, owned, tg, wg, g0, tu, wu, u0, td, wd, clamp, scratch, qx,
                          qh, Y, chunks)

    return gate_up_phase, down_phase, routed_ffn, routed_ffn_host


_gate_up_phase, _down_phase, routed_ffn, routed_ffn_host = _build_drivers(source_digest())


@njit(nogil=True, cache=True, fastmath=True, error_model="numpy")
def _weighted_sum(out, assign_tok, assign_w, Y):
    """Y[t] += w_a * out[a] for every assignment a of token t (one token's assignments
    sit in different slots, so this runs after the expert phases)."""
    for a in range(out.shape[0]):
        Y[assign_tok[a]] += assign_w[a] * out[a]


def swiglu_oai(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """gpt-oss's clamped GLU: g ≤ limit, |u| ≤ limit, (u + 1) · g · σ(α·g). float32, in place:
    the result is ``g`` and ``u`` is overwritten (one temporary beside them: placement.compute
    counts three)."""
    g = np.minimum(g, SWIGLU_OAI_LIMIT, out=g)
    u = np.clip(u, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT, out=u)
    s = np.multiply(g, -SWIGLU_OAI_ALPHA, dtype=f32)
    with np.errstate(over="ignore"):           # exp(+large) = inf: σ → 0, as it should
        np.exp(s, out=s)
    s += f32(1)
    u += f32(1)
    np.divide(g, s, out=g)
    return np.multiply(g, u, out=g)


def _project(kern, raw, row0: int, n_rows: int, A_in, slot_expert, slot_start, n_threads, int8=None):
    """(A, n_rows): rows row0.. of each assignment's expert matrix times its row of A_in —
    the grouped down-projection kernel applied to another matrix."""
    if use_int8(kern, int8):
        q, dq, bsums, s4, d8 = quantized_activations(A_in)
    else:
        q, dq, bsums, s4, d8 = None, None, bsums_for(A_in, kern), None, None
    out = np.empty((A_in.shape[0], n_rows), f32)
    view = raw if row0 == 0 and raw.shape[1] == n_rows else raw[:, row0:row0 + n_rows]
    if q is not None and A_in.shape[0] > DECODE_TOKENS:        # a prompt batch: the GEMM
        _down_gemm_rows(kern.tag, view, q, dq, bsums, s4, d8, slot_expert, slot_start, out, n_threads,
                        GEMM_MIN_LANES)
    else:
        _down_phase(kern.tag, view, A_in, bsums, q, dq, s4, d8, slot_expert, slot_start, out, n_threads)
    return out


def _biased_glu(w, X, tok, flat, slot_expert, slot_start, n_threads, act, gate_bias, up_bias, int8=None,
                limit=None):
    """H for an activation or biases the fused gate/up phase does not do: gate and up
    projected separately, biased per expert, then the activation in numpy."""
    (gk, gb, g0, _), (uk, ub, u0, _) = w._parts
    Xa = np.ascontiguousarray(X[tok])                                 # one row per assignment
    g = _project(gk, gb, g0, w.n_ff, Xa, slot_expert, slot_start, n_threads, int8)
    u = _project(uk, ub, u0, w.n_ff, Xa, slot_expert, slot_start, n_threads, int8)
    if gate_bias is not None:
        g += gate_bias[flat]
    if up_bias is not None:
        u += up_bias[flat]
    if act == "swiglu_oai":
        return swiglu_oai(g, u)
    if act == "swiglu_clamp":    # DeepSeek-V4 (llama.cpp's order): silu(min(g, limit)) · clamp(u, ±limit)
        np.minimum(g, f32(limit), out=g)
        np.clip(u, -f32(limit), f32(limit), out=u)
    with np.errstate(over="ignore"):
        return (g / (f32(1) + np.exp(-g)) * u).astype(f32)


def _bias(b, rows: int, w: ExpertWeights, what: str):
    if b is None:
        return None
    b = np.asarray(b, dtype=f32)
    if b.shape != (w.n_expert, rows):
        raise ValueError(f"{w.name}: {what} bias of shape {b.shape}, expected ({w.n_expert}, {rows})")
    return b


def moe_ffn(x, expert_ids, expert_weights, w: ExpertWeights, *, owned=None, act: str = "silu",
            gate_bias=None, up_bias=None, down_bias=None, int8: bool | str | None = None,
            limit: float | None = None):
    """Sum over the k routed experts of each token of ``weight * down(act(gate(x)) * up(x))``.
    ``act``: "silu" (silu(g)·u), "swiglu_oai" (gpt-oss's clamped GLU) or "swiglu_clamp"
    (DeepSeek-V4's, clamped at ``limit``); ``gate_bias`` /
    ``up_bias`` [E, n_ff] and ``down_bias`` [E, n_embd]: per-expert biases added to each
    projection (gpt-oss), or None.

    x: float32 [B, n_embd]; expert_ids: int [B, k]; expert_weights: float32 [B, k]
    (already normalised/scaled by the router). owned: bool [E] or None (= all experts):
    experts not owned contribute nothing here (the caller adds them, e.g. GPU experts).
    int8: int8 activations for this call, per phase (``matmul.use_int8``: True/False, "auto"
    per weight type, None: the process setting).
    Returns float32 [B, n_embd]. The compiled phases run with the GIL released.
    """
    if act not in ACTIVATIONS:
        raise ValueError(f"{w.name}: unknown expert activation {act!r}; supported: {sorted(ACTIVATIONS)}")
    if (act == "swiglu_clamp") != (limit is not None):
        raise ValueError(f"{w.name}: a clamp limit goes with swiglu_clamp only (act {act!r}, limit {limit})")
    X = activations(x, w.n_embd, f"{w.name} moe_ffn x")
    B = X.shape[0]
    ids = np.asarray(expert_ids)
    wts = np.asarray(expert_weights, dtype=np.float32)
    if ids.ndim != 2 or ids.shape[0] != B or wts.shape != ids.shape:
        raise ValueError(f"{w.name}: expert_ids {ids.shape} / expert_weights {wts.shape} "
                         f"must both be [B={B}, k]")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{w.name}: expert_ids must be integers, got {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= w.n_expert):
        raise ValueError(f"{w.name}: expert id outside 0..{w.n_expert - 1}")
    gate_bias, up_bias = _bias(gate_bias, w.n_ff, w, "gate"), _bias(up_bias, w.n_ff, w, "up")
    down_bias = _bias(down_bias, w.n_embd, w, "down")
    Y = np.zeros((B, w.n_embd), f32)

    # Group (token, expert) pairs by expert: a stable sort keeps token order per expert.
    flat = ids.reshape(-1).astype(np.int64)
    tok = np.repeat(np.arange(B, dtype=np.int64), ids.shape[1])
    keep = np.ones(flat.shape, bool)
    if owned is not None:
        owned = np.asarray(owned, dtype=bool)
        if owned.shape != (w.n_expert,):
            raise ValueError(f"{w.name}: owned mask of shape {owned.shape}, expected ({w.n_expert},)")
        keep = owned[flat]
    flat, tok, wsel = flat[keep], tok[keep], wts.reshape(-1)[keep]
    if flat.size == 0:
        return Y
    order = np.argsort(flat, kind="stable")
    flat, tok, wsel = flat[order], tok[order], np.ascontiguousarray(wsel[order])
    first = np.flatnonzero(np.r_[True, flat[1:] != flat[:-1]])
    slot_expert = flat[first]
    slot_start = np.r_[first, flat.size].astype(np.int64)

    (gk, gb, g0, _), (uk, ub, u0, _) = w._parts
    dk, db = w._down
    n_threads = settings.apply_threads()
    int8_x, int8_h = int8_phases(w, int8)
    if act == "swiglu_oai" or gate_bias is not None or up_bias is not None:
        H = _biased_glu(w, X, tok, flat, slot_expert, slot_start, n_threads, act, gate_bias, up_bias, int8,
                        limit)
    else:
        H = np.empty((flat.size, w.n_ff), f32)
        if int8_x:
            xq, dx, bsums, xs4, dx8 = quantized_activations(X)
        else:
            xq, dx, bsums, xs4, dx8 = None, None, bsums_for(X, gk, uk), None, None
        # the fused phase's clamp: 0 for SiLU, the limit for the clamped SwiGLU; float32 either
        # way, as routed_ffn passes it (one compiled gate_up_rows per weight types and mode)
        clamp = f32(limit if act == "swiglu_clamp" else 0)
        if int8_x and B > DECODE_TOKENS:
            _gate_up_gemm_rows(gk.tag, gb, g0, uk.tag, ub, u0, xq, dx, bsums, xs4, dx8, slot_expert, slot_start,
                               tok, H, n_threads, clamp, GEMM_MIN_LANES)
        else:
            _gate_up_phase(gk.tag, gb, g0, uk.tag, ub, u0, X, bsums, xq, dx, xs4, dx8, slot_expert, slot_start,
                           tok, H, n_threads, clamp)
    if int8_h:
        hq, hdx, h_bsums, hxs4, hdx8 = quantized_activations(H)
    else:
        hq, hdx, h_bsums, hxs4, hdx8 = None, None, bsums_for(H, dk), None, None
    out = np.empty((flat.size, w.n_embd), f32)
    if int8_h and B > DECODE_TOKENS:
        _down_gemm_rows(dk.tag, db, hq, hdx, h_bsums, hxs4, hdx8, slot_expert, slot_start, out, n_threads,
                        GEMM_MIN_LANES)
    else:
        _down_phase(dk.tag, db, H, h_bsums, hq, hdx, hxs4, hdx8, slot_expert, slot_start, out, n_threads)
    if down_bias is not None:
        out += down_bias[flat]
    _weighted_sum(out, tok, wsel, Y)
    return Y
