"""SMEM <-> register fragments: vector and tile loads, stores of P and of the bias rows, the
per-warp value codes, zeroing, and the query tile's prologue.

The loads build WGMMA-layout values (`layout.WG_LAYOUT` tiles, or its reduce(0) column
vectors) from SMEM with the addressing written out, for tiled and swizzled buffers as
`layout.swizzle_transforms` lays them out, where Mosaic's own loads would cost a relayout or
per-step address arithmetic. Some results are per-warp (warps or lanes hold different
vectors: `vec_load` with rows, `warp_vec_load`, `row_halves_load`, `warp_value_codes`): valid
under a broadcast along rows and elementwise use only. The caller orders stores before other
threads' loads (`reduce.warpgroup_sync`, `reduce.warp_sync`, `commit_smem` for wgmma).

All inline Mosaic GPU (native only), except `group_vecs` without per_warp and perm (a Mosaic
load and jnp selects).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.rotation import sign_bits
from pallas_kernels.sm90.inline import (
    as_index,
    col_vector,
    const_i32,
    fresh_value,
    lane_warp,
    origins,
    transpose8x8,
)
from pallas_kernels.sm90.layout import PLANE, WG_LAYOUT, swizzle_transforms


def pairs64(ref, idx):
    """The four fp16 elements at `idx` (the last index a multiple of 4: 8-byte aligned) of an
    SMEM ref as two 2-element registers, from one 64-bit load: in the `PERM16` order a
    thread's register pair (positions 2c, 2c + 1 and 8 + 2c, 9 + 2c of a 16-block) is the
    four consecutive elements 4c .. 4c + 3."""
    dt = ir.MemRefType(ref.type).element_type
    quad = vector.load(ir.VectorType.get((4,), dt), ref, idx, alignment=8)
    pair = ir.VectorType.get((2,), dt)
    return tuple(vector.extract_strided_slice(pair, quad, [o], [2], [1]) for o in (0, 2))


def swizzled_offset(off, swizzle: int):
    """Byte offset `off` (i32, within a swizzled SMEM buffer) after Mosaic's swizzle: the 16-byte
    chunk index xored with the 128-byte row index modulo swizzle / 16."""
    if swizzle == 16:
        return off
    bits = arith.andi(arith.shrui(off, const_i32(7)), const_i32(swizzle // 16 - 1))
    return arith.xori(off, arith.shli(bits, const_i32(4)))


def vec_load(
    rows_ref,
    *,
    rows: tuple[int, ...] = (),
    perm: bool = False,
    wide: bool = False,
    align4: bool = False,
    n_half: int = 0,
):
    """A (X,) fp16 vector in the reduce(0) WGMMA layout (the row vector of a 64-row tile).

    rows_ref: (X,) or, with rows, (n, X) vectors of which warp w loads row rows[w] (the group
    its 16 tile rows lie in), so the warps hold different vectors (valid only under a row
    broadcast and elementwise use: `group_vecs`, `kfold_scores`). perm: in the `PERM16`
    order of the widen8 path; wide (with perm): two registers per 64-bit load (`pairs64`)
    instead of one per 32-bit load. align4 (perm, not wide): the 32-bit loads marked 4-byte
    aligned (they are: even element offsets in rows of >= 64 elements); without it MLIR gives
    them the element's 2 and LLVM may not prove more where the row offset is dynamic (under
    fold_v_warp: 88 more LDS per step than the IR's loads). n_half (perm):
    rows_ref holds X + n_half elements and lanes 16-31 (those of mma.sync's B columns 4-7)
    read theirs n_half further on: the scale vectors of two planes at once for a packed score
    tile's B (pack_planes with fold_v_warp; lane-dependent, valid only in `mma.scale_rhs`). Not
    interpretable (inline Mosaic GPU).
    """
    X = rows_ref.shape[-1] - n_half

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((X,), rows_ref.dtype, layout=WG_LAYOUT.reduce(0)),
    )
    def load(_, ref):
        lane, warp = lane_warp()
        if rows:  # the warp's row, by selects on the (loop-invariant) warp index
            g = const_i32(rows[0])
            for w in range(1, 4):
                if rows[w] != rows[0]:
                    g = arith.select(
                        arith.cmpi(arith.CmpIPredicate.eq, warp, const_i32(w)),
                        const_i32(rows[w]),
                        g,
                    )
            ref = mgpu_utils.memref_slice(ref, arith.index_cast(ir.IndexType.get(), g))
        if not perm:
            return mgpu_fa.FragmentedArray.load_untiled(
                ref, layout=mgpu_fa.WGMMA_COL_LAYOUT, optimized=False
            )
        k4 = arith.muli(arith.andi(lane, const_i32(3)), const_i32(4))
        if n_half:  # lanes 16-31: the second vector
            k4 = arith.addi(k4, arith.muli(arith.shrui(lane, const_i32(4)), const_i32(n_half)))
        pair_ty = ir.VectorType.get((2,), ir.MemRefType(ref.type).element_type)
        regs = []
        if wide:  # registers 2j, 2j + 1: positions 16j + 4k .. 16j + 4k + 3
            for j in range(X // 16):
                regs.extend(pairs64(ref, [as_index(arith.addi(k4, const_i32(16 * j)))]))
        else:
            for i in range(X // 8):  # register i: positions 8i + 2k + (0, 1)
                col = arith.addi(k4, const_i32(16 * (i // 2) + 2 * (i % 2)))
                regs.append(
                    vector.load(pair_ty, ref, [as_index(col)], alignment=4 if align4 else None)
                )
        return col_vector(regs, X)

    return load(rows_ref)


def warp_vec_load(at, groups: tuple[int, ...], **kw):
    """The vector of group groups[w] in each warp w (`vec_load`): `at(g)` the (X,) vector of
    group g, `at(g, n)` the (n, X) rows of groups g .. g+n-1."""
    g0 = min(groups)
    if len(set(groups)) == 1:
        return vec_load(at(g0), **kw)
    return vec_load(at(g0, max(groups) - g0 + 1), rows=tuple(g - g0 for g in groups), **kw)


def group_vecs(
    scale_at,
    min_at,
    groups: tuple[int, ...],
    shape,
    cache: dict,
    key,
    per_warp: bool = False,
    perm: bool = False,
):
    """Scale and minimum of a (64, X) tile whose rows 16 w .. 16 w + 15 lie in group groups[w]
    (w = 0..3), broadcast along rows (WGMMA layout). `scale_at(g)` / `min_at(g)` give the vector
    of group g, `scale_at(g, n)` the (n, X) rows of groups g .. g+n-1. A tile over several
    groups: per_warp loads each warp's own vector (`vec_load` with rows), otherwise a select
    per element picks it by row block. perm: vectors in the widen8 column order."""

    def vec(at, g):
        k = (key, at is min_at, g)
        if k not in cache:  # tiles of one group share the SMEM loads of its vectors
            cache[k] = (
                vec_load(at(g), perm=True)
                if perm
                else plgpu.load(at(g), (), layout=WG_LAYOUT.reduce(0))
            )
        return lax.broadcast_in_dim(cache[k], shape, [1])

    if len(set(groups)) == 1:
        return vec(scale_at, groups[0]), vec(min_at, groups[0])
    if per_warp:

        def wvec(at):
            k = (key, at is min_at, groups, "warp")
            if k not in cache:
                cache[k] = warp_vec_load(at, groups, perm=perm)
            return lax.broadcast_in_dim(cache[k], shape, [1])

        return wvec(scale_at), wvec(min_at)
    blk = lax.div(plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=WG_LAYOUT), 16)

    def pick(at):
        x = vec(at, groups[0])
        for w in range(1, 4):
            if groups[w] != groups[0]:
                x = jnp.where(blk == w, vec(at, groups[w]), x)
        return x

    return pick(scale_at), pick(min_at)


def row_halves_load(ref, n_half: int):
    """`mma.halves(lo, hi, rows=True)` of two (64,) row vectors loaded from one SMEM ref: ref
    holds lo at [0, 64) and hi at [n_half, n_half + 64), and the lanes of columns 0-3 read
    lo's rows, those of 4-7 hi's (a lane-dependent vector, valid as `halves`' rows). The
    lane's offset (its rows and half) is loop-invariant, so that each load addresses the
    step's buffer plus it (LDS [R + UR]) where the select between two loaded vectors left
    ptxas computing and selecting both addresses every step. Not interpretable."""

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((64,), ref.dtype, layout=WG_LAYOUT.reduce(1)),
    )
    def load(_, r):
        lane, warp = lane_warp()
        row = arith.addi(arith.muli(warp, const_i32(16)), arith.shrui(lane, const_i32(2)))
        half = arith.shrui(arith.andi(lane, const_i32(2)), const_i32(1))  # 1 in the lanes of 4-7
        off = arith.addi(row, arith.muli(half, const_i32(n_half)))
        one = ir.VectorType.get((1,), ir.MemRefType(r.type).element_type)
        lay = mgpu_fa.WGMMA_ROW_LAYOUT
        regs = [
            vector.load(one, r, [as_index(arith.addi(off, const_i32(8 * j)))]) for j in range(2)
        ]
        return mgpu_fa.FragmentedArray(
            _registers=np.array(regs, dtype=object).reshape(lay.registers_shape((64,))),
            _layout=lay,
            _is_signed=None,
        )

    return load(ref)


def dense_rows(ref):
    """The (16, X) fp16 SMEM rows `ref` (dense_bias: 16 groups' minimum vectors) as a (64, X)
    A operand in the WGMMA layout whose rows 16 w + r hold ref[r] in every warp w, in the
    `PERM16` column order: lane (g, t) loads rows g and g + 8 by one 64-bit load per 16
    columns each (`pairs64`). Not interpretable."""
    X = ref.shape[-1]

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((PLANE, X), ref.dtype, layout=WG_LAYOUT),
    )
    def load(_, r):
        lane, _w = lane_warp()
        k4 = arith.muli(arith.andi(lane, const_i32(3)), const_i32(4))
        halves = []
        for h in range(2):
            row = as_index(arith.addi(arith.shrui(lane, const_i32(2)), const_i32(8 * h)))
            regs = []
            for j in range(X // 16):
                regs.extend(pairs64(r, [row, as_index(arith.addi(k4, const_i32(16 * j)))]))
            halves.append(origins(col_vector(regs, X)))
        lay = mgpu_fa.WGMMA_LAYOUT
        out = np.empty(lay.registers_shape((PLANE, X)), dtype=object)
        for i in np.ndindex(out.shape):
            r0, c0 = lay.tiling.untile_indices(i)
            out[i] = halves[r0 // 8 % 2][(c0,)]
        return mgpu_fa.FragmentedArray(_registers=out, _layout=lay, _is_signed=None)

    return load(ref)


def store_bias_rows(x, ref):
    """dense_bias: the 16 rows of each warp of x (64, N) f32, WGMMA layout (a `dense_rows`
    product: the same in every warp) to that warp's columns of ref (16, 4, N) f32: lane (g, t)
    stores rows g and g + 8 of its columns 2t, 2t + 1 of every 8. The caller orders the
    stores before the warp's loads (`reduce.warp_sync`). Not interpretable."""

    @plgpu.inline_mgpu(arg_types=(WG_LAYOUT, plgpu.RefType()))
    def store(_, xa, r):
        lane, warp = lane_warp()
        g, t2 = (
            arith.shrui(lane, const_i32(2)),
            arith.muli(arith.andi(lane, const_i32(3)), const_i32(2)),
        )
        for i, reg in np.ndenumerate(xa.registers):
            r0, c0 = xa.layout.tiling.untile_indices(i)
            vector.store(
                reg,
                r,
                [
                    as_index(arith.addi(g, const_i32(r0 % 16))),
                    as_index(warp),
                    as_index(arith.addi(t2, const_i32(c0))),
                ],
            )

    store(x, ref)


def bias_rows(ref, rows: tuple[int, ...], dup_half: bool):
    """dense_bias: the key bias of a (64, N) score tile, f32 in the WGMMA layout: warp w's rows
    all hold row rows[w] of its columns of ref (n, 4, N) (`store_bias_rows`), one 64-bit load
    per 8 columns. dup_half (pack_zeros: the bias mma's B had q in columns 0-3 only): columns
    4-7 take the heads of 0-3, where the odd plane of a packed tile puts them. Not
    interpretable."""
    N = ref.shape[-1]

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(),),
        return_type=plgpu.ShapeDtypeStruct((PLANE, N), jnp.float32, layout=WG_LAYOUT),
    )
    def load(_, r):
        lane, warp = lane_warp()
        row = const_i32(rows[0])
        for w in range(1, 4):
            if rows[w] != rows[0]:
                row = arith.select(
                    arith.cmpi(arith.CmpIPredicate.eq, warp, const_i32(w)), const_i32(rows[w]), row
                )
        t = arith.andi(lane, const_i32(1 if dup_half else 3))
        t2 = arith.muli(t, const_i32(2))
        lay = mgpu_fa.WGMMA_LAYOUT
        f2 = ir.VectorType.get((2,), ir.F32Type.get())
        loaded, out = {}, np.empty(lay.registers_shape((PLANE, N)), dtype=object)
        for i in np.ndindex(out.shape):
            _r0, c0 = lay.tiling.untile_indices(i)
            if c0 not in loaded:
                col = as_index(arith.addi(t2, const_i32(c0)))
                loaded[c0] = vector.load(f2, r, [as_index(row), as_index(warp), col])
                out[i] = loaded[c0]
            else:
                out[i] = fresh_value(loaded[c0])
        return mgpu_fa.FragmentedArray(_registers=out, _layout=lay, _is_signed=None)

    return load(ref)


def store_p_perm(p16, dst, col0: int = 0, split: bool = False):
    """Stores P (64 tokens, N) fp16 (WGMMA layout) as columns [col0, col0 + 64) of the wgmma B
    operand dst [N, X] (tiling (8, 64), 128-byte swizzle) with the tokens in the `PERM16`
    order: each 8x8 block of the warp's registers is transposed in registers (`movmatrix`), so
    that a thread holds two tokens of one head, which `PERM16` keeps adjacent: one 32-bit store
    per register (instead of two 16-bit stores and their two byte permutes). Also q * s_g of the
    folded key product (channels for tokens). split (pack_zeros, N = 8): dst is two [8, 64]
    tiles; columns 0-3 of P go to rows 0-3 of the first, columns 4-7 to rows 0-3 of the
    second (rows 4-7 of both left as they are)."""
    ctiles = dst.shape[-1] // PLANE  # (8, 64) tiles per 8 rows of dst

    @plgpu.inline_mgpu(
        arg_types=(WG_LAYOUT, plgpu.RefType(transforms=swizzle_transforms(jnp.float16, PLANE)))
    )
    def store(_, x, ref):
        lane, warp = lane_warp()
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        base = mgpu_utils.memref_ptr(ref)
        g, c = arith.shrui(lane, const_i32(2)), arith.andi(lane, const_i32(3))
        # After the transpose lane (g, c) of warp w holds head 8 i + g and tokens 16 w + 8 h +
        # 2 c + (0, 1) (row half h): PERM16 positions 16 w + 4 h + 2 (c // 2) + 8 (c % 2) + (0,
        # 1), in the 16-byte chunk 2 w + c % 2 of the head's 128-byte row, which the swizzle
        # xors with the row (g).
        chunk = arith.addi(arith.muli(warp, const_i32(2)), arith.andi(c, const_i32(1)))
        if split:  # head g: row g % 4 of tile g // 4
            r = arith.andi(g, const_i32(3))
            row = arith.addi(
                arith.addi(
                    arith.muli(arith.shrui(g, const_i32(2)), const_i32(1024)),
                    arith.muli(r, const_i32(128)),
                ),
                arith.muli(arith.xori(chunk, r), const_i32(16)),
            )
        else:
            row = arith.addi(
                arith.muli(g, const_i32(128)), arith.muli(arith.xori(chunk, g), const_i32(16))
            )
        half = arith.muli(arith.shrui(c, const_i32(1)), const_i32(4))  # bytes of 2 (c // 2) fp16
        for idx in np.ndindex(x.registers.shape):
            i, h = idx[1], idx[4]  # column tile (8 heads), row half (rows r or r + 8)
            t = mgpu_utils.bitcast(transpose8x8(x.registers[idx]), i32)
            tile = i * ctiles + col0 // PLANE
            off = arith.addi(arith.addi(row, half), const_i32(tile * 1024 + 8 * h))
            llvm.store(t, mgpu_utils.getelementptr(base, [off], i8))

    store(p16, dst)


def warp_value_codes(codes_ref, transforms, m: int, col0: int):
    """Value code bytes as each warp's own A operand of the value product: the (64, 16) uint16
    tile (WGMMA layout) whose warp-w rows (i, k) hold the code byte of channel 16 m + i and byte
    column col0 + 16 w + k of `codes_ref` (D channels, X byte columns; SMEM tiling (8, sw) and
    an sw-byte swizzle), widened to 16 bits with the *high byte undefined* (every code field
    mask clears it, `codes.field_sub`). Natural column order: lane (g, c) holds columns 2c, 2c + 1
    and 8 + 2c, 9 + 2c, which one 16-byte load per row and two byte permutes of its four words
    give. Not interpretable."""
    tile_w = transforms[0].tiling[1]
    swizzle = transforms[1].swizzle
    X = codes_ref.shape[-1]
    # blocked V codes (nb, D, 64): column col0 + 16 w is column col0 % 64 + 16 w of block
    # col0 // 64, whose (8, 64) tiles follow the previous blocks'
    blk0, col0 = (col0 // X, col0 % X) if len(codes_ref.shape) == 3 else (0, col0)
    blk_tiles = codes_ref.shape[-2] // 8 * (X // tile_w)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(transforms=transforms),),
        return_type=plgpu.ShapeDtypeStruct((PLANE, 16), jnp.uint16, layout=WG_LAYOUT),
    )
    def load(_, ref):
        lane, warp = lane_warp()
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        v4 = ir.VectorType.get((4,), i32)
        pair_ty = ir.VectorType.get((2,), ir.IntegerType.get_signless(16))
        base = mgpu_utils.memref_ptr(ref)
        g, c = arith.shrui(lane, const_i32(2)), arith.andi(lane, const_i32(3))
        col = arith.addi(const_i32(col0), arith.muli(warp, const_i32(16)))
        # columns 2c, 2c + 1 of the eight in (w0, w1) (resp. (w2, w3)), stored at bytes
        # f = 2c - c % 2 and f + 2 (the middle bytes of every four swapped), into the low bytes
        # of two 16-bit lanes: prmt selector nibbles (f, f, f + 2, f + 2)
        f = arith.subi(arith.muli(c, const_i32(2)), arith.andi(c, const_i32(1)))
        sel = arith.addi(
            arith.muli(f, const_i32(0x0011)),
            arith.muli(arith.addi(f, const_i32(2)), const_i32(0x1100)),
        )
        regs = np.empty(mgpu_fa.WGMMA_LAYOUT.registers_shape((PLANE, 16)), dtype=object)
        at = {mgpu_fa.WGMMA_LAYOUT.tiling.untile_indices(i): i for i in np.ndindex(regs.shape)}
        for r0 in (0, 8):
            row = arith.addi(g, const_i32(16 * m + r0))
            # Mosaic's tiled layout: (8, tile_w) tiles, row-major over (row // 8, col // tile_w)
            tile = arith.addi(
                arith.muli(arith.shrui(row, const_i32(3)), const_i32(X // tile_w)),
                arith.divui(col, const_i32(tile_w)),
            )
            tile = arith.addi(tile, const_i32(blk0 * blk_tiles))
            off = arith.addi(
                arith.addi(
                    arith.muli(tile, const_i32(8 * tile_w)), arith.muli(g, const_i32(tile_w))
                ),
                arith.remui(col, const_i32(tile_w)),
            )
            ptr = mgpu_utils.getelementptr(base, [swizzled_offset(off, swizzle)], i8)
            words = llvm.load(v4, ptr, alignment=16)
            w = [llvm.extractelement(words, const_i32(k)) for k in range(4)]
            for c0, (lo, hi) in ((0, (w[0], w[1])), (8, (w[2], w[3]))):
                r = mgpu_utils.inline_ptx("prmt.b32 $0, $1, $2, $3;", lo, hi, sel, result_types=i32)
                regs[at[(r0, c0)]] = mgpu_utils.bitcast(r, pair_ty)
        return mgpu_fa.FragmentedArray(
            _registers=regs, _layout=mgpu_fa.WGMMA_LAYOUT, _is_signed=False
        )

    return load(codes_ref)


def zero_smem(ref, transforms=()):
    """Zeroes ref (a warpgroup's SMEM buffer of a multiple of 2 KiB, with its SMEM transforms)
    with 16-byte stores; the caller orders them before other threads' accesses
    (`reduce.warpgroup_sync`)."""
    nbytes = math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
    if nbytes % 2048:
        raise ValueError(f"zero_smem needs a multiple of 2048 bytes, got {nbytes}")

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(transforms=transforms),))
    def zero(_, r):
        lane, warp = lane_warp()
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        v4 = ir.VectorType.get((4,), i32)
        z = arith.constant(v4, ir.DenseElementsAttr.get_splat(v4, ir.IntegerAttr.get(i32, 0)))
        base = mgpu_utils.memref_ptr(r)
        tid16 = arith.muli(arith.addi(lane, arith.muli(warp, const_i32(32))), const_i32(16))
        for k in range(nbytes // 2048):
            off = arith.addi(tid16, const_i32(2048 * k))
            llvm.store(z, mgpu_utils.getelementptr(base, [off], i8))

    zero(ref)


def q_tile(
    q_ref,
    q_s,
    *,
    nq: int,
    scale: float | None,
    dup: bool,
    natural: bool = False,
    signs: tuple[float, ...] | None = None,
):
    """The query's prologue inside the kernel (`TuningConfig.q_prologue`): the nq query heads
    of one kv head, q_ref [nq, D] bf16/fp16 in GMEM, to the key product's B tile q_s [NP, D]
    fp16 (tiling (8, 64), 128-byte swizzle): times `scale` in float32, in the `PERM16`
    contraction order of the widen8 code tiles, rows nq.. zero (dup, pack_planes without
    pack_zeros: rows 4-7 repeat rows 0-3). What the kernel's `_kernel_call` otherwise does in
    XLA before the launch, one fusion per call. Thread t takes one 16-column block of one row
    (NP D / 16 of them): two 16-byte loads, the words 0, 2, 4, 6 of the block to its first
    output chunk and 1, 3, 5, 7 to its second (the order `PERM16` puts the column pairs in).
    natural: the natural contraction order and q_s's dtype instead (times `scale` unless it is
    None): the B operand of the window tail's key product, whose A tiles are plain 16-bit
    loads. signs: each row first rotated by diag(signs) H / sqrt(D) (`hadamard_rotation`), in
    float32: the signs applied, then the Walsh-Hadamard transform's log2(D) stages of sums and
    differences, four in each thread's 16 columns and the rest between the lanes that hold the
    row's other blocks (a row's D / 16 threads are adjacent lanes of one warp). The caller
    orders the stores before the tile's readers (`reduce.warpgroup_sync`, `commit_smem` for
    wgmma). Native only."""
    NP, D = q_s.shape[-2:]
    blocks = D // 16
    dt = q_ref.dtype
    if signs is not None and (len(signs) != D or (NP * blocks) % 32 or 32 % blocks):
        # the lanes that exchange values must be whole warps, every one of them in the tile
        raise NotImplementedError(f"the rotation in q_tile needs D = {D} signs and whole warps")

    mlir_type = lambda x: ir.BF16Type.get() if x == jnp.bfloat16 else ir.F16Type.get()
    out_dt = q_s.dtype if natural else jnp.float16

    @plgpu.inline_mgpu(
        arg_types=(plgpu.RefType(), plgpu.RefType(transforms=swizzle_transforms(out_dt, 64)))
    )
    def prologue(_, src, dst):
        i8, i32, f32 = (
            ir.IntegerType.get_signless(8),
            ir.IntegerType.get_signless(32),
            ir.F32Type.get(),
        )
        v4, v1 = ir.VectorType.get((4,), i32), ir.VectorType.get((1,), i32)
        e2 = ir.VectorType.get((2,), mlir_type(dt))
        h2, f2 = ir.VectorType.get((2,), mlir_type(out_dt)), ir.VectorType.get((2,), f32)
        factor = (scale or 1.0) / (math.sqrt(D) if signs is not None else 1.0)
        sc = arith.constant(f2, ir.DenseElementsAttr.get_splat(f2, ir.FloatAttr.get(f32, factor)))
        zero = arith.constant(v4, ir.DenseElementsAttr.get_splat(v4, ir.IntegerAttr.get(i32, 0)))
        tid = arith.andi(mgpu_utils.thread_idx(), const_i32(127))
        src_base, dst_base = mgpu_utils.memref_ptr(src), mgpu_utils.memref_ptr(dst)

        def conv(w):  # two q elements -> out_dt(scale * x) as one word
            if scale is None and out_dt == dt:
                return w
            x = vector.bitcast(e2, vector.broadcast(ir.VectorType.get((1,), i32), w))
            x = arith.extf(f2, x)
            y = arith.truncf(h2, x if scale is None else arith.mulf(x, sc))
            return vector.extract(
                vector.bitcast(ir.VectorType.get((1,), i32), y),
                dynamic_position=[],
                static_position=[0],
            )

        def rotated(words, cb):  # the 16 columns of a block, rotated -> out_dt(factor * x)
            x = []
            for w in words:
                pair = arith.extf(f2, vector.bitcast(e2, vector.broadcast(v1, w)))
                x += [
                    vector.extract(pair, dynamic_position=[], static_position=[j]) for j in (0, 1)
                ]
            # the signs of this thread's block: a 16-bit pattern chosen by cb, each column's
            # bit moved to the float's sign bit
            pattern = const_i32(0)
            for b, bits in enumerate(sign_bits(signs, 16)):
                is_b = arith.cmpi(arith.CmpIPredicate.eq, cb, const_i32(b))
                pattern = arith.select(is_b, const_i32(bits), pattern)
            for j in range(16):
                flip = arith.andi(
                    arith.shli(pattern, const_i32(31 - j)), const_i32(np.int32(-(2**31)).item())
                )
                x[j] = arith.bitcast(f32, arith.xori(arith.bitcast(i32, x[j]), flip))
            h = 1
            while h < 16:  # the stages within the block
                for j in range(16):
                    if not j & h:
                        x[j], x[j + h] = arith.addf(x[j], x[j + h]), arith.subf(x[j], x[j + h])
                h *= 2
            for bit in range(blocks.bit_length() - 1):  # the stages across the row's lanes
                high = arith.cmpi(
                    arith.CmpIPredicate.ne, arith.andi(cb, const_i32(1 << bit)), const_i32(0)
                )
                for j in range(16):
                    other = mgpu_utils.shfl_bfly(x[j], 1 << bit)
                    # the pair's low block keeps the sum, the high one the difference
                    x[j] = arith.select(high, arith.subf(other, x[j]), arith.addf(x[j], other))
            out = []
            for j in range(0, 16, 2):
                y = arith.mulf(vector.from_elements(f2, [x[j], x[j + 1]]), sc)
                out.append(
                    vector.extract(
                        vector.bitcast(v1, arith.truncf(h2, y)),
                        dynamic_position=[],
                        static_position=[0],
                    )
                )
            return out

        for i in range(-(-NP * blocks // 128)):
            k = arith.addi(tid, const_i32(128 * i))
            r, cb = arith.divui(k, const_i32(blocks)), arith.remui(k, const_i32(blocks))
            src_r = arith.subi(r, const_i32(4)) if dup else r
            live = arith.cmpi(arith.CmpIPredicate.ult, r, const_i32(nq))
            if dup:  # rows 4-7 from rows 0-3
                live_dup = arith.andi(
                    arith.cmpi(arith.CmpIPredicate.uge, r, const_i32(4)),
                    arith.cmpi(arith.CmpIPredicate.ult, src_r, const_i32(nq)),
                )
                src_row = arith.select(live, r, src_r)
                live = arith.ori(live, live_dup)
            else:
                src_row = r
            src_row = arith.minui(src_row, const_i32(nq - 1))  # (a dead row reads a live one)
            in_range = arith.cmpi(arith.CmpIPredicate.ult, k, const_i32(NP * blocks))
            r8 = arith.andi(r, const_i32(7))
            tile0 = arith.addi(
                arith.muli(arith.shrui(r, const_i32(3)), const_i32(D // 64)),
                arith.shrui(cb, const_i32(2)),
            )  # 64 columns = 4 blocks per tile
            with mgpu_utils.when(in_range):
                words = []
                off = arith.muli(
                    arith.addi(arith.muli(src_row, const_i32(D)), arith.muli(cb, const_i32(16))),
                    const_i32(2),
                )
                for half in range(2):
                    at = mgpu_utils.getelementptr(
                        src_base, [arith.addi(off, const_i32(16 * half))], i8
                    )
                    x = arith.select(live, llvm.load(v4, at, alignment=16), zero)
                    words += [
                        vector.extract(x, dynamic_position=[], static_position=[j])
                        for j in range(4)
                    ]
                words = rotated(words, cb) if signs is not None else [conv(w) for w in words]
                for half in range(2):  # output chunk 2 (cb % 4) + half of the row's 64-col tile
                    ch = arith.addi(
                        arith.muli(arith.andi(cb, const_i32(3)), const_i32(2)), const_i32(half)
                    )
                    byte = arith.addi(
                        arith.addi(
                            arith.muli(tile0, const_i32(1024)), arith.muli(r8, const_i32(128))
                        ),
                        arith.muli(arith.xori(ch, r8), const_i32(16)),
                    )
                    # PERM16: the even words to the first chunk, the odd ones to the second
                    idx = [4 * half + j if natural else 2 * j + half for j in range(4)]
                    out = vector.from_elements(v4, [words[k] for k in idx])
                    llvm.store(out, mgpu_utils.getelementptr(dst_base, [byte], i8), alignment=16)

    prologue(q_ref, q_s)
