"""mma.sync operands and products, and the register-level tile surgery around them.

Both products of the decode loop run as warp-level mma.sync (m16n8k16) on (64, N) tiles: the A
operand and the accumulator are held in the WGMMA register layout (`layout.WG_LAYOUT`: the same
elements per thread as mma.sync's fragments, which `as_mma_lhs` relabels at no cost), B (K, N)
in `Layout.MMA_RHS`. Here: the product (`mma`); B from SMEM (`mma_rhs`), from P in registers,
each warp its own 16 tokens (`warp_rhs`), or scaled per K row (`scale_rhs`); two column
vectors as one A tile (`rows_of`) and a row half of its product broadcast (`row_half`); the
value minimums' term over each warp's tokens (`group_min_mma`, inline PTX `MMA_K16`); and the
pack_planes lane selects, where one 8-column tile holds two planes, columns 0-3 the even
plane's and 4-7 the odd one's (`swap_halves`, `halves`, `halves_const`).

`mma`, `mma_rhs`, `swap_halves`, `halves` (not with rows) and `halves_const` take `interpret`
and compute the same in jnp under the interpreter; the rest are inline Mosaic GPU, native
only.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sm90.inline import (
    as_index,
    const_i32,
    fresh_value,
    lane_warp,
    origins,
    transpose8x8,
)
from pallas_kernels.sm90.layout import PLANE, WG_LAYOUT, swizzle_transforms

# the m16n8k16 of `group_min_mma`, whose A is built from raw 32-bit loads (no Mosaic fragment)
MMA_K16 = (
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, "
    "{$8,$9}, {$10,$11,$12,$13};"
)


def mma(acc, a, b, interpret):
    """acc + a @ b on warp-level mma.sync (`plgpu.mma`): acc (64, N) f32/int32 and a (64, K)
    in the WGMMA layouts (the same registers per thread as mma.sync's fragments: the casts are
    relabellings), b (K, N) in `Layout.MMA_RHS`. Returns (64, N) in the WGMMA layout."""
    if interpret:  # the interpreter has no mma: the same product in jnp
        return acc + jnp.dot(a, b, preferred_element_type=acc.dtype)
    acc = plgpu.layout_cast(acc, plgpu.Layout.MMA_ACC(acc.dtype))
    return plgpu.layout_cast(plgpu.mma(acc, as_mma_lhs(a), b), WG_LAYOUT)


def as_mma_lhs(x):
    """A (64, K) tile in the WGMMA layout (8-bit: WGMMA_8BIT) relabelled as `Layout.MMA_LHS`:
    both give a thread the same elements (warp w rows 16w.., lane (g, t) rows g and g + 8,
    columns 2t.. (16-bit) or 4t.. (8-bit) of every 8- or 16-column block); only the order of
    the register array differs. Mosaic has no such relayout, so it is done here, per
    register, at trace time: no instructions."""
    src = plgpu.Layout.WGMMA_8BIT if x.dtype.itemsize == 1 else WG_LAYOUT
    dst = plgpu.Layout.MMA_LHS(x.dtype)

    @plgpu.inline_mgpu(
        arg_types=(src,), return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=dst)
    )
    def relabel(_, xa):
        new = dst.to_mgpu()
        at = origins(xa)
        regs = np.empty(new.registers_shape(xa.shape), dtype=object)
        for i in np.ndindex(regs.shape):
            regs[i] = fresh_value(at[new.tiling.untile_indices(i)])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=new, _is_signed=xa.is_signed)

    return relabel(x)


def mma_rhs(ref, interpret):
    """The (K, N) SMEM view `ref` loaded as mma.sync's B operand (replicated over warps)."""
    if interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.MMA_RHS(ref.dtype))


def scale_rhs(b, s):
    """fp16(b[k, n] * s[k]): b (K, N) mma.sync's B operand (`Layout.MMA_RHS`), s (K,) in the
    reduce(0) WGMMA layout (warps may hold different vectors, `smem.vec_load` with rows). Both give
    lane l the elements k = 8i + 2 (l % 4) + (0, 1), so it is one fp16x2 multiply per register
    (Mosaic has no broadcast of a vector into MMA_RHS). Not interpretable."""
    lay = plgpu.Layout.MMA_RHS(b.dtype)

    @plgpu.inline_mgpu(
        arg_types=(lay, WG_LAYOUT.reduce(0)),
        return_type=plgpu.ShapeDtypeStruct(b.shape, b.dtype, layout=lay),
    )
    def scale(_, ba, sa):
        s_at = origins(sa)
        regs = np.empty_like(ba.registers)
        for i, r in np.ndenumerate(ba.registers):
            regs[i] = arith.mulf(r, s_at[(ba.layout.tiling.untile_indices(i)[0],)])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=ba.layout, _is_signed=None)

    return scale(b, s)


