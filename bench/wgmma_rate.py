"""How fast does an SM retire wgmma m64nNk16 with A from registers (the kernel's shape)?

Each warpgroup issues ITERS wgmma calls of K (8 HGMMA each at K = 128, a dependent chain on
one accumulator) against a B operand in SMEM, round-robin over NACC independent accumulators,
keeping DEPTH calls in flight (wgmma_wait(DEPTH - 1)); one-warpgroup blocks, WG/SM per SM.
Prints clocks per HGMMA per SM (SM clock assumed 1.98 GHz).

    PYTHONPATH=. python3 bench/wgmma_rate.py            # N sweep, one call in flight
    PYTHONPATH=. python3 bench/wgmma_rate.py --depth    # calls in flight and chain length
    PYTHONPATH=. python3 bench/wgmma_rate.py --int8     # s8 x s8 -> s32, K = 32 per HGMMA
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

WG = plgpu.Layout.WGMMA
ITERS = 4096
SMS = 132


def make(N, nacc, blocks, depth=2, K=128, dtype=jnp.float16):
    def body(b_g, o_g, b_s, o_s, bar):
        plgpu.copy_gmem_to_smem(b_g, b_s, bar)
        plgpu.barrier_wait(bar)
        if dtype == jnp.int8:
            a = plgpu.layout_cast(jnp.full((64, K), 1, jnp.int8), plgpu.Layout.WGMMA_8BIT)
        else:
            a = plgpu.layout_cast(jnp.full((64, K), 1.0 / 1024, dtype), WG)

        def f(*accs):
            def it(i, _):
                for k in range(nacc):
                    plgpu.wgmma(accs[k], a, b_s.at[:, pl.ds(0, K)].T)
                    plgpu.wgmma_wait(depth - 1)
                return _
            lax.fori_loop(0, ITERS // nacc, it, None)
            plgpu.wgmma_wait(0)
            return sum(x[...] for x in accs)

        acc_t = jnp.int32 if dtype == jnp.int8 else jnp.float32
        o_s[...] = pl.run_scoped(f, *[plgpu.ACC((64, N), acc_t)] * nacc).astype(jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_s, o_g.at[lax.axis_index("x")])
        plgpu.wait_smem_to_gmem(0)

    bits = jnp.dtype(dtype).itemsize * 8
    sw = plgpu.find_swizzle(128 * bits, "b")
    tf = (plgpu.TilingTransform((8, sw * 8 // bits)), plgpu.SwizzleTransform(sw))
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((blocks, 64, N), jnp.float32),
        grid=(blocks,), grid_names=("x",),
        scratch_types=[plgpu.SMEM((N, 128), dtype, transforms=tf),
                       plgpu.SMEM((64, N), jnp.float32), plgpu.Barrier()])


def median_seconds(f, *args, reps=5):
    """Median host time of f(*args) after one warm-up call (the launch included)."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[reps // 2]


def rate(N, nacc, per_sm, depth=2, K=128, dtype=jnp.float16):
    blocks = SMS * per_sm
    f = jax.jit(make(N, nacc, blocks, depth, K, dtype))
    b = jnp.full((N, 128), 1 if dtype == jnp.int8 else 1.0 / 128, dtype)
    t = median_seconds(f, b)
    return t * 1.98e9 / (per_sm * ITERS * K // (32 if dtype == jnp.int8 else 16))


def main():
    rows = []
    if "--int8" in sys.argv:  # N = 8: fp16 (K = 16) against s8 (K = 32) per HGMMA
        for dt in (jnp.float16, jnp.int8):
            for per_sm in (1, 2, 3):
                rows.append((jnp.dtype(dt).name, per_sm, rate(8, 2, per_sm, 2, 128, dt)))
                print(rows[-1], flush=True)
        print("\n| A/B type | WG per SM | clk per HGMMA per SM |")
        for name, per_sm, clk in rows:
            print(f"| {name} | {per_sm} | {clk:.1f} |")
        return
    if "--depth" in sys.argv:  # N = 8: calls in flight, chain length, warpgroups per SM
        for K in (128, 64):
            for depth in (1, 2, 4, 8):
                for per_sm in (1, 2, 3):
                    clk = rate(8, max(depth, 1), per_sm, depth, K)
                    rows.append((K, depth, per_sm, clk))
                    print(rows[-1], flush=True)
        print("\n| K per call | calls in flight | WG per SM | clk per HGMMA per SM |")
        for K, depth, per_sm, clk in rows:
            print(f"| {K} | {depth} | {per_sm} | {clk:.1f} |")
        return
    for N in (8, 16, 32, 64):
        for nacc in (1, 4):
            for per_sm in (1, 2, 3):
                rows.append((N, nacc, per_sm, rate(N, nacc, per_sm)))
                print(rows[-1], flush=True)
    print("\n| N | accumulators | WG per SM | clk per HGMMA per SM |")
    for N, nacc, per_sm, clk in rows:
        print(f"| {N} | {nacc} | {per_sm} | {clk:.1f} |")


if __name__ == "__main__":
    main()
