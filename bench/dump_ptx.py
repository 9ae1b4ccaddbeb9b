"""Compiles one kernel variant once and leaves Mosaic GPU's PTX / SASS / ptxas dumps behind,
for register and instruction analysis with a local ptxas (e.g. `ptxas --maxrregcount`).

    MOSAIC_GPU_DUMP_TO=dir MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTXAS=1 \
        PYTHONPATH=. python3 bench/dump_ptx.py --kb 2 --G 128 --flags fold_k=1
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kb", type=int, default=2)
    ap.add_argument("--G", type=int, default=128)
    ap.add_argument("--flags", default="", help="TuningConfig overrides, e.g. fold_k=1,stages=3")
    a = ap.parse_args()
    B, Hq, Hkv, D, T = 2, 32, 8, 128, 8192
    tun = kd.choose_tuning(8, Hkv, 131072, key_bits=a.kb, value_bits=a.kb, group_size=a.G)
    tun = da.override(tun, a.flags)
    cache = da.make_cache(jax.random.key(0), 1, B, Hkv, D, T, a.kb, a.kb, a.G)
    q = jax.random.normal(jax.random.key(1), (B, Hq, D), jnp.float32).astype(jnp.bfloat16)
    kw = dict(key_bits=a.kb, value_bits=a.kb, group_size=a.G, sm_scale=1 / math.sqrt(D))
    o = kd.kivi_decode(q, *cache, jnp.full((B,), T, jnp.int32), jnp.int32(0), **kw, tuning=tun)
    jax.block_until_ready(o)
    print("compiled", tun)


if __name__ == "__main__":
    main()
