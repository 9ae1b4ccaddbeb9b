"""The kernel's figure of record: one public decode-attention call on a KIVI cache, timed as a
model makes it, against cuDNN fp16 attention over the same rows, on a grid of shapes.

    python -m bench.kernel_grid --hq 32 --json docs/results/kernel_chain_grid_hq32.json  # the grid
    python -m bench.kernel_grid --hq 64 --json docs/results/kernel_chain_grid_hq64.json
    python -m bench.kernel_grid --anchor            # B=8, T=128k, 2-bit G=128 only
    python -m bench.kernel_grid --check             # the kernel against "reference" (GPU)
    python -m bench.kernel_grid --dry-run           # the CPU path: reference vs XLA, tiny
    python -m bench.kernel_grid --kbg 2:32,2:64 --sinks 8 --rotate both  # best3 / best25's
                                                    # knobs with post-RoPE keys
    python -m bench.kernel_grid --ragged --batches 8 --tokens 32768  # rows of T/3..T
    python -m bench.kernel_grid --formats fp8:64,nvfp4:64 --batches 1,8 --tokens 32768
                                                    # the float formats' public call ("auto")

What is timed: `kivi_jax.decode_attention(q, cache, layer, implementation="pallas")` (the
kernel over the quantized region, the residual tail and their merge) on a `kivi_jax.KiviCache`
whose rows hold T quantized tokens plus R = 128 in the residual windows; the baseline is
`jax.nn.dot_product_attention(..., implementation="cudnn")` over fp16 K/V of the same rows
(B, T + R tokens, Hkv = 8, D = 128, the same Hq / Hkv query-head groups, one query token per
row, the row lengths through key_value_seq_lengths). Each side is a straight-line chain of
--calls dependent calls in one jit (`bench.common.kivi_chain` / `dense_chain`: each call's
query is the previous query plus 1e-3 times its output, over as many distinct layers as keep
the bytes between two visits of a layer above the L2), so one launch spreads the host's
dispatch over the calls and nothing can overlap, be hoisted or be merged. Kernel and baseline
alternate over --rounds rounds (ABBA) in one process; the per-call time is the median launch
time over the rounds divided by --calls. TB/s: the bytes a call reads (codes, scales and
minimums of T tokens, the R full-precision tokens; fp16 K and V for the baseline) per second.
With --ragged the rows hold T/3..T quantized tokens (spaced evenly, the longest T; the
baseline masks the same lengths) and the bytes are the rows' own. With --sinks N the first N
positions are kept in full precision and --rotate rotates the cache (docs/formats.md); the call
attends the sinks and rotates q and o where `decode_attention` does (in the kernel where it
takes them, docs/kernel.md). With --formats the cells are caches of those names
(`kivi_jax.make_cache(NAME, group_size=G, per_layer=True)`, random bf16 K/V of std 1 prefilled, T
quantized tokens and R in the windows) read by `implementation=--format-impl` ("auto": on Hopper
the fp8 kernel, best3 / best25's pre-RoPE kernel up to 16k slots per launch, XLA otherwise) with
the layer index a Python int, as a model's unrolled layers pass it; the bytes those of one layer of
the cache.

Feeds the kernel tables of docs/performance.md and README.md (docs/results/kernel_chain_*.json:
rows plus an `env` block with the date, GPU, driver, versions and
the command line). Needs a Hopper GPU except --dry-run. A whole grid takes several minutes
(each configuration compiles its chain once); split it with --batches / --tokens / --kbg.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import kivi_jax
from bench import common
from kivi_jax import memory

KV_HEADS, HEAD_DIM, RESIDUAL = 8, 128, 128
GRID = dict(batches="1,8,32", tokens="8192,32768,131072", kbg="2:128,2:32,4:128,4:32")
ANCHOR = dict(batches="8", tokens="131072", kbg="2:128")
DRY_RUN = dict(batches="2", tokens="256", kbg="2:32", calls=3, rounds=2)


def kernel_tuning(cache: kivi_jax.KiviCache, q_heads: int) -> str:
    """The launch the kernel chooses for this cache (what decode_attention's tuning=None
    gives), for the results row."""
    return str(common.cache_tuning(cache, q_heads))


def row_tokens(batch: int, tokens: int, ragged: bool) -> list[int]:
    """The quantized tokens of each row: T each, or (ragged) spaced evenly from T/3 to T in
    whole groups of 256 tokens (rows that differ by 3x, the longest full)."""
    if not ragged:
        return [tokens] * batch
    lo = tokens // 3
    return [int(lo + (tokens - lo) * i / max(1, batch - 1)) // 256 * 256 for i in range(batch)]


def measure(
    batch,
    tokens,
    kbg,
    dense,
    *,
    sinks=0,
    rotation="none",
    ragged=False,
    **timing,
) -> dict:
    """One grid cell: the kernel chain and the baseline chain (`dense`: its K/V per layer),
    alternating; a results row. `ragged`: rows of `row_tokens` quantized tokens (T/3..T);
    `timing`: `_timed_row`'s hq, calls, rounds, implementations and masking."""
    kb, vb, g = kbg
    quantized = row_tokens(batch, tokens, ragged)
    nbytes = sum(
        common.kivi_bytes(1, KV_HEADS, HEAD_DIM, t, RESIDUAL, kb, vb, g, sinks=sinks)
        for t in quantized
    )
    layers = common.layers_for(
        common.kivi_bytes(batch, KV_HEADS, HEAD_DIM, tokens, RESIDUAL, kb, vb, g, sinks=sinks),
        timing["calls"],
    )
    cache = common.random_kivi_cache(
        jax.random.key(batch * 7 + tokens + kb),
        layers=layers,
        batch=batch,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        tokens=tokens,
        key_bits=kb,
        value_bits=vb,
        group_size=g,
        residual=RESIDUAL,
        lengths=[t + RESIDUAL for t in quantized],
        sinks=sinks,
        rotation=rotation,
    )
    fields = dict(key_bits=kb, value_bits=vb, G=g, sinks=sinks, rotation=rotation, ragged=ragged)
    return _timed_row(cache, layers, nbytes, batch, quantized, dense, fields=fields, **timing)


