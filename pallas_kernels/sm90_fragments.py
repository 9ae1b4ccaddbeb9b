"""Register-level building blocks of the sm_90 KIVI decode kernel (inline Mosaic GPU).

`kivi_decode_sm90` composes these into the kernel; its module docstring says why each exists
and docs/performance.md what each was measured to do. Here: the code fields as fp16 operands
(`_widen8`, `_field_sub`, the magic-number and e4m3 fields), the mma.sync operand fragments
(`_as_mma_lhs`, `_scale_rhs`, `_mma_rhs`, `_warp_rhs`), the key bias and the value minimums'
products (`_rows_of`, `_group_min_mma`, `_dense_rows`, `_bias_rows`), P's store as the value
product's B (`_store_p_perm`), the warp and warpgroup reductions and barriers (`_warp_max`,
`_wg_reduce`, `_wg_max_open`, `_wg_sync`), the per-warp vector loads (`_vec_load`,
`_group_vecs`) and the TMA pipeline without auto barriers (`_pipeline`). Most of them lower
to inline PTX through Mosaic GPU's fragmented arrays and do not run under the interpreter:
where they take `interpret`, that path computes the same function with jnp.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, nvvm, scf, vector
from jax._src.lib.mlir.dialects import math as math_dialect
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

PLANE = 64  # tokens per packed plane = wgmma M tile (docs/layout.md)
# Tokens per block of the cache order (kivi_jax.quant.cache_slot): slot 64 p + 16 w + c of a
# block holds token 64 w + 16 p + c, so warp w's rows of the block's four planes are its 64
# consecutive tokens 64 w .. 64 w + 63. Steps and sub-steps are whole blocks.
_CACHE_BLOCK = 256
_WG = plgpu.Layout.WGMMA


def _swz(dtype, minor_elems):
    bits = jnp.dtype(dtype).itemsize * 8
    sw = plgpu.find_swizzle(minor_elems * bits, "kivi")
    return (plgpu.TilingTransform((8, sw * 8 // bits)), plgpu.SwizzleTransform(sw))


_EXP_BITS = 0x7C00  # the five exponent bits of an fp16 bit pattern
# vsub (fold_v on mma.sync): B = P * s_t * 2^(_VSUB_C - bits j) relative to the running max of
# P * s_t stays <= 2^14 (fp16 range) and normal down to 2^-22 (2-bit) / 2^-24 (4-bit) of it.
_VSUB_C = 14
# fold_v_warp: P is stored as P * 2^(_VW_C - bits j), so that with subnormal code fields
# (weight 2^(bits j - 24)) every plane's product weighs 2^(_VW_C - 24); B = P * s * 2^(_VW_C -
# bits j) <= 2^_VW_C s stays finite for value scales below 2^(16 - _VW_C) and normal down to
# P * s = 2^-14 (2^-12 at the 2-bit field 3).
_VW_C = 4
_RED_SCRATCH = 512  # f32 elements of cross-warp reduction scratch per warpgroup (at least)


def _red_scratch(padded_heads: int) -> int:
    """f32 elements of a warpgroup's reduction scratch: `_RED_SCRATCH`, or more where
    `_warp_group_sum` needs it (four warps x five rows x the padded heads: past 24 heads per kv
    head)."""
    return max(_RED_SCRATCH, 4 * 5 * padded_heads)
# warp_softmax: the running max may lag the true one by this much (log2 units) before the
# accumulators are rescaled (`_lazy_rescale`); B = P * s_t * 2^(_VSUB_C - slack - bits j) then
# stays <= 2^14 as before.
_RESCALE_SLACK = 4.0
_WSM_MIN_STEPS = 16  # choose_tuning: the per-warp softmax from this many steps per split


def _widen_codes(x8):
    """Code bytes (uint8) -> uint16 with all five exponent bits set, ready for `_field_to_f16`.

    One or per byte here instead of one per code field there: the field's exponent is then
    selected by the and-mask alone (measured: ptxas does not fuse and + or with two constants
    into one LOP3, so this removes an instruction per element pair and plane).
    """
    return x8.astype(jnp.uint16) | jnp.uint16(_EXP_BITS)


def _field_offset(bits: int, j: int) -> float:
    """The fp16 offset 2^(10 - bits*j) of code field j under the magic-number trick."""
    return float(2 ** (10 - bits * j))


def _field_raw(y16, bits: int, j: int):
    """Code field j of bytes widened by `_widen_codes` as the fp16 number
    `_field_offset(bits, j) + code` (exact): one and, the offset left to the caller.

    Keeping the field (bits [bits*j, bits*(j+1))) and the exponent bits of 2^(10 - bits*j)
    makes the field's lowest bit weigh exactly 1.
    """
    mask = ((1 << bits) - 1) << (bits * j)
    magic = (25 - bits * j) << 10  # fp16 bit pattern of the offset (a subset of _EXP_BITS)
    return lax.bitcast_convert_type(y16 & jnp.uint16(mask | magic), jnp.float16)


def _field_to_f16(y16, bits: int, j: int):
    """Code field j of bytes widened by `_widen_codes` as exact fp16 integers: `_field_raw`
    less its offset (an exact subtraction)."""
    return _field_raw(y16, bits, j) - jnp.float16(_field_offset(bits, j))


def _field_sub(y16, bits: int, j: int):
    """Code field j of code bytes widened *without* exponent bits (`_widen8(...,
    exponent=False)`, or a plain u8 -> u16) masked in place: the fp16 bit pattern code *
    2^(bits*j) read as the subnormal number code * 2^(bits*j - 24), exact and without an
    offset (tensor cores take fp16 subnormals as they are). One and per element pair."""
    mask = ((1 << bits) - 1) << (bits * j)
    return lax.bitcast_convert_type(y16 & jnp.uint16(mask), jnp.float16)


def _field_sub_weight(bits: int, j: int) -> float:
    """What a product over `_field_sub(..., bits, j)` operands is multiplied by to weigh the
    codes 1: 2^(24 - bits*j)."""
    return float(2 ** (24 - bits * j))


# Permuted contraction order of the widen8 path: within each 16-wide block, position p of the
# fp16 operand holds element _PERM16[p]. It is the order in which the 8-bit WGMMA fragment (four
# consecutive bytes per register) lands in the 16-bit fragment (two consecutive elements per
# register, at columns 2k and 8 + 2k) when each byte register is split by two byte permutes.
_PERM16 = tuple(4 * (p % 8 // 2) + 2 * (p // 8) + p % 2 for p in range(16))


def permute_contraction(x, axis=-1):
    """x with its `axis` (a multiple of 16) reordered into the widen8 contraction order."""
    n = x.shape[axis]
    idx = np.array([16 * (i // 16) + _PERM16[i % 16] for i in range(n)])
    return jnp.take(x, idx, axis=axis)


def _i32(v):
    return mgpu_utils.c(v, ir.IntegerType.get_signless(32))


def _idx(v):
    """An i32 value as an MLIR index (a memref subscript)."""
    return arith.index_cast(ir.IndexType.get(), v)


def _col_vector(regs, n):
    """A (n,) vector in the WGMMA column layout (`_WG.reduce(0)`) from its registers, in
    order: what the loads and reductions below build lane by lane."""
    return mgpu_fa.FragmentedArray(
        _registers=np.array(regs, dtype=object).reshape(
            mgpu_fa.WGMMA_COL_LAYOUT.registers_shape((n,))),
        _layout=mgpu_fa.WGMMA_COL_LAYOUT, _is_signed=None)


def _lane_warp():
    """(lane, warp within the warpgroup) as i32 values."""
    tid = mgpu_utils.thread_idx()
    return arith.andi(tid, _i32(31)), arith.andi(arith.shrui(tid, _i32(5)), _i32(3))


def _widen8(codes_ref, transforms, exponent: bool = True, warp_rows=None):
    """(64, X) uint8 code tile in SMEM -> (64, X) uint16 in the WGMMA layout, every byte widened
    with the exponent bits set (as `_widen_codes`; exponent=False: the high bytes undefined, for
    `_field_sub`), columns in the `_PERM16` order.

    The bytes are loaded in the 8-bit WGMMA layout (four consecutive bytes of a row per
    register, stored as the cache stores them, the middle two swapped: `kivi_jax.quant.
    swap_bytes`), so a register's fp16 pairs (b0, b2) and (b1, b3) are the row's elements
    (4k, 4k + 1) and (4k + 2, 4k + 3): one `prmt` per output register interleaves them with the
    exponent byte, or, without exponent bits, the register itself and the register shifted
    right by 8 are the pairs (the other byte of each 16-bit lane is left there: every code
    field mask clears it, `_field_sub`): one instruction per two output registers.
    Mosaic's own u8 -> u16 relayout into the natural order costs about three byte permutes and
    an or per output register (SASS, docs/performance.md run 8). `transforms`: the tile's SMEM
    tiling and swizzle (unswizzled 64- or 128-byte rows put the eight rows of an 8x16-byte
    fragment into the same banks: measured 6x the ideal shared-memory wavefronts). Not
    interpretable.

    warp_rows (a, b): codes_ref holds more than 64 rows and warp w's 16 rows of the tile are
    its rows a w + b .. a w + b + 15 (multiples of 8), by a per-warp slice of the tiled ref.
    """
    swizzle = transforms[1].swizzle
    X = codes_ref.shape[-1]

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=transforms),),
                       return_type=plgpu.ShapeDtypeStruct((PLANE, X), jnp.uint16, layout=_WG))
    def widen(_, ref):
        if warp_rows is not None:  # rows a w + b - 16 w .. + 63: warp w's 16 at a w + b
            # A per-warp base pointer under a static 64-row memref type, so that every load's
            # address is that register plus a constant (run 91: a memref subview with a
            # dynamic offset cost ~100 IMAD and LDS more per step).
            a, b = warp_rows
            _, warp = _lane_warp()
            ty = ir.MemRefType(ref.type)
            strides, _ = ty.get_strides_and_offset()
            t0 = arith.addi(arith.muli(warp, _i32((a - 16) // 8)), _i32(b // 8))
            off = arith.muli(t0, _i32(strides[0]))  # bytes: u8 elements
            ptr = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(ref), [off],
                                           ir.IntegerType.get_signless(8))
            ref = mgpu_utils.ptr_as_memref(ptr, ir.MemRefType.get(
                (PLANE // 8, *ty.shape[1:]), ty.element_type,
                ir.StridedLayoutAttr.get(0, strides), ty.memory_space))
        x = mgpu_fa.FragmentedArray.load_tiled(ref, swizzle, layout=mgpu_fa.WGMMA_LAYOUT_8BIT,
                                               is_signed=False, optimized=False)
        i32 = ir.IntegerType.get_signless(32)
        pair_ty = ir.VectorType.get((2,), ir.IntegerType.get_signless(16))
        high = 0x7C7C7C7C if exponent else 0
        regs = x.registers
        out = np.empty((1, X // 8, *regs.shape[2:]), dtype=object)
        for idx in np.ndindex(regs.shape):
            w = mgpu_utils.bitcast(regs[idx], i32)
            for half, sel in ((0, 0x4240), (1, 0x4341)):  # stored bytes (0, 2) / (1, 3) of w
                if exponent:
                    r = mgpu_utils.inline_ptx("prmt.b32 $0, $1, $2, $3;", w, _i32(high),
                                              _i32(sel), result_types=i32)
                else:  # bytes 0, 2 in place; bytes 1, 3 shifted into place
                    r = w if half == 0 else arith.shrui(w, _i32(8))
                out[(idx[0], 2 * idx[1] + half, *idx[2:])] = mgpu_utils.bitcast(r, pair_ty)
        return mgpu_fa.FragmentedArray(_registers=out, _layout=mgpu_fa.WGMMA_LAYOUT,
                                       _is_signed=False)

    return widen(codes_ref)


def _pairs64(ref, idx):
    """The four fp16 elements at `idx` (the last index a multiple of 4: 8-byte aligned) of an
    SMEM ref as two 2-element registers, from one 64-bit load: in the `_PERM16` order a
    thread's register pair (positions 2c, 2c + 1 and 8 + 2c, 9 + 2c of a 16-block) is the
    four consecutive elements 4c .. 4c + 3."""
    dt = ir.MemRefType(ref.type).element_type
    quad = vector.load(ir.VectorType.get((4,), dt), ref, idx, alignment=8)
    pair = ir.VectorType.get((2,), dt)
    return tuple(vector.extract_strided_slice(pair, quad, [o], [2], [1]) for o in (0, 2))


def _vec_load(rows_ref, *, rows: tuple[int, ...] = (), perm: bool = False,
              wide: bool = False, align4: bool = False, n_half: int = 0):
    """A (X,) fp16 vector in the reduce(0) WGMMA layout (the row vector of a 64-row tile).

    rows_ref: (X,) or, with rows, (n, X) vectors of which warp w loads row rows[w] (the group
    its 16 tile rows lie in), so the warps hold different vectors (valid only under a row
    broadcast and elementwise use: `_group_vecs`, `kfold_scores`). perm: in the `_PERM16`
    order of the widen8 path; wide (with perm): two registers per 64-bit load (`_pairs64`)
    instead of one per 32-bit load. align4 (perm, not wide): the 32-bit loads marked 4-byte
    aligned (they are: even element offsets in rows of >= 64 elements); without it MLIR gives
    them the element's 2 and LLVM may not prove more where the row offset is dynamic (the
    fold_v_warp suspect of run 91: 88 more LDS per step than the IR's loads). n_half (perm):
    rows_ref holds X + n_half elements and lanes 16-31 (those of mma.sync's B columns 4-7)
    read theirs n_half further on: the scale vectors of two planes at once for a packed score
    tile's B (pack_planes with fold_v_warp; lane-dependent, valid only in `_scale_rhs`). Not
    interpretable (inline Mosaic GPU).
    """
    X = rows_ref.shape[-1] - n_half

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((X,), rows_ref.dtype,
                                                          layout=_WG.reduce(0)))
    def load(_, ref):
        lane, warp = _lane_warp()
        if rows:  # the warp's row, by selects on the (loop-invariant) warp index
            g = _i32(rows[0])
            for w in range(1, 4):
                if rows[w] != rows[0]:
                    g = arith.select(arith.cmpi(arith.CmpIPredicate.eq, warp, _i32(w)),
                                     _i32(rows[w]), g)
            ref = mgpu_utils.memref_slice(ref, arith.index_cast(ir.IndexType.get(), g))
        if not perm:
            return mgpu_fa.FragmentedArray.load_untiled(ref, layout=mgpu_fa.WGMMA_COL_LAYOUT,
                                                        optimized=False)
        k4 = arith.muli(arith.andi(lane, _i32(3)), _i32(4))
        if n_half:  # lanes 16-31: the second vector
            k4 = arith.addi(k4, arith.muli(arith.shrui(lane, _i32(4)), _i32(n_half)))
        pair_ty = ir.VectorType.get((2,), ir.MemRefType(ref.type).element_type)
        regs = []
        if wide:  # registers 2j, 2j + 1: positions 16j + 4k .. 16j + 4k + 3
            for j in range(X // 16):
                regs.extend(_pairs64(ref, [_idx(arith.addi(k4, _i32(16 * j)))]))
        else:
            for i in range(X // 8):  # register i: positions 8i + 2k + (0, 1)
                col = arith.addi(k4, _i32(16 * (i // 2) + 2 * (i % 2)))
                regs.append(vector.load(pair_ty, ref, [_idx(col)],
                                        alignment=4 if align4 else None))
        return _col_vector(regs, X)

    return load(rows_ref)


def _transpose8x8(reg):
    """`movmatrix`: the warp's 8x8 matrix of 16-bit elements held one register per lane (lane
    (g, c): row g, columns 2c, 2c + 1) transposed in registers (lane (g, c): row g of the
    transpose). `reg`: a 2 x 16-bit vector; returns the same type."""
    i32 = ir.IntegerType.get_signless(32)
    t = mgpu_utils.inline_ptx("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
                              mgpu_utils.bitcast(reg, i32), result_types=i32)
    return mgpu_utils.bitcast(t, reg.type)


def _store_p_perm(p16, dst, col0: int = 0, split: bool = False):
    """Stores P (64 tokens, N) fp16 (WGMMA layout) as columns [col0, col0 + 64) of the wgmma B
    operand dst [N, X] (tiling (8, 64), 128-byte swizzle) with the tokens in the `_PERM16`
    order: each 8x8 block of the warp's registers is transposed in registers (`movmatrix`), so
    that a thread holds two tokens of one head, which `_PERM16` keeps adjacent: one 32-bit store
    per register (instead of two 16-bit stores and their two byte permutes). Also q * s_g of the
    folded key product (channels for tokens). split (pack_zeros, N = 8): dst is two [8, 64]
    tiles; columns 0-3 of P go to rows 0-3 of the first, columns 4-7 to rows 0-3 of the
    second (rows 4-7 of both left as they are)."""
    ctiles = dst.shape[-1] // PLANE  # (8, 64) tiles per 8 rows of dst

    @plgpu.inline_mgpu(arg_types=(_WG, plgpu.RefType(transforms=_swz(jnp.float16, PLANE))))
    def store(_, x, ref):
        lane, warp = _lane_warp()
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        base = mgpu_utils.memref_ptr(ref)
        g, c = arith.shrui(lane, _i32(2)), arith.andi(lane, _i32(3))
        # After the transpose lane (g, c) of warp w holds head 8 i + g and tokens 16 w + 8 h +
        # 2 c + (0, 1) (row half h): _PERM16 positions 16 w + 4 h + 2 (c // 2) + 8 (c % 2) + (0,
        # 1), in the 16-byte chunk 2 w + c % 2 of the head's 128-byte row, which the swizzle
        # xors with the row (g).
        chunk = arith.addi(arith.muli(warp, _i32(2)), arith.andi(c, _i32(1)))
        if split:  # head g: row g % 4 of tile g // 4
            r = arith.andi(g, _i32(3))
            row = arith.addi(arith.addi(arith.muli(arith.shrui(g, _i32(2)), _i32(1024)),
                                        arith.muli(r, _i32(128))),
                             arith.muli(arith.xori(chunk, r), _i32(16)))
        else:
            row = arith.addi(arith.muli(g, _i32(128)),
                             arith.muli(arith.xori(chunk, g), _i32(16)))
        half = arith.muli(arith.shrui(c, _i32(1)), _i32(4))  # bytes of 2 (c // 2) fp16
        for idx in np.ndindex(x.registers.shape):
            i, h = idx[1], idx[4]  # column tile (8 heads), row half (rows r or r + 8)
            t = mgpu_utils.bitcast(_transpose8x8(x.registers[idx]), i32)
            tile = i * ctiles + col0 // PLANE
            off = arith.addi(arith.addi(row, half), _i32(tile * 1024 + 8 * h))
            llvm.store(t, mgpu_utils.getelementptr(base, [off], i8))

    store(p16, dst)


def _zero_smem(ref, transforms=()):
    """Zeroes ref (a warpgroup's SMEM buffer of a multiple of 2 KiB, with its SMEM transforms)
    with 16-byte stores; the caller orders them before other threads' accesses
    (`_wg_sync`)."""
    nbytes = math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
    if nbytes % 2048:
        raise ValueError(f"_zero_smem needs a multiple of 2048 bytes, got {nbytes}")

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=transforms),))
    def zero(_, r):
        lane, warp = _lane_warp()
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        v4 = ir.VectorType.get((4,), i32)
        z = arith.constant(v4, ir.DenseElementsAttr.get_splat(v4, ir.IntegerAttr.get(i32, 0)))
        base = mgpu_utils.memref_ptr(r)
        tid16 = arith.muli(arith.addi(lane, arith.muli(warp, _i32(32))), _i32(16))
        for k in range(nbytes // 2048):
            off = arith.addi(tid16, _i32(2048 * k))
            llvm.store(z, mgpu_utils.getelementptr(base, [off], i8))

    zero(ref)


def _f8_field_spec(bits: int, j: int):
    """(shift, mask, weight) of value code field j as an e4m3 subnormal: (byte >> shift) & mask
    is a byte b <= 15, which e4m3 reads as b * 2^-9 = code * weight * 2^-9 (the subnormals and
    the first binade share the spacing 2^-9, so bytes 0..15 are exactly linear). Fields of the
    upper nibble are shifted down by four first."""
    lo = bits * j
    shift = lo - lo % 4
    return shift, ((1 << bits) - 1) << (lo - shift), 1 << (lo - shift)


def _code_field8(x8, spec, dtype):
    """Code field (shift, mask, _) = spec (`_f8_field_spec`) of a (64, X) uint8 tile in the
    8-bit WGMMA layout (as stored: the middle bytes of every four swapped) as the float8_e4m3fn
    A operand in the natural column order: one byte permute, one and (plus one shift for a
    shifted field) per register of four bytes. Not interpretable (inline Mosaic GPU)."""
    shift, mask, _ = spec
    W8 = plgpu.Layout.WGMMA_8BIT

    @plgpu.inline_mgpu(arg_types=(W8,),
                       return_type=plgpu.ShapeDtypeStruct(x8.shape, dtype, layout=W8))
    def field(_, xa):
        i32 = ir.IntegerType.get_signless(32)
        elt = ir.Float8E4M3FNType.get()
        out = np.empty(xa.registers.shape, dtype=object)
        for idx in np.ndindex(xa.registers.shape):
            reg = xa.registers[idx]
            w = mgpu_utils.inline_ptx("prmt.b32 $0, $1, 0, 0x3120;",
                                      mgpu_utils.bitcast(reg, i32), result_types=i32)
            if shift:
                w = arith.shrui(w, _i32(shift))
            w = arith.andi(w, _i32(mask * 0x01010101))
            out[idx] = mgpu_utils.bitcast(w, ir.VectorType.get(ir.VectorType(reg.type).shape,
                                                               elt))
        return mgpu_fa.FragmentedArray(_registers=out, _layout=xa.layout, _is_signed=None)

    return field(x8)


def _code_field8_reference(x8, spec, dtype):
    """`_code_field8` in jnp (the interpreter's path): x8 (64, X) uint8 as stored."""
    shift, mask, _ = spec
    x8 = _natural_bytes(x8)
    return lax.bitcast_convert_type(((x8.astype(jnp.int32) >> shift) & mask).astype(jnp.uint8),
                                    dtype)


def _natural_bytes(x8):
    """A code tile's last axis from the cache's stored byte order (`kivi_jax.quant.swap_bytes`)
    to the natural one, in jnp: the interpreter's paths and the natural-order ones."""
    from kivi_jax.quant import swap_bytes

    return swap_bytes(x8, -1)


def _wg_reduce(x, kind: str, scratch_ref):
    """x (64, N) f32 in the WGMMA layout reduced over its rows ("add" or "max") -> (N,) in the
    reduce(0) layout, the cross-warp step going through `scratch_ref`, this warpgroup's own
    f32 SMEM scratch. (Mosaic's reductions use one scratch region per block: two warpgroups
    of a block reducing at once would race on it.) Not interpretable (inline Mosaic GPU)."""
    N = x.shape[1]

    @plgpu.inline_mgpu(arg_types=(_WG, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((N,), x.dtype, layout=_WG.reduce(0)))
    def reduce(_, xa, ref):
        return xa.reduce(kind, 0, scratch=ref)

    return reduce(x, scratch_ref)


def _warp_col_max(at, i: int):
    """Columns 8i + 2c, 8i + 2c + 1 (lane (g, c)) of a (64, N) WGMMA-layout f32 array, given by
    its `_origins`, maximized over the warp's 16 rows: the thread's two rows, then three
    shuffles across the warp's eight row pairs."""
    r = arith.maximumf(at[(0, 8 * i)], at[(8, 8 * i)])
    for dist in (4, 8, 16):
        r = arith.maximumf(r, mgpu_utils.shfl_bfly(r, dist))
    return r


def _swap_halves(x, interpret):
    """x (64, 8) in the WGMMA layout or (8,) in its reduce(0) layout with columns 0-3 and 4-7
    exchanged (pack_planes): lane (g, c) holds columns 2c, 2c + 1, so it is one butterfly
    shuffle across lane bit 1 per register."""
    if interpret:
        return jnp.roll(x, 4, axis=-1)
    lay = _WG if x.ndim == 2 else _WG.reduce(0)

    @plgpu.inline_mgpu(arg_types=(lay,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=lay))
    def swap(_, xa):
        regs = np.empty_like(xa.registers)
        for i, r in np.ndenumerate(xa.registers):
            regs[i] = mgpu_utils.shfl_bfly(r, 2)
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=xa.layout,
                                       _is_signed=xa.is_signed)

    return swap(x)


def _halves(lo, hi, interpret, rows: bool = False):
    """(64, 8) tiles (WGMMA layout) or (8,) vectors (its reduce(0) layout) -> columns 0-3 of
    lo and 4-7 of hi (pack_planes): one select per register on the lane's column half.

    rows: lo, hi are (64,) row vectors (the reduce(1) layout) and the result holds lo in the
    lanes of columns 0-3, hi in those of 4-7: a vector whose lanes disagree, valid only under a
    broadcast along rows and elementwise use (as the per-warp vectors of `_vec_load`), so that
    the per-token math of a tile's two planes costs one plane's. Not interpretable."""
    if interpret:
        assert not rows, "lane-dependent row vectors have no interpreter form"
        col = lax.broadcasted_iota(jnp.int32, lo.shape, lo.ndim - 1)
        return jnp.where(col < 4, lo, hi)
    lay = _WG.reduce(1) if rows else _WG if lo.ndim == 2 else _WG.reduce(0)

    @plgpu.inline_mgpu(arg_types=(lay, lay),
                       return_type=plgpu.ShapeDtypeStruct(lo.shape, lo.dtype, layout=lay))
    def pick(_, la, ha):
        lane, _ = _lane_warp()
        upper = arith.cmpi(arith.CmpIPredicate.uge, arith.andi(lane, _i32(3)), _i32(2))
        regs = np.empty_like(la.registers)
        for i in np.ndindex(regs.shape):
            regs[i] = arith.select(upper, ha.registers[i], la.registers[i])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=la.layout,
                                       _is_signed=la.is_signed)

    return pick(lo, hi)


def _row_halves_load(ref, n_half: int):
    """`_halves(lo, hi, rows=True)` of two (64,) row vectors loaded from one SMEM ref: ref
    holds lo at [0, 64) and hi at [n_half, n_half + 64), and the lanes of columns 0-3 read
    lo's rows, those of 4-7 hi's (a lane-dependent vector, valid as `_halves`' rows). The
    lane's offset (its rows and half) is loop-invariant, so that each load addresses the
    step's buffer plus it (LDS [R + UR]) where the select between two loaded vectors left
    ptxas computing and selecting both addresses every step (deviceless SASS of the anchor's
    launch, docs/performance.md runs 135-137). Not interpretable."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((64,), ref.dtype,
                                                          layout=_WG.reduce(1)))
    def load(_, r):
        lane, warp = _lane_warp()
        row = arith.addi(arith.muli(warp, _i32(16)), arith.shrui(lane, _i32(2)))
        half = arith.shrui(arith.andi(lane, _i32(2)), _i32(1))  # 1 in the lanes of 4-7
        off = arith.addi(row, arith.muli(half, _i32(n_half)))
        one = ir.VectorType.get((1,), ir.MemRefType(r.type).element_type)
        lay = mgpu_fa.WGMMA_ROW_LAYOUT
        regs = [vector.load(one, r, [_idx(arith.addi(off, _i32(8 * j)))]) for j in range(2)]
        return mgpu_fa.FragmentedArray(
            _registers=np.array(regs, dtype=object).reshape(lay.registers_shape((64,))),
            _layout=lay, _is_signed=None)

    return load(ref)


def _halves_const(lo: float, hi: float, n: int, interpret):
    """The (n,) f32 vector (the WGMMA layout's reduce(0)) of lo in columns 0-3 and hi in 4-7
    (pack_planes), built in registers: constants passed into `_halves` stay splats that the
    inline_mgpu argument cast cannot materialize (run 92: an unrealized_conversion_cast left in
    the LLVM module)."""
    if interpret:
        return jnp.where(lax.broadcasted_iota(jnp.int32, (n,), 0) < 4, lo, hi).astype(jnp.float32)
    lay = _WG.reduce(0)

    @plgpu.inline_mgpu(arg_types=(),
                       return_type=plgpu.ShapeDtypeStruct((n,), jnp.float32, layout=lay))
    def make(_):
        lane, _ = _lane_warp()
        upper = arith.cmpi(arith.CmpIPredicate.uge, arith.andi(lane, _i32(3)), _i32(2))
        f32 = ir.F32Type.get()
        mlay = lay.to_mgpu()
        const = lambda c: vector.broadcast(mlay.registers_element_type(f32),
                                           arith.constant(f32, c))
        reg = arith.select(upper, const(hi), const(lo))
        return mgpu_fa.FragmentedArray(_registers=np.full(mlay.registers_shape((n,)), reg,
                                                          dtype=object),
                                       _layout=mlay, _is_signed=None)

    return make()


def _wg_max_open(x, scratch_ref):
    """The row max of x (64, N) f32 (WGMMA layout) -> (N,) in the reduce(0) layout, as
    `_wg_reduce(x, "max", ...)` but with one warpgroup barrier instead of two: each warp's
    maxima go to `scratch_ref[warp * N + col]` (shuffles within the warp), one barrier, every
    thread reads the four warps'. Mosaic's reduction ends with a second barrier so that the
    scratch can be written again at once; the caller instead guarantees a warpgroup barrier
    between these reads and the next write of `scratch_ref` (in the decode loop: the barrier
    before P is read, `_wg_sync`). Not interpretable."""
    N = x.shape[1]

    @plgpu.inline_mgpu(arg_types=(_WG, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct((N,), x.dtype, layout=_WG.reduce(0)))
    def reduce(_, xa, ref):
        at = _origins(xa)
        lane, warp = _lane_warp()
        c2 = arith.muli(arith.andi(lane, _i32(3)), _i32(2))  # columns 8i + c2 + (0, 1)
        vty = ir.VectorType(at[(0, 0)].type)
        idx = lambda w, i: arith.index_cast(ir.IndexType.get(), arith.addi(
            arith.addi(arith.muli(w, _i32(N)), _i32(8 * i)), c2))
        for i in range(N // 8):
            vector.store(_warp_col_max(at, i), ref, [idx(warp, i)])
        mgpu_utils.warpgroup_barrier()
        regs = []
        for i in range(N // 8):
            vals = [vector.load(vty, ref, [idx(_i32(w), i)]) for w in range(4)]
            regs.append(arith.maximumf(arith.maximumf(vals[0], vals[1]),
                                       arith.maximumf(vals[2], vals[3])))
        return _col_vector(regs, N)

    return reduce(x, scratch_ref)


# --- Per-warp softmax (`TuningConfig.warp_softmax`) -------------------------------------------
# Each warp of a warpgroup runs its own online softmax over the tokens of its key rows (16 per
# 64-token plane) and its own value product over those tokens: no cross-warp max and no P
# hand-over through SMEM in the loop. Per-warp quantities live in the Mosaic layouts as arrays
# whose warps hold different values (as `_vec_load` with G): valid under row broadcasts and
# elementwise use only, never under a Mosaic reduction.


def _warp_max(x):
    """The max of x (64, N) f32 (WGMMA layout) over each warp's 16 rows -> (N,) in the
    reduce(0) layout, a different vector per warp: three shuffles, no SMEM, no barrier. Not
    interpretable."""
    N = x.shape[1]

    @plgpu.inline_mgpu(arg_types=(_WG,),
                       return_type=plgpu.ShapeDtypeStruct((N,), x.dtype, layout=_WG.reduce(0)))
    def reduce(_, xa):
        regs = [_warp_col_max(_origins(xa), i) for i in range(N // 8)]
        return _col_vector(regs, N)

    return reduce(x)


def _warp_rhs(p16):
    """P (64 tokens, N) fp16 (WGMMA layout) -> each warp's own 16 tokens as mma.sync's B
    operand (16, N) (`Layout.MMA_RHS`, a different operand per warp): each 8x8 block is
    transposed in registers (`movmatrix`), which turns the accumulator fragment (lane (g, c):
    token g, heads 2c, 2c + 1) into the B fragment (head g, tokens 2c, 2c + 1). No SMEM, no
    barrier. Not interpretable."""
    N = p16.shape[1]
    lay = plgpu.Layout.MMA_RHS(p16.dtype)

    @plgpu.inline_mgpu(arg_types=(_WG,),
                       return_type=plgpu.ShapeDtypeStruct((16, N), p16.dtype, layout=lay))
    def rhs(_, xa):
        at = _origins(xa)
        new = lay.to_mgpu()
        regs = np.empty(new.registers_shape((16, N)), dtype=object)
        for i in np.ndindex(regs.shape):
            k0, n0 = new.tiling.untile_indices(i)  # tokens k0 + 2c + (0, 1), head n0 + g
            regs[i] = _transpose8x8(at[(k0, n0)])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=new, _is_signed=None)

    return rhs(p16)


def _swizzled(off, swizzle: int):
    """Byte offset `off` (i32, within a swizzled SMEM buffer) after Mosaic's swizzle: the 16-byte
    chunk index xored with the 128-byte row index modulo swizzle / 16."""
    if swizzle == 16:
        return off
    bits = arith.andi(arith.shrui(off, _i32(7)), _i32(swizzle // 16 - 1))
    return arith.xori(off, arith.shli(bits, _i32(4)))


def _warp_value_codes(codes_ref, transforms, m: int, col0: int):
    """Value code bytes as each warp's own A operand of the value product: the (64, 16) uint16
    tile (WGMMA layout) whose warp-w rows (i, k) hold the code byte of channel 16 m + i and byte
    column col0 + 16 w + k of `codes_ref` (D channels, X byte columns; SMEM tiling (8, sw) and
    an sw-byte swizzle), widened to 16 bits with the *high byte undefined* (every code field
    mask clears it, `_field_sub`). Natural column order: lane (g, c) holds columns 2c, 2c + 1
    and 8 + 2c, 9 + 2c, which one 16-byte load per row and two byte permutes of its four words
    give. Not interpretable."""
    tile_w = transforms[0].tiling[1]
    swizzle = transforms[1].swizzle
    X = codes_ref.shape[-1]
    # blocked V codes (nb, D, 64): column col0 + 16 w is column col0 % 64 + 16 w of block
    # col0 // 64, whose (8, 64) tiles follow the previous blocks'
    blk0, col0 = (col0 // X, col0 % X) if len(codes_ref.shape) == 3 else (0, col0)
    blk_tiles = codes_ref.shape[-2] // 8 * (X // tile_w)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=transforms),),
                       return_type=plgpu.ShapeDtypeStruct((PLANE, 16), jnp.uint16, layout=_WG))
    def load(_, ref):
        lane, warp = _lane_warp()
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        v4 = ir.VectorType.get((4,), i32)
        pair_ty = ir.VectorType.get((2,), ir.IntegerType.get_signless(16))
        base = mgpu_utils.memref_ptr(ref)
        g, c = arith.shrui(lane, _i32(2)), arith.andi(lane, _i32(3))
        col = arith.addi(_i32(col0), arith.muli(warp, _i32(16)))
        # columns 2c, 2c + 1 of the eight in (w0, w1) (resp. (w2, w3)), stored at bytes
        # f = 2c - c % 2 and f + 2 (the middle bytes of every four swapped), into the low bytes
        # of two 16-bit lanes: prmt selector nibbles (f, f, f + 2, f + 2)
        f = arith.subi(arith.muli(c, _i32(2)), arith.andi(c, _i32(1)))
        sel = arith.addi(arith.muli(f, _i32(0x0011)), arith.muli(arith.addi(f, _i32(2)),
                                                                  _i32(0x1100)))
        regs = np.empty(mgpu_fa.WGMMA_LAYOUT.registers_shape((PLANE, 16)), dtype=object)
        at = {mgpu_fa.WGMMA_LAYOUT.tiling.untile_indices(i): i for i in np.ndindex(regs.shape)}
        for r0 in (0, 8):
            row = arith.addi(g, _i32(16 * m + r0))
            # Mosaic's tiled layout: (8, tile_w) tiles, row-major over (row // 8, col // tile_w)
            tile = arith.addi(arith.muli(arith.shrui(row, _i32(3)), _i32(X // tile_w)),
                              arith.divui(col, _i32(tile_w)))
            tile = arith.addi(tile, _i32(blk0 * blk_tiles))
            off = arith.addi(arith.addi(arith.muli(tile, _i32(8 * tile_w)),
                                        arith.muli(g, _i32(tile_w))),
                             arith.remui(col, _i32(tile_w)))
            ptr = mgpu_utils.getelementptr(base, [_swizzled(off, swizzle)], i8)
            words = llvm.load(v4, ptr, alignment=16)
            w = [llvm.extractelement(words, _i32(k)) for k in range(4)]
            for c0, (lo, hi) in ((0, (w[0], w[1])), (8, (w[2], w[3]))):
                r = mgpu_utils.inline_ptx("prmt.b32 $0, $1, $2, $3;", lo, hi, sel,
                                          result_types=i32)
                regs[at[(r0, c0)]] = mgpu_utils.bitcast(r, pair_ty)
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=mgpu_fa.WGMMA_LAYOUT,
                                       _is_signed=False)

    return load(codes_ref)


def _lazy_rescale(m_run, mw, xs, slack: float):
    """Per warp: the running max m_run (N,) against the sub-step's maxima mw (N,) (both per-warp
    vectors in the reduce(0) layout). Where some lane of the warp has mw > m_run + slack, m_new
    = max(m_run, mw) and every (64, N) array of xs (WGMMA layout, f32) is rescaled by 2^(m_run -
    m_new); otherwise m_run and xs are returned as they are (a warp-uniform branch on a vote).
    A max that lags the true one by at most `slack` (log2 units) leaves the softmax exact (the
    sums and the output are all relative to the same m) and bounds the weights by 2^slack, so
    that after the first sub-steps the rescale (one multiply per accumulator register) is
    rarely taken (FlashAttention-4's conditional rescaling). Not interpretable."""
    N = m_run.shape[0]
    vec_t = plgpu.ShapeDtypeStruct((N,), jnp.float32, layout=_WG.reduce(0))
    arr_t = [plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=_WG) for x in xs]

    @plgpu.inline_mgpu(arg_types=(_WG.reduce(0), _WG.reduce(0), *[_WG] * len(xs)),
                       return_type=(vec_t, *arr_t))
    def rescale(_, ma, wa, *xas):
        i1 = ir.IntegerType.get_signless(1)
        m_regs, w_regs = list(ma.registers.flat), list(wa.registers.flat)
        vty = ir.VectorType(m_regs[0].type)
        splat = lambda v: vector.broadcast(vty, mgpu_utils.c(v, ir.F32Type.get()))
        pred = None
        for m, w in zip(m_regs, w_regs, strict=True):
            gt = arith.cmpf(arith.CmpFPredicate.OGT, w, arith.addf(m, splat(slack)))
            gt = vector.reduction(i1, vector.CombiningKind.OR, gt)
            pred = gt if pred is None else arith.ori(pred, gt)
        take = nvvm.vote_sync(_i32(0xFFFFFFFF), pred, "any")
        flat = [(k, i, r) for k, xa in enumerate(xas) for i, r in np.ndenumerate(xa.registers)]
        if_op = scf.IfOp(take, [r.type for r in m_regs] + [r.type for _, _, r in flat],
                         has_else=True)
        with ir.InsertionPoint(if_op.then_block):
            new_m, alpha = [], []
            for m, w in zip(m_regs, w_regs, strict=True):
                nm = arith.maximumf(m, w)
                # nothing seen yet (nm = -inf): a finite stand-in keeps 2^(m - nm) at 0, not NaN
                safe = arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, nm, splat(-np.inf)),
                                    splat(0.0), nm)
                new_m.append(nm)
                alpha.append(math_dialect.exp2(arith.subf(m, safe)))
            out = []
            for k, i, r in flat:
                c0 = xas[k].layout.tiling.untile_indices(i)[1]
                out.append(arith.mulf(r, alpha[c0 // 8]))
            scf.yield_(new_m + out)
        with ir.InsertionPoint(if_op.else_block):
            scf.yield_(m_regs + [r for _, _, r in flat])
        res = list(if_op.results)
        m_out = mgpu_fa.FragmentedArray(
            _registers=np.array(res[:len(m_regs)], dtype=object).reshape(ma.registers.shape),
            _layout=ma.layout, _is_signed=None)
        res = res[len(m_regs):]
        outs = []
        for xa in xas:
            n = xa.registers.size
            outs.append(mgpu_fa.FragmentedArray(
                _registers=np.array(res[:n], dtype=object).reshape(xa.registers.shape),
                _layout=xa.layout, _is_signed=None))
            res = res[n:]
        return (m_out, *outs)

    m_new, *xs = rescale(m_run, mw, *xs)
    return m_new, xs


def _exceed_barrier(x, thr):
    """lazy_max: the warpgroup barrier that hands P over, which also reduces whether any of
    the warpgroup's scores x (64, N) f32 (WGMMA layout) passes thr (N,) (`_WG.reduce(0)`: the
    running max plus the slack): one compare per register, then `bar.red.or.pred` on the
    warpgroup's named barrier (the barrier `_wg_sync` passes, with an OR over its threads'
    predicates). Returns an int32 scalar, 1 or 0 and the same in every thread, for the branch
    that follows. Before (47aa106): a vote per warp stored to the reduction scratch, a plain
    barrier, four flag loads and their sum: ~11 instructions per step more (run 135). A running
    max still at -inf gives thr = -inf, which every finite score passes (the first step of a
    split holds one). Not interpretable."""
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(arg_types=(_WG, _WG.reduce(0)),
                       return_type=plgpu.ShapeDtypeStruct((), jnp.int32, layout=splat))
    def vote(_, xa, ta):
        t_regs = list(ta.registers.flat)
        pred = None
        for i, r in np.ndenumerate(xa.registers):  # scalar compares: ptxas chains FSETP.OR
            t = t_regs[xa.layout.tiling.untile_indices(i)[1] // 8]
            for j in range(ir.VectorType(r.type).shape[0]):
                p = arith.cmpf(arith.CmpFPredicate.OGT, vector.extract(r, [], [j]),
                               vector.extract(t, [], [j]))
                pred = p if pred is None else arith.ori(pred, p)
        out = mgpu_utils.inline_ptx(
            "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; bar.red.or.pred q, $2, 128, p; "
            "selp.u32 $0, 1, 0, q; }",
            arith.extui(ir.IntegerType.get_signless(32), pred),
            mgpu_utils.warpgroup_barrier_idx(sync=False),
            result_types=ir.IntegerType.get_signless(32), has_side_effects=True,
            convergent=True)
        return mgpu_fa.FragmentedArray.splat(out, (), is_signed=True)

    return vote(x, thr)


def _merge_warp_rows(accs, dst):
    """dst[16 m + i, n] += accs[m][16 w + i, n] for w = 0, 1, 2, 3 in that order (one warp at a
    time between warpgroup barriers, so that the sum is the same run to run): the per-warp
    value products (`_warp_value_codes`: warp-w rows 16 w + i stand for channel 16 m + i)
    summed into dst (D, N) f32 in SMEM (untiled). The caller orders dst's initialisation
    before (a warpgroup barrier); the last barrier here orders the sums before any read. Not
    interpretable."""

    @plgpu.inline_mgpu(arg_types=(*[_WG] * len(accs), plgpu.RefType()))
    def merge(_, *args):
        *xs, ref = args
        lane, warp = _lane_warp()
        g, c = arith.shrui(lane, _i32(2)), arith.andi(lane, _i32(3))
        idx = lambda v: arith.index_cast(ir.IndexType.get(), v)
        for w in range(4):
            mine = arith.cmpi(arith.CmpIPredicate.eq, warp, _i32(w))
            with mgpu_utils.when(mine):
                for m, xa in enumerate(xs):
                    for (r0, c0), reg in _origins(xa).items():
                        at = [idx(arith.addi(g, _i32(16 * m + r0))),
                              idx(arith.addi(arith.muli(c, _i32(2)), _i32(c0)))]
                        old = vector.load(ir.VectorType(reg.type), ref, at)
                        vector.store(arith.addf(old, reg), ref, at)
            mgpu_utils.warpgroup_barrier()

    merge(*accs, dst)


def _mma(acc, a, b, interpret):
    """acc + a @ b on warp-level mma.sync (`plgpu.mma`): acc (64, N) f32/int32 and a (64, K)
    in the WGMMA layouts (the same registers per thread as mma.sync's fragments: the casts are
    relabellings), b (K, N) in `Layout.MMA_RHS`. Returns (64, N) in the WGMMA layout."""
    if interpret:  # the interpreter has no mma: the same product in jnp
        return acc + jnp.dot(a, b, preferred_element_type=acc.dtype)
    acc = plgpu.layout_cast(acc, plgpu.Layout.MMA_ACC(acc.dtype))
    return plgpu.layout_cast(plgpu.mma(acc, _as_mma_lhs(a), b), _WG)


def _fresh(r):
    """The register r through an integer of its width and back: a new SSA value, so that MLIR
    does not fold a per-register relabelling (vector -> registers -> vector) away."""
    bits = ir.VectorType(r.type).get_dim_size(0) * mgpu_utils.bitwidth(
        ir.VectorType(r.type).element_type)
    return mgpu_utils.bitcast(mgpu_utils.bitcast(r, ir.IntegerType.get_signless(bits)), r.type)


def _origins(xa):
    """{logical index of the register for lane 0 of warp 0: register} of a FragmentedArray."""
    return {xa.layout.tiling.untile_indices(i): r for i, r in np.ndenumerate(xa.registers)}


def _as_mma_lhs(x):
    """A (64, K) tile in the WGMMA layout (8-bit: WGMMA_8BIT) relabelled as `Layout.MMA_LHS`:
    both give a thread the same elements (warp w rows 16w.., lane (g, t) rows g and g + 8,
    columns 2t.. (16-bit) or 4t.. (8-bit) of every 8- or 16-column block); only the order of
    the register array differs. Mosaic has no such relayout, so it is done here, per
    register, at trace time: no instructions."""
    src = plgpu.Layout.WGMMA_8BIT if x.dtype.itemsize == 1 else _WG
    dst = plgpu.Layout.MMA_LHS(x.dtype)

    @plgpu.inline_mgpu(arg_types=(src,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=dst))
    def relabel(_, xa):
        new = dst.to_mgpu()
        at = _origins(xa)
        regs = np.empty(new.registers_shape(xa.shape), dtype=object)
        for i in np.ndindex(regs.shape):
            regs[i] = _fresh(at[new.tiling.untile_indices(i)])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=new, _is_signed=xa.is_signed)

    return relabel(x)


def _scale_rhs(b, s):
    """fp16(b[k, n] * s[k]): b (K, N) mma.sync's B operand (`Layout.MMA_RHS`), s (K,) in the
    reduce(0) WGMMA layout (warps may hold different vectors, `_vec_load` with G). Both give
    lane l the elements k = 8i + 2 (l % 4) + (0, 1), so it is one fp16x2 multiply per register
    (Mosaic has no broadcast of a vector into MMA_RHS). Not interpretable."""
    lay = plgpu.Layout.MMA_RHS(b.dtype)

    @plgpu.inline_mgpu(arg_types=(lay, _WG.reduce(0)),
                       return_type=plgpu.ShapeDtypeStruct(b.shape, b.dtype, layout=lay))
    def scale(_, ba, sa):
        s_at = _origins(sa)
        regs = np.empty_like(ba.registers)
        for i, r in np.ndenumerate(ba.registers):
            regs[i] = arith.mulf(r, s_at[(ba.layout.tiling.untile_indices(i)[0],)])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=ba.layout, _is_signed=None)

    return scale(b, s)


def _rows_of(za, zb=None):
    """The (64, X) tile (WGMMA layout) whose rows 16 w + (0..7) are za and 16 w + (8..15) zb,
    both (X,) in the reduce(0) layout (per-warp vectors allowed): lane (g, t) holds rows g and
    g + 8 of its warp's 16, so one mma.sync against it gives both vectors' products with B.
    zb None: rows 8..15 undefined (their products are dropped), where copying za there cost
    ptxas a move per register (the key bias at G >= 64: 36 per step at 2-bit G=128). Per
    register, no instructions. Not interpretable."""
    X = za.shape[0]
    one = zb is None

    @plgpu.inline_mgpu(arg_types=(_WG.reduce(0),) * (1 if one else 2),
                       return_type=plgpu.ShapeDtypeStruct((PLANE, X), za.dtype, layout=_WG))
    def rows(_, a, *b):
        lo = _origins(a)
        hi = _origins(b[0]) if b else None
        lay = mgpu_fa.WGMMA_LAYOUT
        regs = np.empty(lay.registers_shape((PLANE, X)), dtype=object)
        for i in np.ndindex(regs.shape):
            r0, c0 = lay.tiling.untile_indices(i)
            if r0 // 8 % 2 == 0:
                regs[i] = _fresh(lo[(c0,)])
            else:
                regs[i] = _fresh(hi[(c0,)]) if hi else llvm.mlir_undef(lo[(c0,)].type)
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=lay, _is_signed=None)

    return rows(za) if one else rows(za, zb)


_MMA_K16 = ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, "
            "{$8,$9}, {$10,$11,$12,$13};")


