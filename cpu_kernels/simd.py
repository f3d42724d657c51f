"""Explicit SIMD for Numba kernels: a 16-lane float32 vector type and the few operations
the quant kernels need, written as portable LLVM vector IR (no x86 intrinsics).

A 16-lane vector maps to one AVX-512 register; on AVX2 or NEON, LLVM splits it.

Why not rely on auto-vectorization: Numba widens small integers to int64 and cannot
prove that output arrays do not alias the weights, so LLVM either leaves decode loops
scalar or reduces every 32-weight block horizontally. With an explicit vector type the
decoded weights of a block stay in registers as SSA values, accumulators stay vectors
for a whole row, and one decoded block serves every token of a batch.

All loads take an array plus a *byte* offset into its data (weights are raw GGUF bytes,
read in place). Nothing here checks bounds: callers index within the arrays they own.
"""
from __future__ import annotations

import operator

import llvmlite.binding as _ll
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

LANES = 16

_F32 = ir.FloatType()
_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_VF = ir.VectorType(_F32, LANES)
_VI32 = ir.VectorType(_I32, LANES)


class FVec(types.Type):
    """Numba type of a LANES-wide float32 vector (LLVM ``<16 x float>``)."""

    def __init__(self):
        super().__init__(name=f"f32x{LANES}")


fvec = FVec()


@register_model(FVec)
class _FVecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


# ---------------------------------------------------------------- IR helpers

def _fast(instr):
    # Reassociation lets LLVM fuse mul+add into FMA and reduce in any order: the kernels
    # accept float32 rounding differences (tested against float64 references).
    instr.flags.append("fast")
    return instr


def _byte_ptr(context, builder, aryty, ary, off, offty):
    """i8* to byte ``off`` of an array's data."""
    arr = context.make_array(aryty)(context, builder, ary)
    base = builder.bitcast(arr.data, _I8.as_pointer())
    off = context.cast(builder, off, offty, types.intp)
    return builder.gep(base, [off])


def _load_vec(builder, ptr, elty, n=LANES):
    vty = ir.VectorType(elty, n)
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def _splat(builder, val, vty):
    undef = ir.Constant(vty, ir.Undefined)
    v = builder.insert_element(undef, val, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(_VI32, [0] * vty.count))


def _const_vec(elty, values):
    return ir.Constant(ir.VectorType(elty, len(values)), list(values))


def _is_int(t):
    return isinstance(t, types.Integer)


def _is_array(t):
    return isinstance(t, types.Array)


# ---------------------------------------------------------------- construction