def _timed_row(
    cache,
    layers,
    nbytes,
    batch,
    quantized,
    dense,
    *,
    hq,
    calls,
    rounds,
    kernel_impl,
    baseline_impl,
    masked,
    fields,
    static_layer=False,
) -> dict:
    """The cache's chain (`layers` distinct layers, `nbytes` read per call; `static_layer`:
    `common.kivi_chain`'s) and the baseline's chain (`dense`: its K/V per layer and dtype),
    alternating; the results row."""
    q = common.random_query(jax.random.key(1), batch, hq, HEAD_DIM)
    kvs, dense_dtype = dense
    qd = q[:, None].astype(dense_dtype)
    lengths = cache.lengths
    kernel = common.kivi_chain(calls, layers, kernel_impl, static_layer=static_layer)
    baseline = common.dense_chain(calls, baseline_impl, masked)
    times, first = common.alternate(
        {"kernel": lambda: kernel(q, cache), "baseline": lambda: baseline(qd, kvs, lengths)}, rounds
    )
    k_ms = common.median_ms(times["kernel"], calls)
    b_ms = common.median_ms(times["baseline"], calls)
    dbytes = sum(
        common.dense_bytes(1, KV_HEADS, HEAD_DIM, t + RESIDUAL, jnp.dtype(dense_dtype).itemsize)
        for t in quantized
    )
    return dict(
        B=batch,
        T=max(quantized),  # the longest row (all of them unless ragged)
        R=RESIDUAL,
        Hq=hq,
        Hkv=KV_HEADS,
        D=HEAD_DIM,
        **fields,
        row_tokens=quantized,
        kernel=kernel_impl,
        baseline=baseline_impl,
        baseline_masked=masked,
        kernel_ms=k_ms,
        baseline_ms=b_ms,
        speedup=b_ms / k_ms,
        kernel_TBps=nbytes / k_ms / 1e9,
        baseline_TBps=dbytes / b_ms / 1e9,
        kernel_bytes=nbytes,
        baseline_bytes=dbytes,
        kernel_layers=layers,
        baseline_layers=len(kvs),
        calls=calls,
        rounds=rounds,
        kernel_round_ms=[1e3 * t / calls for t in times["kernel"]],
        baseline_round_ms=[1e3 * t / calls for t in times["baseline"]],
        first_launch_s=first,
        tuning=(
            kernel_tuning(cache, hq)
            if kernel_impl.startswith("pallas") and "format" not in fields
            else None
        ),
    )