def _group_min_mma(z_rows, p_ref, z_odd=None):
    """fold_v_warp's minimums term, split over the warps by tokens instead of by groups: (64, N)
    f32 (WGMMA layout) whose row g < n of warp w holds z_rows[g] . P over the warp's own 16
    tokens (16 w .. 16 w + 15); `_warp_group_sum` adds the four warps' rows at the end.
    z_rows: (n, 64) fp16 SMEM, the minimums of the n value groups of a plane's tokens in the
    codes' order; p_ref: the plane's P as `_store_p_perm` stored it ([N, 64], 128-byte swizzle,
    tokens in the `_PERM16` order). One m16n8k16 per warp and 8 heads: B is four tokens of
    head g by one 64-bit load, A the same four of the lane's group row by two 32-bit loads
    once, where each warp's own group over all 64 tokens took four m16n8k16 whose A operand
    ptxas built of moves (runs 97-103). A's rows g + 8 are left undefined (their products
    dropped), or with z_odd (pack_planes: p_ref a score tile of two planes, columns 0-3 the
    even plane's P, 4-7 the odd one's) hold the odd plane's minimums, and the lanes of columns
    4-7 take rows g + 8: both planes' terms from the one mma. Native only (fold_v_warp is)."""
    n, K = z_rows.shape
    N = p_ref.shape[0]
    if K != PLANE or p_ref.shape[1] != PLANE or N % 8 or not 1 <= n <= 8:
        raise ValueError(f"_group_min_mma: z_rows {z_rows.shape}, P {p_ref.shape}")
    packed = z_odd is not None
    if packed and (z_odd.shape != z_rows.shape or N != 8):
        raise ValueError(f"_group_min_mma: z_odd {z_odd.shape} for z_rows {z_rows.shape}, "
                         f"{N} columns (packed planes: 8)")
    zs = (z_rows, z_odd) if packed else (z_rows,)

    @plgpu.inline_mgpu(arg_types=(*[plgpu.RefType()] * len(zs),
                                  plgpu.RefType(transforms=_swz(jnp.float16, PLANE))),
                       return_type=plgpu.ShapeDtypeStruct((PLANE, N), jnp.float32, layout=_WG))
    def prod(_, *refs):
        *zrefs, pref = refs
        i8, i32, f32 = (ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32),
                        ir.F32Type.get())
        lane, warp = _lane_warp()
        g, t = arith.shrui(lane, _i32(2)), arith.andi(lane, _i32(3))
        # A row g and B column g (head 8 i + g) hold a lane's k-lo and k-hi pairs, which must
        # be the same four tokens. B is one 64-bit load per 8 heads: positions 16 w + 4t .. + 3
        # of P (bytes 32 w + 8t of the head's 128-byte row, in the 16-byte chunk 2 w + t // 2,
        # which the swizzle xors with the row, as `_store_p_perm`), i.e. in the `_PERM16`
        # order tokens 16 w + e + (0, 1) and e + (4, 5), e = 8 (t % 2) + 2 (t // 2); A takes
        # those two pairs of the minimums, two 32-bit loads once per plane. (z's consecutive
        # 4t .. 4t + 3 against P's positions 4t .. was run 104's error, 3e-2.) Rows g >= n
        # repeat the last (products dropped).
        row = _idx(arith.minui(g, _i32(n - 1)))
        e = arith.addi(arith.addi(arith.muli(warp, _i32(16)),
                                  arith.muli(arith.andi(t, _i32(1)), _i32(8))),
                       arith.muli(arith.shrui(t, _i32(1)), _i32(2)))
        half = ir.VectorType.get((2,), ir.MemRefType(zrefs[0].type).element_type)

        def k_pairs(ref):  # (k-lo, k-hi) of the lane's group row, as i32
            return [mgpu_utils.bitcast(vector.load(half, ref, [row, _idx(arith.addi(e, _i32(o)))],
                                                   alignment=4), i32) for o in (0, 4)]

        lo, hi = k_pairs(zrefs[0])
        lo8, hi8 = k_pairs(zrefs[1]) if packed else (llvm.mlir_undef(i32),) * 2
        a = [lo, lo8, hi, hi8]  # rows g, g + 8 at k-lo; rows g, g + 8 at k-hi
        chunk = arith.addi(arith.muli(warp, _i32(2)), arith.shrui(t, _i32(1)))
        off = arith.addi(arith.addi(arith.muli(g, _i32(128)),
                                    arith.muli(arith.xori(chunk, g), _i32(16))),
                         arith.muli(arith.andi(t, _i32(1)), _i32(8)))
        base = mgpu_utils.memref_ptr(pref)
        pair_i = ir.VectorType.get((2,), i32)
        zero = arith.constant(f32, 0.0)
        pair = ir.VectorType.get((2,), f32)
        struct = llvm.StructType.get_literal([f32] * 4)
        upper = arith.cmpi(arith.CmpIPredicate.uge, t, _i32(2))  # columns 4-7 (packed)
        rows = {}
        for i in range(N // 8):
            at = mgpu_utils.getelementptr(base, [arith.addi(off, _i32(i * 1024))], i8)
            bq = llvm.load(pair_i, at, alignment=8)
            b = [vector.extract(bq, dynamic_position=[], static_position=[k]) for k in (0, 1)]
            out = llvm.inline_asm(struct, [*a, *b, zero, zero, zero, zero], _MMA_K16,
                                  "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", has_side_effects=False)
            c = [llvm.extractvalue(f32, out, [k]) for k in range(4)]
            if packed:  # the odd plane's columns from rows g + 8
                c = [arith.select(upper, c[k + 2], c[k]) for k in (0, 1)] * 2
            rows[0, 8 * i] = vector.from_elements(pair, c[:2])
            rows[8, 8 * i] = vector.from_elements(pair, c[2:])
        lay = mgpu_fa.WGMMA_LAYOUT
        regs = np.empty(lay.registers_shape((PLANE, N)), dtype=object)
        for idx in np.ndindex(regs.shape):
            r0, c0 = lay.tiling.untile_indices(idx)
            regs[idx] = rows[r0 % 16, c0]
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=lay, _is_signed=None)

    return prod(*zs, p_ref)


