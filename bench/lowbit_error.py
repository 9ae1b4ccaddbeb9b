"""What the opt-in low-bit product (TuningConfig.fp8_values) adds to KIVI's own
error, on float K/V quantized by the library (not random codes).

    PYTHONPATH=. python3 bench/lowbit_error.py [--ts 8192,32768] [--kernel | --interpret]

K, V [B, Hkv, T, D] bf16 with the structure of real ones: every channel has its own mean (N(0, 2)
per channel and head) plus N(0, 1) per token, and four key channels are 8x larger (the
outliers KIVI's per-channel keys are for); without channel means the output is an average of
noise, near zero, and every error is large against it. bf16 q of std 1 (flat attention) and
4 (peaked), ragged lengths, G = 128, residual 128. For each (bits, T, q std) prints
max |o - o_dense| / max |o_dense| of KIVI itself (the jnp reference over the quantized cache)
and, with --kernel (a Hopper GPU), of the kernel under each variant, plus its distance to
KIVI's reference: the variant's own error. o_dense: float32 attention over the unquantized
K, V.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import kivi_jax  # noqa: E402
from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402

VARIANTS = {  # TuningConfig fields over choose_tuning's (products on mma.sync since run 40)
    "default (mma.sync)": {}, "wgmma": dict(mma_sync=""),
    "fp8_values, keys mma.sync (low_precision)": dict(fp8_values=True, mma_sync="keys"),
    "fold_k (mma.sync)": dict(fold_k=True),
    "fold_k + fp8_values": dict(fold_k=True, fp8_values=True, mma_sync="keys"),
    "no fold_k (mma.sync)": dict(fold_k=False),
    "no subnormal values": dict(subnormal_values=False),
    "no warp_softmax": dict(warp_softmax=False)}


def dense_attention(q, k, v, lengths):
    """float32 softmax attention, q [B, Hq, D] over k, v [B, Hkv, T, D], ragged lengths."""
    B, Hq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    qg = q.astype(jnp.float32).reshape(B, Hkv, Hq // Hkv, D) / math.sqrt(D)
    s = jnp.einsum("bhnd,bhtd->bhnt", qg, k.astype(jnp.float32), precision="highest")
    s = jnp.where(jnp.arange(T)[None, None, None] < lengths[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhnt,bhtd->bhnd", p, v.astype(jnp.float32), precision="highest")
    return o.reshape(B, Hq, D)


def rel(o, ref):
    return float(jnp.abs(o.astype(jnp.float32) - ref).max() / jnp.abs(ref).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ts", default="8192,32768")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--kernel", action="store_true", help="also the kernel variants (Hopper GPU)")
    ap.add_argument("--interpret", action="store_true",
                    help="the kernel variants under the GPU interpreter (any backend; slow)")
    ap.add_argument("--variants", default="",
                    help="comma list of indices into VARIANTS (default: all)")
    a = ap.parse_args()
    B, Hq, Hkv, D, G = 2, 32, 8, 128, 128
    names = list(VARIANTS) if a.kernel or a.interpret else []
    if a.variants:
        names = [names[int(i)] for i in a.variants.split(",")]
    print("| bits | T | q std | KIVI (jnp reference) | "
          + " | ".join(f"kernel {n}: vs dense / vs KIVI" for n in names) + " |")
    print("|---" * (4 + len(names)) + "|")
    for kb in map(int, a.bits.split(",")):
        for T in map(int, a.ts.split(",")):
            ks = jax.random.split(jax.random.key(T + kb), 5)
            mean = lambda kk: 2.0 * jax.random.normal(kk, (1, B, Hkv, 1, D), jnp.float32)
            k = jax.random.normal(ks[0], (1, B, Hkv, T, D), jnp.float32) + mean(ks[3])
            k = k.at[..., :4].multiply(8.0).astype(jnp.bfloat16)  # outlier channels
            v = jax.random.normal(ks[1], (1, B, Hkv, T, D), jnp.float32) + mean(ks[4])
            v = v.astype(jnp.bfloat16)
            lengths = jnp.array([T, T // 2 + 1], jnp.int32)
            cache = kivi_jax.make_cache(f"kivi{kb}", num_layers=1, batch=B, kv_heads=Hkv,
                                        head_dim=D, max_len=T, group_size=G)
            cache = cache.prefill(k, v, lengths)
            base = kd.choose_tuning(B, Hkv, cache.keys.codes.shape[3] * (8 // kb),
                                    key_bits=kb, value_bits=kb, group_size=G)
            for std in (1.0, 4.0):
                q = (std * jax.random.normal(ks[2], (B, Hq, D))).astype(jnp.bfloat16)
                dense = dense_attention(q, k[0], v[0], lengths)
                kivi = kivi_jax.decode_attention(q, cache, 0, implementation="reference")
                cells = [f"{rel(kivi, dense):.2e}"]
                for flags in (VARIANTS[n] for n in names):
                    tun = dataclasses.replace(base, **flags)
                    o = kivi_jax.decode_attention(q, cache, 0, implementation="pallas",
                                                  tuning=tun, interpret=a.interpret)
                    cells.append(f"{rel(o, dense):.2e} / {rel(o, kivi.astype(jnp.float32)):.2e}")
                print(f"| {kb} | {T} | {std:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