def rows_of(za, zb=None):
    """The (64, X) tile (WGMMA layout) whose rows 16 w + (0..7) are za and 16 w + (8..15) zb,
    both (X,) in the reduce(0) layout (per-warp vectors allowed): lane (g, t) holds rows g and
    g + 8 of its warp's 16, so one mma.sync against it gives both vectors' products with B.
    zb None: rows 8..15 undefined (their products are dropped), where copying za there cost
    ptxas a move per register (the key bias at G >= 64: 36 per step at 2-bit G=128). Per
    register, no instructions. Not interpretable."""
    X = za.shape[0]
    one = zb is None

    @plgpu.inline_mgpu(
        arg_types=(WG_LAYOUT.reduce(0),) * (1 if one else 2),
        return_type=plgpu.ShapeDtypeStruct((PLANE, X), za.dtype, layout=WG_LAYOUT),
    )
    def rows(_, a, *b):
        lo = origins(a)
        hi = origins(b[0]) if b else None
        lay = mgpu_fa.WGMMA_LAYOUT
        regs = np.empty(lay.registers_shape((PLANE, X)), dtype=object)
        for i in np.ndindex(regs.shape):
            r0, c0 = lay.tiling.untile_indices(i)
            if r0 // 8 % 2 == 0:
                regs[i] = fresh_value(lo[(c0,)])
            else:
                regs[i] = fresh_value(hi[(c0,)]) if hi else llvm.mlir_undef(lo[(c0,)].type)
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=lay, _is_signed=None)

    return rows(za) if one else rows(za, zb)


def row_half(x, h: int):
    """x (64, N) in the WGMMA layout with rows 16 w + 8 h + (0..7) of every warp copied over
    its 16 rows: the (64, N) broadcast of the h-th vector of a `rows_of` product. Per
    register, no instructions. Not interpretable."""

    @plgpu.inline_mgpu(
        arg_types=(WG_LAYOUT,),
        return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=WG_LAYOUT),
    )
    def pick(_, xa):
        at = origins(xa)
        regs = np.empty_like(xa.registers)
        for i in np.ndindex(regs.shape):
            r0, c0 = xa.layout.tiling.untile_indices(i)
            regs[i] = fresh_value(at[(r0 - r0 % 16 + 8 * h, c0)])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=xa.layout, _is_signed=xa.is_signed)

    return pick(x)


