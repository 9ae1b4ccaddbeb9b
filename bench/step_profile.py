"""Where a decode step's time goes: the generation loop under the JAX profiler, its GPU kernels
summed by kind (GEMMs, the KIVI kernel, cuDNN attention, other fusions, copies).

    python -m bench.step_profile --points 1x4096 --caches fp16,kivi2 --out DIR   # the GPU run
    python -m bench.step_profile --tiny                                          # CPU smoke test

Runs the same loop as `bench.generate` (random weights in the decode layout, a cache whose rows
hold `context` tokens, greedy decoding through `models.generate.decode_loop_jit`) once to
compile, once timed (wall ms per step), then once inside `jax.profiler.trace`. The trace's
device events on the compute streams give each kernel's duration; per step: GPU busy time
(the sum of kernel durations), kernel launches, the time per kind and the heaviest kernels by
name. Wall minus busy is what the GPU spent waiting between kernels (launch latency, host
work). The weights' bytes over the step's time against the H200's 4.8 TB/s is the roofline
view of batch 1, where the weights dominate. A point whose cache cannot fit the device's free
memory is skipped with an `error` before anything is allocated (`bench.generate.check_fits`).

Not a figure of record (the profiler adds a little per kernel); it answers which kernels to
remove or speed up. Prints one table per point last and, with --out, writes
DIR/step_profile.json (points and an `env` block). Needs a GPU except --tiny, which runs the
same path on a tiny model on the CPU (no device events: only the wall time).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from bench import generate as bg
from models import generate as G
from models import llama
from models.presets import get_preset

# (kind, pattern over the lower-cased kernel name), first match wins
KINDS = (
    ("kivi kernel", r"mosaic|kivi_decode|fp8_decode|prerope_decode"),
    ("cudnn attention", r"cudnn|fmha|flash|sdpa"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|gemv|dot"),
    ("copy / update", r"dynamic_update|copy|memcpy|memset"),
    ("gather / scatter", r"gather|scatter"),
    ("reduction fusion", r"reduce"),
)


def kind_of(name: str) -> str:
    n = name.lower()
    return next((k for k, pat in KINDS if re.search(pat, n)), "other fusion")


def device_kernels(trace_dir: str) -> list[dict]:
    """Kernel events of a profiler trace: complete events on the device's compute streams."""
    files = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)
    if not files:
        return []
    with gzip.open(files[0]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    meta = lambda what: {
        (e["pid"], e.get("tid")) if what == "thread_name" else e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == what
    }
    procs, threads = meta("process_name"), meta("thread_name")
    on_device = [
        e for e in events if e.get("ph") == "X" and "gpu" in procs.get(e["pid"], "").lower()
    ]
    # The device process also holds an "XLA Ops" line that repeats the kernels by HLO op.
    stream = lambda e: threads.get((e["pid"], e.get("tid")), "").lower().startswith("stream")
    return [e for e in on_device if stream(e)]


def summarize(kernels: list[dict], steps: int, top: int = 10) -> dict:
    by_kind, count = collections.Counter(), collections.Counter()
    by_name = collections.Counter()
    for e in kernels:
        k = kind_of(e["name"])
        by_kind[k] += e.get("dur", 0.0)
        count[k] += 1
        by_name[e["name"][:80]] += e.get("dur", 0.0)
    per_step = lambda us: round(us / 1e3 / steps, 4)  # microseconds in total -> ms per step
    return dict(
        busy_ms=per_step(sum(by_kind.values())),
        kernels=round(len(kernels) / steps, 1),
        kinds={
            k: dict(ms=per_step(v), launches=round(count[k] / steps, 1))
            for k, v in by_kind.most_common()
        },
        top={n: per_step(v) for n, v in by_name.most_common(top)},
    )


def profile_point(params, config, cache_name, batch, context, steps, impl, group_size) -> dict:
    """The point's step profile; MemoryError (nothing allocated) where its cache cannot fit."""
    fill_args = (
        cache_name,
        config,
        batch,
        context,
        steps,
        params_dtype(params),
        128,
        group_size,
        llama.is_unstacked(params),
    )
    bg.check_fits(*fill_args)
    fill = lambda: bg.filled_cache(*fill_args)
    bg.run_loop(params, config, fill(), steps, impl, max_new=2)  # compiles
    cache = fill()
    jax.block_until_ready(cache)
    t = time.perf_counter()
    bg.run_loop(params, config, cache, steps, impl, max_new=steps + 1)
    wall = time.perf_counter() - t
    cache = fill()
    jax.block_until_ready(cache)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            bg.run_loop(params, config, cache, steps, impl, max_new=steps + 1)
        kernels = device_kernels(d)
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    wall_ms = 1e3 * wall / steps
    return dict(
        model=config.name,
        batch=batch,
        context=context,
        cache=cache_name,
        impl=impl,
        wall_ms=round(wall_ms, 4),
        tokens_per_s=round(batch / wall_ms * 1e3, 1),
        weights_TBps=round(weights / wall_ms / 1e9, 3),
        **summarize(kernels, steps),
    )


def params_dtype(params):
    return jax.tree.leaves(params)[0].dtype


def table(r: dict) -> str:
    head = (
        f"{r['model']} B={r['batch']} T={r['context']} {r['cache']} ({r['impl']}): "
        f"{r['wall_ms']:.2f} ms/step wall, {r['busy_ms']:.2f} busy, {r['kernels']:.0f} "
        f"kernels/step, weights at {r['weights_TBps']:.2f} TB/s"
    )
    kinds = [
        f"  {k:18s} {v['ms']:8.3f} ms {v['launches']:7.1f}/step" for k, v in r["kinds"].items()
    ]
    tops = [f"    {ms:8.3f} ms  {name}" for name, ms in r["top"].items()]
    return "\n".join([head, *kinds, *tops])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--points", default="1x4096", help="batch x context pairs, comma separated")
    ap.add_argument("--caches", default="fp16,kivi2")
    ap.add_argument("--impl", default="auto", help="decode attention implementation")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=None, help="KIVI G (128; --tiny: 32)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model")
    ap.add_argument("--out", type=Path, default=None, help="directory for step_profile.json")
    a = ap.parse_args(argv)
    config = bg.TINY if a.tiny else get_preset(a.model)
    group_size = a.group_size or (32 if a.tiny else 128)
    params = G.decode_layout(llama.init_params(config, jax.random.key(0), jnp.bfloat16), config)
    points = [tuple(int(v) for v in p.split("x")) for p in a.points.split(",") if p]
    rows = []
    for batch, context in points:
        for cache in a.caches.split(","):
            try:
                r = profile_point(
                    params, config, cache, batch, context, a.steps, a.impl, group_size
                )
            except MemoryError as e:  # a point too large for the device: say so and go on
                r = dict(model=config.name, batch=batch, context=context, cache=cache, error=str(e))
            rows.append(r)
            print(json.dumps(r), flush=True)
    if a.out:
        env = common.env_info(sys.argv[1:] if argv is None else argv, "step_profile")
        common.write_json(a.out / "step_profile.json", env=env, points=rows)
    print()
    for r in rows:
        print(
            table(r)
            if "error" not in r
            else f"{r['model']} B={r['batch']} T={r['context']} {r['cache']}: skipped, {r['error']}"
        )
    return rows


if __name__ == "__main__":
    main()
