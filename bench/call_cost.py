"""Where the time of one public decode-attention call goes at small and medium shapes: the whole
call against its parts and against cuDNN, and the XLA launches around the kernel.

    python -m bench.call_cost                       # B x T of 1x1k, 1x8k, 1x32k, 8x8k, 1x128k
    python -m bench.call_cost --points 1x1024 --json out.json
    python -m bench.call_cost --dry-run             # CPU: the reference path, tiny shapes

Timed, each as a straight-line chain of --calls dependent calls in one jit over layers that
keep the bytes between two visits of a layer above the L2 (`bench.common.kivi_chain`'s
protocol, the kernel grid's), alternating over --rounds rounds in one process, 2-bit G = 128,
Hq = 32, Hkv = 8, D = 128, rows of T quantized tokens plus R = 128 in the residual windows:

    call     `kivi_jax.decode_attention(q, cache, layer, implementation="pallas")`: what a
             model runs (the kernel attends the windows too where they fit, docs/kernel.md)
    kernel   `pallas_kernels.kivi_decode.kivi_decode` over the quantized region alone
    tail     `kivi_jax.attention.tail_attention`: the windows attended in jnp, the path taken
             where the windows do not fit the kernel's shared memory
    cudnn    `jax.nn.dot_product_attention(..., implementation="cudnn")` over fp16 K/V of the
             same rows (the same chain)

and, from the compiled chain, the XLA fusions and custom calls per call (`call` only). Feeds
the fixed-cost table of docs/performance.md. Needs a Hopper GPU except --dry-run.
"""

from __future__ import annotations

import argparse
import functools
import re

import jax
import jax.numpy as jnp

import kivi_jax
from bench import common
from kivi_jax.attention import _group_query, kernel_on_cache, tail_attention

HQ, HKV, D, R, BITS, G = 32, 8, 128, 128, 2, 128
POINTS = "1x1024,1x8192,1x32768,8x8192,1x131072"


def _kernel_alone(q, cache, layer):
    o, _ = kernel_on_cache(q, cache, layer, cache.quantized_split(), scale=D**-0.5)
    return o.astype(q.dtype)


def _tail_alone(q, cache, layer):
    qg = _group_query(q, cache.kv_heads, D**-0.5)
    o, _ = tail_attention(qg, cache, layer, cache.quantized_split())
    return o.reshape(q.shape).astype(q.dtype)


def _chain(step, calls: int, layers: int):
    """`bench.common.kivi_chain`'s chain over an arbitrary step(q, cache, layer)."""
    step = jax.jit(step)

    def run(q, cache):
        for i in range(calls):
            q = q + common.CHAIN_STEP * step(q, cache, jnp.int32(i % layers))
        return q

    return jax.jit(run)


def launches_per_call(chain, calls: int, *args) -> dict[str, float]:
    """XLA fusions and custom calls per call in the compiled chain's entry computation."""
    text = chain.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :]
    fusions = len(re.findall(r"= [^ ]+ fusion\(", entry))
    custom = len(re.findall(r"custom-call\(", entry))
    return dict(fusions=fusions / calls, custom_calls=custom / calls)


def measure(batch: int, tokens: int, calls: int, rounds: int, dry_run: bool) -> dict:
    nbytes = common.kivi_bytes(batch, HKV, D, tokens, R, BITS, BITS, G)
    layers = common.layers_for(nbytes, calls)
    cache = common.random_kivi_cache(
        jax.random.key(0),
        layers=layers,
        batch=batch,
        kv_heads=HKV,
        head_dim=D,
        tokens=tokens,
        key_bits=BITS,
        value_bits=BITS,
        group_size=G,
        residual=R,
    )
    q = common.random_query(jax.random.key(1), batch, HQ, D)
    impl = "reference" if dry_run else "pallas"
    steps = {"call": functools.partial(kivi_jax.decode_attention, implementation=impl)}
    if not dry_run:
        steps["kernel"] = _kernel_alone
    steps["tail"] = _tail_alone
    chains = {name: _chain(f, calls, layers) for name, f in steps.items()}
    fns = {name: functools.partial(c, q, cache) for name, c in chains.items()}
    if not dry_run:
        kvs = common.random_dense_kv(
            jax.random.key(2),
            layers=common.layers_for(common.dense_bytes(batch, HKV, D, tokens + R), calls),
            batch=batch,
            kv_heads=HKV,
            head_dim=D,
            length=tokens + R,
        )
        dense = common.dense_chain(calls, "cudnn", True)
        qd = q[:, None].astype(jnp.float16)
        fns["cudnn"] = lambda: dense(qd, kvs, cache.lengths)
    times, _ = common.alternate(fns, rounds)
    row = dict(batch=batch, tokens=tokens, layers=layers)
    row.update({f"{n}_us": round(1e3 * common.median_ms(t, calls), 2) for n, t in times.items()})
    row["launches_per_call"] = launches_per_call(chains["call"], calls, q, cache)
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=POINTS, help="BxT pairs (T quantized tokens)")
    ap.add_argument("--calls", type=int, default=50, help="dependent calls per launch")
    ap.add_argument("--rounds", type=int, default=7, help="timed launches of each side")
    ap.add_argument("--dry-run", action="store_true", help="CPU: reference path, tiny shapes")
    ap.add_argument("--json", default=None, help="results file (rows and an env block)")
    a = ap.parse_args(argv)
    points = "1x256,2x512" if a.dry_run else a.points
    calls, rounds = (2, 1) if a.dry_run else (a.calls, a.rounds)
    rows = []
    for point in points.split(","):
        b, t = (int(x) for x in point.split("x"))
        rows.append(measure(b, t, calls, rounds, a.dry_run))
    names = [n for n in ("call", "kernel", "tail", "cudnn") if f"{n}_us" in rows[0]]
    print(f"{'B':>3} {'T':>7} " + " ".join(f"{n:>8}" for n in names) + "  (us per call)")
    for r in rows:
        cells = " ".join(f"{r[f'{n}_us']:8.1f}" for n in names)
        lpc = r["launches_per_call"]
        print(
            f"{r['batch']:>3} {r['tokens']:>7} {cells}  "
            f"fusions/call {lpc['fusions']:.2f}, custom calls/call {lpc['custom_calls']:.2f}"
        )
    if a.json:
        common.write_json(a.json, env=common.env_info(argv, "call_cost"), rows=rows)
    return rows


if __name__ == "__main__":
    main()