def group_min_mma(z_rows, p_ref, z_odd=None):
    """fold_v_warp's minimums term, split over the warps by tokens instead of by groups: (64, N)
    f32 (WGMMA layout) whose row g < n of warp w holds z_rows[g] . P over the warp's own 16
    tokens (16 w .. 16 w + 15); `reduce.warp_group_sum` adds the four warps' rows at the end.
    z_rows: (n, 64) fp16 SMEM, the minimums of the n value groups of a plane's tokens in the
    codes' order; p_ref: the plane's P as `smem.store_p_perm` stored it ([N, 64], 128-byte swizzle,
    tokens in the `PERM16` order). One m16n8k16 per warp and 8 heads: B is four tokens of
    head g by one 64-bit load, A the same four of the lane's group row by two 32-bit loads
    once, where each warp's own group over all 64 tokens took four m16n8k16 whose A operand
    ptxas built of moves. A's rows g + 8 are left undefined (their products
    dropped), or with z_odd (pack_planes: p_ref a score tile of two planes, columns 0-3 the
    even plane's P, 4-7 the odd one's) hold the odd plane's minimums, and the lanes of columns
    4-7 take rows g + 8: both planes' terms from the one mma. Native only (fold_v_warp is)."""
    n, K = z_rows.shape
    N = p_ref.shape[0]
    if K != PLANE or p_ref.shape[1] != PLANE or N % 8 or not 1 <= n <= 8:
        raise ValueError(f"group_min_mma: z_rows {z_rows.shape}, P {p_ref.shape}")
    packed = z_odd is not None
    if packed and (z_odd.shape != z_rows.shape or N != 8):
        raise ValueError(
            f"group_min_mma: z_odd {z_odd.shape} for z_rows {z_rows.shape}, "
            f"{N} columns (packed planes: 8)"
        )
    zs = (z_rows, z_odd) if packed else (z_rows,)

    @plgpu.inline_mgpu(
        arg_types=(
            *[plgpu.RefType()] * len(zs),
            plgpu.RefType(transforms=swizzle_transforms(jnp.float16, PLANE)),
        ),
        return_type=plgpu.ShapeDtypeStruct((PLANE, N), jnp.float32, layout=WG_LAYOUT),
    )
    def prod(_, *refs):
        *zrefs, pref = refs
        i8, i32, f32 = (
            ir.IntegerType.get_signless(8),
            ir.IntegerType.get_signless(32),
            ir.F32Type.get(),
        )
        lane, warp = lane_warp()
        g, t = arith.shrui(lane, const_i32(2)), arith.andi(lane, const_i32(3))
        # A row g and B column g (head 8 i + g) hold a lane's k-lo and k-hi pairs, which must
        # be the same four tokens. B is one 64-bit load per 8 heads: positions 16 w + 4t .. + 3
        # of P (bytes 32 w + 8t of the head's 128-byte row, in the 16-byte chunk 2 w + t // 2,
        # which the swizzle xors with the row, as `store_p_perm`), i.e. in the `PERM16`
        # order tokens 16 w + e + (0, 1) and e + (4, 5), e = 8 (t % 2) + 2 (t // 2); A takes
        # those two pairs of the minimums, two 32-bit loads once per plane. (z's consecutive
        # 4t .. 4t + 3 against P's positions 4t .. would be wrong: errors of 3e-2.) Rows g >= n
        # repeat the last (products dropped).
        row = as_index(arith.minui(g, const_i32(n - 1)))
        e = arith.addi(
            arith.addi(
                arith.muli(warp, const_i32(16)),
                arith.muli(arith.andi(t, const_i32(1)), const_i32(8)),
            ),
            arith.muli(arith.shrui(t, const_i32(1)), const_i32(2)),
        )
        half = ir.VectorType.get((2,), ir.MemRefType(zrefs[0].type).element_type)

        def k_pairs(ref):  # (k-lo, k-hi) of the lane's group row, as i32
            return [
                mgpu_utils.bitcast(
                    vector.load(
                        half, ref, [row, as_index(arith.addi(e, const_i32(o)))], alignment=4
                    ),
                    i32,
                )
                for o in (0, 4)
            ]

        lo, hi = k_pairs(zrefs[0])
        lo8, hi8 = k_pairs(zrefs[1]) if packed else (llvm.mlir_undef(i32),) * 2
        a = [lo, lo8, hi, hi8]  # rows g, g + 8 at k-lo; rows g, g + 8 at k-hi
        chunk = arith.addi(arith.muli(warp, const_i32(2)), arith.shrui(t, const_i32(1)))
        off = arith.addi(
            arith.addi(
                arith.muli(g, const_i32(128)), arith.muli(arith.xori(chunk, g), const_i32(16))
            ),
            arith.muli(arith.andi(t, const_i32(1)), const_i32(8)),
        )
        base = mgpu_utils.memref_ptr(pref)
        pair_i = ir.VectorType.get((2,), i32)
        zero = arith.constant(f32, 0.0)
        pair = ir.VectorType.get((2,), f32)
        struct = llvm.StructType.get_literal([f32] * 4)
        upper = arith.cmpi(arith.CmpIPredicate.uge, t, const_i32(2))  # columns 4-7 (packed)
        rows = {}
        for i in range(N // 8):
            at = mgpu_utils.getelementptr(base, [arith.addi(off, const_i32(i * 1024))], i8)
            bq = llvm.load(pair_i, at, alignment=8)
            b = [vector.extract(bq, dynamic_position=[], static_position=[k]) for k in (0, 1)]
            out = llvm.inline_asm(
                struct,
                [*a, *b, zero, zero, zero, zero],
                MMA_K16,
                "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                has_side_effects=False,
            )
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


def warp_rhs(p16):
    """P (64 tokens, N) fp16 (WGMMA layout) -> each warp's own 16 tokens as mma.sync's B
    operand (16, N) (`Layout.MMA_RHS`, a different operand per warp): each 8x8 block is
    transposed in registers (`movmatrix`), which turns the accumulator fragment (lane (g, c):
    token g, heads 2c, 2c + 1) into the B fragment (head g, tokens 2c, 2c + 1). No SMEM, no
    barrier. Not interpretable."""
    N = p16.shape[1]
    lay = plgpu.Layout.MMA_RHS(p16.dtype)

    @plgpu.inline_mgpu(
        arg_types=(WG_LAYOUT,), return_type=plgpu.ShapeDtypeStruct((16, N), p16.dtype, layout=lay)
    )
    def rhs(_, xa):
        at = origins(xa)
        new = lay.to_mgpu()
        regs = np.empty(new.registers_shape((16, N)), dtype=object)
        for i in np.ndindex(regs.shape):
            k0, n0 = new.tiling.untile_indices(i)  # tokens k0 + 2c + (0, 1), head n0 + g
            regs[i] = transpose8x8(at[(k0, n0)])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=new, _is_signed=None)

    return rhs(p16)