@intrinsic
def vzero(typingctx):
    """All-zero vector."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [0.0] * LANES)
    return fvec(), codegen


@intrinsic
def vsplat(typingctx, x):
    """Broadcast a scalar to all lanes."""
    if not isinstance(x, (types.Float, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return _splat(builder, v, _VF)
    return fvec(x), codegen


@intrinsic
def vset2(typingctx, a, b):
    """Lanes (a, b, 0, 0, ...)."""
    if not (isinstance(a, (types.Float, types.Integer)) and isinstance(b, (types.Float, types.Integer))):
        return None

    def codegen(context, builder, sig, args):
        v = ir.Constant(_VF, [0.0] * LANES)
        for i in range(2):
            x = context.cast(builder, args[i], sig.args[i], types.float32)
            v = builder.insert_element(v, x, ir.Constant(_I32, i))
        return v
    return fvec(a, b), codegen


# ---------------------------------------------------------------- loads

@intrinsic
def vload(typingctx, arr, idx):
    """Lanes ``arr[idx : idx + LANES]`` of a 1-D float32 array (element index)."""
    if not (_is_array(arr) and arr.dtype == types.float32 and _is_int(idx)):
        return None

    def codegen(context, builder, sig, args):
        off = builder.mul(context.cast(builder, args[1], sig.args[1], types.intp),
                          ir.Constant(_I64, 4))
        p = _byte_ptr(context, builder, sig.args[0], args[0], off, types.intp)
        return _load_vec(builder, p, _F32)
    return fvec(arr, idx), codegen


@intrinsic
def vstore(typingctx, arr, idx, v):
    """``arr[idx : idx + LANES] = v`` for a 1-D float32 array."""
    if not (_is_array(arr) and arr.dtype == types.float32 and _is_int(idx) and v == fvec):
        return None

    def codegen(context, builder, sig, args):
        off = builder.mul(context.cast(builder, args[1], sig.args[1], types.intp),
                          ir.Constant(_I64, 4))
        p = _byte_ptr(context, builder, sig.args[0], args[0], off, types.intp)
        builder.store(args[2], builder.bitcast(p, _VF.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(arr, idx, v), codegen


def _field8(context, builder, sig, args, i):
    """(bytes[off + l] >> shift) & mask for l < LANES, as <LANES x i8>; args[i:i+3] are
    (off, shift, mask) after the array at args[0]. Byte lanes keep the shifts and masks
    on narrow registers (cheap ports); only the final value is widened."""
    p = _byte_ptr(context, builder, sig.args[0], args[0], args[i], sig.args[i])
    b = _load_vec(builder, p, _I8)
    sh = builder.trunc(context.cast(builder, args[i + 1], sig.args[i + 1], types.int32), _I8)
    mk = builder.trunc(context.cast(builder, args[i + 2], sig.args[i + 2], types.int32), _I8)
    v8 = ir.VectorType(_I8, LANES)
    return builder.and_(builder.lshr(b, _splat(builder, sh, v8)), _splat(builder, mk, v8))


@intrinsic
def vbits(typingctx, arr, off, shift, mask):
    """Lanes ``float((bytes[off + l] >> shift) & mask)``: nibbles, 2-bit fields and single
    bits of consecutive bytes (``shift`` < 8 and ``mask`` < 256; constants in practice)."""
    if not (_is_array(arr) and _is_int(off) and _is_int(shift) and _is_int(mask)):
        return None

    def codegen(context, builder, sig, args):
        return builder.uitofp(builder.zext(_field8(context, builder, sig, args, 1), _VI32), _VF)
    return fvec(arr, off, shift, mask), codegen


@intrinsic
def vbits2(typingctx, arr, off_a, shift_a, mask_a, off_b, shift_b, mask_b, up_b):
    """Lanes ``float(A | (B << up_b))`` with A, B bit fields as in ``vbits`` (at bytes
    ``off_a + l`` and ``off_b + l``): the 5- and 6-bit quants whose high bits live in a
    separate array (Q5_K's qh, Q6_K's qh, Q3_K's hmask). The result must fit in 8 bits."""
    ints = (off_a, shift_a, mask_a, off_b, shift_b, mask_b, up_b)
    if not (_is_array(arr) and all(_is_int(t) for t in ints)):
        return None

    def codegen(context, builder, sig, args):
        a = _field8(context, builder, sig, args, 1)
        b = _field8(context, builder, sig, args, 4)
        up = builder.trunc(context.cast(builder, args[7], sig.args[7], types.int32), _I8)
        q = builder.or_(a, builder.shl(b, _splat(builder, up, ir.VectorType(_I8, LANES))))
        return builder.uitofp(builder.zext(q, _VI32), _VF)
    return fvec(arr, *ints), codegen


def byte_fields(a_idx, a_shift, a_mask, b_idx=None, b_shift=None, b_mask=None, b_up=None):
    """Make ``f(arr, off)``: lane L = ((byte[off + a_idx[L]] >> a_shift[L]) & a_mask[L]) |
    (((byte[off + b_idx[L]] >> b_shift[L]) & b_mask[L]) << b_up[L]) as float32, from one
    16-byte load and constant shuffles. Unpacks packed scale arrays (Q4_K's 6-bit scales
    and mins, Q3_K's, IQ4_XS's) into one vector per block. Reads 16 bytes at ``off``."""
    def const(vals):
        return ir.Constant(_VI32, [int(v) for v in vals])
    lanes = [a_idx, a_shift, a_mask] + ([b_idx, b_shift, b_mask, b_up] if b_idx is not None else [])
    if any(len(t) != LANES for t in lanes) or max(a_idx) >= 16 or (b_idx is not None and max(b_idx) >= 16):
        raise ValueError("byte_fields: one entry per lane, byte indices < 16")

    @intrinsic
    def fields(typingctx, arr, off):
        if not (_is_array(arr) and _is_int(off)):
            return None

        def codegen(context, builder, sig, args):
            p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            raw = _load_vec(builder, p, _I8, 16)
            undef = ir.Constant(ir.VectorType(_I8, 16), ir.Undefined)

            def field(idx, sh, mk):
                v = builder.shuffle_vector(raw, undef, const(idx))
                return builder.and_(builder.lshr(builder.zext(v, _VI32), const(sh)), const(mk))
            q = field(a_idx, a_shift, a_mask)
            if b_idx is not None:
                q = builder.or_(q, builder.shl(field(b_idx, b_shift, b_mask), const(b_up)))
            return builder.uitofp(q, _VF)
        return fvec(arr, off), codegen
    return fields


@intrinsic
def vi8(typingctx, arr, off):
    """Lanes ``float(int8 bytes[off + l])``."""
    if not (_is_array(arr) and _is_int(off)):
        return None

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.sitofp(_load_vec(builder, p, _I8), _VF)
    return fvec(arr, off), codegen


@intrinsic
def vf32(typingctx, arr, off):
    """Lanes of little-endian float32 values starting at byte ``off``."""
    if not (_is_array(arr) and _is_int(off)):
        return None

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return _load_vec(builder, p, _F32)
    return fvec(arr, off), codegen


@intrinsic
def vf16(typingctx, arr, off):
    """Lanes of IEEE half values starting at byte ``off`` (one vcvtph2ps with F16C)."""
    if not (_is_array(arr) and _is_int(off)):
        return None

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return builder.fpext(_load_vec(builder, p, ir.HalfType()), _VF)
    return fvec(arr, off), codegen


@intrinsic
def vbf16(typingctx, arr, off):
    """Lanes of bfloat16 values starting at byte ``off`` (bits << 16)."""
    if not (_is_array(arr) and _is_int(off)):
        return None

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        v = builder.zext(_load_vec(builder, p, _I16), _VI32)
        v = builder.shl(v, _splat(builder, ir.Constant(_I32, 16), _VI32))
        return builder.bitcast(v, _VF)
    return fvec(arr, off), codegen


@intrinsic
def vbit_lanes(typingctx, word, start):
    """Lanes ``float((word >> (start + l)) & 1)``: the 5th bit of Q5_0/Q5_1 weights,
    kept as one 32-bit word per block."""
    if not (_is_int(word) and _is_int(start)):
        return None

    def codegen(context, builder, sig, args):
        w = context.cast(builder, args[0], sig.args[0], types.uint32)
        s = context.cast(builder, args[1], sig.args[1], types.int32)
        sh = builder.add(_splat(builder, s, _VI32), _const_vec(_I32, range(LANES)))
        b = builder.and_(builder.lshr(_splat(builder, w, _VI32), sh),
                         _splat(builder, ir.Constant(_I32, 1), _VI32))
        return builder.uitofp(b, _VF)
    return fvec(word, start), codegen


def target_features() -> str:
    """The LLVM feature string Numba compiles for ("+avx512f,+gfni,-amx-tile,..."); the
    intrinsics pick their instructions from it, so they always match the target:
    NUMBA_CPU_FEATURES if set; none (portable IR only) if just NUMBA_CPU_NAME is set;
    else the host CPU's features as Numba's own code generator sees them (which honours
    NUMBA_ENABLE_AVX=0). Numba's on-disk cache is keyed by (triple, CPU name, this
    string), so machine code compiled on one CPU is never loaded on another."""
    from numba.core import codegen, config
    if config.CPU_FEATURES is not None:
        return config.CPU_FEATURES
    return "" if config.CPU_NAME else codegen.get_host_cpu_features()


def target_has(*names: str) -> bool:
    """Whether the compile target has every feature in ``names`` ("gfni", "avx512bw")."""
    on = {f[1:] for f in target_features().split(",") if f.startswith("+")}
    return all(n in on for n in names)


@intrinsic
def vlut16(typingctx, arr, off, shift, table):
    """Lanes ``table[(bytes[off + l] >> shift) & 15]`` for a 16-entry table held in a
    vector (IQ4_NL's non-linear grid, MXFP4's e2m1 values, Q4_0's signed nibbles): one
    ``vpermps`` with AVX-512 (it reads only an index's low 4 bits: that is the mask); two
    8-lane ``vpermps`` and a blend per 8 lanes with AVX2; elsewhere a gather."""
    if not (_is_array(arr) and _is_int(off) and _is_int(shift) and table == fvec):
        return None

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        sh = context.cast(builder, args[2], sig.args[2], types.int32)
        idx = builder.lshr(builder.zext(_load_vec(builder, p, _I8), _VI32), _splat(builder, sh, _VI32))
        tab = args[3]
        if target_has("avx512f"):          # vpermps reads only bits 0..3 of each index
            fnty = ir.FunctionType(_VF, [_VF, _VI32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.permvar.sf.512")
            return builder.call(fn, [tab, idx])
        if target_has("avx2") and LANES == 16:
            # vpermps ymm reads bits 0..2: look the index up in both 8-entry halves of the
            # table and keep the one bit 3 picks (a gather was ~5x slower on Zen 3)
            v8f, v8i = ir.VectorType(_F32, 8), ir.VectorType(_I32, 8)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8f, [v8f, v8i]),
                                                "llvm.x86.avx2.permps")
            t_lo = builder.shuffle_vector(tab, tab, ir.Constant(ir.VectorType(_I32, 8), list(range(8))))
            t_hi = builder.shuffle_vector(tab, tab, ir.Constant(ir.VectorType(_I32, 8), list(range(8, 16))))
            eight = ir.Constant(v8i, [8] * 8)
            halves = []
            for h in (0, 1):
                i8 = builder.shuffle_vector(idx, idx, ir.Constant(ir.VectorType(_I32, 8), list(range(8 * h, 8 * h + 8))))
                hi = builder.icmp_unsigned("!=", builder.and_(i8, eight), ir.Constant(v8i, [0] * 8))
                halves.append(builder.select(hi, builder.call(fn, [t_hi, i8]), builder.call(fn, [t_lo, i8])))
            return builder.shuffle_vector(halves[0], halves[1], ir.Constant(_VI32, list(range(16))))
        n = builder.and_(idx, _splat(builder, ir.Constant(_I32, 15), _VI32))
        slot = cgutils.alloca_once(builder, _VF)
        builder.store(tab, slot)
        base = builder.bitcast(slot, _F32.as_pointer())
        vptr = ir.VectorType(_F32.as_pointer(), LANES)
        ptrs = builder.inttoptr(
            builder.add(_splat(builder, builder.ptrtoint(base, _I64), ir.VectorType(_I64, LANES)),
                        builder.shl(builder.zext(n, ir.VectorType(_I64, LANES)),
                                    _splat(builder, ir.Constant(_I64, 2), ir.VectorType(_I64, LANES)))),
            vptr)
        fnty = ir.FunctionType(_VF, [vptr, _I32, ir.VectorType(ir.IntType(1), LANES), _VF])
        fn = cgutils.get_or_insert_function(builder.module, fnty,
                                            f"llvm.masked.gather.v{LANES}f32.v{LANES}p0")
        mask = ir.Constant(ir.VectorType(ir.IntType(1), LANES), [1] * LANES)
        return builder.call(fn, [ptrs, ir.Constant(_I32, 4), mask, ir.Constant(_VF, ir.Undefined)])
    return fvec(arr, off, shift, table), codegen


@intrinsic
def prefetch(typingctx, arr, off):
    """Hint that byte ``off`` of ``arr`` will be read soon (llvm.prefetch: a no-op where
    the target has none). Prefetches never fault, so ``off`` may point past the end."""
    if not (_is_array(arr) and _is_int(off)):
        return None

    def codegen(context, builder, sig, args):
        arr_ = context.make_array(sig.args[0])(context, builder, args[0])
        addr = builder.add(builder.ptrtoint(arr_.data, _I64),
                           context.cast(builder, args[1], sig.args[1], types.intp))
        fnty = ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [builder.inttoptr(addr, _I8.as_pointer()), ir.Constant(_I32, 0),
                          ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.none(arr, off), codegen


# ---------------------------------------------------------------- scalar loads

def _scalar_load(elty, nbty):
    @intrinsic
    def load(typingctx, arr, off):
        if not (_is_array(arr) and _is_int(off)):
            return None

        def codegen(context, builder, sig, args):
            p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            return builder.load(builder.bitcast(p, elty.as_pointer()), align=1)
        return nbty(arr, off), codegen
    return load


ld_u8 = _scalar_load(_I8, types.uint8)
ld_u16 = _scalar_load(_I16, types.uint16)
ld_u32 = _scalar_load(_I32, types.uint32)


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose IEEE bits are ``bits`` (e.g. MXFP4's e8m0 scale)."""
    if not _is_int(bits):
        return None

    def codegen(context, builder, sig, args):
        b = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(b, _F32)
    return types.float32(bits), codegen


# ---------------------------------------------------------------- scalar stores (KV cache)

def _scalar_store(convert):
    @intrinsic
    def store(typingctx, arr, off, x):
        """Write float32 ``x`` at byte ``off`` of ``arr`` in the element format."""
        if not (_is_array(arr) and _is_int(off) and x == types.float32):
            return None

        def codegen(context, builder, sig, args):
            p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            v = convert(builder, args[2])
            builder.store(v, builder.bitcast(p, v.type.as_pointer()), align=1)
            return context.get_dummy_value()
        return types.none(arr, off, x), codegen
    return store


@intrinsic
def st_u8(typingctx, arr, off, x):
    """Write the low byte of integer ``x`` at byte ``off`` of ``arr`` (any rank: raw cache bytes)."""
    if not (_is_array(arr) and _is_int(off) and _is_int(x)):
        return None

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        builder.store(builder.trunc(args[2], _I8) if args[2].type.width > 8 else args[2], p, align=1)
        return context.get_dummy_value()
    return types.none(arr, off, x), codegen


def _to_bf16(builder, x):
    """float32 -> bfloat16 bits, round to nearest even, NaN kept NaN (as torch converts)."""
    b = builder.bitcast(x, _I32)
    lsb = builder.and_(builder.lshr(b, ir.Constant(_I32, 16)), ir.Constant(_I32, 1))
    r = builder.lshr(builder.add(b, builder.add(lsb, ir.Constant(_I32, 0x7FFF))), ir.Constant(_I32, 16))
    nan = builder.fcmp_unordered("uno", x, x)
    return builder.trunc(builder.select(nan, ir.Constant(_I32, 0x7FC0), r), _I16)


st_f32 = _scalar_store(lambda builder, x: x)
st_f16 = _scalar_store(lambda builder, x: builder.fptrunc(x, ir.HalfType()))   # IEEE round to nearest even
st_bf16 = _scalar_store(_to_bf16)


# Scale tables: an f16's float32 value (ggml's 65,536-entry table), and MXFP4's e8m0 byte
# as ggml's e8m0_to_fp32_half: 2**(e - 128) (subnormal for e < 2). One copy per process:
# compiled code refers to them as external symbols (their addresses are registered with
# the JIT's linker here, before any kernel is compiled or loaded from Numba's cache), so
# cached kernels do not each carry 256 KB of table.
_F16_TABLE = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
_E8M0_TABLE = np.ldexp(np.float64(1), np.arange(256) - 128).astype(np.float32)
_TABLES = {"offload_f16_to_f32": _F16_TABLE, "offload_e8m0_half_to_f32": _E8M0_TABLE}
for _name, _values in _TABLES.items():
    _ll.add_symbol(_name, _values.ctypes.data)


def _table(module, name):
    """The table ``name`` (see _TABLES) as an external global of ``module``."""
    try:
        return module.get_global(name)
    except KeyError:
        g = ir.GlobalVariable(module, ir.ArrayType(_F32, len(_TABLES[name])), name)
        g.linkage = "external"
        g.global_constant = True
        return g


def _ld_table(builder, p, name="offload_f16_to_f32", ity=_I16):
    """Table ``name``'s float32 entry for the ``ity`` code at pointer p (an f16's value)."""
    tab = _table(builder.module, name)
    i = builder.zext(builder.load(builder.bitcast(p, ity.as_pointer()), align=1), _I64)
    return builder.load(builder.gep(tab, [ir.Constant(_I64, 0), i]), align=4)


@intrinsic
def ld_f16(typingctx, arr, off):
    """The IEEE half at byte ``off`` as float32, through ggml's 65,536-entry table: two
    loads instead of a conversion (and a broadcast of the result is one more load)."""
    if not (_is_array(arr) and _is_int(off)):
        return None

    def codegen(context, builder, sig, args):
        return _ld_table(builder, _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]))
    return types.float32(arr, off), codegen


@intrinsic
def ld_e8m0(typingctx, arr, off):
    """MXFP4's e8m0 byte at ``off`` as ggml's half scale 2**(e - 128), from the table (one
    load that a broadcast reads straight from memory, instead of scalar bit arithmetic)."""
    if not (_is_array(arr) and _is_int(off)):
        return None

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return _ld_table(builder, p, "offload_e8m0_half_to_f32", _I8)
    return types.float32(arr, off), codegen


# ---------------------------------------------------------------- arithmetic

def _binop(op):
    @intrinsic
    def f(typingctx, a, b):
        if a == fvec and b == fvec:
            def codegen(context, builder, sig, args):
                return _fast(getattr(builder, op)(args[0], args[1]))
            return fvec(a, b), codegen
        return None
    return f


vadd, vsub, vmul = _binop("fadd"), _binop("fsub"), _binop("fmul")


@intrinsic
def vfma(typingctx, a, b, c):
    """``a * b + c`` lane-wise (fused where the target has FMA)."""
    if not (a == fvec and b == fvec and c == fvec):
        return None

    def codegen(context, builder, sig, args):
        fnty = ir.FunctionType(_VF, [_VF, _VF, _VF])
        fn = cgutils.get_or_insert_function(builder.module, fnty, f"llvm.fmuladd.v{LANES}f32")
        return builder.call(fn, list(args))
    return fvec(a, b, c), codegen


@intrinsic
def vsum(typingctx, v):
    """Sum of the lanes, float32."""
    if v != fvec:
        return None

    def codegen(context, builder, sig, args):
        (x,) = args
        # Pairwise halving: 3 shuffles + 3 adds.
        n = LANES
        while n > 1:
            n //= 2
            lo = builder.shuffle_vector(x, x, _const_vec(_I32, range(n)))
            hi = builder.shuffle_vector(x, x, _const_vec(_I32, range(n, 2 * n)))
            x = _fast(builder.fadd(lo, hi))
        return builder.extract_element(x, ir.Constant(_I32, 0))
    return types.float32(v), codegen


@intrinsic
def vlane(typingctx, v, i):
    """Lane ``i`` of a vector."""
    if not (v == fvec and _is_int(i)):
        return None

    def codegen(context, builder, sig, args):
        idx = context.cast(builder, args[1], sig.args[1], types.int32)
        return builder.extract_element(args[0], idx)
    return types.float32(v, i), codegen


def _vec_operator(op, fn):
    @overload(op, inline="always")
    def impl(a, b):
        if a == fvec and b == fvec:
            return lambda a, b: fn(a, b)
        if a == fvec and isinstance(b, (types.Float, types.Integer)):
            return lambda a, b: fn(a, vsplat(b))
        if isinstance(a, (types.Float, types.Integer)) and b == fvec:
            return lambda a, b: fn(vsplat(a), b)
        return None


_vec_operator(operator.add, vadd)
_vec_operator(operator.sub, vsub)
_vec_operator(operator.mul, vmul)
_vec_operator(operator.iadd, vadd)
_vec_operator(operator.isub, vsub)
_vec_operator(operator.imul, vmul)


# Cephes' expf on [-ln2/2, ln2/2]: exp(r) = 1 + r + r^2 (c0 + c1 r + ... + c5 r^5), ~1 ulp.
_EXP_POLY = (5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3, 1.3981999507e-3,
             1.9875691500e-4)
_TINY = float(np.finfo(np.float32).tiny)


@intrinsic
def vsilu_glu(typingctx, g, u, clamp):
    """Lane-wise ``moe._silu_glu``: silu(g) * u, with g ≤ clamp and |u| ≤ clamp first where
    ``clamp`` > 0; 0 where g ≤ -80 (or NaN) and where |result| is below float32's smallest
    normal (subnormals would slow the down projection). exp of -|g| by range reduction and
    Cephes' polynomial (about 1 ulp from the libm exp of the scalar version)."""
    if not (g == fvec and u == fvec and isinstance(clamp, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        g, u = args[0], args[1]
        lim = context.cast(builder, args[2], sig.args[2], types.float32)

        def splat(x):
            return _splat(builder, ir.Constant(_F32, x) if isinstance(x, float) else x, _VF)

        def call(name, *vals):
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF, [_VF] * len(vals)),
                                                f"llvm.{name}.v{LANES}f32")
            return builder.call(fn, list(vals))
        clamped = builder.fcmp_ordered(">", lim, ir.Constant(_F32, 0.0))
        vlim = splat(lim)
        # compares, not minnum/maxnum: a NaN stays NaN (and gives 0 below), as in the scalar version
        on = _splat(builder, clamped, ir.VectorType(ir.IntType(1), LANES))
        nlim = builder.fneg(vlim)
        g = builder.select(builder.and_(on, builder.fcmp_ordered(">", g, vlim)), vlim, g)
        u = builder.select(builder.and_(on, builder.fcmp_ordered(">", u, vlim)), vlim,
                           builder.select(builder.and_(on, builder.fcmp_ordered("<", u, nlim)), nlim, u))
        x = call("maxnum", builder.fneg(call("fabs", g)), splat(-87.0))        # exp(x), x in [-87, 0]
        n = call("rint", builder.fmul(x, splat(1.4426950408889634)))
        r = call("fma", n, splat(-0.693359375), x)
        r = call("fma", n, splat(2.12194440e-4), r)
        p = splat(_EXP_POLY[-1])
        for c in reversed(_EXP_POLY[:-1]):
            p = call("fma", p, r, splat(c))
        p = call("fma", builder.fmul(p, r), r, builder.fadd(r, splat(1.0)))
        bits = builder.shl(builder.add(builder.fptosi(n, _VI32), _splat(builder, ir.Constant(_I32, 127), _VI32)),
                           _splat(builder, ir.Constant(_I32, 23), _VI32))
        e = builder.fmul(p, builder.bitcast(bits, _VF))
        pos = builder.fcmp_ordered(">=", g, splat(0.0))
        sg = builder.fdiv(builder.fmul(g, builder.select(pos, splat(1.0), e)), builder.fadd(splat(1.0), e))
        sg = builder.select(builder.fcmp_ordered(">", g, splat(-80.0)), sg, splat(0.0))
        h = builder.fmul(sg, u)
        return builder.select(builder.fcmp_ordered(">=", call("fabs", h), splat(_TINY)), h, splat(0.0))
    return fvec(g, u, clamp), codegen
