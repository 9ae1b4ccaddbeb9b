"""Prefill throughput through the cache: chunked prefill (`models.llama.prefill_chunked`) of one
long random prompt, then decode steps over the filled cache; the one-piece prefill beside it
where asked.

    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python -m bench.prefill --model llama-3-8b \\
        --context 131072 --chunk 4096 --caches kivi2,fp16 --one-piece --out DIR   # a GPU run
    python -m bench.prefill --tiny                                               # CPU smoke test

Each run: random weights of the preset's shapes (`models.generate.decode_layout`), a random
prompt of `context` tokens per row, an empty cache of capacity context + steps + 1. The chunked
prefill is compiled ahead (`jit(...).lower(...).compile()`, its time reported apart) and run
once, timed to the last logit; then `--decode-steps` steps of the real generation loop
(`decode_loop_jit`, greedy) over the filled cache, timed the same way as bench.generate (a
compile run on a copy of the cache first). The one-piece prefill (`llama.prefill`, exact
attention over the whole prompt, then the cache filled at once) runs the same way when
`--one-piece` is given; a run that does not fit records its error.

Reported per run: prefill seconds and tokens/s; the attention's FLOPs, 4 D Hq L x (the
query-key pairs a causal prompt has, S (S + 1) / 2 per row), divided by the whole prefill's
time ("attention TFLOP/s over the prefill": a lower bound of the attention's own rate, which
shares the time with the weights' GEMMs, 2 x params x S FLOPs, also reported); peak device
memory after the run (the process's peak, weights included: run one configuration per
process for a configuration's own peak); decode tokens/s.

Feeds the chunked-prefill and 1M-token tables of docs/generation.md; writes
DIR/prefill_bench.json (runs and an `env` block) and prints a table last. Needs a GPU for the
recorded numbers; --tiny runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from bench import common
from bench.generate import TINY, peak_bytes, run_loop
from models import generate as G
from models import llama
from models.presets import get_preset


def attention_flops(config, batch: int, context: int) -> float:
    """FLOPs of a causal prompt's attention: QK^T and PV, 2 x 2 D per query-key pair."""
    pairs = context * (context + 1) / 2
    return 4.0 * config.head_dim * config.num_heads * config.num_layers * batch * pairs


def _timed(fn, *args):
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - t0


def run_one(params, config, cache_name, batch, context, chunk, steps, args) -> dict:
    """One prefill (chunked, or one piece for chunk=None) then the decode steps."""
    rec = dict(
        model=config.name, cache=cache_name, batch=batch, context=context, chunk=chunk or "none"
    )
    max_len = context + steps + 1
    dtype = params["embed"].dtype
    kw = {} if cache_name == "fp16" else dict(group_size=args.group_size)
    make = lambda: G.new_cache(
        cache_name, config, batch, max_len, dtype, residual_length=args.residual, **kw
    )
    tokens = jax.random.randint(jax.random.key(1), (batch, context), 1, config.vocab_size)
    lengths = jnp.full((batch,), context, jnp.int32)
    if chunk is None:
        fn = lambda p, t, n, c: llama.prefill(p, config, t, n, c)
    else:
        impl = args.chunk_implementation
        fn = lambda p, t, n, c: llama.prefill_chunked(
            p, config, t, n, c, chunk=chunk, implementation=impl
        )
    cache = make()
    t0 = time.perf_counter()
    compiled = jax.jit(fn, donate_argnums=3).lower(params, tokens, lengths, cache).compile()
    rec["compile_s"] = round(time.perf_counter() - t0, 2)
    (logits, cache), secs = _timed(compiled, params, tokens, lengths, cache)
    flops = attention_flops(config, batch, context)
    rec.update(
        prefill_s=round(secs, 3),
        prefill_tokens_per_s=round(batch * context / secs, 1),
        attention_flops=flops,
        attention_tflops_over_prefill=round(flops / secs / 1e12, 1),
        weight_gemm_flops=2.0 * config.num_params() * batch * context,
        logits_finite=bool(jnp.isfinite(logits).all()),
        cache_bytes=cache.nbytes().total,
    )
    if steps:
        run_loop(params, config, jax.tree.map(jnp.copy, cache), steps, args.implementation, 2)
        t0 = time.perf_counter()
        state = run_loop(params, config, cache, steps, args.implementation, steps + 1)
        secs = time.perf_counter() - t0
        assert int(state.step) == steps + 1, int(state.step)
        rec["decode_tokens_per_s"] = round(batch * steps / secs, 1)
    rec["peak_device_bytes"] = peak_bytes()
    return rec


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens)")
    ap.add_argument("--caches", default="kivi2", help="comma separated cache names")
    ap.add_argument("--one-piece", action="store_true", help="also the one-piece prefill")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--implementation", default="auto", help="decode attention")
    ap.add_argument(
        "--chunk-implementation",
        default="auto",
        help="the chunks' attention (kivi_jax.attention.chunk_attention): auto, cudnn, pallas, "
        "reference",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--residual", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=128, help="KIVI group size G")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with a tiny model")
    ap.add_argument("--out", type=Path, default=None, help="directory for prefill_bench.json")
    args = ap.parse_args(argv)
    if args.tiny:
        args.context, args.chunk, args.decode_steps = min(args.context, 512), 128, 4
        args.group_size, args.residual = 32, 32
    config = TINY if args.tiny else get_preset(args.model)
    dtype = jnp.dtype(args.dtype)
    result = dict(
        env=common.env_info(sys.argv[1:] if argv is None else argv, "prefill"),
        weights="random (preset shapes)",
        dtype=dtype.name,
        residual_length=args.residual,
        group_size=args.group_size,
        runs=[],
    )
    params = G.decode_layout(llama.init_params(config, jax.random.key(0), dtype), config)
    jax.block_until_ready(params)
    plan = [(c, args.chunk) for c in args.caches.split(",")]
    if args.one_piece:
        plan += [(c, None) for c in args.caches.split(",")]
    for cache_name, chunk in plan:
        try:
            rec = run_one(
                params, config, cache_name, args.batch, args.context, chunk, args.decode_steps, args
            )
        except Exception as e:  # noqa: BLE001 - an OOM is a result: record it and go on
            rec = dict(cache=cache_name, chunk=chunk or "none", error=f"{type(e).__name__}: {e}")
            rec["error"] = rec["error"][:300]
        result["runs"].append(rec)
        print(json.dumps(rec), flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "prefill_bench.json").write_text(json.dumps(result, indent=1))

    env = result["env"]
    print(
        f"\n{env['device']} | jax {env['jax']} | {env['date']} | {config.name} {dtype.name} | "
        f"random weights | B={args.batch} S={args.context}"
    )
    print(
        f"{'cache':6} {'chunk':>6} {'prefill s':>9} {'tok/s':>9} {'attn TF/s':>9} "
        f"{'decode tok/s':>12} {'peak GB':>8}"
    )
    for r in result["runs"]:
        if "error" in r:
            print(f"{r['cache']:6} {r['chunk']!s:>6} error: {r['error'][:80]}")
            continue
        peak = f"{r['peak_device_bytes'] / 1e9:8.1f}" if r.get("peak_device_bytes") else ""
        print(
            f"{r['cache']:6} {r['chunk']!s:>6} {r['prefill_s']:9.2f} "
            f"{r['prefill_tokens_per_s']:9.1f} {r['attention_tflops_over_prefill']:9.1f} "
            f"{r.get('decode_tokens_per_s', float('nan')):12.1f} {peak}"
        )
    return result


if __name__ == "__main__":
    main()