def llama_rope() -> np.ndarray:
    """Llama-3-8B's RoPE inverse frequencies [D/2] (the grid's head dim)."""
    from models import llama
    from models.presets import get_preset

    return llama.rope_frequencies(get_preset("llama-3-8b"))


def format_cache(name, group, *, layers, batch, tokens, residual, lengths, sinks, rotation):
    """A `FORMATS` cache (`kivi_jax.make_cache(name, per_layer=True)`, as a model with
    per-layer weights makes it) whose rows hold `lengths` tokens: random bf16 K/V of std 1,
    the same in every layer, prefilled; keys before RoPE turned by Llama-3-8B's frequencies."""
    t = tokens + residual
    config = kivi_jax.cache_config(name, group, residual, sinks=sinks, rotation=rotation)
    rope = {"rope_frequencies": llama_rope()} if config.pre_rope else {}
    cache = kivi_jax.make_cache(
        name,
        num_layers=layers,
        batch=batch,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_len=t,
        group_size=group,
        residual_length=residual,
        sinks=sinks,
        rotation=rotation,
        per_layer=True,
        **rope,
    )
    shape = (batch, KV_HEADS, t, HEAD_DIM)

    @jax.jit
    def fill(c, n):
        kk, kv = jax.random.split(jax.random.key(batch * 7 + tokens))
        k, v = (jax.random.normal(x, shape, jnp.bfloat16) for x in (kk, kv))
        grow = lambda x: jnp.broadcast_to(x, (layers, *shape))
        return c.prefill(grow(k), grow(v), n)

    return fill(cache, jnp.asarray(lengths, jnp.int32))


def measure_format(
    batch,
    tokens,
    fmt,
    dense,
    *,
    sinks=0,
    rotation="none",
    ragged=False,
    **timing,
) -> dict:
    """One grid cell of a float-format cache (`fmt`: (name, G)) against the baseline chain,
    alternating; a results row as `measure`'s, with the format's name."""
    name, g = fmt
    quantized = row_tokens(batch, tokens, ragged)
    # one layer of the cache as allocated (the calculator `kivi_jax.memory` is exact for it)
    config = kivi_jax.cache_config(name, g, RESIDUAL, sinks=sinks, rotation=rotation)
    shape = memory.KVShape(1, KV_HEADS, HEAD_DIM)
    layer_bytes = memory.cache_bytes(shape, config, tokens=tokens + RESIDUAL, batch=batch).total
    layers = common.layers_for(layer_bytes, timing["calls"])
    cache = format_cache(
        name,
        g,
        layers=layers,
        batch=batch,
        tokens=tokens,
        residual=RESIDUAL,
        lengths=[t + RESIDUAL for t in quantized],
        sinks=sinks,
        rotation=rotation,
    )
    fields = dict(
        format=name,
        key_bits=config.key_bits,
        value_bits=config.value_bits,
        G=g,
        sinks=config.sinks,  # a name's own where it fixes them (best3, best25)
        rotation=config.rotation,
        pre_rope=config.pre_rope,
        ragged=ragged,
    )
    # the layer a Python int, as a model's unrolled layers pass it to a per-layer cache
    return _timed_row(
        cache,
        layers,
        layer_bytes,
        batch,
        quantized,
        dense,
        fields=fields,
        static_layer=True,
        **timing,
    )


def grid(
    batches,
    tokens,
    kbgs,
    *,
    hq,
    calls,
    rounds,
    kernel_impl="pallas",
    baseline_impl="cudnn",
    masked=True,
    dense_dtype=jnp.float16,
    log=print,
    sinks=0,
    rotation="none",
    ragged=False,
    formats=(),
) -> list[dict]:
    """Every (B, T) point with every bits/G configuration (or, given `formats`, every
    (name, G) float format); the baseline's K/V built once per point and timed again beside
    each configuration."""
    rows = []
    for b in batches:
        for t in tokens:
            nbytes = common.dense_bytes(
                b, KV_HEADS, HEAD_DIM, t + RESIDUAL, jnp.dtype(dense_dtype).itemsize
            )
            kvs = common.random_dense_kv(
                jax.random.key(3),
                layers=common.layers_for(nbytes, calls),
                batch=b,
                kv_heads=KV_HEADS,
                head_dim=HEAD_DIM,
                length=t + RESIDUAL,
                dtype=dense_dtype,
            )
            cells = [(measure_format, f) for f in formats] or [(measure, c) for c in kbgs]
            for cell, config in cells:
                row = cell(
                    b,
                    t,
                    config,
                    (kvs, dense_dtype),
                    hq=hq,
                    calls=calls,
                    rounds=rounds,
                    kernel_impl=kernel_impl,
                    baseline_impl=baseline_impl,
                    masked=masked,
                    sinks=sinks,
                    rotation=rotation,
                    ragged=ragged,
                )
                rows.append(row)
                log(table_line(row))
            del kvs
    return rows