def _warp_group_sum(x, groups: tuple[int, ...], scratch_ref):
    """x (64, N) f32 of `_group_min_mma` sums (row g < n of each warp: its partial for group
    g) -> (64, N) whose 16 rows of warp w all hold the four warps' sum for group groups[w]:
    each warp's rows through scratch_ref (rows >= n into a slot never read), a warpgroup
    barrier, each thread adds the four warps' values of its warp's group, and a second
    barrier before the scratch is written again. Once per split. Native only."""
    N = x.shape[1]
    n = max(groups) + 1
    if n > 4 or 4 * (n + 1) * N > _red_scratch(N):
        raise ValueError(f"_warp_group_sum: {n} groups x {N} columns exceed the scratch")

    @plgpu.inline_mgpu(arg_types=(_WG, plgpu.RefType()),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=_WG))
    def total(_, xa, ref):
        at = _origins(xa)
        lane, warp = _lane_warp()
        c2 = arith.muli(arith.andi(lane, _i32(3)), _i32(2))
        slot = arith.minui(arith.shrui(lane, _i32(2)), _i32(n))
        idx = lambda w, g, i: arith.index_cast(ir.IndexType.get(), arith.addi(
            arith.muli(arith.addi(arith.muli(w, _i32(n + 1)), g), _i32(N)),
            arith.addi(_i32(8 * i), c2)))
        for i in range(N // 8):
            vector.store(at[(0, 8 * i)], ref, [idx(warp, slot, i)])
        mgpu_utils.warpgroup_barrier()
        mine = _i32(groups[0])
        for w in range(1, 4):
            if groups[w] != groups[0]:
                mine = arith.select(arith.cmpi(arith.CmpIPredicate.eq, warp, _i32(w)),
                                    _i32(groups[w]), mine)
        vty = ir.VectorType(at[(0, 0)].type)
        sums = {}
        for i in range(N // 8):
            vals = [vector.load(vty, ref, [idx(_i32(w), mine, i)]) for w in range(4)]
            sums[8 * i] = arith.addf(arith.addf(vals[0], vals[1]), arith.addf(vals[2], vals[3]))
        mgpu_utils.warpgroup_barrier()
        regs = np.empty_like(xa.registers)
        for i in np.ndindex(regs.shape):
            r0, c0 = xa.layout.tiling.untile_indices(i)
            regs[i] = sums[c0] if r0 % 16 == 0 else _fresh(sums[c0])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=xa.layout, _is_signed=None)

    return total(x, scratch_ref)


def _row_half(x, h: int):
    """x (64, N) in the WGMMA layout with rows 16 w + 8 h + (0..7) of every warp copied over
    its 16 rows: the (64, N) broadcast of the h-th vector of a `_rows_of` product. Per
    register, no instructions. Not interpretable."""

    @plgpu.inline_mgpu(arg_types=(_WG,),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=_WG))
    def pick(_, xa):
        at = _origins(xa)
        regs = np.empty_like(xa.registers)
        for i in np.ndindex(regs.shape):
            r0, c0 = xa.layout.tiling.untile_indices(i)
            regs[i] = _fresh(at[(r0 - r0 % 16 + 8 * h, c0)])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=xa.layout,
                                       _is_signed=xa.is_signed)

    return pick(x)


