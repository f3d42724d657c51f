"""The int8 engine: 64 weights per step, one 512-bit ``vpdpbusd`` per row (llama.cpp's
int8-activation trick, laid out for AVX-512).

For ggml's 32-weight blocks a *block-pair decoder* (``block_pair_decoder``) turns the raw
bytes of blocks A, B (consecutive in a row) into

    codes  ``I8x64``: unsigned weight codes u in activation order (A 0..31, then B 0..31),
    d      f32x16: lanes 0..7 the scale of A, lanes 8..15 the scale of B,
    m      f32x16: the same for the blocks' mins (zero for types without one),

with ``w = d * (u - offset) + m``. A step is a handful of whole-register operations
(counted from the emitted code for Q4_0, per row: 7 vector ALU operations per 64
weights): two 16-byte broadcast loads and one insert put each block's nibble bytes where
its low and high halves go, one GF(2) affine instruction extracts both nibbles (or a word
shift, and ``vpermb`` doing MXFP4's / IQ4_NL's value table), the two scales are table
entries (ggml's f16 -> f32 table; e8m0) broadcast from memory with one insert.
``pdot`` is the dot of the 64 codes with 64 int8 activations per 4-weight group (16
int32 lanes, as float). The code offset is taken out once per activation, not per weight
byte: with xs = dx * (sum of the 4 activations) per lane,

    acc += d * (dx * pdot - offset * xs)    [+ m * xs]

(two FMAs per row and step; dx: the activations' scale per 32, spread over lanes).
Only bytes of the row's blocks are read: an odd row's last block is decoded alone.

For 256-weight blocks (K-quants, IQ4_XS) a *sub-block-pair decoder*
(``sub_block_pair_decoder``) gives the codes of sub-blocks 2j and 2j + 1 the same way
(their bit fields via GF(2) affine maps; IQ4_XS's nibbles through its value table); their
scales come from the types' ``scales`` decoders (``rowdot8``).

Instructions are chosen when Numba compiles, from ``simd.target_features()`` (the
features Numba's code generator targets): ``vpdpbusd`` zmm with AVX512-VNNI, two ymm
halves with AVX-VNNI, ``vpmaddubsw`` + ``vpmaddwd`` with AVX2 (one pair per 32 bytes for the
codes below 128 of most types, ``I8x64.small``; two for full-byte codes), widened multiplies
otherwise (the drivers take the int8 path only with one of the first three,
``simd8.has_int8_dot``); GF(2) affine with GFNI + AVX512BW, word shifts
otherwise; ``vpermb`` with AVX512-VBMI, ``vpshufb`` with AVX512BW or AVX2.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, register_model

from .simd import _VF, _byte_ptr, _is_array, _is_int, _table, fvec, target_has

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(n) for n in (1, 8, 16, 32, 64))
_F32 = ir.FloatType()
_V64I8 = ir.VectorType(_I8, 64)
_V32I8 = ir.VectorType(_I8, 32)
_V16I32 = ir.VectorType(_I32, 16)
_V8I32 = ir.VectorType(_I32, 8)


class I8x64(types.Type):
    """64 bytes in one register (LLVM ``<64 x i8>``): a step's weight codes. ``small``: every
    code is below 128 (4- to 6-bit fields, MXFP4's values + 12), which AVX2's dot product
    takes in one ``vpmaddubsw`` without the split a full byte needs (``dpbusd``)."""

    def __init__(self, small: bool = False):
        self.small = small
        super().__init__(name="i8x64s" if small else "i8x64")


i8x64 = I8x64()
i8x64_small = I8x64(small=True)


@register_model(I8x64)
class _I8x64Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V64I8)


def _const(ty, vals):
    return ir.Constant(ir.VectorType(ty, len(vals)), [int(v) for v in vals])


def _lut(builder, idx, table):
    """table[idx & 15] for 64 byte lanes (``table``: 16 byte values)."""
    if target_has("avx512vbmi"):
        # vpermb reads 6 index bits: with the table repeated 4 times, bits 4, 5 don't matter.
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V64I8, [_V64I8] * 2),
                                            "llvm.x86.avx512.permvar.qi.512")
        return builder.call(fn, [_const(_I8, list(table) * 4), idx])
    idx = builder.and_(idx, _const(_I8, [15] * 64))
    if target_has("avx512bw"):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V64I8, [_V64I8] * 2),
                                            "llvm.x86.avx512.pshuf.b.512")
        return builder.call(fn, [_const(_I8, list(table) * 4), idx])
    if target_has("avx2"):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V32I8, [_V32I8] * 2),
                                            "llvm.x86.avx2.pshuf.b")
        tab = _const(_I8, list(table) * 2)
        lo = builder.call(fn, [tab, builder.shuffle_vector(idx, idx, _const(_I32, range(32)))])
        hi = builder.call(fn, [tab, builder.shuffle_vector(idx, idx, _const(_I32, range(32, 64)))])
        return builder.shuffle_vector(lo, hi, _const(_I32, range(64)))
    out = ir.Constant(_V64I8, [0] * 64)              # portable: element by element
    tab = _const(_I8, table)
    for i in range(64):
        k = builder.extract_element(idx, ir.Constant(_I32, i))
        out = builder.insert_element(out, builder.extract_element(tab, k), ir.Constant(_I32, i))
    return out


def _gf2_matrix(shift, width, up):
    """The 8x8 bit matrix (as ``vgf2p8affineqb`` reads a qword: row 7 - i gives output bit
    i) of ``((byte >> shift) & (2**width - 1)) << up``."""
    return sum((1 << (i - up + shift)) << (8 * (7 - i)) for i in range(up, min(8, up + width)))


def _bitfields(builder, v, fields):
    """Per byte of ``v`` (<64 x i8>): ``((b >> shift) & (2**width - 1)) << up`` with
    ``fields[q] = (shift, width, up)`` for the bytes of qword q (8 qwords): one GF(2)
    affine instruction where the target has GFNI and AVX-512, byte shifts elsewhere."""
    if target_has("gfni", "avx512bw"):
        mats = [_gf2_matrix(*f) for f in fields]
        m = ir.Constant(_V64I8, [(q >> (8 * b)) & 255 for q in mats for b in range(8)])
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V64I8, [_V64I8, _V64I8, _I8]), "llvm.x86.vgf2p8affineqb.512")
        return builder.call(fn, [v, m, ir.Constant(_I8, 0)])
    per = [f for f in fields for _ in range(8)]
    v = builder.lshr(v, _const(_I8, [f[0] for f in per]))
    v = builder.and_(v, _const(_I8, [(1 << f[1]) - 1 for f in per]))
    return builder.shl(v, _const(_I8, [f[2] for f in per]))


def _nibbles(builder, c, table):
    """Nibble codes of ``c`` = (q_A, q_A, q_B, q_B) (16 bytes each): low nibbles in the
    first copy of each block, high nibbles in the second; through ``table`` if given."""
    if table is None and target_has("gfni", "avx512bw"):
        return _bitfields(builder, c, [(0, 4, 0), (0, 4, 0), (4, 4, 0), (4, 4, 0)] * 2)
    # Word shifts: 4 for the high-nibble copies (bytes 16..31 of each block).
    v16 = ir.VectorType(_I16, 32)
    c = builder.bitcast(builder.lshr(builder.bitcast(c, v16),
                                     _const(_I16, [4 * ((2 * i // 16) % 2) for i in range(32)])), _V64I8)
    if table is not None:
        return _lut(builder, c, table)
    return builder.and_(c, _const(_I8, [15] * 64))


def sub_block_pair_decoder(*parts, nibbles_at: int | None = None, table=None):
    """Make an intrinsic ``(w, ob, j) -> codes`` (``I8x64``) for 256-weight blocks: the
    unsigned codes of sub-blocks 2j and 2j + 1 (32 weights each) of the block at byte ``ob``,
    in activation order. Each part is ``(at, shift, width, up)``, functions of the sub-block
    k: weight l of sub-block k has ``((byte[ob + at(k) + l] >> shift(k)) & (2**width - 1)) <<
    up(k)`` OR-ed over the parts. Or, with ``nibbles_at``, sub-block k is the 16 bytes at
    ``nibbles_at + 16 k`` (low nibbles, then high) through ``table`` (IQ4_XS). j must be
    a constant once inlined (the drivers unroll the four pairs); for each j the bytes are
    one or two loads and one bit-field map."""
    def codes_for(builder, p, j):
        if nibbles_at is not None:
            v16 = ir.VectorType(_I8, 16)
            qa, qb = (builder.load(builder.bitcast(builder.gep(p, [ir.Constant(_I64, nibbles_at + 32 * j + 16 * h)]),
                                                   v16.as_pointer()), align=1) for h in (0, 1))
            return _nibbles(builder, builder.shuffle_vector(qa, qb, _const(_I32, [*range(16)] * 2 + [*range(16, 32)] * 2)),
                            table)
        out = None
        for at, shift, width, up in parts:
            a0, a1 = at(2 * j), at(2 * j + 1)

            def load(off, n):
                q = builder.gep(p, [ir.Constant(_I64, off)])
                return builder.load(builder.bitcast(q, ir.VectorType(_I8, n).as_pointer()), align=1)
            if a1 == a0 + 32:
                v = load(a0, 64)
            else:
                lo = load(a0, 32)
                hi = lo if a1 == a0 else load(a1, 32)
                v = builder.shuffle_vector(lo, hi, _const(_I32, range(64)))
            f0, f1 = (shift(2 * j), width, up(2 * j)), (shift(2 * j + 1), width, up(2 * j + 1))
            t = _bitfields(builder, v, [f0] * 4 + [f1] * 4)
            out = t if out is None else builder.or_(out, t)
        return out

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        j = context.cast(builder, args[2], sig.args[2], types.int64)
        # A select chain over the four pairs: folds to one once j is a constant.
        out = codes_for(builder, p, 3)
        for jj in (2, 1, 0):
            out = builder.select(builder.icmp_signed("==", j, ir.Constant(_I64, jj)),
                                 codes_for(builder, p, jj), out)
        return out

    out_type = i8x64 if table is not None and max(table) > 127 else i8x64_small

    @intrinsic
    def decode(typingctx, w, ob, j):
        if not (_is_array(w) and _is_int(ob) and _is_int(j)):
            return None
        return out_type(w, ob, j), codegen
    decode.codes_small = out_type.small          # read by registry.QuantKernel.codes_small
    return decode


def block_pair_decoder(*, block_bytes: int, qs: int, scale: str, scale_at: int = 0,
                 min_at: int | None = None, table=None, qh: int | None = None,
                 signed8: bool = False):
    """Make ``(decode_block_pair, decode_block)``: intrinsics ``(w, ob) -> (codes, d, m)`` for the blocks
    at byte ``ob`` and ``ob + block_bytes`` (decode_block: block A only, B's lanes zero).

    block_bytes: ggml's block size; qs: byte offset of the 16 nibble bytes (of the 32
    int8 values if ``signed8``); scale: "f16" or "e8m0" (then ``d = 2**(e - 128)``, ggml's
    half scale) at ``scale_at``; min_at: an f16 min; table: 16 code values the nibble
    indexes; qh: byte offset of a u32 whose bit j is weight j's 5th bit."""
    bb = block_bytes

    def build(n_blocks):
        def codegen(context, builder, sig, args):
            p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])

            def load(k, at, ty):
                """Field at byte ``at`` of block k (B: zero when decoding A alone)."""
                if k == 1 and n_blocks == 1:
                    return ir.Constant(ty, None)
                q = builder.gep(p, [ir.Constant(_I64, k * bb + at)])
                return builder.load(builder.bitcast(q, ty.as_pointer()), align=1)

            def pairs(a, b, per):
                """Vector of ``per`` copies of a's lanes, then of b's."""
                n = len(a.type) if isinstance(a.type, ir.VectorType) else 1
                if n == 1:
                    vt = ir.VectorType(a.type, 1)
                    a = builder.insert_element(ir.Constant(vt, None), a, ir.Constant(_I32, 0))
                    b = builder.insert_element(ir.Constant(vt, None), b, ir.Constant(_I32, 0))
                return builder.shuffle_vector(a, b, _const(_I32, [i for _ in range(per) for i in range(n)]
                                                       + [n + i for _ in range(per) for i in range(n)]))
            if signed8:
                c = pairs(load(0, qs, _V32I8), load(1, qs, _V32I8), 1)
                codes = builder.xor(c, _const(_I8, [0x80] * 64))   # int8 + 128
            else:
                v16i8 = ir.VectorType(_I8, 16)
                c = pairs(load(0, qs, v16i8), load(1, qs, v16i8), 2)
                codes = _nibbles(builder, c, table)
                if qh is not None:
                    bits = builder.zext(load(0, qh, _I32), _I64)
                    if n_blocks == 2:
                        bits = builder.or_(bits, builder.shl(builder.zext(load(1, qh, _I32), _I64),
                                                             ir.Constant(_I64, 32)))
                    hi = builder.select(builder.bitcast(bits, ir.VectorType(_I1, 64)),
                                        _const(_I8, [16] * 64), _const(_I8, [0] * 64))
                    codes = builder.or_(codes, hi)

            def scale_pair(at, kind):
                # Each block's scale is a table entry (f16 -> f32 as ggml does; e8m0): the
                # lanes come from two broadcast loads rather than from vector conversions.
                ity, name = (_I16, "offload_f16_to_f32") if kind == "f16" else (_I8, "offload_e8m0_half_to_f32")
                tab = _table(builder.module, name)

                def val(k):
                    if k == 1 and n_blocks == 1:
                        return ir.Constant(_F32, 0.0)
                    i = builder.zext(load(k, at, ity), _I64)
                    return builder.load(builder.gep(tab, [ir.Constant(_I64, 0), i]), align=4)
                return pairs(val(0), val(1), 8)

            d = scale_pair(scale_at, scale)
            m = scale_pair(min_at, "f16") if min_at is not None else ir.Constant(_VF, [0.0] * 16)
            return context.make_tuple(builder, sig.return_type, [codes, d, m])

        @intrinsic
        def decode(typingctx, w, ob):
            if not (_is_array(w) and _is_int(ob)):
                return None
            return types.Tuple((out_type, fvec, fvec))(w, ob), codegen
        decode.codes_small = out_type.small      # read by registry.QuantKernel.codes_small
        return decode

    out_type = i8x64 if signed8 or (table is not None and max(table) > 127) else i8x64_small

    return build(2), build(1)


