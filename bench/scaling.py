"""Sequence-parallel decode across devices: the generation loop's step latency with a KIVI cache's
tokens sharded over a `seq` mesh axis (weights replicated), on 1, 2, 4, 8 devices.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m bench.scaling --devices 1,2,4,8 --out DIR
    python -m bench.scaling --devices 1,2,4,8 --points 1x4194304 --weak --out DIR   # weak
    python -m bench.scaling --tiny --devices 1,2,4                                  # CPU

Strong scaling (default): each `--points` B x T (default 1 x 1M and 8 x 256k tokens, the
issue's) runs on every device count n of `--devices`. The cache (`--cache`, default KIVI-2
G=128) holds T zero tokens per row (decode cost does not depend on the values) in a capacity of
T + steps rounded up to whole 256-token blocks per shard; on n devices it is sharded over a
mesh ("seq",) of the first n (`kivi_jax.sharding.shard_cache`) and the loop is the one
`models.generate.generate(..., mesh=...)` runs (`_sharded_programs`: every device attends and
writes its own tokens, the partials merged across "seq"). A first call compiles, the second
runs `--steps` steps, timed: step ms = seconds / steps. The single-device loop without a mesh
(`bench.generate.run_loop`) is timed beside as the baseline ("n = 1, no mesh"); speedup =
that over the n-device step. Weak scaling (`--weak`): each point's T is the tokens per
device, the context n x T, and the speedup the efficiency (1.0: the step time stays flat).

The merge's share (`merge_ms`, `merge_share`): a chain of `--merge-calls` dependent
`kivi_jax.attention.merge_across` calls over the mesh on one layer's partials (B x Hq x D
outputs and B x Hq log-sum-exps per device), timed alone, times the layers, over the step.

Prefill (`--prefill T`): a T-token random prompt (one row) prefilled through the sharded cache
in chunks of `--chunk` (`llama.prefill_chunked` inside the same shard_map: each chunk attends
every device's part of the past), tokens/s of the second call.

Check (`--check`, on the largest n): one layer's `sequence_parallel_attention` against
`decode_attention` on the unsharded cache (the same implementation, "auto"), both over a small
prefilled cache of random K/V (B = 2, 4,096 + 300 tokens, the preset's heads): max |error| /
max |o| must stay below 4e-3 (bf16 rounding of two orders of summation); the tool exits 1
otherwise.

Random bf16 weights of a preset (`--model`, default llama-3-8b) in `models.generate.
decode_layout`; never imports gguf. Feeds the scaling tables and plot of docs/generation.md
(issue 40's run): prints a table last and writes DIR/scaling_bench.json (rows, merge, prefill,
check, and an `env` block). Needs GPUs for the recorded numbers; --tiny runs on the CPU's
simulated devices (`jax_num_cpu_devices`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import kivi_jax
from bench import common
from bench import generate as bench_generate
from models import generate as G
from models import llama
from models.presets import get_preset

P = jax.P
CHECK_TOLERANCE = 4e-3  # of max |o|


def seq_mesh(n: int) -> jax.sharding.Mesh:
    """A mesh ("seq",) over the first n devices; ValueError when fewer exist."""
    if n > jax.device_count():
        raise ValueError(f"{n} devices asked for, {jax.device_count()} present")
    return jax.make_mesh((n,), ("seq",), devices=jax.devices()[:n])


def sharded_cache(mesh, config, name, batch, context, steps, dtype, group_size):
    """(fill, abstract cache): fill() makes a cache holding `context` zero tokens per row
    (`bench.generate.filled_cache`, its capacity in whole 256-token blocks per shard) directly
    in its shards over `mesh` (no device holds the whole cache on the way)."""
    rules = G._mesh_rules(mesh, None)
    make = lambda: bench_generate.filled_cache(
        name, config, batch, context, steps, dtype, 128, group_size, multiple=256 * mesh.size
    )
    abstract = jax.eval_shape(make)
    shardings = kivi_jax.sharding.cache_shardings(abstract, mesh, rules)
    return jax.jit(make, out_shardings=shardings), abstract


def sharded_loop(params, config, abstract_cache, mesh, steps: int):
    """run(cache, max_new) of the generation loop over `mesh`: weights replicated, the cache's
    tokens over "seq" (`models.generate.generate`'s program over a mesh)."""
    rules = G._mesh_rules(mesh, None)
    params = jax.device_put(params, jax.NamedSharding(mesh, P()))
    logits = jax.device_put(
        jnp.zeros((abstract_cache.batch, config.vocab_size), jnp.float32),
        jax.NamedSharding(mesh, P()),
    )
    _, loop = G._sharded_programs(
        mesh, rules, abstract_cache, config, G.bucket(steps + 1), G.GREEDY, "auto"
    )

    def run(c, max_new):
        state = loop(params, logits, c, jax.random.key(0), jnp.int32(max_new), G._pad_stops([]))
        state.tokens.block_until_ready()
        return state

    return run


def time_steps(run, fill, steps: int) -> tuple[float, float]:
    """(compile + first run seconds, ms per step) of `run(cache, max_new)` on fresh caches."""
    t0 = time.perf_counter()
    run(fill(), 2)  # compiles; max_new is traced
    t1 = time.perf_counter()
    c = fill()
    jax.block_until_ready(c)
    t2 = time.perf_counter()
    state = run(c, steps + 1)
    t3 = time.perf_counter()
    assert int(state.step) == steps + 1, int(state.step)
    return t1 - t0, 1e3 * (t3 - t2) / steps


def merge_ms(mesh, batch: int, config, calls: int) -> float:
    """ms per `merge_across` of one layer's partials over `mesh`, in a chain of dependent
    calls (each call's o feeds the next), the median of 5 runs."""
    n, hq, d = mesh.size, config.num_heads, config.head_dim
    o = jax.random.normal(jax.random.key(0), (n * batch, hq, d), jnp.float32)
    lse = jax.random.normal(jax.random.key(1), (n * batch, hq), jnp.float32)

    def chain(o, lse):
        step = lambda i, o: kivi_jax.attention.merge_across(o * 1.001, lse, "seq")
        return lax.fori_loop(0, calls, step, o, unroll=True)

    spec = P("seq")
    smap = jax.shard_map(chain, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False)
    f = jax.jit(smap)
    put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, spec))
    o, lse = put(o), put(lse)
    f(o, lse).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f(o, lse).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times)) / calls


