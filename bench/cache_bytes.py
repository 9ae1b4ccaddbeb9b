"""Measured bytes per cached token of each cache, from the arrays a cache actually allocates.

    .venv/bin/python bench/cache_bytes.py [--layers 32 --kv-heads 8 --head-dim 128]

Allocates each cache (B=1, 4096 tokens) and divides the bytes of its quantized part by its
token capacity; the residual window is reported apart (a fixed cost per row, not per token).
Defaults are Llama-3-8B's shapes.
"""

import argparse
import datetime
import platform

import jax
import jax.numpy as jnp

import kivi_jax as kj


def measure(name, group_size, residual, layers, kv_heads, head_dim, tokens=4096):
    c = kj.make_cache(
        name,
        num_layers=layers,
        batch=1,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_len=tokens,
        dtype=jnp.float16,
        group_size=group_size,
        residual_length=residual,
    )
    nb = c.nbytes()
    if isinstance(c, kj.DenseCache):
        return nb.residual / tokens, 0
    return (nb.codes + nb.scales) / c.keys.capacity, nb.residual


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    rows = [("fp16", 32)] + [(n, g) for n in ("kivi2", "kivi4", "k4v2") for g in (32, 64, 128)]
    fp16, _ = measure("fp16", 32, 128, a.layers, a.kv_heads, a.head_dim)
    print(
        f"# bytes per cached token, L={a.layers} Hkv={a.kv_heads} D={a.head_dim}; "
        f"{datetime.date.today()}, jax {jax.__version__}, {platform.machine()} CPU\n"
    )
    print(
        "| cache | G | bytes/token | KiB/token | bits/element | vs fp16 | residual window (R=128) |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, g in rows:
        per, res = measure(name, g, 128, a.layers, a.kv_heads, a.head_dim)
        bits = per * 8 / (2 * a.layers * a.kv_heads * a.head_dim)
        print(
            f"| {name} | {g if name != 'fp16' else '-'} | {per:,.0f} | {per / 1024:.2f} | "
            f"{bits:.3f} | {fp16 / per:.2f}x | {res / 1024:,.0f} KiB per row |"
        )


if __name__ == "__main__":
    main()