def _half(builder, v, h):
    """Lanes of half ``h`` (0: low, 1: high) of vector ``v``: one 256-bit register's worth."""
    n = v.type.count // 2
    return builder.shuffle_vector(v, v, _const(_I32, range(h * n, (h + 1) * n)))


def dpbusd(builder, acc, c, x, small: bool = False):
    """acc (``<16 x i32>``) + lane i: sum_{j<4} c[4i + j] * x[4i + j], c unsigned and x signed
    bytes (``<64 x i8>``; activations at most 127 in magnitude): ``vpdpbusd`` zmm with
    AVX512-VNNI, two ymm halves with AVX-VNNI, ``vpmaddubsw`` + ``vpmaddwd`` with AVX2
    (``small``: every code is below 128), widened multiplies otherwise."""
    if target_has("avx512vnni", "avx512f"):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16I32, [_V16I32] * 3),
                                            "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [acc, builder.bitcast(c, _V16I32), builder.bitcast(x, _V16I32)])
    if target_has("avxvnni") or target_has("avx512vnni", "avx512vl"):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8I32, [_V8I32] * 3),
                                            "llvm.x86.avx512.vpdpbusd.256")

        rs = [builder.call(fn, [_half(builder, acc, h),
                                builder.bitcast(_half(builder, c, h), _V8I32),
                                builder.bitcast(_half(builder, x, h), _V8I32)]) for h in (0, 1)]
        return builder.shuffle_vector(rs[0], rs[1], _const(_I32, range(16)))
    if target_has("avx2"):
        return _dpbusd_avx2(builder, acc, c, x, small)
    v64 = ir.VectorType(_I32, 64)
    prod = builder.mul(builder.zext(c, v64), builder.sext(x, v64))
    r = acc
    for j in range(4):
        r = builder.add(r, builder.shuffle_vector(prod, prod, _const(_I32, [4 * i + j for i in range(16)])))
    return r


