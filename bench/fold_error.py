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
import os
import sys

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
    print("| bits | T | q std | fold_v: o err / lse err | no fold_v: o err / lse err |")
    print("|---|---|---|---|---|")
    for kb, T, std, q, cache, nt, kw, tun in da.error_cases(
            list(map(int, a.bits.split(","))), list(map(int, a.ts.split(",")))):
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
