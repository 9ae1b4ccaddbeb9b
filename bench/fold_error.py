"""Numerical error of the folded value scale (fold_v) against the unfolded kernel, both against
the float32 twin, at short and long contexts: the fields' offsets are subtracted after every
sub-step, so the error must not grow with the number of steps.

    PYTHONPATH=. python3 bench/fold_error.py [--ts 8192,131072]

Prints max |o - o_ref| / max |o_ref| and max |lse - lse_ref| per (bits, T, variant), for bf16
queries drawn N(0, 1) (flat attention) and N(0, 4) (peaked attention).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402


def errors(o, lse, ro, rlse):
    return (float(jnp.abs(o - ro).max() / jnp.abs(ro).max()),
            float(jnp.abs(lse - rlse).max()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="8192,131072")
    ap.add_argument("--bits", default="2,4")
    a = ap.parse_args()
    B, Hq, Hkv, D, G = 2, 32, 8, 128, 128
    print("| bits | T | q std | fold_v: o err / lse err | no fold_v: o err / lse err |")
    print("|---|---|---|---|---|")
    for kb in map(int, a.bits.split(",")):
        for T in map(int, a.ts.split(",")):
            cache = da.make_cache(jax.random.key(T + kb), 1, B, Hkv, D, T, kb, kb, G)
            nt = jnp.array([T, T // 2 + 1], jnp.int32)  # ragged
            kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
            tun = kd.choose_tuning(B, Hkv, T, key_bits=kb, value_bits=kb, group_size=G)
            for std in (1.0, 4.0):
                q = (std * jax.random.normal(jax.random.key(7), (B, Hq, D))).astype(jnp.bfloat16)
                ro, rl = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(0), **kw)
                cells = []
                for fv in (True, False):
                    t = dataclasses.replace(tun, fold_v=fv)
                    o, lse = kd.kivi_decode(q, *cache, nt, jnp.int32(0), **kw, tuning=t)
                    eo, el = errors(o, lse, ro, rl)
                    cells.append(f"{eo:.2e} / {el:.2e}")
                print(f"| {kb} | {T} | {std:g} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