def _dpbusd_avx2(builder, acc, c, x, small):
    """``dpbusd`` exactly with AVX2's ``vpmaddubsw`` (u8 x s8 pairs summed into a saturating
    int16) and ``vpmaddwd`` (int16 pairs into int32), per 32-byte half. Codes below 128 pair
    to at most 127 * 127 * 2 < 32767 (activations are at most 127 in magnitude:
    ``quantize_rows``). A code over 127 could saturate (255 * 127 * 2 > 32767), so without
    ``small`` the codes are split at bit 7, c & 127 and c & 128 (pairs at most 128 * 127 * 2),
    and each split goes to int32 on its own: twice the work."""
    v32i16, v8i32 = ir.VectorType(_I16, 16), _V8I32
    maddubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32i16, [_V32I8] * 2),
                                             "llvm.x86.avx2.pmadd.ub.sw")
    maddwd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8i32, [v32i16] * 2),
                                            "llvm.x86.avx2.pmadd.wd")
    ones = ir.Constant(v32i16, [1] * 16)
    splits = [c] if small else [builder.and_(c, _const(_I8, [m] * 64)) for m in (0x7F, 0x80)]
    out = []
    for h in (0, 1):
        r, xh = _half(builder, acc, h), _half(builder, x, h)
        for part in splits:
            r = builder.add(r, builder.call(maddwd, [builder.call(maddubs, [_half(builder, part, h), xh]), ones]))
        out.append(r)
    return builder.shuffle_vector(out[0], out[1], _const(_I32, range(16)))


