"""The load pipeline alone for candidate cache layouts: how fast the kernel's own pipeline
(`_pipeline`: one warp issues, the copies only, no compute) streams a KIVI cache when a
256-token step is six, four or one copies.

    PYTHONPATH=. python3 bench/page_probe.py --kbg 2:128,2:32,4:128

B=8, Hkv=8, D=128, T=128k, with choose_tuning's launch (warpgroups per block, splits, stages,
release_slots) for the bits and group size. Per 256-token step at 2-bit G=128 (18
KiB): K codes 8 KiB, V codes 8 KiB, the key scale and minimum 1 KiB, the value scale and
minimum 1 KiB. Layouts (`layouts`):

- `documented`: docs/layout.md (the cache's layout): six copies, V codes [D, Tq/Pv] (rows
  of 64 bytes);
- `vblock`: V codes in blocks of 64 Pv tokens [Tq/(64 Pv), D, 64], scales as documented;
- `vblock+stacked`: and scale, minimum stacked on a leading axis: four copies;
- `alt`: and scale, minimum adjacent per group / step (`to_alt_layout`): four copies;
- `page`: everything of a step in one page, one copy.

Timed as bench/decode_attention.py (ROUNDS launches of the L layers in one jitted loop).
"""

from __future__ import annotations

import argparse
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

B, HKV, D, T, TS = 8, 8, 128, 131072, 256
NH, NSTEP = B * HKV, T // TS
u8, f16 = jnp.uint8, jnp.float16


def layouts(kb=2, G=128):
    """name -> [(per-head array shape, dtype, block shape, axis of the step index)] for
    kb-bit codes (keys and values) and group size G."""
    P = 8 // kb
    kc = ((T // P, D), u8, (TS // P, D), 0)  # key codes: the same in every layout
    g, vb = TS // G, TS // (64 * P)  # key groups, value-code blocks per step
    sep = [((T // G, D), f16, (g, D), 0)] * 2  # documented: key scale, key minimum
    vsep = [((D // G, T // TS, TS), f16, (D // G, 1, TS), 1)] * 2  # value scale, minimum
    vdoc = ((D, T // P), u8, (D, TS // P), 1)
    vblk = ((T // (64 * P), D, 64), u8, (vb, D, 64), 0)
    page = TS * D * 2 * kb // 8 + 2 * 2 * (g * D + D // G * TS)  # bytes per step
    row = 128 if page // 128 <= 256 else 256  # (a TMA box is at most 256 rows)
    return {
        "documented": [kc, *sep, vdoc, *vsep],
        "vblock": [kc, *sep, vblk, *vsep],
        "vblock+stacked": [kc, ((2, T // G, D), f16, (2, g, D), 1), vblk,
                           ((2, D // G, T // TS, TS), f16, (2, D // G, 1, TS), 2)],
        "alt": [kc, ((T // G, 2, D), f16, (g, 2, D), 0), vblk,
                ((T // TS, D // G, 2, TS), f16, (1, D // G, 2, TS), 0)],
        "page": [((NSTEP * page // row, row), u8, (page // row, row), 0)],
    }


def probe(arrs_spec, W, S, stages, release):
    """The kernel's own pipeline (`kd._pipeline`) over the arrays of `arrs_spec`, W
    warpgroups per block, S splits per head, no compute."""
    specs = [plgpu.BlockSpec(blk, functools.partial(
        lambda nd, ax, i: tuple(i if d == ax else 0 for d in range(nd)), len(blk), ax))
        for _, _, blk, ax in arrs_spec]

    def body(*refs):
        layer_ref, *gmem = refs[:1 + len(specs)]
        out, *sc = refs[1 + len(specs):]
        bufs, full, empty = sc[:len(specs)], sc[len(specs)], sc[len(specs) + 1]
        wg = lax.axis_index("wg") if W > 1 else 0
        u = lax.axis_index("blk") * W + wg
        hd, s = lax.div(u, S), lax.rem(u, S)
        layer = layer_ref[0]
        srcs = [g.at[layer, hd] for g in gmem]
        first = s * (NSTEP // S)
        sp = [plgpu.BlockSpec(x.block_shape, lambda i, f=x.index_map: f(first + i))
              for x in specs]
        kd._pipeline(lambda idx, *r: r[-1], sp, srcs, [b.at[wg] for b in bufs], full, wg,
                     stages, -(-NSTEP // S), jnp.int32(0), sync=True, one_warp=True,
                     empty=empty if release else None,
                     issuer=None if W > 1 else lax.rem(u, 4))
        del out  # (the copies are the work; nothing is written)

    scratch = [plgpu.SMEM((W, stages, *blk), dt) for _, dt, blk, _ in arrs_spec]
    scratch += [plgpu.Barrier(num_arrivals=len(specs), num_barriers=W * stages),
                plgpu.Barrier(num_arrivals=1, num_barriers=W * stages)]
    threads = dict(num_threads=W, thread_name="wg") if W > 1 else {}
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((128,), jnp.float32),
        grid=(NH * S // W,), grid_names=("blk",), **threads, scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kbg", default="2:128", help="bits:G list")
    a = ap.parse_args()
    print("| bits | G | layout | copies per step | ms | TB/s |")
    for kbg in a.kbg.split(","):
        kb, G = map(int, kbg.split(":"))
        nbytes = NH * T * D * 2 * kb // 8 + 4 * NH * T * (D // G) * 2  # codes + scales
        L = da.layers_for(nbytes)
        tun = kd.choose_tuning(B, HKV, T, key_bits=kb, value_bits=kb, group_size=G)
        for name, spec in layouts(kb, G).items():
            arrs = [jnp.zeros((L, NH, *shape), dt) for shape, dt, _, _ in spec]
            kern = probe(spec, tun.wg_per_block, tun.num_splits, tun.stages,
                         tun.release_slots)

            def run(*arrs, kern=kern, L=L):
                def one(i, acc):
                    return acc + kern(jnp.reshape(i % L, (1,)).astype(jnp.int32), *arrs)[0]
                return lax.fori_loop(0, da.ROUNDS * L, one, jnp.float32(0))
            t, _ = da.time_layers(jax.jit(run), arrs, reps=10)
            r = da.per_call(t, L, nbytes)
            print(f"| {kb} | {G} | {name} | {len(spec)} | {r['ms']:.4f} | {r['TBps']:.2f} |",
                  flush=True)
            del arrs


if __name__ == "__main__":
    main()
