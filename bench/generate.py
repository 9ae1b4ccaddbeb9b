"""Decode throughput of the jitted generation loop: dense vs KIVI caches, model presets with
random weights, several (batch, context) points, and the largest batch that fits at 32k context.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m bench.generate --out DIR   # the GPU run
    python -m bench.generate --tiny                                           # CPU smoke test

Each point: a cache of `context + steps` tokens is created and its rows set to hold `context`
tokens (contents left zero: decode cost does not depend on the values), then the real
generation loop (`models.generate.decode_loop_jit`: while_loop over decode_step + greedy
sampling, cache donated) runs `steps` decode steps. A first call with the same shapes compiles
(its time is reported separately); the second is timed. tokens/s = batch * steps / seconds.
`peak_device_bytes` is the process's peak allocation after the point (weights included; it
never decreases, so a point's own peak needs a process of its own).
The dense cache attends through --dense-impl; each fp16 record names the path that ran
(`dense_path`: "cudnn" or "xla"; "auto" takes cuDNN on a GPU for a 16-bit cache). A point
whose cache would take more than 92% of the device's free memory is recorded with an
`error` before anything is allocated (`check_fits`; the largest-batch probe, which tests the
memory model's prediction, allocates it regardless).

Largest batch at 32k: predicted with kivi_jax.memory from the device's free memory after the
weights, then checked by allocating that cache and running decode steps (7/8, 3/4 and half
of the batch if that fails).

The roofline of each point and largest batch (`roofline_tokens_per_s`, `of_roofline`): the
tokens/s of a step that reads the weights (`weight_bytes_per_step`) and the whole cache
(`cache_bytes`) once at --bandwidth bytes/s (default 4.3e12, the H200's achievable).

Weights in the layout `models.generate.decode_layout` picks (per-layer on GPUs; `--stacked`
keeps the layer scan over stacked weights everywhere). Random weights, so that the run needs
no checkpoint on the device machine; shapes are the presets'. Never imports gguf.

Feeds the generation tables of docs/generation.md and docs/performance.md: prints a table last
and writes DIR/generate_bench.json (points, max_batch, and an `env` block). Needs a GPU for
the recorded numbers; --tiny runs anywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import kivi_jax
from bench import common
from kivi_jax import memory
from models import generate as G
from models import llama
from models.presets import ModelConfig, get_preset

TINY = ModelConfig(
    name="tiny",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=1 << 16,
)


def free_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))


def peak_bytes() -> int | None:
    """The device's peak allocation so far (weights included), where the backend reports it."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def filled_cache(
    name,
    config,
    batch,
    context,
    steps,
    dtype,
    residual_length,
    group_size,
    per_layer=False,
    knobs=None,
    multiple=1,
):
    """A cache with capacity context + steps + 1 (rounded up to a multiple of `multiple`: 256
    per shard for a cache sharded over tokens, as `generate` over a mesh allocates it) whose
    rows hold `context` (zero) tokens (`per_layer`: as `generate` makes it for per-layer
    weights, `kivi_jax.make_cache`; `knobs`: new_cache's sinks / rotation / layer_overrides
    for a quantized one)."""
    kw = dict(per_layer=per_layer)
    if name != "fp16":
        kw.update(group_size=group_size, **knobs or {})
    capacity = -(-(context + steps + 1) // multiple) * multiple
    c = G.new_cache(name, config, batch, capacity, dtype, residual_length=residual_length, **kw)
    held = lambda: jnp.full((batch,), context, jnp.int32)
    if isinstance(c, kivi_jax.MixedCache):  # every part its own lengths (the loop donates them)
        parts = tuple(dataclasses.replace(p, lengths=held()) for p in c.parts)
        return dataclasses.replace(c, parts=parts)
    return dataclasses.replace(c, lengths=held())


# The share of the device's free memory a point's cache may take; the rest is for the step's
# activations and XLA's temporaries (the largest-batch prediction keeps to it too).
CACHE_SHARE = 0.92


def check_fits(*fill_args, **fill_kw) -> None:
    """Raise MemoryError, before anything is allocated, where the cache `filled_cache(*fill_args,
    **fill_kw)` would make takes more than CACHE_SHARE of the device's free memory: allocated
    anyway, it leaves XLA's allocator retrying for minutes before it gives up. Nothing to check
    where the backend reports no memory limit (CPU)."""
    free = free_bytes()
    if free is None:
        return
    shapes = jax.eval_shape(lambda: filled_cache(*fill_args, **fill_kw))
    need = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    if need > CACHE_SHARE * free:
        raise MemoryError(
            f"the cache needs {need / 2**30:.1f} GiB, more than {CACHE_SHARE:.0%} of the "
            f"{free / 2**30:.1f} GiB free"
        )


def dense_path_of(impl: str, dtype) -> str:
    """The dense attention path `impl` takes for a `dtype` model and cache."""
    if impl != "auto":
        return impl
    x = jax.ShapeDtypeStruct((), dtype)
    return kivi_jax.attention.dense_path(x, x)  # reads only the dtypes


# The roofline's bandwidth: what the H200 reaches in practice (cuDNN's decode attention reads
# 4.4 TB/s of its 4.8 TB/s datasheet at B=8, T=128k; docs/performance.md, "Limits").
ROOFLINE_BANDWIDTH = 4.3e12


def weight_bytes_per_step(params) -> int:
    """Bytes of weights one decode step reads: every parameter, less the embedding table
    where a separate lm_head exists (the step gathers one row of it per token)."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    return total - params["embed"].nbytes if "lm_head" in params else total


def with_roofline(rec: dict, weight_bytes: int, bandwidth: float) -> dict:
    """rec (batch, cache_bytes, tokens_per_s) with the roofline: tokens/s of a step that reads
    the weights and the whole cache once at `bandwidth`, and the share of it reached."""
    if "cache_bytes" not in rec or "tokens_per_s" not in rec:
        return rec
    roof = rec["batch"] * bandwidth / (weight_bytes + rec["cache_bytes"])
    return dict(
        rec, roofline_tokens_per_s=round(roof, 1), of_roofline=round(rec["tokens_per_s"] / roof, 3)
    )


def run_loop(params, config, cache, steps, impl, max_new):
    B = cache.batch
    logits = jnp.zeros((B, config.vocab_size), jnp.float32)
    state = G.decode_loop_jit(
        params,
        logits,
        cache,
        jax.random.key(0),
        jnp.int32(max_new),
        G._pad_stops([]),
        config=config,
        num_slots=G.bucket(steps + 1),
        sampling=G.GREEDY,
        implementation=impl,
    )
    state.tokens.block_until_ready()
    return state


def measure(
    params,
    config,
    cache_name,
    batch,
    context,
    steps,
    impl,
    dtype,
    residual_length,
    group_size,
    knobs=None,
    check=True,
):
    """(compile+first-run seconds, timed seconds, tokens/s, cache bytes). check: refuse a
    cache that cannot fit before allocating it (`check_fits`); the largest-batch probe, which
    is there to test its prediction against the device, allocates regardless."""
    t0 = time.perf_counter()
    fill_args = (
        cache_name,
        config,
        batch,
        context,
        steps,
        dtype,
        residual_length,
        group_size,
        llama.is_unstacked(params),
        knobs,
    )
    if check:
        check_fits(*fill_args)
    fill = lambda: filled_cache(*fill_args)
    c = fill()
    nbytes = c.nbytes().total
    run_loop(params, config, c, steps, impl, max_new=2)  # compiles; max_new is traced
    t1 = time.perf_counter()
    c = fill()
    jax.block_until_ready(c)
    t2 = time.perf_counter()
    state = run_loop(params, config, c, steps, impl, max_new=steps + 1)
    t3 = time.perf_counter()
    assert int(state.step) == steps + 1, int(state.step)
    return t1 - t0, t3 - t2, batch * steps / (t3 - t2), nbytes


def max_batch_at(
    params, config, cache_name, context, dtype, residual_length, group_size, impl, probe
):
    """Predicted largest batch from free memory, then (probe) checked by a decode step."""
    free = free_bytes()
    kcfg = kivi_jax.cache_config(cache_name, group_size, residual_length=residual_length)
    shape = memory.KVShape(
        config.num_layers, config.num_kv_heads, config.head_dim, jnp.dtype(dtype).itemsize
    )
    rec = dict(model=config.name, cache=cache_name, context=context, free_bytes=free)
    if free is None:
        rec["error"] = "device reports no memory limit"
        return rec
    budget = int(free * CACHE_SHARE)
    pred = memory.max_batch(shape, kcfg, budget, tokens=context + 2)
    rec["predicted_batch"] = int(pred)
    if not probe or pred < 1:
        return rec
    # Each try compiles. The largest array (one store's codes for every layer) needs one free
    # block of its size: where earlier points have fragmented the device's memory the
    # predicted batch can fail to allocate while seven eighths of it fits.
    tries = [int(pred), int(pred) * 7 // 8, int(pred) * 3 // 4, int(pred) // 2]
    for b in dict.fromkeys(max(1, t) for t in tries):
        try:
            _, secs, tps, nbytes = measure(
                params,
                config,
                cache_name,
                b,
                context,
                4,
                impl,
                dtype,
                residual_length,
                group_size,
                check=False,
            )
            rec.update(batch=b, cache_bytes=nbytes, tokens_per_s=round(tps, 1))
            return rec
        except Exception as e:  # noqa: BLE001 - an OOM: the next, smaller try
            rec.setdefault("failed", []).append([b, type(e).__name__, str(e)[:160]])
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,llama-3-8b")
    ap.add_argument("--max-batch-model", default="llama-3-8b")
    ap.add_argument(
        "--points", default="1x4096,16x4096,4x32768", help="batch x context pairs, comma separated"
    )
    ap.add_argument("--caches", default="fp16,kivi2,kivi4")
    ap.add_argument("--impls", default="reference", help="KIVI decode attention implementations")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=32, help="KIVI group size G")
    ap.add_argument("--max-batch-context", type=int, default=32768)
    ap.add_argument("--no-max-batch", action="store_true")
    ap.add_argument("--no-probe", action="store_true", help="predict max batch, do not run it")
    ap.add_argument("--deadline", type=float, default=1e9, help="stop new work after N seconds")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model")
    ap.add_argument(
        "--dense-impl",
        default="auto",
        help="decode attention of the fp16 cache: auto (cudnn on a GPU, else xla), cudnn, xla, "
        "reference (float32 copies of K/V)",
    )
    ap.add_argument(
        "--stacked",
        action="store_true",
        help="decode with stacked weights (the layer scan) on every backend",
    )
    ap.add_argument("--sinks", type=int, default=0, help="KIVI caches: first N tokens exact")
    ap.add_argument("--rotate", default="none", help="KIVI caches: none, keys, values, both")
    ap.add_argument(
        "--layer-override",
        action="append",
        default=[],
        help="KIVI caches: 'LAYERS FIELD=VALUE ...' (kivi-jax eval's), repeatable; needs "
        "--no-max-batch (the largest-batch prediction takes one config)",
    )
    ap.add_argument(
        "--bandwidth",
        type=float,
        default=ROOFLINE_BANDWIDTH,
        help="bytes/s of the roofline (default: the H200's achievable 4.3e12)",
    )
    ap.add_argument("--out", type=Path, default=None, help="directory for generate_bench.json")
    args = ap.parse_args(argv)
    if args.layer_override and not args.no_max_batch:
        ap.error("--layer-override needs --no-max-batch")
    knobs = {}
    try:
        if args.sinks or args.rotate != "none":
            kivi_jax.KiviConfig(sinks=args.sinks, rotation=args.rotate)
            knobs.update(sinks=args.sinks, rotation=args.rotate)
        if args.layer_override:
            knobs["layer_overrides"] = tuple(
                kivi_jax.mixed.parse_override(t) for t in args.layer_override
            )
    except ValueError as e:
        ap.error(str(e))

    start = time.perf_counter()
    dtype = jnp.dtype(args.dtype)
    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",") if p]
    caches = args.caches.split(",")
    impls = args.impls.split(",")
    configs = [TINY] if args.tiny else [get_preset(m) for m in args.models.split(",")]
    result = dict(
        env=common.env_info(sys.argv[1:] if argv is None else argv, "generate"),
        weights="random (preset shapes)",
        dtype=dtype.name,
        steps=args.steps,
        residual_length=args.residual,
        group_size=args.group_size,
        sinks=args.sinks,
        rotation=args.rotate,
        layer_overrides=args.layer_override,
        layout="stacked" if args.stacked else "decode_layout",
        points=[],
        max_batch=[],
    )

    def save():
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "generate_bench.json").write_text(json.dumps(result, indent=1))

    def late():
        return time.perf_counter() - start > args.deadline

    for config in configs:
        if late():
            break
        t0 = time.perf_counter()
        params = llama.init_params(config, jax.random.key(0), dtype)
        if not args.stacked:
            params = G.decode_layout(params, config)  # what generate() and the CLI decode with
        jax.block_until_ready(params)
        weights = weight_bytes_per_step(params)
        print(
            f"# {config.name}: {config.num_params() / 1e9:.2f}B random params in "
            f"{time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        for batch, context in points:
            for cache in caches:
                for impl in [args.dense_impl] if cache == "fp16" else impls:
                    if late():
                        break
                    rec = dict(
                        model=config.name, batch=batch, context=context, cache=cache, impl=impl
                    )
                    if cache == "fp16":
                        rec["dense_path"] = dense_path_of(impl, dtype)
                    try:
                        comp, secs, tps, nbytes = measure(
                            params,
                            config,
                            cache,
                            batch,
                            context,
                            args.steps,
                            impl,
                            dtype,
                            args.residual,
                            args.group_size,
                            knobs,
                        )
                        rec.update(
                            compile_s=round(comp, 2),
                            seconds=round(secs, 4),
                            tokens_per_s=round(tps, 1),
                            cache_bytes=nbytes,
                            peak_device_bytes=peak_bytes(),
                        )
                    except Exception as e:  # noqa: BLE001 - record and go on
                        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rec = with_roofline(rec, weights, args.bandwidth)
                    result["points"].append(rec)
                    print(json.dumps(rec), flush=True)
                    save()
        if not args.no_max_batch and config.name == args.max_batch_model:
            for cache in caches:
                if late():
                    break
                rec = max_batch_at(
                    params,
                    config,
                    cache,
                    args.max_batch_context,
                    dtype,
                    args.residual,
                    args.group_size,
                    args.dense_impl if cache == "fp16" else impls[0],
                    probe=not args.no_probe,
                )
                rec = with_roofline(rec, weights, args.bandwidth)
                result["max_batch"].append(rec)
                print(json.dumps(rec), flush=True)
                save()
        del params
    result["elapsed_s"] = round(time.perf_counter() - start, 1)
    save()

    env = result["env"]
    print(
        f"\n{env['device']} | jax {env['jax']} | {env['date']} | {dtype.name} | "
        f"random weights | {args.steps} decode steps timed after a compile run"
    )
    print(
        f"{'model':14} {'batch':>5} {'context':>7} {'cache':6} {'impl':9} {'tok/s':>9} "
        f"{'cache MB':>9} {'peak GB':>8} {'roofline':>9}"
    )
    for r in result["points"]:
        tps = f"{r['tokens_per_s']:9.1f}" if "tokens_per_s" in r else "    error"
        mb = f"{r['cache_bytes'] / 1e6:9.1f}" if "cache_bytes" in r else ""
        peak = f"{r['peak_device_bytes'] / 1e9:8.1f}" if r.get("peak_device_bytes") else " " * 8
        roof = f"{100 * r['of_roofline']:8.0f}%" if "of_roofline" in r else ""
        print(
            f"{r['model']:14} {r['batch']:5d} {r['context']:7d} {r['cache']:6} {r['impl']:9} "
            f"{tps} {mb} {peak} {roof}"
        )
    for r in result["max_batch"]:
        print(
            f"max batch at {r['context']} ({r['model']}, {r['cache']}): "
            f"predicted {r.get('predicted_batch')}, ran {r.get('batch', '-')} "
            f"({r.get('tokens_per_s', float('nan')):.1f} tok/s"
            + (f", {100 * r['of_roofline']:.0f}% of the roofline)" if "of_roofline" in r else ")")
            + (f"; failed {r['failed']}" if r.get("failed") else "")
        )
    return result


if __name__ == "__main__":
    main()