def merge_point(mesh, batch: int, config, calls: int, step_ms: float) -> dict:
    """merge_ms (one step's: every layer's merge) and its share of a step of `step_ms`."""
    ms = config.num_layers * merge_ms(mesh, batch, config, calls)
    return dict(merge_ms=round(ms, 4), merge_share=round(ms / step_ms, 4))


def prefill_point(params, config, n: int, tokens: int, chunk: int, dtype, group_size, name):
    """tokens_per_s of prefilling one random `tokens`-token prompt in chunks over n devices
    (the second call; the first compiles)."""
    mesh = seq_mesh(n)
    fill, abstract = sharded_cache(mesh, config, name, 1, 0, tokens, dtype, group_size)
    prefill, _ = G._sharded_programs(
        mesh, G._mesh_rules(mesh, None), abstract, config, G.bucket(2), G.GREEDY, "auto",
        prefill_chunk=chunk,
    )  # fmt: skip
    params = jax.device_put(params, jax.NamedSharding(mesh, P()))
    prompt = jax.random.randint(jax.random.key(2), (1, tokens), 0, config.vocab_size)
    lengths = jnp.array([tokens], jnp.int32)
    seconds = []
    for _ in range(2):
        c = fill()
        jax.block_until_ready(c)
        t = time.perf_counter()
        logits, _ = prefill(params, prompt, lengths, c)
        logits.block_until_ready()
        seconds.append(time.perf_counter() - t)
    return dict(tokens_per_s=round(tokens / seconds[-1], 1))


def check_sharded_attention(config, cache_name, group_size, mesh) -> dict:
    """One layer's sequence-parallel attention against the unsharded call on a small cache of
    random K/V: {"max_error", "of_max_o", "ok"}."""
    L, B, T, hkv, d = 2, 2, 4096 + 300, config.num_kv_heads, config.head_dim
    cache = bench_generate.filled_cache(
        cache_name, dataclasses.replace(config, num_layers=L), B, 0, T, jnp.bfloat16, 128,
        group_size, multiple=256 * mesh.size,
    )  # fmt: skip
    k, v = (jax.random.normal(jax.random.key(i), (L, B, hkv, T, d), jnp.bfloat16) for i in (3, 4))
    cache = cache.prefill(k, v, jnp.array([T, T - 1000], jnp.int32))
    q = jax.random.normal(jax.random.key(5), (B, config.num_heads, d), jnp.bfloat16)
    want = jax.jit(lambda q, c: kivi_jax.decode_attention(q, c, 1))(q, cache)
    rules = G._mesh_rules(mesh, None)
    sharded = kivi_jax.sharding.shard_cache(cache, mesh, rules)
    f = jax.jit(lambda q, c: kivi_jax.sequence_parallel_attention(q, c, 1, mesh=mesh, rules=rules))
    got = f(q, sharded)
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    err, top = float(np.abs(got - want).max()), float(np.abs(want).max())
    return dict(
        devices=mesh.size, max_error=err, of_max_o=err / top, ok=err <= CHECK_TOLERANCE * top
    )


