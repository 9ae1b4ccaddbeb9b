"""SM clock, power and clock-event reasons while a kernel variant runs back to back (H200).

    PYTHONPATH=. python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 \
        --variants "default;skip=copies;skip=compute" --cudnn

Is a variant slower than its floors because it does more, or because the GPU runs it at a lower
clock (power)? Each variant (`decode_attention.override` flags on choose_tuning's launch, as
bench/point_compare.py) runs as bench/decode_attention.py times it (ROUNDS x L layers per
launch, inputs rotated over L layers) for --seconds, while `nvidia-smi` samples the SM clock,
the power draw and the active clock-event reasons every 20 ms; the table gives the median
launch time per call, the median and minimum SM clock, the median power and the reasons seen.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


def sampled(fn, args, seconds):
    """Median seconds per launch of fn(*args) run back to back for `seconds`, with nvidia-smi's
    samples over that window: (t, [(MHz, W, reasons)])."""
    jax.block_until_ready(fn(*args))  # compiled and warm before sampling starts
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                            "-lms", "20"], stdout=subprocess.PIPE, text=True)
    ts, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    smi.terminate()
    out, _ = smi.communicate()
    rows = []
    for line in out.strip().splitlines():
        mhz, watts, why = (x.strip() for x in line.split(","))
        try:
            rows.append((float(mhz), float(watts), why))
        except ValueError:  # "[N/A]" or a partial line at termination
            continue
    return statistics.median(ts), rows


def report(name, t, calls, rows):
    mhz = [r[0] for r in rows] or [math.nan]
    watts = [r[1] for r in rows] or [math.nan]
    why = sorted({r[2] for r in rows})
    print(f"| {name} | {1e3 * t / calls:.4f} | {statistics.median(mhz):.0f} | {min(mhz):.0f} | "
          f"{statistics.median(watts):.0f} | {' '.join(why)} | {len(rows)} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--point", default="8x131072", help="BxT")
    ap.add_argument("--kbg", default="2:128", help="bits:G list")
    ap.add_argument("--variants", default="default;skip=copies;skip=compute")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--cudnn", action="store_true", help="cuDNN fp16 decode attention too")
    ap.add_argument("--prev", default="",
                    help="earlier kernel module files (variants prev, prev2.. or prev:flags, "
                         "as bench/point_compare.py)")
    a = ap.parse_args()
    mods = da.prev_modules(a.prev)
    B, T = map(int, a.point.split("x"))
    Hq, Hkv, D = a.hq, 8, 128
    print(subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.max.sm,"
                          "power.limit", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip())
    print(f"B={B}, T={T}, Hq={Hq}, Hkv={Hkv}, D={D}")
    print("| variant | ms per call | SM MHz median | SM MHz min | W median | clock-event reasons "
          "| samples |")
    print("|---|---|---|---|---|---|---|")
    if a.cudnn:
        L, _, args = da.fp16_inputs(B, Hq, Hkv, D, T)
        t, rows = sampled(da.fp16_fn(L, "cudnn"), args, a.seconds)
        report("cuDNN fp16", t, da.ROUNDS * L, rows)
        del args
    for kbg in a.kbg.split(","):
        kb, G = map(int, kbg.split(":"))
        L = da.layers_for(da.quant_bytes(B, Hkv, D, T, kb, kb, G))
        cache = da.make_cache(jax.random.key(B * 7 + T), L, B, Hkv, D, T, kb, kb, G)
        q = jax.random.normal(jax.random.key(1), (B, Hq, D), jnp.float32).astype(jnp.bfloat16)
        nt = jnp.full((B,), T, jnp.int32)
        kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
        for var in a.variants.split(";"):
            with da.module_variant(mods, var, B, Hkv, T, kb, G) as tun:
                t, rows = sampled(da.kivi_fn(L, kw, tun), (q, nt, *cache), a.seconds)
            report(f"{kb}-bit G={G} {var}", t, da.ROUNDS * L, rows)
        del cache


if __name__ == "__main__":
    main()
