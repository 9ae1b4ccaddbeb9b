"""Does where the cache lies in device memory move the kernel's time?

Run 128b ran the anchor (B=8 T=128k, 2-bit G=128) 5% faster in its second process than in its
first on the same card, while cuDNN measured the same in both (docs/performance.md). Between
two processes the cache's buffers land at other device addresses; this probe varies only that
inside one process:

    PYTHONPATH=. python3 bench/placement_probe.py --point 8x131072 --kbg 2:128 --allocs 4 \
        --rounds 3

`--allocs` copies of the point's L-layer cache (`decode_attention.kernel_inputs`'s, as the
other kernel-alone scripts take it, and copies of it), each allocated after a spacer buffer of
another size so that the copies start at different
addresses, all kept alive; then `--rounds` rounds, each timing cuDNN fp16 once and every copy
in turn with the benchmark's launch (`decode_attention.kivi_fn`, 16 x L calls, median of 10
after 2 warm-ups). Prints each copy's buffer addresses (the key and value codes' offsets mod 2
MiB, and their distance to the first copy's) and a table of ms per call: a spread between the
copies well beyond the spread of one copy over the rounds says that placement matters.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kivi_jax
import decode_attention as da  # noqa: E402

_MIB = 2**20


def allocate(cache, n, spacer_mib):
    """cache and n - 1 copies of it, the i-th after a spacer of 1 + i * spacer_mib MiB (kept
    alive with them, so that no copy reuses another's memory)."""
    keep, caches = [], [cache]
    for i in range(1, n):
        keep.append(jnp.zeros(((1 + i * spacer_mib) * _MIB // 4,), jnp.float32))
        caches.append(jax.block_until_ready([jnp.copy(x) for x in cache]))
    return keep, caches


def addresses(cache):
    """Device addresses of the cache's six buffers (key codes, scales, minimums; value codes,
    scales, minimums)."""
    return [x.unsafe_buffer_pointer() for x in cache]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", default="8x131072", help="BxT")
    ap.add_argument("--kbg", default="2:128", help="bits:G")
    ap.add_argument("--hq", type=int, default=32, help="query heads (Hkv=8, D=128)")
    ap.add_argument("--allocs", type=int, default=4, help="copies of the cache")
    ap.add_argument("--spacer_mib", type=int, default=37,
                    help="spacer growth per copy, MiB (odd: shifts every power-of-two phase)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no_cudnn", action="store_true")
    a = ap.parse_args(argv)
    B, T = map(int, a.point.split("x"))
    kb, G = map(int, a.kbg.split(":"))
    Hq, Hkv, D = a.hq, 8, 128
    if a.allocs < 2 or a.rounds < 1:
        raise ValueError(f"need --allocs >= 2 and --rounds >= 1, got {a.allocs}, {a.rounds}")
    nbytes = da.quant_bytes(B, Hkv, D, T, kb, kb, G)
    L, cache, tun, q, nt, kw = da.kernel_inputs(B, T, kb, G, Hq, Hkv, D)
    fn = da.kivi_fn(L, kw, tun)
    _keep, caches = allocate(cache, a.allocs, a.spacer_mib)
    del cache

    print(f"B={B} T={T} Hq={Hq} bits={kb} G={G} L={L} W={tun.wg_per_block} "
          f"S={tun.num_splits}; {jax.devices()[0].device_kind}")
    base = addresses(caches[0])
    print("| copy | key codes mod 2 MiB | value codes mod 2 MiB | key codes - copy 0 (MiB) |")
    print("|---|---|---|---|")
    for i, c in enumerate(caches):
        ad = addresses(c)
        print(f"| {i} | {ad[0] % (2 * _MIB)} | {ad[3] % (2 * _MIB)} | "
              f"{(ad[0] - base[0]) / _MIB:.1f} |", flush=True)

    times = {i: [] for i in range(a.allocs)}
    cudnn = []
    print("| round | " + " | ".join(f"copy {i}" for i in range(a.allocs))
          + ("" if a.no_cudnn else " | cuDNN") + " |")
    print("|---|" + "---|" * (a.allocs + (0 if a.no_cudnn else 1)))
    for r in range(a.rounds):
        row = []
        for i, c in enumerate(caches):
            t, _ = da.time_layers(fn, (q, nt, *c), reps=10)
            times[i].append(da.per_call(t, L, nbytes)["ms"])
            row.append(f"{times[i][-1]:.4f}")
        if not a.no_cudnn:
            cudnn.append(da.bench_fp16(B, Hq, Hkv, D, T, "cudnn", reps=10)["ms"])
            row.append(f"{cudnn[-1]:.4f}")
        print(f"| {r + 1} | " + " | ".join(row) + " |", flush=True)

    med = {i: statistics.median(ts) for i, ts in times.items()}
    within = max(max(ts) - min(ts) for ts in times.values())
    between = max(med.values()) - min(med.values())
    print(f"medians per copy (ms): {', '.join(f'{med[i]:.4f}' for i in range(a.allocs))}")
    print(f"spread between the copies' medians {between:.4f} ms "
          f"({100 * between / min(med.values()):.1f}%), largest spread of one copy over the "
          f"rounds {within:.4f} ms ({100 * within / min(med.values()):.1f}%)")
    return med, within, between


if __name__ == "__main__":
    main()