@intrinsic
def pdot(typingctx, codes, xq, xo):
    """Lane i: sum_{j<4} codes[4i + j] * xq[xo + 4i + j] (u8 x s8), as float32."""
    if not (isinstance(codes, I8x64) and _is_array(xq) and _is_int(xo)):
        return None

    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[1], args[1], args[2], sig.args[2])
        x = builder.load(builder.bitcast(p, _V64I8.as_pointer()), align=1)
        r = dpbusd(builder, ir.Constant(_V16I32, [0] * 16), args[0], x, codes.small)
        return builder.sitofp(r, _VF)
    return fvec(codes, xq, xo), codegen


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


@intrinsic
def quantize32(typingctx, x, xo, xq, qo, dx, du, bsums, bo, xs4, so, dx8, eo):
    """Quantize 32 float32 activations x[xo : xo + 32] (element offsets into each array's data)
    as ``rowdot8.quantize_rows`` does, in vector registers: d = max |x| / 127 into dx[du], codes
    rint(x / d) into xq[qo:], d times the sums of 16 codes into bsums[bo], bsums[bo + 1], of 4
    codes into xs4[so : so + 8], d into dx8[eo : eo + 8]. Exact IEEE operations (no fast-math),
    so the codes are those of the scalar loop."""
    if not all(_is_array(a) for a in (x, xq, dx, bsums, xs4, dx8)) or not all(_is_int(o) for o in (xo, qo, du, bo, so, eo)):
        return None
    v32f, v32i, v8i, v8f = (ir.VectorType(t, n) for t, n in ((_F32, 32), (_I32, 32), (_I32, 8), (_F32, 8)))

    def codegen(context, builder, sig, args):
        def ptr(i, ty, n=1):
            """Pointer to element args[i + 1] of array args[i], as ``ty`` (n: bytes per element)."""
            off = builder.mul(context.cast(builder, args[i + 1], sig.args[i + 1], types.intp), ir.Constant(_I64, n))
            return builder.bitcast(_byte_ptr(context, builder, sig.args[i], args[i], off, types.intp), ty.as_pointer())
        v = builder.load(ptr(0, v32f, 4), align=1)
        amax = _call(builder, "llvm.vector.reduce.fmax.v32f32", _F32, [_call(builder, "llvm.fabs.v32f32", v32f, [v])])
        d = builder.fdiv(amax, ir.Constant(_F32, 127.0))
        inv = builder.select(builder.fcmp_ordered(">", d, ir.Constant(_F32, 0.0)),
                             builder.fdiv(ir.Constant(_F32, 1.0), d), ir.Constant(_F32, 0.0))
        vinv = builder.shuffle_vector(builder.insert_element(ir.Constant(v32f, None), inv, ir.Constant(_I32, 0)),
                                      ir.Constant(v32f, None), _const(_I32, [0] * 32))
        q = builder.fptosi(_call(builder, "llvm.rint.v32f32", v32f, [builder.fmul(v, vinv)]), v32i)
        builder.store(builder.trunc(q, ir.VectorType(_I8, 32)), ptr(2, ir.VectorType(_I8, 32)), align=1)
        builder.store(d, ptr(4, _F32, 4), align=1)
        for h in range(2):
            half = builder.shuffle_vector(q, q, _const(_I32, range(16 * h, 16 * h + 16)))
            s = builder.sitofp(_call(builder, "llvm.vector.reduce.add.v16i32", _I32, [half]), _F32)
            p = builder.gep(ptr(6, _F32, 4), [ir.Constant(_I64, h)])
            builder.store(builder.fmul(s, d), p, align=1)
        s4 = None
        for j in range(4):
            part = builder.shuffle_vector(q, q, _const(_I32, [4 * g + j for g in range(8)]))
            s4 = part if s4 is None else builder.add(s4, part)
        vd = builder.shuffle_vector(builder.insert_element(ir.Constant(v8f, None), d, ir.Constant(_I32, 0)),
                                    ir.Constant(v8f, None), _const(_I32, [0] * 8))
        builder.store(builder.fmul(builder.sitofp(s4, v8f), vd), ptr(8, v8f, 4), align=1)
        builder.store(vd, ptr(10, v8f, 4), align=1)
        return context.get_dummy_value()
    return types.none(x, xo, xq, qo, dx, du, bsums, bo, xs4, so, dx8, eo), codegen
