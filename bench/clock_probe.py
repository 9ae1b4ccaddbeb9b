"""SM clock, power and clock-event reasons while the kernel (and cuDNN) run back to back (H200).

    python -m bench.clock_probe --point 8x131072 --kbg 2:128 --cudnn
    python -m bench.clock_probe --variants "default;num_splits=12;stages=3"

Is a launch slower than its byte count says because it does more, or because the GPU runs it
at a lower clock (the power cap)? Each variant (TuningConfig overrides `name=value,...` on the
kernel's own launch, `bench.common.override`; "default": the kernel's choice) runs the chain
of bench/kernel_grid.py (`bench.common.kivi_chain`: --calls dependent public calls per launch)
back to back for --seconds, while `nvidia-smi` samples the SM clock, the power draw and the
active clock-event reasons every 20 ms. The table gives the median time per call, the median
and minimum SM clock, the median power and the reasons seen: the "back to back" figures of
docs/performance.md, beside kernel_grid's bursts. Needs an NVIDIA Hopper GPU and nvidia-smi.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp

from bench import common
from bench.kernel_grid import HEAD_DIM, KV_HEADS, RESIDUAL

QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"


def sampled(fn, seconds: float) -> tuple[float, list[tuple[float, float, str]]]:
    """Median seconds per launch of fn() run back to back for `seconds`, with nvidia-smi's
    samples over that window: (t, [(MHz, W, reasons)])."""
    jax.block_until_ready(fn())  # compiled and warm before sampling starts
    smi = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "20"],
        stdout=subprocess.PIPE,
        text=True,
    )
    ts, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        ts.append(common.launch_seconds(fn))
    smi.terminate()
    out, _ = smi.communicate()
    rows = []
    for line in out.strip().splitlines():
        try:
            mhz, watts, why = (x.strip() for x in line.split(","))
            rows.append((float(mhz), float(watts), why))
        except ValueError:  # "[N/A]" or a partial line at termination
            continue
    return statistics.median(ts), rows


def report(name: str, t: float, calls: int, rows) -> str:
    mhz = [r[0] for r in rows] or [math.nan]
    watts = [r[1] for r in rows] or [math.nan]
    why = " ".join(sorted({r[2] for r in rows}))
    return (
        f"| {name} | {1e3 * t / calls:.4f} | {statistics.median(mhz):.0f} | {min(mhz):.0f} | "
        f"{statistics.median(watts):.0f} | {why} | {len(rows)} |"
    )


def variant_tuning(cache, hq: int, variant: str):
    """None for "default" (the kernel's own choice), else choose_tuning's launch for this
    cache with the variant's overrides."""
    if variant in ("", "default"):
        return None
    return common.override(common.cache_tuning(cache, hq), variant)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", default="8x131072", help="BxT (T quantized tokens per row)")
    ap.add_argument("--kbg", default="2:128", help="bits:G (or kbits:vbits:G) list")
    ap.add_argument(
        "--variants",
        default="default",
        help="';'-separated TuningConfig overrides name=value,... ('default': none)",
    )
    ap.add_argument("--hq", type=int, default=32, help="query heads (Hkv = 8, D = 128)")
    ap.add_argument("--calls", type=int, default=50, help="dependent calls per launch")
    ap.add_argument("--seconds", type=float, default=4.0, help="back-to-back time per variant")
    ap.add_argument("--cudnn", action="store_true", help="cuDNN fp16 attention too")
    a = ap.parse_args(argv)
    b, t = map(int, a.point.split("x"))
    print(
        subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,clocks.max.sm,power.limit",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    print(
        f"B={b}, T={t} + R={RESIDUAL}, Hq={a.hq}, Hkv={KV_HEADS}, D={HEAD_DIM}, "
        f"{a.calls} calls per launch"
    )
    print(
        "| variant | ms per call | SM MHz median | SM MHz min | W median | clock-event reasons "
        "| samples |\n|---|---|---|---|---|---|---|",
        flush=True,
    )
    q = common.random_query(jax.random.key(1), b, a.hq, HEAD_DIM)
    if a.cudnn:
        nbytes = common.dense_bytes(b, KV_HEADS, HEAD_DIM, t + RESIDUAL)
        kvs = common.random_dense_kv(
            jax.random.key(3),
            layers=common.layers_for(nbytes, a.calls),
            batch=b,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            length=t + RESIDUAL,
        )
        lengths = jnp.full((b,), t + RESIDUAL, jnp.int32)
        fn = common.dense_chain(a.calls, "cudnn")
        qd = q[:, None].astype(jnp.float16)
        secs, rows = sampled(lambda: fn(qd, kvs, lengths), a.seconds)
        print(report("cuDNN fp16", secs, a.calls, rows), flush=True)
        del kvs
    for kb, vb, g in common.parse_kbg(a.kbg):
        nbytes = common.kivi_bytes(b, KV_HEADS, HEAD_DIM, t, RESIDUAL, kb, vb, g)
        layers = common.layers_for(nbytes, a.calls)
        cache = common.random_kivi_cache(
            jax.random.key(b * 7 + t + kb),
            layers=layers,
            batch=b,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            tokens=t,
            key_bits=kb,
            value_bits=vb,
            group_size=g,
            residual=RESIDUAL,
        )
        for variant in a.variants.split(";"):
            tuning = variant_tuning(cache, a.hq, variant)
            fn = common.kivi_chain(a.calls, layers, "pallas", tuning)
            secs, rows = sampled(lambda fn=fn, cache=cache: fn(q, cache), a.seconds)
            print(report(f"{kb}/{vb}-bit G={g} {variant}", secs, a.calls, rows), flush=True)
        del cache


if __name__ == "__main__":
    main()
