"""Warp-level mma.sync (`plgpu.mma`) against wgmma with A from registers, at the kernel's shape.

The kernel's products are (64 tokens, K) @ (K, N = 8 heads) tiles. wgmma runs them as
m64n8k16 (fp16) or m64n8k32 (8-bit) with A in registers; `plgpu.mma` runs the same tile as
four warp-level mma.sync m16n8k16 / m16n8k32, one per warp, both operands in registers. Each
warpgroup runs ITERS calls of K = 128 (a chain of 128 / k instructions per accumulator)
round-robin over NACC independent accumulators; one-warpgroup blocks, WG/SM per SM. Prints
SM clocks per 64 x 8 x k tile (k = 16 for fp16, 32 for 8-bit) per SM (SM clock 1.98 GHz).

    PYTHONPATH=. python3 bench/mma_rate.py
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(__file__))
from wgmma_rate import median_seconds  # noqa: E402

ITERS = 2048
SMS = 132
K = 128


def make(kind, dtype, nacc, blocks):
    acc_t = jnp.int32 if dtype == jnp.int8 else jnp.float32
    one = 1 if dtype == jnp.int8 else 1.0 / 1024

    def body(b_g, o_g, b_s, o_s, bar):
        plgpu.copy_gmem_to_smem(b_g, b_s, bar)
        plgpu.barrier_wait(bar)
        if kind == "wgmma":
            lay = plgpu.Layout.WGMMA_8BIT if jnp.dtype(dtype).itemsize == 1 else plgpu.Layout.WGMMA
            a = plgpu.layout_cast(jnp.full((64, K), one, dtype), lay)

            def f(*accs):
                def it(i, _):
                    for k in range(nacc):
                        plgpu.wgmma(accs[k], a, b_s.T)
                        plgpu.wgmma_wait(1)
                    return _
                lax.fori_loop(0, ITERS // nacc, it, None)
                plgpu.wgmma_wait(0)
                return sum(x[...] for x in accs)
            out = pl.run_scoped(f, *[plgpu.ACC((64, 8), acc_t)] * nacc)
        else:
            a = plgpu.layout_cast(jnp.full((64, K), one, dtype), plgpu.Layout.MMA_LHS(dtype))
            b = plgpu.load(b_s.T, (), layout=plgpu.Layout.MMA_RHS(dtype))
            acc_lay = plgpu.Layout.MMA_ACC(acc_t)
            z = plgpu.layout_cast(jnp.zeros((64, 8), acc_t), acc_lay)

            def it(i, accs):
                return tuple(plgpu.mma(x, a, b) for x in accs)
            # distinct starting values, so that the compiler cannot merge identical chains
            accs = lax.fori_loop(0, ITERS // nacc, it,
                                 tuple(z + jnp.asarray(k, acc_t) for k in range(nacc)))
            out = sum(accs)
        o_s[...] = out.astype(jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[lax.axis_index("x")])
        plgpu.wait_smem_to_gmem(0)

    bits = jnp.dtype(dtype).itemsize * 8
    sw = plgpu.find_swizzle(K * bits, "b")
    tf = (plgpu.TilingTransform((8, sw * 8 // bits)), plgpu.SwizzleTransform(sw))
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((blocks, 64, 8), jnp.float32),
        grid=(blocks,), grid_names=("x",),
        scratch_types=[plgpu.SMEM((8, K), dtype, transforms=tf),
                       plgpu.SMEM((64, 8), jnp.float32), plgpu.Barrier()])


def rate(kind, dtype, nacc, per_sm, lower_only=False):
    blocks = SMS * per_sm
    f = jax.jit(make(kind, dtype, nacc, blocks))
    b = jnp.full((8, K), 1 if dtype == jnp.int8 else 1.0 / 128, dtype)
    if lower_only:
        f.trace(b).lower(lowering_platforms=("cuda",))
        return 0.0
    out = f(b)
    t = median_seconds(f, b)
    kt = 32 if jnp.dtype(dtype).itemsize == 1 else 16
    tiles = per_sm * ITERS * K // kt  # 64 x 8 x kt tiles per SM
    return t * 1.98e9 / tiles, float(out[0, 0, 0])


def main():
    lower_only = "--lower" in sys.argv
    rows = []
    for dtype in (jnp.float16, jnp.int8, jnp.float8_e4m3fn):
        for kind in ("wgmma", "mma"):
            for nacc in (1, 4):
                for per_sm in (1, 2, 4):
                    r = rate(kind, dtype, nacc, per_sm, lower_only)
                    rows.append((jnp.dtype(dtype).name, kind, nacc, per_sm, r))
                    print(rows[-1], flush=True)
    print("\n| operands | instruction | accumulators | WG per SM | clk per 64x8xk tile per SM |")
    for name, kind, nacc, per_sm, r in rows:
        print(f"| {name} | {kind} | {nacc} | {per_sm} | {r if lower_only else f'{r[0]:.1f}'} |")


if __name__ == "__main__":
    main()