def swap_halves(x, interpret):
    """x (64, 8) in the WGMMA layout or (8,) in its reduce(0) layout with columns 0-3 and 4-7
    exchanged (pack_planes): lane (g, c) holds columns 2c, 2c + 1, so it is one butterfly
    shuffle across lane bit 1 per register."""
    if interpret:
        return jnp.roll(x, 4, axis=-1)
    lay = WG_LAYOUT if x.ndim == 2 else WG_LAYOUT.reduce(0)

    @plgpu.inline_mgpu(
        arg_types=(lay,), return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=lay)
    )
    def swap(_, xa):
        regs = np.empty_like(xa.registers)
        for i, r in np.ndenumerate(xa.registers):
            regs[i] = mgpu_utils.shfl_bfly(r, 2)
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=xa.layout, _is_signed=xa.is_signed)

    return swap(x)


def halves(lo, hi, interpret, rows: bool = False):
    """(64, 8) tiles (WGMMA layout) or (8,) vectors (its reduce(0) layout) -> columns 0-3 of
    lo and 4-7 of hi (pack_planes): one select per register on the lane's column half.

    rows: lo, hi are (64,) row vectors (the reduce(1) layout) and the result holds lo in the
    lanes of columns 0-3, hi in those of 4-7: a vector whose lanes disagree, valid only under a
    broadcast along rows and elementwise use (as the per-warp vectors of `smem.vec_load`), so that
    the per-token math of a tile's two planes costs one plane's. Not interpretable."""
    if interpret:
        assert not rows, "lane-dependent row vectors have no interpreter form"
        col = lax.broadcasted_iota(jnp.int32, lo.shape, lo.ndim - 1)
        return jnp.where(col < 4, lo, hi)
    lay = WG_LAYOUT.reduce(1) if rows else WG_LAYOUT if lo.ndim == 2 else WG_LAYOUT.reduce(0)

    @plgpu.inline_mgpu(
        arg_types=(lay, lay), return_type=plgpu.ShapeDtypeStruct(lo.shape, lo.dtype, layout=lay)
    )
    def pick(_, la, ha):
        lane, _ = lane_warp()
        upper = arith.cmpi(arith.CmpIPredicate.uge, arith.andi(lane, const_i32(3)), const_i32(2))
        regs = np.empty_like(la.registers)
        for i in np.ndindex(regs.shape):
            regs[i] = arith.select(upper, ha.registers[i], la.registers[i])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=la.layout, _is_signed=la.is_signed)

    return pick(lo, hi)


def halves_const(lo: float, hi: float, n: int, interpret):
    """The (n,) f32 vector (the WGMMA layout's reduce(0)) of lo in columns 0-3 and hi in 4-7
    (pack_planes), built in registers: constants passed into `halves` stay splats that the
    inline_mgpu argument cast cannot materialize (an unrealized_conversion_cast would be left in
    the LLVM module)."""
    if interpret:
        return jnp.where(lax.broadcasted_iota(jnp.int32, (n,), 0) < 4, lo, hi).astype(jnp.float32)
    lay = WG_LAYOUT.reduce(0)

    @plgpu.inline_mgpu(
        arg_types=(), return_type=plgpu.ShapeDtypeStruct((n,), jnp.float32, layout=lay)
    )
    def make(_):
        lane, _ = lane_warp()
        upper = arith.cmpi(arith.CmpIPredicate.uge, arith.andi(lane, const_i32(3)), const_i32(2))
        f32 = ir.F32Type.get()
        mlay = lay.to_mgpu()
        const = lambda c: vector.broadcast(mlay.registers_element_type(f32), arith.constant(f32, c))
        reg = arith.select(upper, const(hi), const(lo))
        return mgpu_fa.FragmentedArray(
            _registers=np.full(mlay.registers_shape((n,)), reg, dtype=object),
            _layout=mlay,
            _is_signed=None,
        )

    return make()