def check(
    kbgs, *, hq=32, implementation="pallas", batch=3, tokens=2048, sinks=0, rotation="none"
) -> tuple[list, bool]:
    """`implementation` against "reference" on one small cache per configuration and query
    dtype, ragged rows (full, part-quantized, empty): max |o - o_ref| / max |o_ref| within 5e-3
    (fp16 q) or 1e-2 (bf16 q, whose output unit is 8x coarser), the same bits on a second run,
    finite outputs. Returns (rows, all passed)."""
    rows, ok_all = [], True
    lengths = [tokens + RESIDUAL, tokens // 2 + 77, 0][:batch]
    run = jax.jit(
        lambda q, c, impl: kivi_jax.decode_attention(q, c, 1, implementation=impl),
        static_argnums=2,
    )
    for i, (kb, vb, g) in enumerate(kbgs):
        cache = common.random_kivi_cache(
            jax.random.key(100 + i),
            layers=2,
            batch=len(lengths),
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            tokens=tokens,
            key_bits=kb,
            value_bits=vb,
            group_size=g,
            residual=RESIDUAL,
            lengths=lengths,
            sinks=sinks,
            rotation=rotation,
        )
        for dtype, tol in ((jnp.float16, 5e-3), (jnp.bfloat16, 1e-2)):
            q = common.random_query(jax.random.key(7 + i), len(lengths), hq, HEAD_DIM, dtype)
            o = np.asarray(run(q, cache, implementation), np.float32)
            again = np.asarray(run(q, cache, implementation), np.float32)
            ref = np.asarray(run(q, cache, "reference"), np.float32)
            err = float(np.abs(o - ref).max() / max(1e-6, np.abs(ref).max()))
            ok = bool(err <= tol and np.isfinite(o).all() and (o == again).all())
            ok_all &= ok
            rows.append(
                dict(
                    kind="check",
                    implementation=implementation,
                    lengths=lengths,
                    T=tokens,
                    Hq=hq,
                    key_bits=kb,
                    value_bits=vb,
                    G=g,
                    sinks=sinks,
                    rotation=rotation,
                    dtype=jnp.dtype(dtype).name,
                    rel_err=err,
                    tolerance=tol,
                    deterministic=bool((o == again).all()),
                    ok=ok,
                )
            )
    return rows, ok_all


# The caches --formats times through the public call: the float formats, and the named caches of
# keys before RoPE (their RoPE frequencies Llama-3-8B's, the grid's shapes)
FORMATS = ("fp8", "nvfp4", "mxfp4", "best3", "best25")


def parse_formats(text: str) -> list[tuple[str, int]]:
    """'fp8:64,nvfp4:64' -> [("fp8", 64), ("nvfp4", 64)]; ValueError for another name."""
    out = []
    for item in filter(None, text.split(",")):
        name, _, g = item.partition(":")
        if name not in FORMATS or not g.isdigit():
            raise ValueError(f"--formats takes NAME:G with NAME in {FORMATS}, got {item!r}")
        out.append((name, int(g)))
    return out


TABLE_HEAD = (
    "| B | T | K/V bits | G | kernel ms | baseline ms | speedup | kernel TB/s | "
    "layers |\n|---|---|---|---|---|---|---|---|---|"
)


def tokens_label(t: int) -> str:
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def table_line(r: dict) -> str:
    variant = f" S{r['sinks']}" if r.get("sinks") else ""
    variant += f" rot={r['rotation']}" if r.get("rotation", "none") != "none" else ""
    variant += " ragged" if r.get("ragged") else ""
    bits = r.get("format") or f"{r['key_bits']}/{r['value_bits']}"
    return (
        f"| {r['B']} | {tokens_label(r['T'])} | {bits} | "
        f"{r['G']}{variant} | "
        f"{r['kernel_ms']:.4f} | {r['baseline_ms']:.4f} | {r['speedup']:.2f}x | "
        f"{r['kernel_TBps']:.2f} | {r['kernel_layers']}/{r['baseline_layers']} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default=GRID["batches"], help="comma list of B")
    ap.add_argument("--tokens", default=GRID["tokens"], help="comma list of T (quantized)")
    ap.add_argument("--kbg", default=GRID["kbg"], help="bits:G (or kbits:vbits:G) list")
    ap.add_argument("--hq", type=int, default=32, help="query heads (Hkv = 8, D = 128)")
    ap.add_argument("--calls", type=int, default=50, help="dependent calls per launch")
    ap.add_argument("--rounds", type=int, default=7, help="timed launches of each side")
    ap.add_argument("--anchor", action="store_true", help="B=8, T=128k, 2-bit G=128 only")
    ap.add_argument(
        "--no-mask",
        action="store_true",
        help="baseline without key_value_seq_lengths (its rows are full anyway)",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="only compare the kernel with the reference on small shapes",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny shape, 'reference' against XLA attention: runs on CPU",
    )
    ap.add_argument("--sinks", type=int, default=0, help="N sinks per row (best3, best25: 8)")
    ap.add_argument(
        "--rotate",
        default="none",
        choices=("none", "keys", "values", "both"),
        help="Hadamard rotation of the cache (best3, best25: both)",
    )
    ap.add_argument(
        "--ragged", action="store_true", help="rows of T/3..T quantized tokens (the longest T)"
    )
    ap.add_argument(
        "--formats",
        default="",
        help="NAME:G list of float formats (fp8, nvfp4, mxfp4) or best3 / best25 (keys before "
        "RoPE) timed instead of --kbg",
    )
    ap.add_argument(
        "--format-impl",
        default="auto",
        choices=("auto", "pallas", "xla", "reference"),
        help="decode_attention's implementation for --formats (auto on Hopper: the fp8 kernel; "
        "best3 / best25's pre-RoPE kernel up to 16k slots per launch)",
    )
    ap.add_argument("--json", default=None, help="results file (rows and an env block)")
    a = ap.parse_args(argv)
    knobs = dict(sinks=a.sinks, rotation=a.rotate)
    argv = sys.argv[1:] if argv is None else argv
    env = common.env_info(argv, "kernel_grid")
    kbgs = common.parse_kbg(a.kbg)
    if a.check:
        rows, ok = check(kbgs, hq=a.hq, **knobs)
        for r in rows:
            print(r, flush=True)
        print("CHECK", "PASS" if ok else "FAIL")
        if a.json:
            common.write_json(a.json, env=env, rows=rows)
        return 0 if ok else 1
    if a.anchor:
        a.batches, a.tokens, a.kbg = ANCHOR["batches"], ANCHOR["tokens"], ANCHOR["kbg"]
    formats = parse_formats(a.formats)
    kernel_impl = a.format_impl if formats else "pallas"
    impls = dict(kernel_impl=kernel_impl, baseline_impl="cudnn", dense_dtype=jnp.float16)
    if a.dry_run:
        for name, value in DRY_RUN.items():
            setattr(a, name, value)
        # CPU XLA has no fp16 x fp16 -> f32 product: the baseline reads bf16 there
        impls = dict(kernel_impl="reference", baseline_impl="xla", dense_dtype=jnp.bfloat16)
    print(
        f"{env['device']} | jax {env['jax']} | Hq={a.hq} Hkv={KV_HEADS} D={HEAD_DIM} "
        f"R={RESIDUAL} | {a.calls} calls per launch, median of {a.rounds} rounds"
    )
    print(TABLE_HEAD, flush=True)
    rows = grid(
        common.parse_ints(a.batches),
        common.parse_ints(a.tokens),
        common.parse_kbg(a.kbg),
        hq=a.hq,
        calls=a.calls,
        rounds=a.rounds,
        masked=not a.no_mask,
        log=lambda line: print(line, flush=True),
        **impls,
        **knobs,
        ragged=a.ragged,
        formats=formats,
    )
    if a.json:
        common.write_json(a.json, env=env, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
