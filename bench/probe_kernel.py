"""Where the fused kernel's time goes: ablations timed in one process, and a single-launch
target for Nsight Compute / SASS dumps.

    PYTHONPATH=. python3 bench/probe_kernel.py --mode ablate      # table of variants
    PYTHONPATH=. python3 bench/probe_kernel.py --mode one [--kb 2 --G 128]  # one launch
    ncu --clock-control none -k regex:kivi --launch-count 1 --set full -o prof \
        python3 bench/probe_kernel.py --mode one

Shapes: B=8, Hq=32, Hkv=8, D=128, T=128k unless given. Timing as bench/decode_attention.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402

TC = kd.TuningConfig


def ablations(kb, G, which="where"):
    d = kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G)
    r = lambda **k: dataclasses.replace(d, **k)
    if which == "steps":  # launch parameters again, now that the loop is shorter (run 11)
        return [("default", d, False), ("stages3", r(stages=3), False),
                ("512-token copies", r(block_tokens=512), False),
                ("512 stages3", r(block_tokens=512, stages=3), False),
                ("S12", r(num_splits=12), False), ("S6", r(num_splits=6), False)]
    if which == "floors":  # load pipeline alone, compute alone (L2-resident copies), layouts
        return [("default", d, False), ("stages3", r(stages=3), False),
                ("pipeline-only", r(skip="compute"), False),
                ("pipeline-only st3", r(skip="compute", stages=3), False),
                ("pipeline-only 512", r(skip="compute", block_tokens=512), False),
                ("pipeline-only alt", r(skip="compute"), True),
                ("pipeline-only alt st3", r(skip="compute", stages=3), True),
                ("pipeline-only alt 512", r(skip="compute", block_tokens=512), True),
                ("compute-only", r(skip="loads"), False),
                ("compute-only alt", r(skip="loads"), True),
                ("alt", d, True), ("alt st3", r(stages=3), True),
                ("alt 512", r(block_tokens=512), True)]
    if which == "lean":  # fewer live registers: re-widened code bytes, folded key scale
        return [("default", d, False), ("reload", r(reload_codes=True), False),
                ("fold_k", r(fold_k=True), False),
                ("fold_k reload", r(fold_k=True, reload_codes=True), False),
                ("fold_k reload lean", r(fold_k=True, reload_codes=True, lean_values=True),
                 False),
                ("reload lean", r(reload_codes=True, lean_values=True), False)]
    if which == "wg":  # warpgroups per block (ptxas's register cap: W = 3 -> 168)
        d3 = kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G,
                              wg_per_block=3)
        rows = [("default", d, False), (f"W3 S{d3.num_splits}", d3, False)]
        rows += [(f"W3 S{S}", dataclasses.replace(d3, num_splits=S), False)
                 for S in (6, 12) if S != d3.num_splits]
        rows.append(("W3 fold_k", dataclasses.replace(d3, fold_k=True), False))
        rows.append(("W3 st3", dataclasses.replace(d3, stages=3), False))
        rows.append(("W3 compute-only", dataclasses.replace(d3, skip="loads"), False))
        return rows
    # The int8-key sets of runs 21-28 ("i8", "f8", "f8b", "f8c") were removed with int8_keys
    # (stop 19); they ran at the commits docs/performance.md names.
    if which == "mma":  # warp-level mma.sync against wgmma, exact and low-precision products
        fast = kd.choose_tuning(8, 8, 131072, key_bits=kb, value_bits=kb, group_size=G,
                                fp8_values=True)
        m = lambda t, **k: dataclasses.replace(t, **{"mma_sync": "both", **k})
        rows = [("default", d, False), ("mma", m(d), False),
                ("mma compute-only", m(d, skip="loads"), False)]
        if d.wg_per_block == 1:
            rows.append(("mma W3 S6", m(d, wg_per_block=3, num_splits=6), False))
        else:
            rows.append(("mma W1", m(d, wg_per_block=1, num_splits=8), False))
        if G == 128:
            rows += [(f"lowp S{fast.num_splits}", fast, False),
                     (f"lowp mma S{fast.num_splits}", m(fast), False),
                     ("lowp mma S12", m(fast, num_splits=12), False),
                     ("lowp mma compute-only", m(fast, skip="loads"), False)]
        return rows
    if which == "mma2":  # run 40: warpgroups per block, splits, mixed products with mma.sync
        m = lambda **k: dataclasses.replace(d, **{"mma_sync": "both", **k})
        if G == 32:
            return [("mma W3 S6", m(wg_per_block=3, num_splits=6), False),
                    ("mma W3 S12", m(wg_per_block=3, num_splits=12), False),
                    ("mma W2 S8", m(wg_per_block=2, num_splits=8), False),
                    ("mma W3 S12 compute-only", m(wg_per_block=3, num_splits=12, skip="loads"),
                     False)]
        if kb == 4:
            return [("mma W2 S8", m(wg_per_block=2, num_splits=8), False),
                    ("mma W1 S12", m(num_splits=12), False),
                    ("mma keys + fp8 values", m(mma_sync="keys", fp8_values=True), False)]
        return [("mma W3 S6", m(wg_per_block=3, num_splits=6), False),
                ("mma W3 S12", m(wg_per_block=3, num_splits=12), False),
                ("mma W2 S8", m(wg_per_block=2, num_splits=8), False),
                ("mma W3 S12 compute-only", m(wg_per_block=3, num_splits=12, skip="loads"),
                 False),
                ("mma W3 S12 pipeline-only", m(wg_per_block=3, num_splits=12, skip="compute"),
                 False),
                ("mma sub512 S8", m(block_tokens=512, sub_tokens=512), False),
                ("mma keys + fp8 values", m(mma_sync="keys", fp8_values=True), False),
                ("mma keys + fp8 values W3 S6",
                 m(mma_sync="keys", fp8_values=True, wg_per_block=3, num_splits=6), False),
                ("mma values only W3 S6", m(mma_sync="values", wg_per_block=3, num_splits=6),
                 False),
                ("mma keys only W3 S6", m(mma_sync="keys", wg_per_block=3, num_splits=6),
                 False)]
    if which == "mma3":  # run 43: the key scale folded into q (fold_k) on mma.sync
        m = lambda **k: dataclasses.replace(d, **k)
        if kb == 4:
            return [("default", d, False), ("fold_k", m(fold_k=True), False),
                    ("fold_k + fp8 values", m(fold_k=True, fp8_values=True, mma_sync="keys"),
                     False)]
        return [("default", d, False), ("fold_k", m(fold_k=True), False),
                ("fold_k W1 S8", m(fold_k=True, wg_per_block=1, num_splits=8), False),
                ("fold_k + fp8 values", m(fold_k=True, fp8_values=True, mma_sync="keys"),
                 False),
                ("fp8 values", m(fp8_values=True, mma_sync="keys"), False)]
    if which == "kfold":  # run 46: fold_k on mma.sync in registers, subnormal code fields
        m = lambda **k: dataclasses.replace(d, **k)
        f8 = dict(fp8_values=True, mma_sync="keys")
        rows = [("default", d, False), ("fold_k", m(fold_k=True), False),
                ("fold_k compute-only", m(fold_k=True, skip="loads"), False)]
        if G == 128:
            rows += [("fp8 values", m(**f8), False),
                     ("fold_k + fp8 values", m(fold_k=True, **f8), False)]
            if d.wg_per_block == 3:
                rows += [("fold_k S12", m(fold_k=True, num_splits=12), False),
                         ("fold_k W1 S8", m(fold_k=True, wg_per_block=1, num_splits=8), False)]
        return rows
    if which == "kfold2":  # run 47: fold_k with four warpgroups per block, more stages
        f = dataclasses.replace(d, fold_k=True)
        m = lambda **k: dataclasses.replace(f, **k)
        f8 = dict(fp8_values=True, mma_sync="keys")
        if kb == 4:
            return [("fold_k", f, False), ("fold_k W2 S8", m(wg_per_block=2, num_splits=8), False),
                    ("fold_k + fp8 W2 S8", m(wg_per_block=2, num_splits=8, **f8), False)]
        rows = [("fold_k", f, False),
                ("fold_k W4 S8", m(wg_per_block=4, num_splits=8), False),
                ("fold_k W4 S16", m(wg_per_block=4, num_splits=16), False),
                ("fold_k W4 S8 compute-only", m(wg_per_block=4, num_splits=8, skip="loads"),
                 False),
                ("fold_k W4 S8 pipeline-only", m(wg_per_block=4, num_splits=8, skip="compute"),
                 False)]
        if G == 128:
            rows += [("fold_k W3 st3", m(stages=3), False),
                     ("fold_k W2 512", m(wg_per_block=2, num_splits=8, block_tokens=512,
                                         sub_tokens=512), False),
                     ("fold_k + fp8 W4 S8", m(wg_per_block=4, num_splits=8, **f8), False)]
        return rows
    if which == "vsub":  # run 48: value fields as fp16 subnormals, log2-unit logits
        m = lambda **k: dataclasses.replace(d, **k)
        f8 = dict(fp8_values=True, mma_sync="keys")
        rows = [("default", d, False), ("no subnormal values", m(subnormal_values=False), False),
                ("default compute-only", m(skip="loads"), False)]
        if G == 128:
            rows += [("fp8 values", m(**f8), False)]
        if d.wg_per_block == 1:
            rows += [("W2 S8", m(wg_per_block=2, num_splits=8), False)]
        return rows
    if which == "fold":  # both scales folded (default at G = D = 128) against fold_k / both off
        return [("default", d, False), ("no fold_k", r(fold_k=False), False),
                ("no folds", r(fold_k=False, fold_v=False), False),
                ("compute-only", r(skip="loads"), False)]
    if which == "fv":  # value scale folded into P (default at G >= 64) against unfolded
        return [("default", d, False), ("no fold_v", r(fold_v=False), False),
                ("compute-only", r(skip="loads"), False)]
    if which == "w8":  # widen8 byte permutes (default) against Mosaic's own u8 -> u16 relayout
        return [("default", d, False), ("no widen8", r(widen8=False), False)]
    if which == "g32":  # G = 32: per-warp group vectors (default) against per-element selects
        return [("default", d, False), ("selects", r(warp_groups=False), False),
                ("selects S12", r(warp_groups=False, num_splits=12), False),
                ("default S12", r(num_splits=12), False)]
    if which == "regs":  # fewer live registers (k_chunks, lean_values), bigger sub-steps
        return [
            ("default", d, False),
            ("kch2", r(k_chunks=2), False),
            ("kch2 lean", r(k_chunks=2, lean_values=True), False),
            ("kch2 lean S6", r(k_chunks=2, lean_values=True, num_splits=6), False),
            ("kch2 lean S12", r(k_chunks=2, lean_values=True, num_splits=12), False),
            ("sub512", r(block_tokens=512, sub_tokens=512), False),
            ("kch2 sub512", r(block_tokens=512, sub_tokens=512, k_chunks=2), False),
            ("kch2 lean sub512", r(block_tokens=512, sub_tokens=512, k_chunks=2,
                                   lean_values=True), False),
            ("kch2 lean alt", r(k_chunks=2, lean_values=True), True),
        ]
    return [
        ("default", d, False),
        ("stages3", r(stages=3), False),
        ("pipeline-only", r(skip="compute"), False),
        ("pipeline-only st4", r(skip="compute", stages=4), False),
        ("pipeline-only alt", r(skip="compute"), True),
        ("pipeline-only alt st4", r(skip="compute", stages=4), True),
        ("pipeline-only alt 512", r(skip="compute", block_tokens=512), True),
        ("no values", r(skip="values"), False),
        ("alt", d, True),
        ("alt st3", r(stages=3), True),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="ablate")
    ap.add_argument("--kb", type=int, default=2)
    ap.add_argument("--G", type=int, default=128)
    ap.add_argument("--T", type=int, default=131072)
    ap.add_argument("--only", default="", help="comma list of ablation names")
    ap.add_argument("--flags", default="",
                    help="--mode one: TuningConfig overrides, e.g. fp8_values=1,num_splits=12")
    ap.add_argument("--set", default="where",
                    help="ablation set: where | regs | g32 | w8 | steps | floors | fv | fold "
                    "| lean | wg | i8 | f8 | f8b | f8c | mma | mma2 | mma3 | kfold | kfold2 | vsub")
    ap.add_argument("--pairs", default="", help="bits:G list, e.g. 2:128,2:32,4:128")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    B, Hq, Hkv, D, T = 8, 32, 8, 128, a.T
    if a.mode == "one":
        tun = kd.choose_tuning(B, Hkv, T, key_bits=a.kb, value_bits=a.kb, group_size=a.G)
        tun = da.override(tun, a.flags)  # TuningConfig overrides, e.g. stages=3
        cache = da.make_cache(jax.random.key(0), 1, B, Hkv, D, T, a.kb, a.kb, a.G)
        q = jax.random.normal(jax.random.key(1), (B, Hq, D), jnp.float32).astype(jnp.bfloat16)
        nt = jnp.full((B,), T, jnp.int32)
        kw = dict(key_bits=a.kb, value_bits=a.kb, group_size=a.G, sm_scale=1 / math.sqrt(D))
        for _ in range(2):
            jax.block_until_ready(kd.kivi_decode(q, *cache, nt, jnp.int32(0), **kw, tuning=tun))
        print("one launch done", tun)
        return
    rows = []
    cud = da.bench_fp16(B, Hq, Hkv, D, T, "cudnn", reps=10)
    rows.append(cud)
    print(cud, flush=True)
    only = set(a.only.split(",")) if a.only else None
    pairs = ([tuple(map(int, x.split(":"))) for x in a.pairs.split(",")] if a.pairs else
             [(a.kb, a.G)] + ([(2, 32)] if a.kb == 2 and a.G == 128 else []))
    ptx = da.PtxasLog(os.environ.get("MOSAIC_GPU_DUMP_TO"))
    for kb, G in pairs:
        for name, tun, alt in ablations(kb, G, a.set):
            if only and name not in only:
                continue
            t0 = time.time()
            try:
                r = da.bench_point(B, Hq, Hkv, D, T, kb, kb, G, tuning=tun, reps=10, alt=alt)
                r.update(name=name, x_cudnn=cud["ms"] / r["ms"], s=round(time.time() - t0, 1),
                         regs=ptx.new())
            except Exception as e:
                r = dict(name=name, kb=kb, G=G, error=repr(e)[:400])
            rows.append(r)
            print(r, flush=True)
    with open(os.path.join(a.out, "probe_rows.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    print(f"\ncuDNN fp16 {cud['ms']:.3f} ms\n| bits | G | variant | ms | TB/s | x cuDNN | regs |")
    for r in rows[1:]:
        if "ms" in r:
            print(f"| {r['kb']} | {r['G']} | {r['name']} | {r['ms']:.3f} | {r['TBps']:.2f} | "
                  f"{r['x_cudnn']:.2f} | {r.get('regs')} |")
        else:
            print(f"| {r['kb']} | {r['G']} | {r['name']} | ERROR {r['error'][:150]} |")


if __name__ == "__main__":
    main()
