"""A TuningConfig variant natively against the float32 twin and against choose_tuning's launch
on the same inputs, before timing it (device runs 90-92).

    PYTHONPATH=. python3 bench/check_variant.py --flags pack_planes=1 \
        --cases 2:2:128:128,2:2:32:128,4:4:128:128

A case is key bits:value bits:G:D; the launch is choose_tuning's at B=8, Hkv=8, T=128k (the
anchor's) with --flags on top, run at B=3, Hq=32, Hkv=8, T=16k with ragged lengths (all, 7001,
255). Exits 1 unless every case is within 5e-3 of max |o| (the GPU tests' bound for exact
paths) and finite.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flags", required=True, help="TuningConfig overrides, e.g. pack_planes=1")
    ap.add_argument("--cases", default="2:2:128:128,2:2:32:128,4:4:128:128")
    a = ap.parse_args()
    ok_all = True
    for case in a.cases.split(","):
        kb, vb, G, D = map(int, case.split(":"))
        B, Hq, Hkv, T = 3, 32, 8, 16384
        base = kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=vb, group_size=G,
                                head_dim=D)
        tun = da.override(base, a.flags)
        cache = da.make_cache(da.jax.random.key(kb * 100 + G + D), 2, B, Hkv, D, T, kb, vb, G)
        q = da.jax.random.normal(da.jax.random.key(G + D), (B, Hq, D)).astype(jnp.bfloat16)
        nt = jnp.array([T, 7001, 255], jnp.int32)
        kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D))
        o, lse = kd.kivi_decode(q, *cache, nt, jnp.int32(1), **kw, tuning=tun)
        o0, _ = kd.kivi_decode(q, *cache, nt, jnp.int32(1), **kw, tuning=base)
        ro, rlse = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(1), **kw)
        m = float(jnp.abs(ro).max())
        err, err0 = float(jnp.abs(o - ro).max()) / m, float(jnp.abs(o0 - ro).max()) / m
        lerr = float(jnp.abs(lse - rlse).max())
        ok = err < 5e-3 and lerr < 5e-3 and bool(jnp.isfinite(o).all())
        ok_all &= ok
        print(f"{case} W={tun.wg_per_block} {a.flags}: rel err {err:.2e} (choose_tuning's "
              f"{err0:.2e}), lse err {lerr:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    print("ALL OK" if ok_all else "FAILED")
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
