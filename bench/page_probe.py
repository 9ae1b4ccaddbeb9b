"""The load pipeline alone for candidate cache layouts: how fast four warpgroups per SM stream a
2-bit G=128 cache through the kernel's own pipeline (`_pipeline`: one warp issues, slots
released through an mbarrier, two stages) when a 256-token step is one, two, four or six
copies.

    PYTHONPATH=. python3 bench/page_probe.py

B=8, Hkv=8, D=128, T=128k, eight splits per (b, h), one block of four warpgroups per SM, as
choose_tuning's launch at the anchor. Per step (18 KiB): K codes 8 KiB, V codes 8 KiB, the key
scale and minimum 1 KiB, the value scale and minimum 1 KiB. Layouts:

- `documented`: docs/layout.md: six copies, V codes as [D, Tq/4] (128 rows of 64 bytes);
- `alt`: `to_alt_layout`: V codes [Tq/256, D, 64] (one block), scales merged: four copies;
- `two`: a K page (codes, scale, minimum) and a V page: two copies of 9 KiB;
- `page`: one page of 18 KiB per step, one copy.

Timed as bench/decode_attention.py (ROUNDS launches of the L layers in one jitted loop).
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402

B, HKV, D, T, S, W, STAGES, TS = 8, 8, 128, 131072, 8, 4, 2, 256
NH, NSTEP = B * HKV, T // TS
u8, f16 = jnp.uint8, jnp.float16


def layouts():
    """name -> [(per-head array shape, dtype, block shape, axis of the step index)]."""
    return {
        "documented": [((T // 4, D), u8, (TS // 4, D), 0), ((T // 128, D), f16, (2, D), 0),
                       ((T // 128, D), f16, (2, D), 0), ((D, T // 4), u8, (D, TS // 4), 1),
                       ((1, T // TS, TS), f16, (1, 1, TS), 1),
                       ((1, T // TS, TS), f16, (1, 1, TS), 1)],
        "alt": [((T // 4, D), u8, (TS // 4, D), 0), ((T // 128, 2, D), f16, (2, 2, D), 0),
                ((T // TS, D, 64), u8, (1, D, 64), 0),
                ((1, T // TS, 2, TS), f16, (1, 1, 2, TS), 1)],
        "two": [((NSTEP * 72, 128), u8, (72, 128), 0), ((NSTEP * 72, 128), u8, (72, 128), 0)],
        "page": [((NSTEP * 144, 128), u8, (144, 128), 0)],
    }


def probe(arrs_spec, L):
    specs = [plgpu.BlockSpec(blk, functools.partial(
        lambda nd, ax, i: tuple(i if d == ax else 0 for d in range(nd)), len(blk), ax))
        for _, _, blk, ax in arrs_spec]

    def body(*refs):
        layer_ref, *gmem = refs[:1 + len(specs)]
        out, *sc = refs[1 + len(specs):]
        bufs, full, empty = sc[:len(specs)], sc[-2], sc[-1]
        wg = lax.axis_index("wg")
        u = lax.axis_index("blk") * W + wg
        hd, s = lax.div(u, S), lax.rem(u, S)
        layer = layer_ref[0]
        srcs = [g.at[layer, hd] for g in gmem]
        first = s * (NSTEP // S)
        sp = [plgpu.BlockSpec(x.block_shape, lambda i, f=x.index_map: f(first + i))
              for x in specs]
        kd._pipeline(lambda idx, *r: r[-1], sp, srcs, [b.at[wg] for b in bufs], full, wg,
                     STAGES, NSTEP // S, jnp.int32(0), sync=True, one_warp=True, empty=empty)
        del out  # (the copies are the work; nothing is written)

    scratch = [plgpu.SMEM((W, STAGES, *blk), dt) for _, dt, blk, _ in arrs_spec]
    scratch += [plgpu.Barrier(num_arrivals=len(specs), num_barriers=W * STAGES),
                plgpu.Barrier(num_arrivals=1, num_barriers=W * STAGES)]
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
        grid=(NH * S // W,), grid_names=("blk",), num_threads=W, thread_name="wg",
        scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))


def main():
    nbytes = NH * T * D // 2 + 4 * NH * T * (D // 128) * 2  # codes + scales (2-bit G=128)
    L = da.layers_for(nbytes)
    print(f"| layout | copies per step | ms | TB/s |  (L={L}, {nbytes / 1e6:.0f} MB per layer)")
    for name, spec in layouts().items():
        arrs = [jnp.zeros((L, NH, *shape), dt) for shape, dt, _, _ in spec]
        kern = probe(spec, L)

        def run(*arrs, kern=kern):
            def one(i, acc):
                return acc + kern(jnp.reshape(i % L, (1,)).astype(jnp.int32), *arrs)[0]
            return lax.fori_loop(0, da.ROUNDS * L, one, jnp.float32(0))
        t, _ = da.time_layers(jax.jit(run), arrs, reps=10)
        r = da.per_call(t, L, nbytes)
        print(f"| {name} | {len(spec)} | {r['ms']:.4f} | {r['TBps']:.2f} |", flush=True)
        del arrs


if __name__ == "__main__":
    main()
