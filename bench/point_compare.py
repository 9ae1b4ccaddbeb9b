"""TuningConfig variants at given (B, T) points, cuDNN fp16 in the same process.

    PYTHONPATH=. python3 bench/point_compare.py --points 16x4096,4x32768 --kbg 2:128 \
        --variants "default;fold_k=0;subnormal_values=0"

Timing as bench/decode_attention.py (Hq=--hq, default 32; Hkv=8, D=128). A variant is "default"
(choose_tuning's) or comma-separated overrides of it (`decode_attention.override`); with
--prev FILE[,FILE2..] (earlier kivi_decode_sm90.py files, e.g. from `git show
REV:pallas_kernels/...`), a variant "prev" ("prev2", ..) or "prev:overrides" runs that module's
kernel with its own choose_tuning, for an A/B of versions in one process.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="16x4096,4x32768", help="BxT list")
    ap.add_argument("--kbg", default="2:128", help="bits:G list")
    ap.add_argument("--variants", default="default;fold_k=0;subnormal_values=0")
    ap.add_argument("--hq", type=int, default=32, help="query heads (Hkv=8, D=128)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="measure cuDNN and every variant this many times in turn (drift "
                         "between them then shows as spread, not as a bias of one)")
    ap.add_argument("--kivi_loops", default="fori",
                    help="the kernel's loop structures (decode_attention.kivi_fn: fori, layers)")
    ap.add_argument("--cudnn_loops", default="rounds",
                    help="cuDNN's loop structures (decode_attention.fp16_fn: rounds, layers); "
                         "the kernel's x cuDNN is against the last one listed")
    ap.add_argument("--prev", default="",
                    help="earlier kernel module files, comma-separated (variants prev, prev2..)")
    a = ap.parse_args()
    mods = da.prev_modules(a.prev)
    Hq, Hkv, D = a.hq, 8, 128
    print(f"Hq={Hq}, Hkv={Hkv}, D={D}")
    print("| B | T | bits | G | variant | tuning (W, S) | ms | x cuDNN |")
    for pt in (p for p in a.points.split(",") for _ in range(a.rounds)):
        B, T = map(int, pt.split("x"))
        for cl in a.cudnn_loops.split(","):
            cud = da.bench_fp16(B, Hq, Hkv, D, T, "cudnn", reps=10, loop=cl)
            tag = "" if a.cudnn_loops == "rounds" else f" ({cl})"
            print(f"| {B} | {T} | fp16 | | cuDNN{tag} | | {cud['ms']:.4f} | 1.00 |", flush=True)
        for kbg in a.kbg.split(","):
            kb, G = map(int, kbg.split(":"))
            for var in a.variants.split(";"):
                # "vrows[:flags]": the value codes as unblocked rows [.., D, T/Pv]
                vrows = var.startswith("vrows")
                spec = var.partition(":")[2] if vrows else var
                with da.module_variant(mods, spec, B, Hkv, T, kb, G) as tun:
                    for kl in a.kivi_loops.split(","):
                        r = da.bench_point(B, Hq, Hkv, D, T, kb, kb, G, tuning=tun, reps=10,
                                           alt="vrows" if vrows else False, loop=kl)
                        tag = "" if a.kivi_loops == "fori" else f" ({kl})"
                        print(f"| {B} | {T} | {kb} | {G} | {var}{tag} | {tun.wg_per_block}, "
                              f"{tun.num_splits} | {r['ms']:.4f} | {cud['ms'] / r['ms']:.2f} |",
                              flush=True)

if __name__ == "__main__":
    main()
