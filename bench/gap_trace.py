"""What a benchmark call runs on the GPU besides the kernel, and the idle time between: a trace.

    PYTHONPATH=. python3 bench/gap_trace.py --point 8x131072 --kbg 2:128

One process, the point's choose_tuning launch (Hq=32, Hkv=8, D=128): after warm-up, under
`jax.profiler.trace` (CUPTI), one timed launch of each structure, separated by host syncs and
sleeps:

- "fori": bench/decode_attention.py's kernel loop (`kivi_fn(loop="fori")`: ROUNDS x L calls of
  `kivi_decode`, one per fori_loop iteration), what the benchmark times;
- "layers": `kivi_fn(loop="layers")` (the L layers unrolled in each round's body);
- "kernel": the kernel alone (`kd._kernel_call`), ROUNDS x L launches enqueued from Python;
- "cudnn": the benchmark's cuDNN fp16 loop (`fp16_fn`), ROUNDS x L calls.

From the GPU plane's events in each window: per call, the window (first event's start to the
last one's end), the busy time (the union of the events) and the idle rest, and every kernel
name with its count and mean duration per call; then the event sequence of one call of "fori".
"""

from __future__ import annotations

import argparse
import collections
import glob
import math
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402


def gpu_events(path):
    """[(start_ns, end_ns, name)] of every GPU plane's lines (kernels, copies), sorted."""
    from jax.profiler import ProfileData
    pd = ProfileData.from_file(path)
    out, seen = [], []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            seen.append(line.name)
            if "stream" not in line.name.lower():  # kernels and memcpys live on stream lines
                continue
            for e in line.events:
                out.append((e.start_ns, e.start_ns + e.duration_ns, e.name))
    if not out:
        print(f"no stream events; the GPU planes' lines: {seen}")
    return sorted(out)


def busy_ns(events):
    """The union of the events' intervals, ns."""
    total, end = 0.0, -math.inf
    for s, e, _ in events:
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def short(name, n=60):
    return name if len(name) <= n else name[: n - 3] + "..."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--point", default="8x131072")
    ap.add_argument("--kbg", default="2:128")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args()
    B, T = map(int, a.point.split("x"))
    kb, G = map(int, a.kbg.split(":"))
    Hq, Hkv, D = 32, 8, 128
    L, cache, tun, q, nt, kw = da.kernel_inputs(B, T, kb, G, Hq, Hkv, D)
    n = da.ROUNDS * L
    kern, args, _ = kd._kernel_call(q, cache, nt, jnp.int32(0), **kw, tuning=tun,
                                    interpret=False, stage_smem=False)
    kj = jax.jit(kern)
    metas = [args[0].at[0].set(i % L) for i in range(L)]
    Lf, _, fargs = da.fp16_inputs(B, Hq, Hkv, D, T)
    fori, layers = (da.kivi_fn(L, kw, tun, loop=lp) for lp in ("fori", "layers"))
    cudnn = da.fp16_fn(Lf, "cudnn")
    runs = {
        "fori": (lambda: fori(q, nt, *cache), n),
        "layers": (lambda: layers(q, nt, *cache), n),
        "kernel": (lambda: [kj(metas[i % L], *args[1:]) for i in range(n)], n),
        "cudnn": (lambda: cudnn(*fargs), da.ROUNDS * Lf),
    }
    for fn, _ in runs.values():  # compile and warm up
        for _ in range(2):
            jax.block_until_ready(fn())
    d = a.out or tempfile.mkdtemp()
    windows = {}
    with jax.profiler.trace(os.path.join(d, "trace")):
        for name, (fn, _) in runs.items():
            time.sleep(0.02)
            t0 = time.time_ns()
            jax.block_until_ready(fn())
            windows[name] = (t0, time.time_ns())
            time.sleep(0.02)
    path = sorted(glob.glob(os.path.join(d, "trace", "**", "*.xplane.pb"), recursive=True))[-1]
    ev = gpu_events(path)
    # the GPU clock and the host's differ by an offset: split the events at the sleeps
    groups, cur = [], []
    for e in ev:
        if cur and e[0] - max(x[1] for x in cur[-50:]) > 10e6:  # > 10 ms idle: a new window
            groups.append(cur)
            cur = []
        cur.append(e)
    if cur:
        groups.append(cur)
    names = list(runs)
    if len(groups) != len(names):
        print(f"found {len(groups)} event groups for {len(names)} structures; "
              f"sizes {[len(g) for g in groups]}")
    print(f"B={B} T={T} {kb}:{G}, L={L}, {n} calls per launch ({da.ROUNDS} rounds); "
          f"tuning {tun}")
    rows = []
    for name, g in zip(names, groups, strict=False):
        calls = runs[name][1]
        win = g[-1][1] - g[0][0]
        busy = busy_ns(g)
        kinds = collections.defaultdict(list)
        for s, e, k in g:
            kinds[k].append(e - s)
        rows.append((name, calls, win / calls / 1e3, busy / calls / 1e3,
                     (win - busy) / calls / 1e3))
        print(f"\n{name}: {len(g)} events, per call: window {win / calls / 1e3:.2f} us, busy "
              f"{busy / calls / 1e3:.2f}, idle {(win - busy) / calls / 1e3:.2f}")
        for k, ds in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
            print(f"  {len(ds) / calls:5.2f} x {sum(ds) / len(ds) / 1e3:9.2f} us  {short(k)}")
        if name == "fori":
            print("  one call's sequence (start after the first, duration), us:")
            mid = len(g) // 2
            for s, e, k in g[mid: mid + 12]:
                print(f"    {(s - g[mid][0]) / 1e3:9.2f} {(e - s) / 1e3:9.2f}  {short(k, 50)}")
    print("\n| structure | calls | window per call (us) | busy (us) | idle (us) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