def step_point(params, config, args, dtype, batch: int, context: int, n: int) -> dict:
    """compile_s, step_ms and tokens_per_s of the decode loop at batch x context on n devices
    (0: one device without a mesh, `bench.generate.run_loop`)."""
    if n == 0:
        fill = lambda: bench_generate.filled_cache(
            args.cache, config, batch, context, args.steps, dtype, 128, args.group_size
        )
        run = lambda c, max_new: bench_generate.run_loop(
            params, config, c, args.steps, "auto", max_new
        )
    else:
        mesh = seq_mesh(n)
        fill, abstract = sharded_cache(
            mesh, config, args.cache, batch, context, args.steps, dtype, args.group_size
        )
        run = sharded_loop(params, config, abstract, mesh, args.steps)
    comp, ms = time_steps(run, fill, args.steps)
    return dict(
        compile_s=round(comp, 2), step_ms=round(ms, 3), tokens_per_s=round(1e3 * batch / ms, 1)
    )


def attempt(rec: dict, measure, *args) -> dict:
    """rec updated with what measure(*args) returns, or with the error it raised (a point
    that fails, out of memory say, is recorded and the run goes on)."""
    try:
        rec.update(measure(*args))
    except Exception as e:  # noqa: BLE001 - record and go on
        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--devices", default="1,2,4,8", help="device counts, comma separated")
    ap.add_argument("--points", default="1x1048576,8x262144", help="B x T pairs")
    ap.add_argument("--weak", action="store_true", help="T of each point is per device")
    ap.add_argument("--cache", default="kivi2")
    ap.add_argument("--group-size", type=int, default=None, help="G (default 128; --tiny: 32)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--merge-calls", type=int, default=50)
    ap.add_argument("--prefill", type=int, default=0, help="prompt tokens to prefill (0: none)")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill chunk")
    ap.add_argument("--check", action="store_true", help="sharded vs unsharded attention")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model")
    ap.add_argument("--out", type=Path, default=None, help="directory for scaling_bench.json")
    args = ap.parse_args(argv)
    if kivi_jax.cache_config(args.cache) is None:
        ap.error("--cache must name a quantized cache (the dense cache does not shard tokens)")
    counts = [int(n) for n in args.devices.split(",") if n]
    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",") if p]
    config = bench_generate.TINY if args.tiny else get_preset(args.model)
    args.group_size = args.group_size or (32 if args.tiny else 128)
    dtype = jnp.bfloat16
    params = G.decode_layout(llama.init_params(config, jax.random.key(0), dtype), config)
    result = dict(
        env=common.env_info(sys.argv[1:] if argv is None else argv, "scaling"),
        model=config.name, weights="random bf16 (preset shapes)", cache=args.cache,
        group_size=args.group_size, steps=args.steps, weak=args.weak, rows=[], prefill=[],
        check=None,
    )  # fmt: skip

    def save():
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "scaling_bench.json").write_text(json.dumps(result, indent=1) + "\n")

    def emit(kind, rec):
        result[kind].append(rec)
        print(json.dumps(rec), flush=True)
        save()

    for batch, tokens in points:
        base = None
        for n in [0, *counts]:  # 0: one device, no mesh (the baseline)
            context = tokens * max(n, 1) if args.weak else tokens
            rec = dict(batch=batch, context=context, devices=max(n, 1), mesh=n > 0)
            attempt(rec, step_point, params, config, args, dtype, batch, context, n)
            ms = rec.get("step_ms")
            if n == 0:
                base = ms
            elif base is not None and ms is not None:
                rec["speedup"] = round(base / ms, 3)
            if n > 1 and ms is not None:
                attempt(rec, merge_point, seq_mesh(n), batch, config, args.merge_calls, ms)
            emit("rows", rec)
    if args.prefill:
        for n in counts:
            rec = dict(tokens=args.prefill, chunk=args.chunk, devices=n)
            attempt(
                rec, prefill_point, params, config, n, args.prefill, args.chunk,
                dtype, args.group_size, args.cache,
            )  # fmt: skip
            emit("prefill", rec)
    if args.check:
        n = min(max(counts), jax.device_count())
        result["check"] = check_sharded_attention(config, args.cache, args.group_size, seq_mesh(n))
        print(json.dumps(result["check"]), flush=True)
        save()

    print("\nB x context | devices | step ms | speedup | merge share")
    for r in result["rows"]:
        cells = [
            f"{r['batch']} x {r['context']}",
            f"{r['devices']}{'' if r['mesh'] else ' (no mesh)'}",
        ]
        cells += [str(r.get(k, r.get("error", "-"))) for k in ("step_ms", "speedup", "merge_share")]
        print(" | ".join(cells))
    return 0 if result["check"] is None or result["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
