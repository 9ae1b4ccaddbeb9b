"""The kernel over V codes in 64-column blocks (`block_columns`) against the same kernel
over the documented layout (bit-identical expected: the same SMEM image) and the f32 twin, at
choose_tuning's anchor launches (runs 88, 109).

    PYTHONPATH=. python3 bench/vblock_check.py [--flags pack_planes=1]

B=3, Hq=32, Hkv=8, D=128, T=16k, ragged lengths (all, 7001, 255). Exits 1 unless every case is
bit-identical across the layouts and within 5e-3 of max |o|.
"""
import argparse
import math
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

from kivi_jax.quant import block_columns  # noqa: E402
from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flags", default="", help="TuningConfig overrides")
    ap.add_argument("--cases", default="2:128,2:32,4:128,4:32,2:64")
    a = ap.parse_args()
    ok_all = True
    for case in a.cases.split(","):
        kb, G = map(int, case.split(":"))
        B, Hq, Hkv, D, T = 3, 32, 8, 128, 16384
        tun = da.override(kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb,
                                           group_size=G), a.flags)
        cache = da.make_cache(da.jax.random.key(kb * 100 + G), 2, B, Hkv, D, T, kb, kb, G,
                              blocked=False)
        q = da.jax.random.normal(da.jax.random.key(G + kb), (B, Hq, D)).astype(jnp.bfloat16)
        nt = jnp.array([T, 7001, 255], jnp.int32)
        kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
        o, lse = kd.kivi_decode(q, *cache, nt, jnp.int32(1), **kw, tuning=tun)
        blk = (*cache[:3], block_columns(cache[3]), *cache[4:])
        ob, lseb = kd.kivi_decode(q, *blk, nt, jnp.int32(1), **kw, tuning=tun)
        ro, _ = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(1), **kw)
        same = bool(jnp.all(o == ob) & jnp.all(lse == lseb))
        err = float(jnp.abs(ob - ro).max() / jnp.abs(ro).max())
        ok = same and err < 5e-3
        ok_all &= ok
        print(f"{kb}:{G} W={tun.wg_per_block} S={tun.num_splits} {a.flags}: blocked == "
              f"documented {same}, rel err vs twin {err:.2e} {'ok' if ok else 'FAIL'}",
              flush=True)
    print("ALL OK" if ok_all else "FAILED")
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
