"""Where a launch's time goes across the SMs: every unit's start, end and SM (`TuningConfig.trace`).

    PYTHONPATH=. python3 bench/tail_probe.py --points 8x131072 --kbg 2:128 --calls 48

Per point (Hq=32, Hkv=8, D=128, choose_tuning's launch with trace=True), in one process: the
kernel alone on operands prepared once (`kd._kernel_call`, as bench/overhead.py), the layers
alternating, `--calls` launches enqueued back to back (one host sync at the end: the GPU runs
them as a decode loop would), then `--bursts` launches each after a host sync (the GPU idle
before each, as in the benchmark's bursts). Each unit (a warpgroup's split of one (b, h) row)
records %globaltimer_lo at its start and before its copy-out, mod 2^24 ns, and %smid. Reported,
median over the launches of each kind:

- span: first unit's start to last unit's end, us;
- unit: a unit's duration, min / median / max, us;
- starts: last start - first start (the launch's ramp), us;
- ends p50 / p90 / max: when the units end, after the first start, us;
- idle: 1 - (sum over the SMs that run units of their busy time, first start to last end
  there) / (those SMs x span): the share of the SMs' time in the span with no unit running,
  what a perfectly balanced launch over the same SMs would not pay;
- gap: from a launch's last end to the next launch's first start (back to back only), us;
- same SM slow: the rank correlation over the SMs of their mean unit duration in the first
  and the second half of the launches (near 1: some SMs are slower in every launch; near 0:
  the tail moves).

The stamps take three padded query-head columns of the lse partials (ignored by the merge);
the kernel is otherwise the benchmark's. A table per point is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402

WRAP = 1 << 24  # the stamps are %globaltimer_lo mod 2^24 ns


def stamps(lse_parts):
    """[B, Hkv, S, NP] lse partials of a trace launch -> (start, end, sm) int64 arrays, one entry
    per unit; start/end in ns, mod 2^24."""
    x = np.asarray(lse_parts).reshape(-1, lse_parts.shape[-1])[:, -3:].astype(np.int64)
    return x[:, 0], x[:, 1], x[:, 2]


def launch_stats(start, end, sm):
    """One launch's figures (module docstring); times in us relative to its first start."""
    # every stamp of one launch lies within a few ms of the others: unwrap around the first
    t0 = (start - start[0] + WRAP // 2) % WRAP - WRAP // 2
    t1 = (end - start[0] + WRAP // 2) % WRAP - WRAP // 2
    base = t0.min()
    t0, t1 = (t0 - base) / 1e3, (t1 - base) / 1e3
    span = float(t1.max())
    busy = []
    for s in np.unique(sm):
        on = sm == s
        busy.append(t1[on].max() - t0[on].min())
    busy = np.asarray(busy)
    dur = t1 - t0
    return dict(span=span, unit_min=float(dur.min()), unit_med=float(np.median(dur)),
                unit_max=float(dur.max()), starts=float(t0.max()),
                end_p50=float(np.percentile(t1, 50)), end_p90=float(np.percentile(t1, 90)),
                end_max=span, idle=float(1 - busy.sum() / (len(busy) * span)),
                sms=int(len(busy)), dur=dur, sm=sm)


def sm_means(launches, sms):
    """Each SM's mean unit duration over the launches (launch_stats results)."""
    out = []
    for x in sms:
        d = np.concatenate([s["dur"][s["sm"] == x] for s in launches])
        out.append(d.mean() if d.size else np.nan)
    return np.array(out)


def rank_corr(a, b):
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def summarize(runs, back_to_back: bool):
    """The medians over launches of `launch_stats` (runs: their `stamps`), the gap between
    consecutive launches where they ran back to back, and the SMs' rank correlation."""
    st = [launch_stats(*r) for r in runs]
    row = {k: statistics.median(s[k] for s in st)
           for k in ("span", "unit_min", "unit_med", "unit_max", "starts", "end_p50",
                     "end_p90", "end_max", "idle", "sms")}
    if back_to_back and len(runs) > 1:
        gaps = []
        for (s0, e0, _), (s1, _e1, _) in zip(runs[:-1], runs[1:], strict=True):
            last_end = s0[0] + max((e0 - s0[0]) % WRAP)  # every end follows every start
            gaps.append(((s1 - last_end) % WRAP).min() / 1e3)
        row["gap"] = statistics.median(gaps)
    half = len(st) // 2
    if half >= 2:
        sms = np.unique(np.concatenate([s["sm"] for s in st]))
        first, second = sm_means(st[:half], sms), sm_means(st[half:], sms)
        both = np.isfinite(first) & np.isfinite(second)  # SMs that ran units in both
        row["same_sm_slow"] = rank_corr(first[both], second[both])
    return {k: round(float(v), 4) for k, v in row.items()}


def probe(B, T, kb, G, calls, bursts, Hq=32, Hkv=8, D=128):
    L, cache, tun, q, nt, kw = da.kernel_inputs(B, T, kb, G, Hq, Hkv, D)
    tun = dataclasses.replace(tun, trace=True)
    kern, args, _ = kd._kernel_call(q, cache, nt, jnp.int32(0), **kw, tuning=tun,
                                    interpret=False, stage_smem=False)
    f = jax.jit(kern)
    metas = [args[0].at[0].set(i % L) for i in range(L)]
    for i in range(3):  # compile, warm up
        jax.block_until_ready(f(metas[i % L], *args[1:]))
    outs = [f(metas[i % L], *args[1:]) for i in range(calls)]  # back to back
    jax.block_until_ready(outs)
    b2b = [stamps(o[1]) for o in outs]
    burst = []
    for i in range(bursts):  # each after a host sync
        burst.append(stamps(jax.block_until_ready(f(metas[i % L], *args[1:]))[1]))
    rows = {"back to back": summarize(b2b, True), "bursts": summarize(burst, False)}
    return dict(B=B, T=T, kb=kb, G=G, tuning=str(tun), n_back_to_back=len(b2b),
                n_bursts=len(burst), **rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="8x131072", help="BxT list")
    ap.add_argument("--kbg", default="2:128", help="bits:G list")
    ap.add_argument("--calls", type=int, default=48,
                    help="back-to-back launches (their stamps must fit in 2^24 ns = 16.7 ms)")
    ap.add_argument("--bursts", type=int, default=12)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    res = []
    for B, T, kb, G in da.points_kbg(a.points, a.kbg):
        r = probe(B, T, kb, G, a.calls, a.bursts)
        print(json.dumps(r), flush=True)
        res.append(r)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    cols = ("span", "unit_min", "unit_med", "unit_max", "starts", "end_p50", "end_p90",
            "idle", "gap", "same_sm_slow", "sms")
    print("| point | launches | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in res:
        for kind in ("back to back", "bursts"):
            v = r[kind]
            print(f"| B={r['B']} T={r['T']} {r['kb']}:{r['G']} | {kind} | " + " | ".join(
                f"{v[c]:.3f}" if c in v else "-" for c in cols) + " |")


if __name__ == "__main__":
    sys.exit(main())
