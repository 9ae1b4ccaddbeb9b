"""Warp and warpgroup reductions and barriers.

A warpgroup is four warps (128 threads) of a block; a block runs one or several, each over its
own split, so the reductions here go through the warpgroup's own SMEM scratch (at least
`reduction_scratch` f32 elements) and its named barrier (`warpgroup_sync`), not Mosaic's
scratch and barrier of the whole block. They take (64, N) f32 tiles in the WGMMA layout
(`layout.WG_LAYOUT`) and return (N,) in its reduce(0) layout: over the whole tile
(`warpgroup_reduce`, `warpgroup_max_open`) or over each warp's 16 rows (`warp_max`,
`warp_col_max`: a different vector per warp, for the per-warp softmax). `exceed_barrier` folds
a vote into the warpgroup barrier that hands P over; `merge_warp_rows` and `warp_group_sum`
sum per-warp partials across the warps.

`warpgroup_sync` takes `interpret` (no barrier there: the interpreter runs a warpgroup as one
thread); the rest are inline Mosaic GPU, native only.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.sm90.inline import col_vector, const_i32, fresh_value, lane_warp, origins
from pallas_kernels.sm90.layout import WG_LAYOUT

# f32 elements, at least, of a warpgroup's cross-warp reduction scratch (Mosaic's reduce and
# `warpgroup_max_open` up to 128 columns fit in it)
REDUCTION_SCRATCH = 512


def reduction_scratch(padded_heads: int) -> int:
    """f32 elements of a warpgroup's reduction scratch: `REDUCTION_SCRATCH`, or more where
    `warp_group_sum` needs it (four warps x five rows x the padded heads: past 24 heads per kv
    head)."""
    return max(REDUCTION_SCRATCH, 4 * 5 * padded_heads)


def warpgroup_sync(interpret):
    """A barrier over this warpgroup's 128 threads (named barrier 1 + warpgroup index): orders
    SMEM stores of one warp before another warp's loads. The interpreter runs a warpgroup as
    one thread, so it needs none."""
    if interpret:
        return

    @plgpu.inline_mgpu()
    def sync(_):
        mgpu_utils.warpgroup_barrier()

    sync()


def warp_sync():
    """A barrier over this warp's 32 threads: orders one lane's SMEM stores before another
    lane's loads where only the warp itself reads them (dense_bias's bias rows)."""

    @plgpu.inline_mgpu()
    def sync(_):
        mgpu_utils.warp_barrier()

    sync()


def warpgroup_reduce(x, kind: str, scratch_ref):
    """x (64, N) f32 in the WGMMA layout reduced over its rows ("add" or "max") -> (N,) in the
    reduce(0) layout, the cross-warp step going through `scratch_ref`, this warpgroup's own
    f32 SMEM scratch. (Mosaic's reductions use one scratch region per block: two warpgroups
    of a block reducing at once would race on it.) Not interpretable (inline Mosaic GPU)."""
    N = x.shape[1]

    @plgpu.inline_mgpu(
        arg_types=(WG_LAYOUT, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((N,), x.dtype, layout=WG_LAYOUT.reduce(0)),
    )
    def reduce(_, xa, ref):
        return xa.reduce(kind, 0, scratch=ref)

    return reduce(x, scratch_ref)


def warp_col_max(at, i: int):
    """Columns 8i + 2c, 8i + 2c + 1 (lane (g, c)) of a (64, N) WGMMA-layout f32 array, given by
    its `origins`, maximized over the warp's 16 rows: the thread's two rows, then three
    shuffles across the warp's eight row pairs."""
    r = arith.maximumf(at[(0, 8 * i)], at[(8, 8 * i)])
    for dist in (4, 8, 16):
        r = arith.maximumf(r, mgpu_utils.shfl_bfly(r, dist))
    return r


