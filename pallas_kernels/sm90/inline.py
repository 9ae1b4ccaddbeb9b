"""Helpers for the bodies of `plgpu.inline_mgpu` functions.

Everything here runs while an inline Mosaic GPU body is traced and takes or returns MLIR
values or Mosaic GPU `FragmentedArray`s, not jax arrays: i32 constants (`const_i32`) and index
casts (`as_index`), the thread's lane and warp (`lane_warp`), a fragmented array's registers by
logical index (`origins`), a column vector built from its registers (`col_vector`), a register
as a new SSA value (`fresh_value`) and the in-register 8x8 transpose (`transpose8x8`). Native
only: the interpreter never traces these bodies.

The register layout is the WGMMA one (`layout.WG_LAYOUT`): warp w holds rows 16 w .. 16 w + 15
of a (64, N) tile, lane (g, c) = (lane // 4, lane % 4) rows g and g + 8 and columns 8 i + 2 c,
8 i + 2 c + 1 of every 8-column block (two 16-bit or 32-bit elements per register; 8-bit
tiles: four consecutive bytes).
"""

from __future__ import annotations

import numpy as np
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils


def const_i32(v):
    """The Python int v as an i32 constant."""
    return mgpu_utils.c(v, ir.IntegerType.get_signless(32))


def as_index(v):
    """An i32 value as an MLIR index (a memref subscript)."""
    return arith.index_cast(ir.IndexType.get(), v)


def lane_warp():
    """(lane, warp within the warpgroup) as i32 values."""
    tid = mgpu_utils.thread_idx()
    return arith.andi(tid, const_i32(31)), arith.andi(arith.shrui(tid, const_i32(5)), const_i32(3))


def col_vector(regs, n):
    """A (n,) vector in the WGMMA column layout (`WG_LAYOUT.reduce(0)`) from its registers, in
    order: what the vector loads and reductions build lane by lane."""
    return mgpu_fa.FragmentedArray(
        _registers=np.array(regs, dtype=object).reshape(
            mgpu_fa.WGMMA_COL_LAYOUT.registers_shape((n,))
        ),
        _layout=mgpu_fa.WGMMA_COL_LAYOUT,
        _is_signed=None,
    )


def origins(xa):
    """{logical index of the register for lane 0 of warp 0: register} of a FragmentedArray."""
    return {xa.layout.tiling.untile_indices(i): r for i, r in np.ndenumerate(xa.registers)}


def fresh_value(r):
    """The register r through an integer of its width and back: a new SSA value, so that MLIR
    does not fold a per-register relabelling (vector -> registers -> vector) away."""
    bits = ir.VectorType(r.type).get_dim_size(0) * mgpu_utils.bitwidth(
        ir.VectorType(r.type).element_type
    )
    return mgpu_utils.bitcast(mgpu_utils.bitcast(r, ir.IntegerType.get_signless(bits)), r.type)


def transpose8x8(reg):
    """`movmatrix`: the warp's 8x8 matrix of 16-bit elements held one register per lane (lane
    (g, c): row g, columns 2c, 2c + 1) transposed in registers (lane (g, c): row g of the
    transpose). `reg`: a 2 x 16-bit vector; returns the same type."""
    i32 = ir.IntegerType.get_signless(32)
    t = mgpu_utils.inline_ptx(
        "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
        mgpu_utils.bitcast(reg, i32),
        result_types=i32,
    )
    return mgpu_utils.bitcast(t, reg.type)