def _dense_rows(ref):
    """The (16, X) fp16 SMEM rows `ref` (dense_bias: 16 groups' minimum vectors) as a (64, X)
    A operand in the WGMMA layout whose rows 16 w + r hold ref[r] in every warp w, in the
    `_PERM16` column order: lane (g, t) loads rows g and g + 8 by one 64-bit load per 16
    columns each (`_pairs64`). Not interpretable."""
    X = ref.shape[-1]

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((PLANE, X), ref.dtype, layout=_WG))
    def load(_, r):
        lane, _w = _lane_warp()
        k4 = arith.muli(arith.andi(lane, _i32(3)), _i32(4))
        halves = []
        for h in range(2):
            row = _idx(arith.addi(arith.shrui(lane, _i32(2)), _i32(8 * h)))
            regs = []
            for j in range(X // 16):
                regs.extend(_pairs64(r, [row, _idx(arith.addi(k4, _i32(16 * j)))]))
            halves.append(_origins(_col_vector(regs, X)))
        lay = mgpu_fa.WGMMA_LAYOUT
        out = np.empty(lay.registers_shape((PLANE, X)), dtype=object)
        for i in np.ndindex(out.shape):
            r0, c0 = lay.tiling.untile_indices(i)
            out[i] = halves[r0 // 8 % 2][(c0,)]
        return mgpu_fa.FragmentedArray(_registers=out, _layout=lay, _is_signed=None)

    return load(ref)


def _store_bias_rows(x, ref):
    """dense_bias: the 16 rows of each warp of x (64, N) f32, WGMMA layout (a `_dense_rows`
    product: the same in every warp) to that warp's columns of ref (16, 4, N) f32: lane (g, t)
    stores rows g and g + 8 of its columns 2t, 2t + 1 of every 8. The caller orders the
    stores before the warp's loads (`mgpu_utils.warp_barrier`). Not interpretable."""

    @plgpu.inline_mgpu(arg_types=(_WG, plgpu.RefType()))
    def store(_, xa, r):
        lane, warp = _lane_warp()
        g, t2 = arith.shrui(lane, _i32(2)), arith.muli(arith.andi(lane, _i32(3)), _i32(2))
        for i, reg in np.ndenumerate(xa.registers):
            r0, c0 = xa.layout.tiling.untile_indices(i)
            vector.store(reg, r, [_idx(arith.addi(g, _i32(r0 % 16))), _idx(warp),
                                  _idx(arith.addi(t2, _i32(c0)))])

    store(x, ref)


def _bias_rows(ref, rows: tuple[int, ...], dup_half: bool):
    """dense_bias: the key bias of a (64, N) score tile, f32 in the WGMMA layout: warp w's rows
    all hold row rows[w] of its columns of ref (n, 4, N) (`_store_bias_rows`), one 64-bit load
    per 8 columns. dup_half (pack_zeros: the bias mma's B had q in columns 0-3 only): columns
    4-7 take the heads of 0-3, where the odd plane of a packed tile puts them. Not
    interpretable."""
    N = ref.shape[-1]

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                       return_type=plgpu.ShapeDtypeStruct((PLANE, N), jnp.float32, layout=_WG))
    def load(_, r):
        lane, warp = _lane_warp()
        row = _i32(rows[0])
        for w in range(1, 4):
            if rows[w] != rows[0]:
                row = arith.select(arith.cmpi(arith.CmpIPredicate.eq, warp, _i32(w)),
                                   _i32(rows[w]), row)
        t = arith.andi(lane, _i32(1 if dup_half else 3))
        t2 = arith.muli(t, _i32(2))
        lay = mgpu_fa.WGMMA_LAYOUT
        f2 = ir.VectorType.get((2,), ir.F32Type.get())
        loaded, out = {}, np.empty(lay.registers_shape((PLANE, N)), dtype=object)
        for i in np.ndindex(out.shape):
            _r0, c0 = lay.tiling.untile_indices(i)
            if c0 not in loaded:
                col = _idx(arith.addi(t2, _i32(c0)))
                loaded[c0] = vector.load(f2, r, [_idx(row), _idx(warp), col])
                out[i] = loaded[c0]
            else:
                out[i] = _fresh(loaded[c0])
        return mgpu_fa.FragmentedArray(_registers=out, _layout=lay, _is_signed=None)

    return load(ref)


def _mma_rhs(ref, interpret):
    """The (K, N) SMEM view `ref` loaded as mma.sync's B operand (replicated over warps)."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.MMA_RHS(ref.dtype))


def _wg_sync(interpret):
    """A barrier over this warpgroup's 128 threads (named barrier 1 + warpgroup index): orders
    SMEM stores of one warp before another warp's loads. The interpreter runs a warpgroup as
    one thread, so it needs none."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def sync(_):
        mgpu_utils.warpgroup_barrier()

    sync()


def _stamp(ref, col: int, smid: bool = False):
    """Diagnostics (`TuningConfig.trace`): one thread of the warpgroup writes %globaltimer_lo
    (ns) mod 2^24, or with smid the SM's id, as float32 (exact below 2^24) to ref[col] of
    the warpgroup's f32 SMEM vector `ref`. The 24 bits wrap every 16.8 ms, 80 times a
    0.2 ms launch: differences within one launch are exact mod 2^24. Not interpretable."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def store(_, r):
        v = mgpu_utils.smid() if smid else mgpu_utils.globaltimer("low")
        v = arith.uitofp(ir.F32Type.get(), arith.andi(v, _i32(0xFFFFFF)))
        vec = vector.broadcast(ir.VectorType.get((1,), ir.F32Type.get()), v)
        with mgpu_utils.single_thread(mgpu_utils.ThreadSubset.WARPGROUP):
            vector.store(vec, r, [_idx(_i32(col))])

    store(ref)


def _copy_stamp(src, dst, col: int):
    """Diagnostics (`TuningConfig.trace`): one thread of the warpgroup copies src[0] to
    dst[col] (f32 SMEM vectors of the warpgroup): the start stamp into the lse tile. The
    caller orders it after the warpgroup's own stores to dst (`_wg_sync`). Not
    interpretable."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def copy(_, s, d):
        f1 = ir.VectorType.get((1,), ir.F32Type.get())
        with mgpu_utils.single_thread(mgpu_utils.ThreadSubset.WARPGROUP):
            vector.store(vector.load(f1, s, [_idx(_i32(0))]), d, [_idx(_i32(col))])

    copy(src, dst)


def _warp_sync():
    """A barrier over this warp's 32 threads: orders one lane's SMEM stores before another
    lane's loads where only the warp itself reads them (dense_bias's bias rows)."""

    @plgpu.inline_mgpu()
    def sync(_):
        mgpu_utils.warp_barrier()

    sync()


def _pipeline(step, specs, srcs, bufs, barrier, wg, stages: int, nsteps, carry,
              sync: bool = False, one_warp: bool = False, empty=None, issuer=None,
              spread: bool = False, no_copies: bool = False, sync_every: bool = False):
    """`plgpu.emit_pipeline` for one warpgroup (of a block of one or several, each with its
    own buffers): steps 0 .. nsteps-1 of `specs` (block shapes and index maps over `srcs`, GMEM)
    go through `bufs[j]` [stages, *block] with `barrier[wg * stages + slot]`; `step(idx,
    *slot_refs, carry)` as for emit_pipeline. A slot is refilled right after its step, ordered
    after every warp's reads by a warpgroup barrier: each copy's own (Mosaic's auto barriers),
    or, with `sync` (a kernel compiled without auto barriers), one before all of the step's
    copies (run 54: the six barriers and the code between them were 9% of the stalls).
    one_warp: the copies are issued by one warp of the warpgroup (warp `issuer`, by default
    wg % 4, so that the block's W issuing warps sit on different schedulers) instead of by all
    four: in the warpgroup semantics every warp computes the copies' coordinates and every
    thread arrives on the barrier (`TuningConfig.copy_warp`). empty (with one_warp and sync):
    barriers [wg * stages + slot] of one warpgroup arrival each: every thread arrives once it
    has read the slot, and only the issuing warp waits there before refilling it, in place of
    the warpgroup barrier (`TuningConfig.release_slots`). spread (with one_warp): copy j
    from warp (issuer + j) % 4, so that no warp computes more than two copies' coordinates
    (`TuningConfig.spread_copies`). no_copies: benchmark ablation (`skip="copies"`).
    sync_every (with sync): the warpgroup barrier after every step, also the last `stages`
    that refill nothing: the step's own hand-overs count on it (`TuningConfig.lazy_max`)."""
    def copies(i, slot, which=None):
        for j, (spec, src, buf) in enumerate(zip(specs, srcs, bufs, strict=True)):
            if which is not None and j not in which:
                continue
            at = tuple(pl.ds(ix * n, n) for ix, n in zip(spec.index_map(i), spec.block_shape,
                                                          strict=True))
            plgpu.copy_gmem_to_smem(src.at[at], buf.at[slot], barrier.at[wg * stages + slot])

    release = empty is not None  # the caller passes it only with one_warp and sync

    def fetch(i, slot, first=False):
        if sync and not first and not release and not sync_every:
            _wg_sync(False)
        if one_warp:
            def issue(which=None):
                if release and not first:  # every warp has read the slot
                    plgpu.barrier_wait(empty.at[wg * stages + slot])
                copies(i, slot, which)
            # warp semantics: the issuing warp's 32 threads arrive for all 128
            who = lax.rem(wg, 4) if issuer is None else issuer
            if spread:  # copy j from warp (who + j) % 4
                def per_warp(w):
                    for k in range(min(4, len(specs))):
                        which = tuple(range(k, len(specs), 4))
                        pl.when(w == lax.rem(who + k, 4))(functools.partial(issue, which))
                plgpu.warp_map(per_warp)
            else:
                plgpu.warp_map(lambda w: pl.when(w == who)(issue))
        else:
            copies(i, slot)

    for k in range(stages):
        pl.when(k < nsteps)(functools.partial(fetch, k, k, True))

    def body(i, carry):
        slot = lax.rem(i, stages)
        if no_copies:  # the prologue's copies, then none: compute on the filled slots
            pl.when(i < stages)(lambda: plgpu.barrier_wait(barrier.at[wg * stages + slot]))
            return step((i,), *[buf.at[slot] for buf in bufs], carry)
        plgpu.barrier_wait(barrier.at[wg * stages + slot])
        carry = step((i,), *[buf.at[slot] for buf in bufs], carry)
        if release:
            plgpu.barrier_arrive(empty.at[wg * stages + slot])
        if sync and sync_every and not release:
            _wg_sync(False)
        pl.when(i + stages < nsteps)(lambda: fetch(i + stages, slot))
        return carry

    return lax.fori_loop(0, nsteps, body, carry)


def _warp_groups(p: int, G: int) -> tuple[int, ...]:
    """The key groups (counted from the sub-step's first) of the rows 16 w .. 16 w + 15 of plane
    p, w = 0..3: in the cache order those rows hold the tokens 256 (p // 4) + 64 w + 16 (p % 4)
    + (0..15) of the sub-step, so a warp's rows of a block's four planes lie in one group
    (G >= 64) or two (G = 32)."""
    return tuple((_CACHE_BLOCK * (p // 4) + 64 * w + 16 * (p % 4)) // G for w in range(4))


def _plane_tokens(p: int, rows):
    """Token offsets within the sub-step of rows (an int32 array of row indices < 64) of plane p
    in the cache order (`_warp_groups`)."""
    return _CACHE_BLOCK * (p // 4) + 16 * (p % 4) + rows + 48 * lax.div(rows, 16)


def _warp_vec_load(at, groups: tuple[int, ...], **kw):
    """The vector of group groups[w] in each warp w (`_vec_load`): `at(g)` the (X,) vector of
    group g, `at(g, n)` the (n, X) rows of groups g .. g+n-1."""
    g0 = min(groups)
    if len(set(groups)) == 1:
        return _vec_load(at(g0), **kw)
    return _vec_load(at(g0, max(groups) - g0 + 1), rows=tuple(g - g0 for g in groups), **kw)


def _group_vecs(scale_at, min_at, groups: tuple[int, ...], shape, cache: dict, key,
                per_warp: bool = False, perm: bool = False):
    """Scale and minimum of a (64, X) tile whose rows 16 w .. 16 w + 15 lie in group groups[w]
    (w = 0..3), broadcast along rows (WGMMA layout). `scale_at(g)` / `min_at(g)` give the vector
    of group g, `scale_at(g, n)` the (n, X) rows of groups g .. g+n-1. A tile over several
    groups: per_warp loads each warp's own vector (`_vec_load` with rows), otherwise a select
    per element picks it by row block. perm: vectors in the widen8 column order."""

    def vec(at, g):
        k = (key, at is min_at, g)
        if k not in cache:  # tiles of one group share the SMEM loads of its vectors
            cache[k] = (_vec_load(at(g), perm=True) if perm else
                        plgpu.load(at(g), (), layout=_WG.reduce(0)))
        return lax.broadcast_in_dim(cache[k], shape, [1])

    if len(set(groups)) == 1:
        return vec(scale_at, groups[0]), vec(min_at, groups[0])
    if per_warp:
        def wvec(at):
            k = (key, at is min_at, groups, "warp")
            if k not in cache:
                cache[k] = _warp_vec_load(at, groups, perm=perm)
            return lax.broadcast_in_dim(cache[k], shape, [1])
        return wvec(scale_at), wvec(min_at)
    blk = lax.div(plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=_WG), 16)

    def pick(at):
        x = vec(at, groups[0])
        for w in range(1, 4):
            if groups[w] != groups[0]:
                x = jnp.where(blk == w, vec(at, groups[w]), x)
        return x

    return pick(scale_at), pick(min_at)


_MAX_CLUSTER = 8  # the portable cluster size limit (blocks): `merge_splits`' cluster of a row


def _merge_splits(o_all, lse_all, *, W: int, C: int, interpret):
    """The log-sum-exp merge of one row's S = C * W splits inside the kernel (`merge_splits`):
    run by warpgroup 0 of the cluster's block 0 once every warpgroup of the cluster has its
    partial in its own SMEM (o_all [W, D, NP] f32, normalized; lse_all [W, NP] f32, natural log,
    -inf for an empty split; without the W axis at W = 1). Writes the merged (o, lse) over
    warpgroup 0's tiles (o_all[0], lse_all[0]); rows whose splits are all empty give o = 0,
    lse = -inf, as `merge_partials`.

    Natively every thread merges whole 16-byte chunks of the [D, NP] tile (chunk k = thread +
    128 i: D NP / 512 of them, four columns of one row each), reading block c's tiles over
    distributed shared memory (mapa + ld.shared::cluster; the local block's with plain loads),
    with ex2/lg2.approx; one warpgroup barrier between the reads and the lse store (other
    threads still read lse_all[0]). The interpreter has no distributed shared memory (C = 1
    only there): jnp over the local tiles."""
    tile = (lambda r, j: r.at[j]) if W > 1 else (lambda r, j: r)
    if interpret:
        if C != 1:
            raise NotImplementedError("the interpreter merges one block's splits only (C = 1)")
        D, NP = tile(o_all, 0).shape
        ls = [tile(lse_all, j)[...] for j in range(W)]
        mx = functools.reduce(jnp.maximum, ls)
        safe = jnp.where(mx > -jnp.inf, mx, 0.0)
        ws = [jnp.exp(x - safe) for x in ls]
        tot = functools.reduce(jnp.add, ws)
        ok = tot > 0
        inv = jnp.where(ok, 1.0 / jnp.where(ok, tot, 1.0), 0.0)
        for mt in range(D // PLANE):
            rows = pl.ds(mt * PLANE, PLANE)
            acc = functools.reduce(jnp.add, [
                tile(o_all, j)[rows, :] * lax.broadcast_in_dim(ws[j], (PLANE, NP), [1])
                for j in range(W)])
            tile(o_all, 0)[rows, :] = acc * lax.broadcast_in_dim(inv, (PLANE, NP), [1])
        tile(lse_all, 0)[...] = jnp.where(ok, safe + jnp.log(jnp.where(ok, tot, 1.0)), -jnp.inf)
        return

    D, NP = o_all.shape[-2:]
    chunks = D * NP // 512

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def merge(_, o_ref, l_ref):
        i8, i32, f32 = (ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32),
                        ir.F32Type.get())
        v4 = ir.VectorType.get((4,), f32)
        tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))  # (warpgroup 0: 0-127 already)
        o_base, l_base = mgpu_utils.memref_ptr(o_ref), mgpu_utils.memref_ptr(l_ref)
        as_i32 = lambda p: llvm.ptrtoint(i32, p)
        struct = llvm.StructType.get_literal([f32] * 4)
        cst = lambda v: arith.constant(f32, v)
        asm1 = lambda op, x: llvm.inline_asm(f32, [x], f"{op} $0, $1;", "=f,f",
                                             has_side_effects=False)

        def load(base, off, c):
            """The 16 bytes at byte offset off of the tile `base` in block c of the cluster."""
            at = mgpu_utils.getelementptr(base, [off], i8)
            if c == 0:  # this block (the merging warpgroup's)
                return [vector.extract(llvm.load(v4, at, alignment=16), dynamic_position=[],
                                       static_position=[k]) for k in range(4)]
            remote = llvm.inline_asm(i32, [as_i32(at), _i32(c)],
                                     "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r",
                                     has_side_effects=False)
            out = llvm.inline_asm(struct, [remote],
                                  "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];",
                                  "=f,=f,=f,=f,r", has_side_effects=True)
            return [llvm.extractvalue(f32, out, [k]) for k in range(4)]

        splits = [(c, w) for c in range(C) for w in range(W)]
        log2e, ln2 = float(np.log2(np.e)), float(np.log(2.0))
        merged, lses = [], []
        for i in range(chunks):
            k = arith.addi(tid, _i32(128 * i))
            off = arith.muli(k, _i32(16))  # bytes into a [D, NP] tile
            col = arith.muli(arith.remui(arith.muli(k, _i32(4)), _i32(NP)), _i32(4))  # bytes
            if i == 0 or 512 % NP:  # (chunks 128 apart share their columns where NP | 512)
                ls = [load(l_base, arith.addi(col, _i32(w * NP * 4)), c) for c, w in splits]
            os_ = [load(o_base, arith.addi(off, _i32(w * D * NP * 4)), c) for c, w in splits]
            out_o, out_l = [], []
            for e in range(4):
                mx = functools.reduce(arith.maximumf, [x[e] for x in ls])
                safe = arith.select(arith.cmpf(arith.CmpFPredicate.OGT, mx, cst(-np.inf)),
                                    mx, cst(0.0))
                ws = [asm1("ex2.approx.ftz.f32", arith.mulf(arith.subf(x[e], safe), cst(log2e)))
                      for x in ls]
                tot = functools.reduce(arith.addf, ws)
                acc = functools.reduce(arith.addf, [
                    arith.mulf(w, o[e]) for w, o in zip(ws, os_, strict=True)])
                ok = arith.cmpf(arith.CmpFPredicate.OGT, tot, cst(0.0))
                out_o.append(arith.select(ok, arith.divf(acc, tot), cst(0.0)))
                lg = arith.addf(safe, arith.mulf(asm1("lg2.approx.ftz.f32", tot), cst(ln2)))
                out_l.append(arith.select(ok, lg, cst(-np.inf)))
            merged.append((off, vector.from_elements(v4, out_o)))
            lses.append((col, vector.from_elements(v4, out_l), k))
        mgpu_utils.warpgroup_barrier()  # every thread's reads of lse_all[0] before its store
        for off, v in merged:
            llvm.store(v, mgpu_utils.getelementptr(o_base, [off], i8), alignment=16)
        for col, v, k in lses:  # the chunks of row 0 hold every column once
            first = arith.cmpi(arith.CmpIPredicate.ult, k, _i32(NP // 4))
            with mgpu_utils.when(first):
                llvm.store(v, mgpu_utils.getelementptr(l_base, [col], i8), alignment=16)

    merge(o_all, lse_all)


def _q_tile(q_ref, q_s, *, nq: int, scale: float, dup: bool):
    """The query's prologue inside the kernel (`TuningConfig.q_prologue`): the nq query heads
    of one kv head, q_ref [nq, D] bf16/fp16 in GMEM, to the key product's B tile q_s [NP, D]
    fp16 (tiling (8, 64), 128-byte swizzle): times `scale` in float32, in the `_PERM16`
    contraction order of the widen8 code tiles, rows nq.. zero (dup, pack_planes without
    pack_zeros: rows 4-7 repeat rows 0-3). What `_kernel_call` otherwise does in XLA before the
    launch, one fusion per call. Thread t takes one 16-column block of one row (NP D / 16 of
    them): two 16-byte loads, the words 0, 2, 4, 6 of the block to its first output chunk and
    1, 3, 5, 7 to its second (the order `_PERM16` puts the column pairs in). The caller orders
    the stores before the tile's readers (`_wg_sync`, `commit_smem` for wgmma). Native only."""
    NP, D = q_s.shape[-2:]
    blocks = D // 16
    dt = q_ref.dtype

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),
                                  plgpu.RefType(transforms=_swz(jnp.float16, 64))))
    def prologue(_, src, dst):
        i8, i32, f32 = (ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32),
                        ir.F32Type.get())
        v4 = ir.VectorType.get((4,), i32)
        e2 = ir.VectorType.get((2,), ir.BF16Type.get() if dt == jnp.bfloat16
                               else ir.F16Type.get())
        h2, f2 = ir.VectorType.get((2,), ir.F16Type.get()), ir.VectorType.get((2,), f32)
        sc = arith.constant(f2, ir.DenseElementsAttr.get_splat(f2, ir.FloatAttr.get(f32, scale)))
        zero = arith.constant(v4, ir.DenseElementsAttr.get_splat(v4, ir.IntegerAttr.get(i32, 0)))
        tid = arith.andi(mgpu_utils.thread_idx(), _i32(127))
        src_base, dst_base = mgpu_utils.memref_ptr(src), mgpu_utils.memref_ptr(dst)

        def conv(w):  # two q elements -> fp16(scale * x) as one word
            x = vector.bitcast(e2, vector.broadcast(ir.VectorType.get((1,), i32), w))
            x = arith.extf(f2, x)
            y = arith.truncf(h2, arith.mulf(x, sc))
            return vector.extract(vector.bitcast(ir.VectorType.get((1,), i32), y),
                                  dynamic_position=[], static_position=[0])

        for i in range(-(-NP * blocks // 128)):
            k = arith.addi(tid, _i32(128 * i))
            r, cb = arith.divui(k, _i32(blocks)), arith.remui(k, _i32(blocks))
            src_r = arith.subi(r, _i32(4)) if dup else r
            live = arith.cmpi(arith.CmpIPredicate.ult, r, _i32(nq))
            if dup:  # rows 4-7 from rows 0-3
                live_dup = arith.andi(arith.cmpi(arith.CmpIPredicate.uge, r, _i32(4)),
                                      arith.cmpi(arith.CmpIPredicate.ult, src_r, _i32(nq)))
                src_row = arith.select(live, r, src_r)
                live = arith.ori(live, live_dup)
            else:
                src_row = r
            src_row = arith.minui(src_row, _i32(nq - 1))  # (a dead row reads a live one)
            in_range = arith.cmpi(arith.CmpIPredicate.ult, k, _i32(NP * blocks))
            r8 = arith.andi(r, _i32(7))
            tile0 = arith.addi(arith.muli(arith.shrui(r, _i32(3)), _i32(D // 64)),
                               arith.shrui(cb, _i32(2)))  # 64 columns = 4 blocks per tile
            with mgpu_utils.when(in_range):
                words = []
                off = arith.muli(arith.addi(arith.muli(src_row, _i32(D)),
                                            arith.muli(cb, _i32(16))), _i32(2))
                for half in range(2):
                    at = mgpu_utils.getelementptr(src_base, [arith.addi(off, _i32(16 * half))],
                                                  i8)
                    x = arith.select(live, llvm.load(v4, at, alignment=16), zero)
                    words += [vector.extract(x, dynamic_position=[], static_position=[j])
                              for j in range(4)]
                words = [conv(w) for w in words]
                for half in range(2):  # output chunk 2 (cb % 4) + half of the row's 64-col tile
                    ch = arith.addi(arith.muli(arith.andi(cb, _i32(3)), _i32(2)), _i32(half))
                    byte = arith.addi(arith.addi(arith.muli(tile0, _i32(1024)),
                                                 arith.muli(r8, _i32(128))),
                                      arith.muli(arith.xori(ch, r8), _i32(16)))
                    out = vector.from_elements(v4, [words[2 * j + half] for j in range(4)])
                    llvm.store(out, mgpu_utils.getelementptr(dst_base, [byte], i8), alignment=16)

    prologue(q_ref, q_s)