def warpgroup_max_open(x, scratch_ref):
    """The row max of x (64, N) f32 (WGMMA layout) -> (N,) in the reduce(0) layout, as
    `warpgroup_reduce(x, "max", ...)` but with one warpgroup barrier instead of two: each warp's
    maxima go to `scratch_ref[warp * N + col]` (shuffles within the warp), one barrier, every
    thread reads the four warps'. Mosaic's reduction ends with a second barrier so that the
    scratch can be written again at once; the caller instead guarantees a warpgroup barrier
    between these reads and the next write of `scratch_ref` (in the decode loop: the barrier
    before P is read, `warpgroup_sync`). Not interpretable."""
    N = x.shape[1]

    @plgpu.inline_mgpu(
        arg_types=(WG_LAYOUT, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct((N,), x.dtype, layout=WG_LAYOUT.reduce(0)),
    )
    def reduce(_, xa, ref):
        at = origins(xa)
        lane, warp = lane_warp()
        c2 = arith.muli(arith.andi(lane, const_i32(3)), const_i32(2))  # columns 8i + c2 + (0, 1)
        vty = ir.VectorType(at[(0, 0)].type)
        idx = lambda w, i: arith.index_cast(
            ir.IndexType.get(),
            arith.addi(arith.addi(arith.muli(w, const_i32(N)), const_i32(8 * i)), c2),
        )
        for i in range(N // 8):
            vector.store(warp_col_max(at, i), ref, [idx(warp, i)])
        mgpu_utils.warpgroup_barrier()
        regs = []
        for i in range(N // 8):
            vals = [vector.load(vty, ref, [idx(const_i32(w), i)]) for w in range(4)]
            regs.append(
                arith.maximumf(arith.maximumf(vals[0], vals[1]), arith.maximumf(vals[2], vals[3]))
            )
        return col_vector(regs, N)

    return reduce(x, scratch_ref)


# --- Per-warp softmax (`TuningConfig.warp_softmax`) -------------------------------------------
# Each warp of a warpgroup runs its own online softmax over the tokens of its key rows (16 per
# 64-token plane) and its own value product over those tokens: no cross-warp max and no P
# hand-over through SMEM in the loop. Per-warp quantities live in the Mosaic layouts as arrays
# whose warps hold different values (as `smem.vec_load` with rows): valid under row broadcasts
# and elementwise use only, never under a Mosaic reduction.


def warp_max(x):
    """The max of x (64, N) f32 (WGMMA layout) over each warp's 16 rows -> (N,) in the
    reduce(0) layout, a different vector per warp: three shuffles, no SMEM, no barrier. Not
    interpretable."""
    N = x.shape[1]

    @plgpu.inline_mgpu(
        arg_types=(WG_LAYOUT,),
        return_type=plgpu.ShapeDtypeStruct((N,), x.dtype, layout=WG_LAYOUT.reduce(0)),
    )
    def reduce(_, xa):
        regs = [warp_col_max(origins(xa), i) for i in range(N // 8)]
        return col_vector(regs, N)

    return reduce(x)


def exceed_barrier(x, thr):
    """lazy_max: the warpgroup barrier that hands P over, which also reduces whether any of
    the warpgroup's scores x (64, N) f32 (WGMMA layout) passes thr (N,) (`WG_LAYOUT.reduce(0)`:
    the running max plus the slack): one compare per register, then `bar.red.or.pred` on the
    warpgroup's named barrier (the barrier `warpgroup_sync` passes, with an OR over its
    threads' predicates). Returns an int32 scalar, 1 or 0 and the same in every thread, for the
    branch that follows. A vote per warp through the reduction scratch, a plain barrier, four
    flag loads and their sum would cost ~11 more instructions per step. A running
    max still at -inf gives thr = -inf, which every finite score passes (the first step of a
    split holds one). Not interpretable."""
    splat = plgpu.Layout.WG_SPLAT(())

    @plgpu.inline_mgpu(
        arg_types=(WG_LAYOUT, WG_LAYOUT.reduce(0)),
        return_type=plgpu.ShapeDtypeStruct((), jnp.int32, layout=splat),
    )
    def vote(_, xa, ta):
        t_regs = list(ta.registers.flat)
        pred = None
        for i, r in np.ndenumerate(xa.registers):  # scalar compares: ptxas chains FSETP.OR
            t = t_regs[xa.layout.tiling.untile_indices(i)[1] // 8]
            for j in range(ir.VectorType(r.type).shape[0]):
                p = arith.cmpf(
                    arith.CmpFPredicate.OGT, vector.extract(r, [], [j]), vector.extract(t, [], [j])
                )
                pred = p if pred is None else arith.ori(pred, p)
        out = mgpu_utils.inline_ptx(
            "{ .reg .pred p, q; setp.ne.u32 p, $1, 0; bar.red.or.pred q, $2, 128, p; "
            "selp.u32 $0, 1, 0, q; }",
            arith.extui(ir.IntegerType.get_signless(32), pred),
            mgpu_utils.warpgroup_barrier_idx(sync=False),
            result_types=ir.IntegerType.get_signless(32),
            has_side_effects=True,
            convergent=True,
        )
        return mgpu_fa.FragmentedArray.splat(out, (), is_signed=True)

    return vote(x, thr)


def merge_warp_rows(accs, dst):
    """dst[16 m + i, n] += accs[m][16 w + i, n] for w = 0, 1, 2, 3 in that order (one warp at a
    time between warpgroup barriers, so that the sum is the same run to run): the per-warp
    value products (`smem.warp_value_codes`: warp-w rows 16 w + i stand for channel 16 m + i)
    summed into dst (D, N) f32 in SMEM (untiled). The caller orders dst's initialisation
    before (a warpgroup barrier); the last barrier here orders the sums before any read. Not
    interpretable."""

    @plgpu.inline_mgpu(arg_types=(*[WG_LAYOUT] * len(accs), plgpu.RefType()))
    def merge(_, *args):
        *xs, ref = args
        lane, warp = lane_warp()
        g, c = arith.shrui(lane, const_i32(2)), arith.andi(lane, const_i32(3))
        idx = lambda v: arith.index_cast(ir.IndexType.get(), v)
        for w in range(4):
            mine = arith.cmpi(arith.CmpIPredicate.eq, warp, const_i32(w))
            with mgpu_utils.when(mine):
                for m, xa in enumerate(xs):
                    for (r0, c0), reg in origins(xa).items():
                        at = [
                            idx(arith.addi(g, const_i32(16 * m + r0))),
                            idx(arith.addi(arith.muli(c, const_i32(2)), const_i32(c0))),
                        ]
                        old = vector.load(ir.VectorType(reg.type), ref, at)
                        vector.store(arith.addf(old, reg), ref, at)
            mgpu_utils.warpgroup_barrier()

    merge(*accs, dst)


def warp_group_sum(x, groups: tuple[int, ...], scratch_ref):
    """x (64, N) f32 of `mma.group_min_mma` sums (row g < n of each warp: its partial for group
    g) -> (64, N) whose 16 rows of warp w all hold the four warps' sum for group groups[w]:
    each warp's rows through scratch_ref (rows >= n into a slot never read), a warpgroup
    barrier, each thread adds the four warps' values of its warp's group, and a second
    barrier before the scratch is written again. Once per split. Native only."""
    N = x.shape[1]
    n = max(groups) + 1
    if n > 4 or 4 * (n + 1) * N > reduction_scratch(N):
        raise ValueError(f"warp_group_sum: {n} groups x {N} columns exceed the scratch")

    @plgpu.inline_mgpu(
        arg_types=(WG_LAYOUT, plgpu.RefType()),
        return_type=plgpu.ShapeDtypeStruct(x.shape, x.dtype, layout=WG_LAYOUT),
    )
    def total(_, xa, ref):
        at = origins(xa)
        lane, warp = lane_warp()
        c2 = arith.muli(arith.andi(lane, const_i32(3)), const_i32(2))
        slot = arith.minui(arith.shrui(lane, const_i32(2)), const_i32(n))
        idx = lambda w, g, i: arith.index_cast(
            ir.IndexType.get(),
            arith.addi(
                arith.muli(arith.addi(arith.muli(w, const_i32(n + 1)), g), const_i32(N)),
                arith.addi(const_i32(8 * i), c2),
            ),
        )
        for i in range(N // 8):
            vector.store(at[(0, 8 * i)], ref, [idx(warp, slot, i)])
        mgpu_utils.warpgroup_barrier()
        mine = const_i32(groups[0])
        for w in range(1, 4):
            if groups[w] != groups[0]:
                mine = arith.select(
                    arith.cmpi(arith.CmpIPredicate.eq, warp, const_i32(w)),
                    const_i32(groups[w]),
                    mine,
                )
        vty = ir.VectorType(at[(0, 0)].type)
        sums = {}
        for i in range(N // 8):
            vals = [vector.load(vty, ref, [idx(const_i32(w), mine, i)]) for w in range(4)]
            sums[8 * i] = arith.addf(arith.addf(vals[0], vals[1]), arith.addf(vals[2], vals[3]))
        mgpu_utils.warpgroup_barrier()
        regs = np.empty_like(xa.registers)
        for i in np.ndindex(regs.shape):
            r0, c0 = xa.layout.tiling.untile_indices(i)
            regs[i] = sums[c0] if r0 % 16 == 0 else fresh_value(sums[c0])
        return mgpu_fa.FragmentedArray(_registers=regs, _layout=xa.layout, _is_signed=None)

    return total(x, scratch_ref)
