"""Precision cost of the int8 key product (TuningConfig.int8_keys): the twin's int8 model and,
on a GPU, the kernel against the exact float32 twin, next to the default kernel.

    PYTHONPATH=. python3 bench/int8_error.py [--ts 8192,131072] [--kernel]

Prints max |o - o_ref| / max |o_ref| and max |lse - lse_ref| per (bits, T, q std), for bf16
queries drawn N(0, 1) (flat attention) and N(0, 4) (peaked attention); o_ref, lse_ref from the
exact twin. Without --kernel only the twin's int8 model is measured (any backend).
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
    return f"{float(jnp.abs(o - ro).max() / jnp.abs(ro).max()):.2e} / " \
           f"{float(jnp.abs(lse - rlse).max()):.2e}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="8192,131072")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--kernel", action="store_true", help="also the kernels (needs a GPU)")
    a = ap.parse_args()
    cols = ["twin int8"] + (["kernel int8", "kernel default"] if a.kernel else [])
    print("| bits | T | q std | " + " | ".join(f"{c}: o err / lse err" for c in cols) + " |")
    print("|---" * (3 + len(cols)) + "|")
    for kb, T, std, q, cache, nt, kw, tun in da.error_cases(
            list(map(int, a.bits.split(","))), list(map(int, a.ts.split(",")))):
        ref = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(0), **kw)
        cells = [errors(*kd.kivi_decode_reference(q, *cache, nt, jnp.int32(0), **kw,
                                                  int8_keys=True), *ref)]
        if a.kernel:
            for i8 in (True, False):
                t = dataclasses.replace(tun, int8_keys=i8)
                cells.append(errors(*kd.kivi_decode(q, *cache, nt, jnp.int32(0), **kw,
                                                    tuning=t), *ref))
        print(f"| {kb} | {T} | {std:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
