"""Decode-attention benchmark on one GPU: the fused KIVI kernel vs cuDNN fp16 vs XLA fp16.

    PYTHONPATH=. python3 bench/decode_attention.py --mode grid [--out DIR]
    PYTHONPATH=. python3 bench/decode_attention.py --mode tune      # variants at B=8, T=128k
    PYTHONPATH=. python3 bench/decode_attention.py --mode check     # GPU correctness only
    PYTHONPATH=. python3 bench/decode_attention.py --mode variants --ptxas  # flags vs default

`--mode variants` (one process): checks each opt-in TuningConfig variant natively against the
float32 twin (outputs poisoned, run twice for determinism), then times the default tuning and
each variant at B=8, T=128k, 32/8/128 for 2-bit/4-bit x G=128/32 with cuDNN fp16 as the
baseline, with ptxas register counts per compiled kernel (`--ptxas`), and prints a table last.

The whole grid (18 shapes x 4 kernel configs + cuDNN + XLA) needs more than one 10-minute
device call (Mosaic compiles take seconds each): split it, e.g. `--hq 32 --ts 32768,8192`.

Timing: one jitted function runs the attention ROUNDS times over every layer of an L-layer
stack (distinct buffers, no copies; L chosen so the bytes touched exceed the 60 MB L2 several
times), so that the host's dispatch of the call (tens of microseconds) is spread over
ROUNDS * L attention calls; time per attention call = wall time / (ROUNDS * L), median over
repeats after warm-up, synchronized with block_until_ready. Each round's query passes through
an optimization barrier tied to the previous round's output, so XLA cannot hoist the
loop-invariant attention out of the loop. Bytes: what each implementation must read (codes +
scales + minimums for the kernel; fp16 K and V for cuDNN/XLA).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from kivi_jax.quant import value_codes_blocked
from pallas_kernels import kivi_decode_sm90 as kd

L2_BYTES = 60e6
ROUNDS = 16  # attention calls per layer inside one timed launch (see the module docstring)


ROWS_FILE = None  # set by main: every result row is also appended here as it is measured


def log(*a):
    print(*a, flush=True)
    if ROWS_FILE and len(a) == 1 and isinstance(a[0], dict):
        with open(ROWS_FILE, "a") as f:
            f.write(json.dumps(a[0], default=str) + "\n")


def quant_bytes(B, Hkv, D, T, kb, vb, G):
    return B * Hkv * T * D * (kb + vb) / 8 + 4 * B * Hkv * T * D // G * 2


def make_cache(key, L, B, Hkv, D, T, kb, vb, G, blocked=None):
    """Random bytes (valid packed codes), scales and minimums in the cache's layout
    (docs/layout.md: 2-bit value codes in blocks of 64 byte columns; blocked=False/True: the
    value codes as unblocked [.., D, T/Pv] rows or as blocks at any width)."""
    if blocked is None:
        blocked = value_codes_blocked(vb)
    ks = jax.random.split(key, 6)
    u8 = lambda k, s: jax.random.bits(k, s, jnp.uint8)  # random bytes are valid packed codes
    f = lambda k, s, lo, hi: jax.random.uniform(k, s, jnp.float32, lo, hi).astype(jnp.float16)
    return (u8(ks[0], (L, B, Hkv, T * kb // 8, D)),
            f(ks[1], (L, B, Hkv, T // G, D), 0.02, 0.2),
            f(ks[2], (L, B, Hkv, T // G, D), -0.5, 0.0),
            u8(ks[3], (L, B, Hkv, T * vb // 8 // 64, D, 64) if blocked else
               (L, B, Hkv, D, T * vb // 8)),
            f(ks[4], (L, B, Hkv, D // G, T), 0.02, 0.2),
            f(ks[5], (L, B, Hkv, D // G, T), -0.5, 0.0))


def time_layers(fn, args, reps=15, warm=2, cap_s=20.0):
    """Median seconds of fn(*args) (fn runs all L layers) over reps after warm-up."""
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    ts = []
    t_end = time.perf_counter() + cap_s
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
        if time.perf_counter() > t_end and len(ts) >= 3:
            break
    return statistics.median(ts), ts


def layers_for(bytes_per_layer, lo=2, hi=16):
    return int(min(hi, max(lo, math.ceil(4 * L2_BYTES / bytes_per_layer))))


def per_call(t, L, nbytes):
    """Time, bandwidth and counts of one attention call from the median launch time t (s) of
    ROUNDS x L calls."""
    n = ROUNDS * L
    return dict(ms=1e3 * t / n, TBps=nbytes * n / t / 1e12, bytes=nbytes, L=L, rounds=ROUNDS)


def kivi_fn(L, kw, tuning, alt=False, loop="fori"):
    """ROUNDS x all L layers. loop="fori": one fori_loop iteration per call with a traced layer
    index, as the model's layer scan does; "layers": a fori_loop over the ROUNDS whose body
    runs the L layers unrolled (static layer index), each call's query through an
    optimization barrier tied to the previous call's output, as `fp16_fn(loop="layers")`."""
    def call(q, nt, cache, layer):
        if alt:
            return kd._kivi_decode(q, cache, nt, layer, **kw, tuning=tuning, interpret=False,
                                   stage_smem=False, alt_layout=True)[0]
        return kd.kivi_decode(q, *cache, nt, layer, **kw, tuning=tuning)[0]

    def run(q0, nt, *cache):
        zero = jnp.zeros(q0.shape, jnp.float32)
        if loop == "fori":
            return jax.lax.fori_loop(
                0, ROUNDS * L, lambda i, acc: acc + call(q0, nt, cache, i % L), zero)

        def one_round(i, acc):
            for layer in range(L):
                q, acc = jax.lax.optimization_barrier((q0, acc))  # no hoisting, no CSE
                acc = acc + call(q, nt, cache, layer)
            return acc
        return jax.lax.fori_loop(0, ROUNDS, one_round, zero)
    return jax.jit(run)


def fp16_fn(L, impl, loop="rounds"):
    """ROUNDS x all L layers: a fori_loop over the ROUNDS, the L layers unrolled in its body
    (distinct buffers, static indices); the query through an optimization barrier tied to
    the accumulator once per round ("rounds") or before every call ("layers")."""
    def run(q0, ks, vs):
        return jax.lax.fori_loop(0, ROUNDS, functools.partial(one_round, q0, ks, vs),
                                 jnp.zeros(q0.shape, jnp.float32))

    def one_round(q0, ks, vs, i, acc):
        q, acc = jax.lax.optimization_barrier((q0, acc))  # not loop-invariant: no hoisting
        for layer in range(L):
            if loop == "layers" and layer:
                q, acc = jax.lax.optimization_barrier((q0, acc))
            if impl == "cudnn":
                o = jax.nn.dot_product_attention(q, ks[layer], vs[layer], implementation="cudnn")
            else:  # XLA einsum, GQA by reshaping the query heads
                B, _, Hq, D = q.shape
                Hkv = ks[layer].shape[2]
                qq = q.reshape(B, Hkv, Hq // Hkv, D).astype(jnp.float32) / math.sqrt(D)
                s = jnp.einsum("bhnd,bthd->bhnt", qq.astype(jnp.float16), ks[layer],
                               preferred_element_type=jnp.float32)
                p = jax.nn.softmax(s, axis=-1).astype(jnp.float16)
                o = jnp.einsum("bhnt,bthd->bhnd", p, vs[layer],
                               preferred_element_type=jnp.float32).reshape(B, 1, Hq, D)
            acc = acc + o.astype(jnp.float32)
        return acc
    return jax.jit(run)


def check(out_rows):
    """GPU correctness of the production kernel vs the float32 twin on fresh random inputs."""
    cfgs = [  # (B, Hq, Hkv, D, T, kb, vb, G, dtype)
        (2, 32, 8, 128, 4096, 2, 2, 128, jnp.float16),
        (2, 32, 8, 128, 4096, 2, 2, 32, jnp.bfloat16),
        (2, 32, 8, 128, 4096, 4, 4, 128, jnp.float16),
        (2, 32, 8, 128, 4096, 4, 2, 32, jnp.bfloat16),
        (3, 16, 16, 64, 2048, 2, 4, 64, jnp.float16),
        (2, 64, 4, 128, 2048, 2, 2, 64, jnp.bfloat16),
        (3, 32, 8, 128, 4096, 2, 2, 128, jnp.bfloat16, kd.TuningConfig(512, 3, 2)),
        (2, 32, 8, 128, 4096, 4, 4, 32, jnp.float16, kd.TuningConfig(512, 2, 3)),
    ]
    ok_all = True
    for i, (B, Hq, Hkv, D, T, kb, vb, G, dt, *tun) in enumerate(cfgs):
        key = jax.random.key(100 + i)
        L = 3
        cache = make_cache(key, L, B, Hkv, D, T, kb, vb, G)
        q = jax.random.normal(jax.random.fold_in(key, 7), (B, Hq, D), jnp.float32).astype(dt)
        nt = jnp.asarray(np.random.default_rng(i).integers(0, T + 1, B), jnp.int32).at[0].set(0)
        nt = nt.at[-1].set(T - 37)
        kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D))
        tun = tun[0] if tun else None
        o, lse = kd.kivi_decode(q, *cache, nt, jnp.int32(2), **kw, tuning=tun)
        o2, lse2 = kd.kivi_decode(q, *cache, nt, jnp.int32(2), **kw, tuning=tun)
        ro, rlse = kd.kivi_decode_reference(q, *cache, nt, jnp.int32(2), **kw)
        o, ro = np.asarray(o), np.asarray(ro)
        err = float(np.abs(o - ro).max() / max(1e-6, np.abs(ro).max()))
        fin = np.isfinite(np.asarray(rlse))
        lerr = float(np.abs(np.asarray(lse)[fin] - np.asarray(rlse)[fin]).max())
        same_inf = bool((np.isfinite(np.asarray(lse)) == fin).all())
        det = bool((np.asarray(o2) == o).all() and (np.asarray(lse2) == np.asarray(lse)).all())
        ok = err < 5e-3 and lerr < 5e-3 and same_inf and det and np.isfinite(o).all()
        ok = bool(ok)
        ok_all &= ok
        row = dict(kind="check", B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, kb=kb, vb=vb, G=G,
                   dtype=jnp.dtype(dt).name, tuning=str(tun), rel_err=err, lse_err=lerr,
                   det=det, ok=ok)
        out_rows.append(row)
        log(row)
    return ok_all


def bench_point(B, Hq, Hkv, D, T, kb, vb, G, tuning=None, label="kivi", reps=15, alt=False,
                loop="fori"):
    qb = quant_bytes(B, Hkv, D, T, kb, vb, G)
    L = layers_for(qb)
    # alt "vrows": the value codes as unblocked rows [.., D, T/Pv] (the layout before run 109)
    cache = make_cache(jax.random.key(B * 7 + T), L, B, Hkv, D, T, kb, vb, G,
                       blocked=False if alt else None)
    tun = tuning or kd.choose_tuning(B, Hkv, T, key_bits=kb, value_bits=vb, group_size=G)
    if alt == "vrows":
        alt = False
        label += "-vrows"
    elif alt:
        cache = kd.to_alt_layout(*cache, value_bits=vb, vch=min(tun.block_tokens, 256))
    q = jax.random.normal(jax.random.key(1), (B, Hq, D), jnp.float32).astype(jnp.bfloat16)
    nt = jnp.full((B,), T, jnp.int32)
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D))
    t, _ = time_layers(kivi_fn(L, kw, tun, alt, loop), (q, nt, *cache), reps=reps)
    del cache
    return dict(kind=label + ("-altlayout" if alt else ""), B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, kb=kb,
                vb=vb, G=G, tuning=str(tun), **per_call(t, L, qb))


def kernel_inputs(B, T, kb, G, Hq=32, Hkv=8, D=128):
    """The kernel-alone scripts' operands at a point (bench/overhead.py, tail_probe.py,
    gap_trace.py): (L, cache, choose_tuning's tuning, q, num_tokens, kernel kwargs), the
    layers and seeds as `bench_point`'s."""
    L = layers_for(quant_bytes(B, Hkv, D, T, kb, kb, G))
    cache = make_cache(jax.random.key(B * 7 + T), L, B, Hkv, D, T, kb, kb, G)
    tun = kd.choose_tuning(B, Hkv, T, key_bits=kb, value_bits=kb, group_size=G)
    q = jax.random.normal(jax.random.key(1), (B, Hq, D), jnp.float32).astype(jnp.bfloat16)
    nt = jnp.full((B,), T, jnp.int32)
    kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
    return L, cache, tun, q, nt, kw


def points_kbg(points: str, kbg: str):
    """(B, T, bits, G) over the bench scripts' "BxT,.." and "bits:G,.." lists, points outer."""
    for p in points.split(","):
        B, T = map(int, p.split("x"))
        for x in kbg.split(","):
            kb, G = map(int, x.split(":"))
            yield B, T, kb, G


def prev_modules(paths: str) -> dict:
    """{"": this kernel module, "prev": .., "prev2": ..}: earlier kivi_decode_sm90.py files
    (comma-separated, e.g. from `git show REV:pallas_kernels/kivi_decode_sm90.py`) loaded as
    modules beside it, for an A/B of versions in one process (they import this checkout's
    sm90_fragments)."""
    import importlib.util

    mods = {"": kd}
    for i, path in enumerate(filter(None, paths.split(","))):
        name = "prev" if i == 0 else f"prev{i + 1}"
        spec = importlib.util.spec_from_file_location(f"kd_{name}", path)
        mods[name] = sys.modules[f"kd_{name}"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mods[name])  # (dataclasses look their module up there)
    return mods


@contextlib.contextmanager
def module_variant(mods: dict, var: str, B, Hkv, T, kb, G):
    """A bench variant's tuning, with this module's kernel (`kd`, which `kivi_fn` and
    `bench_point` run) set to the variant's kernel module for the block: "default" or
    comma-separated overrides of choose_tuning's launch (`override`), or "prev[:overrides]"
    ("prev2", ..) for those of a `prev_modules` kernel, on its own choose_tuning."""
    global kd
    which, _, flags = var.partition(":") if var.startswith("prev") else ("", "", var)
    own, kd = kd, mods[which]
    try:
        base = kd.choose_tuning(B, Hkv, T, key_bits=kb, value_bits=kb, group_size=G)
        yield base if flags in ("", "default") else override(base, flags)
    finally:
        kd = own


def override(tun, flags: str):
    """tun with "name=value,..." TuningConfig overrides (bench scripts' --flags): ints and bools
    as integers, strings as given."""
    for kv in filter(None, flags.split(",")):
        k, v = kv.split("=")
        cur = getattr(tun, k)
        tun = dataclasses.replace(tun, **{k: type(cur)(int(v) if isinstance(cur, (bool, int))
                                                       else v)})
    return tun


def error_cases(bits, ts, B=2, Hq=32, Hkv=8, D=128, G=128):
    """The precision tables' inputs (bench/fold_error.py, bench/lowbit_error.py): per (bits, T,
    q std) yields (kb, T, std, q, cache, num_tokens, kernel kwargs, choose_tuning's tuning);
    ragged lengths, bf16 q of std 1 (flat attention) and 4 (peaked)."""
    for kb in bits:
        for T in ts:
            cache = make_cache(jax.random.key(T + kb), 1, B, Hkv, D, T, kb, kb, G)
            nt = jnp.array([T, T // 2 + 1], jnp.int32)  # ragged
            kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
            tun = kd.choose_tuning(B, Hkv, T, key_bits=kb, value_bits=kb, group_size=G)
            for std in (1.0, 4.0):
                q = (std * jax.random.normal(jax.random.key(7), (B, Hq, D))).astype(jnp.bfloat16)
                yield kb, T, std, q, cache, nt, kw, tun


def fp16_inputs(B, Hq, Hkv, D, T):
    """(L, bytes per layer, (q, ks, vs)): the fp16 baselines' query and L layers of K, V."""
    nbytes = 2 * B * T * Hkv * D * 2
    L = layers_for(nbytes)
    key = jax.random.key(3)
    ks = [jax.random.normal(jax.random.fold_in(key, i), (B, T, Hkv, D), jnp.float16)
          for i in range(L)]
    vs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (B, T, Hkv, D), jnp.float16)
          for i in range(L)]
    q = jax.random.normal(jax.random.key(4), (B, 1, Hq, D), jnp.float16)
    return L, nbytes, (q, ks, vs)


def bench_fp16(B, Hq, Hkv, D, T, impl, reps=15, loop="rounds"):
    L, nbytes, args = fp16_inputs(B, Hq, Hkv, D, T)
    t, _ = time_layers(fp16_fn(L, impl, loop), args, reps=reps)
    del args
    return dict(kind=impl, B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, **per_call(t, L, nbytes))


def bench_reference(B, Hq, Hkv, D, T, kb, vb, G):
    qb = quant_bytes(B, Hkv, D, T, kb, vb, G)
    L = 2
    cache = make_cache(jax.random.key(5), L, B, Hkv, D, T, kb, vb, G)
    q = jax.random.normal(jax.random.key(1), (B, Hq, D), jnp.float32).astype(jnp.bfloat16)
    nt = jnp.full((B,), T, jnp.int32)
    kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D))

    def run(q, nt, *cache):
        return sum(kd.kivi_decode_reference(q, *cache, nt, jnp.int32(i), **kw)[0]
                   for i in range(L))
    t, _ = time_layers(jax.jit(run), (q, nt, *cache), reps=5)
    return dict(kind="jnp-ref", B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, kb=kb, vb=vb, G=G,
                ms=1e3 * t / L, TBps=qb * L / t / 1e12, bytes=qb, L=L)


def tune(rows, deadline):
    B, Hq, Hkv, D, T = 8, 32, 8, 128, 131072
    base = dict(B=B, Hq=Hq, Hkv=Hkv, D=D, T=T)
    cud = bench_fp16(B, Hq, Hkv, D, T, "cudnn")
    rows.append(cud)
    log(cud)
    TC = kd.TuningConfig
    cands = [None, TC(512, 8, 2), TC(256, 8, 2, p_concat=True)]
    variants = [(2, 2, 128, c, False) for c in cands] + [  # (K bits, V bits, G, tuning, alt)
        (2, 2, 128, TC(256, 8, 2, skip="compute"), False),
        (2, 2, 128, TC(512, 8, 2, skip="compute"), False),
        (2, 2, 128, TC(256, 8, 2, skip="values"), False),
        (2, 2, 128, TC(256, 8, 2, skip="compute"), True), (2, 2, 128, None, True),
        (4, 2, 32, None, False),
    ]
    for kb, vb, G, tun, alt in variants:
        if time.time() > deadline:
            log("tune: time cap reached")
            break
        try:
            r = bench_point(**base, kb=kb, vb=vb, G=G, tuning=tun, label="kivi-tune", alt=alt)
            r["cfg"] = None if tun is None else tun
            r["speedup_vs_cudnn"] = cud["ms"] / r["ms"]
        except Exception as e:  # keep going: one bad variant should not lose the others
            r = dict(kind="kivi-tune", kb=kb, vb=vb, G=G, tuning=str(tun), error=repr(e)[:400])
        rows.append(r)
        log(r)
    # The grid's flags: the fastest full-kernel candidate at this anchor point.
    best, best_ms = kd.choose_tuning(B, Hkv, T), 1e9
    for r in rows:
        if r.get("kind") == "kivi-tune" and "ms" in r and r["kb"] == 2 and r["G"] == 128:
            c = r["cfg"]
            if c in cands[1:] and r["ms"] < 0.97 * best_ms or c is None and r["ms"] < best_ms:
                best, best_ms = (c or best), r["ms"]
    return best


GRID_BITS_G = ((2, 128), (2, 32), (4, 128), (4, 32))


def grid(rows, deadline, batches, flags=None, hqs=(32, 64), ts=(131072, 8192, 32768),
         bitsg=GRID_BITS_G, fp16=("cudnn", "xla"), twin=True, wgs=(None,), lps=(False,)):
    # Priority order (the run is time-capped): the anchor shape at 128k first.
    points = []
    for Hq, Hkv, D in [(32, 8, 128), (64, 8, 128)]:
        for T in [131072, 8192, 32768]:
            for B in [8, 1, 32]:
                if B in batches and Hq in hqs and T in ts:
                    points.append((B, Hq, Hkv, D, T))
    for B, Hq, Hkv, D, T in points:
        if time.time() > deadline:
            log("grid: time cap reached")
            return
        base = dict(B=B, Hq=Hq, Hkv=Hkv, D=D, T=T)
        fp = {}
        for impl in fp16:
            try:
                fp[impl] = bench_fp16(**base, impl=impl, reps=10)
            except Exception as e:
                fp[impl] = dict(kind=impl, **base, error=repr(e)[:300])
            rows.append(fp[impl])
            log(fp[impl])
        for (kb, G), W, lp in itertools.product(bitsg, wgs, lps):
            label = ("kivi" if W is None else f"kivi-wg{W}") + ("-f8v" if lp else "")
            if lp and G != D:  # the fp8 value product needs G = D
                continue
            try:
                tun = kd.choose_tuning(
                    B, Hkv, T, key_bits=kb, value_bits=kb, group_size=G,
                    block_tokens=flags.block_tokens if flags else None,
                    stages=flags.stages if flags else 2, fp8_values=lp,
                    **({} if W is None else dict(wg_per_block=W)))
                if flags is not None:
                    tun = dataclasses.replace(tun, p_concat=flags.p_concat)
                r = bench_point(**base, kb=kb, vb=kb, G=G, tuning=tun, reps=10, label=label)
                if "ms" in fp.get("cudnn", {}):
                    r["speedup_vs_cudnn"] = fp["cudnn"]["ms"] / r["ms"]
            except Exception as e:
                r = dict(kind=label, **base, kb=kb, vb=kb, G=G, error=repr(e)[:300])
            rows.append(r)
            log(r)
        if not twin:
            continue
        # The jnp twin (float32 unpack-then-attend over the same packed cache), 2-bit G=128.
        try:
            r = bench_reference(**base, kb=2, vb=2, G=128)
            if "ms" in fp.get("cudnn", {}):
                r["speedup_vs_cudnn"] = fp["cudnn"]["ms"] / r["ms"]
        except Exception as e:
            r = dict(kind="jnp-ref", **base, error=repr(e)[:300])
        rows.append(r)
        log(r)


VARIANTS = [  # (name, TuningConfig fields replaced on top of choose_tuning's default)
    ("fold_k", dict(fold_k=True)),
    ("fold_kv", dict(fold_k=True, fold_v=True)),
    ("fold_k+lean", dict(fold_k=True, reload_codes=True, lean_values=True)),
    ("lean", dict(reload_codes=True, lean_values=True)),  # fewer live registers alone
    ("fold_kv+lean", dict(fold_k=True, fold_v=True, reload_codes=True, lean_values=True)),
    ("fold_k+lean+512", dict(fold_k=True, reload_codes=True, lean_values=True,
                             block_tokens=512)),
]
# Variants in priority order (the run is time-capped): each group is checked, then timed.
VARIANT_GROUPS = [["fold_k", "lean"], ["fold_k+lean", "fold_kv"],
                  ["fold_kv+lean", "fold_k+lean+512"]]
VARIANT_CHECKS = [  # (B, Hq, Hkv, D, T, kb, vb, G, dtype): 4-bit G=32 and 2-bit G=128
    (3, 32, 8, 128, 4096, 4, 4, 32, jnp.float16),
    (2, 32, 8, 128, 4096, 2, 2, 128, jnp.bfloat16),
]
VARIANT_POINT = (8, 32, 8, 128, 131072)  # (B, Hq, Hkv, D, T) of the timings
VARIANT_BITS_G = [(2, 128), (2, 32), (4, 128), (4, 32)]


def variant_tuning(B, Hkv, T, kb, vb, G, fields):
    fields = dict(fields)
    blk = fields.pop("block_tokens", None)
    base = kd.choose_tuning(B, Hkv, T, key_bits=kb, value_bits=vb, group_size=G, block_tokens=blk)
    return dataclasses.replace(base, **fields)


class PtxasLog:
    """Register counts of the kernels compiled since the last call (MOSAIC_GPU_DUMP_PTXAS)."""

    def __init__(self, path):
        self.path = path
        self.seen = set(os.listdir(path)) if path and os.path.isdir(path) else set()

    def new(self):
        if not self.path or not os.path.isdir(self.path):
            return None
        import re

        regs = []
        for f in sorted(set(os.listdir(self.path)) - self.seen):
            self.seen.add(f)
            if f.endswith(".ptxas"):
                with open(os.path.join(self.path, f), errors="replace") as fh:
                    text = fh.read()
                spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", text)]
                for i, x in enumerate(re.findall(r"Used (\d+) registers", text)):
                    sp = spills[i] if i < len(spills) else 0
                    regs.append(int(x) if not sp else f"{x} ({sp} B spilled)")
        return regs


def _decode_call(q, nt, layer, *cache, kw, tun):
    return kd.kivi_decode(q, *cache, nt, layer, **kw, tuning=tun)


def _check_inputs():
    out = []
    for i, (B, Hq, Hkv, D, T, kb, vb, G, dt) in enumerate(VARIANT_CHECKS):
        key = jax.random.key(500 + i)
        cache = make_cache(key, 3, B, Hkv, D, T, kb, vb, G)
        q = jax.random.normal(jax.random.fold_in(key, 7), (B, Hq, D), jnp.float32).astype(dt)
        nt = jnp.asarray(np.random.default_rng(50 + i).integers(1, T + 1, B), jnp.int32)
        nt = nt.at[0].set(0).at[-1].set(T - 37)
        kw = dict(key_bits=kb, value_bits=vb, group_size=G, sm_scale=1 / math.sqrt(D))
        ref = [np.asarray(x) for x in kd.kivi_decode_reference(q, *cache, nt, jnp.int32(2), **kw)]
        out.append((VARIANT_CHECKS[i], cache, q, nt, kw, ref))
    return out


def _check_variant(name, fields, inputs, ptx):
    """Native numerics of one variant vs the float32 twin: outputs poisoned, run twice."""
    rows, ok_all = [], True
    for (B, Hq, Hkv, D, T, kb, vb, G, dt), cache, q, nt, kw, (ro, rlse) in inputs:
        fin = np.isfinite(rlse)
        t0 = time.time()
        try:
            tun = variant_tuning(B, Hkv, T, kb, vb, G, fields)
            fn = jax.jit(functools.partial(_decode_call, kw=kw, tun=tun))
            outs = []
            for _ in range(2):
                poison = jnp.full((256 << 20,), jnp.nan, jnp.float32).block_until_ready()
                del poison
                outs.append([np.asarray(x) for x in jax.block_until_ready(
                    fn(q, nt, jnp.int32(2), *cache))])
            (o, lse), (o2, lse2) = outs
            err = float(np.abs(o - ro).max() / max(1e-6, np.abs(ro).max()))
            lerr = float(np.abs(lse[fin] - rlse[fin]).max())
            same_inf = bool((np.isfinite(lse) == fin).all() and (lse[~fin] == -np.inf).all())
            det = bool((o2 == o).all() and (lse2 == lse).all())
            ok = bool(err < 5e-3 and lerr < 5e-3 and same_inf and det
                      and np.isfinite(o).all() and (o[~fin] == 0).all())
            row = dict(kind="check", variant=name, B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, kb=kb, vb=vb,
                       G=G, dtype=jnp.dtype(dt).name, tuning=str(tun), rel_err=err,
                       lse_err=lerr, det=det, ok=ok, regs=ptx.new(),
                       s=round(time.time() - t0, 1))
        except Exception as e:
            ok = False
            row = dict(kind="check", variant=name, B=B, T=T, dtype=jnp.dtype(dt).name, kb=kb,
                       vb=vb, G=G, ok=False, error=repr(e)[:600], regs=ptx.new())
        ok_all &= ok
        rows.append(row)
        log(row)
    return rows, ok_all


def variants(rows, deadline, ptx):
    """Per group of variants: (a) native numerics vs the twin, (b) time vs the default at
    B=8, T=128k for 2/4-bit x G=128/32; cuDNN fp16 timed first in the same process."""
    B, Hq, Hkv, D, T = VARIANT_POINT
    try:
        cud = bench_fp16(B, Hq, Hkv, D, T, "cudnn", reps=10)
    except Exception as e:
        cud = dict(kind="cudnn", B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, ms=float("nan"),
                   error=repr(e)[:300])
    rows.append(cud)
    log(cud)
    inputs = _check_inputs()
    fields_of = dict(VARIANTS, default={}, **{"default-again": {}})
    caches, failed, ok_all = {}, set(), True
    for names in [["default"]] + VARIANT_GROUPS + [["default-again"]]:
        for name in names:
            if name.startswith("default"):
                continue
            if time.time() > deadline:
                break
            r, ok = _check_variant(name, fields_of[name], inputs, ptx)
            rows.extend(r)
            ok_all &= ok
            if not ok:
                failed.add(name)
        for kb, G in VARIANT_BITS_G:
            for name in names:
                if time.time() > deadline:
                    log("variants: time cap reached")
                    log("CHECK", "PASS" if ok_all else "FAIL", sorted(failed))
                    return
                if name in failed:
                    continue
                qb = quant_bytes(B, Hkv, D, T, kb, kb, G)
                L = layers_for(qb)
                if (kb, G) not in caches:  # L distinct layers: each call streams all of them
                    caches[(kb, G)] = make_cache(jax.random.key(kb * 1000 + G), L, B, Hkv, D, T,
                                                 kb, kb, G)
                cache = caches[(kb, G)]
                q = jax.random.normal(jax.random.key(1), (B, Hq, D), jnp.float32).astype(
                    jnp.bfloat16)
                nt = jnp.full((B,), T, jnp.int32)
                kw = dict(key_bits=kb, value_bits=kb, group_size=G, sm_scale=1 / math.sqrt(D))
                t0 = time.time()
                try:
                    tun = variant_tuning(B, Hkv, T, kb, kb, G, fields_of[name])
                    t, ts = time_layers(kivi_fn(L, kw, tun), (q, nt, *cache), reps=10)
                    pc = per_call(t, L, qb)
                    r = dict(kind="variant", variant=name, B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, kb=kb,
                             vb=kb, G=G, tuning=str(tun), **pc,
                             spread_ms=[per_call(min(ts), L, qb)["ms"],
                                        per_call(max(ts), L, qb)["ms"]],
                             speedup_vs_cudnn=cud["ms"] / pc["ms"], regs=ptx.new(),
                             s=round(time.time() - t0, 1))
                except Exception as e:
                    r = dict(kind="variant", variant=name, kb=kb, vb=kb, G=G,
                             error=repr(e)[:600], regs=ptx.new())
                rows.append(r)
                log(r)
    log("CHECK", "PASS" if ok_all else "FAIL", sorted(failed))


def variants_table(rows):
    lines = ["| check | variant | K/V bits | G | rel err o | err lse | det | regs | ok |",
             "|" + "---|" * 9]
    for r in rows:
        if r.get("kind") == "check" and "variant" in r:
            lines.append(f"| {r.get('B')}x{r.get('T')} {r.get('dtype')} | {r['variant']} | "
                         f"{r['kb']}/{r['vb']} | {r['G']} | {r.get('rel_err', float('nan')):.1e}"
                         f" | {r.get('lse_err', float('nan')):.1e} | {r.get('det')} | "
                         f"{r.get('regs')} | {r['ok']} {r.get('error', '')[:80]} |")
    base = {}
    for r in rows:
        if r.get("kind") == "variant" and r.get("variant") == "default" and "ms" in r:
            base[(r["kb"], r["G"])] = r["ms"]
    cud = [r["ms"] for r in rows if r.get("kind") == "cudnn" and "ms" in r]
    lines += ["", f"cuDNN fp16 B=8 T=128k 32/8/128: {cud[0]:.3f} ms" if cud else "no cuDNN row",
              "", "| K/V bits | G | variant | ms | x cuDNN | x default | regs | tuning |",
              "|" + "---|" * 8]
    for r in rows:
        if r.get("kind") != "variant":
            continue
        if "ms" not in r:
            lines.append(f"| {r['kb']}/{r['vb']} | {r['G']} | {r['variant']} | ERROR "
                         f"{r.get('error', '')[:120]} | | | {r.get('regs')} | |")
            continue
        b = base.get((r["kb"], r["G"]))
        lines.append(f"| {r['kb']}/{r['vb']} | {r['G']} | {r['variant']} | {r['ms']:.3f} | "
                     f"{r['speedup_vs_cudnn']:.2f} | {b / r['ms'] if b else float('nan'):.2f} | "
                     f"{r.get('regs')} | {short_tuning(r['tuning'])} |")
    return "\n".join(lines)


def short_tuning(text):
    """TuningConfig(block_tokens=256, num_splits=8, ...) -> '256,8,2 fold_k' (non-defaults)."""
    import re

    f = dict(re.findall(r"(\w+)=([^,)]+)", text))
    flags = [k for k, v in f.items() if v == "True" and k not in ("overlap",)]
    return f"{f.get('block_tokens')},{f.get('num_splits')},{f.get('stages')} " + " ".join(flags)


def table(rows):
    lines = ["| B | Hq/Hkv/D | T | impl | bits | G | ms | TB/s | x cuDNN |", "|" + "---|" * 9]
    for r in rows:
        if r.get("kind") == "check" or "ms" not in r:
            continue
        lines.append(
            f"| {r['B']} | {r['Hq']}/{r['Hkv']}/{r['D']} | {r['T'] // 1024}k | {r['kind']} | "
            f"{r.get('kb', 16)}/{r.get('vb', 16)} | {r.get('G', '-')} | {r['ms']:.3f} | "
            f"{r['TBps']:.2f} | {r.get('speedup_vs_cudnn', float('nan')):.2f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="grid", help="comma list of check,tune,grid")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--hq", default="32,64", help="query heads of the grid shapes (Hkv=8, D=128)")
    ap.add_argument("--ts", default="131072,8192,32768", help="cache lengths of the grid")
    ap.add_argument("--bits_g", default="2:128,2:32,4:128,4:32",
                    help="kernel configs of the grid, bits:G (keys and values alike)")
    ap.add_argument("--fp16", default="cudnn,xla", help="fp16 baselines of the grid")
    ap.add_argument("--no_twin", action="store_true", help="grid without the jnp twin")
    ap.add_argument("--wg", default="",
                    help="comma list of warpgroups per block to run side by side in the grid "
                    "(TuningConfig.wg_per_block; default: choose_tuning's choice only)")
    ap.add_argument("--lp", default="0",
                    help="comma list of 0 (exact products) / 1 (the opt-in fp8 value product of "
                    "low_precision=True, G = D only) kernels to run side by side in the grid")
    ap.add_argument("--budget_s", type=float, default=500)
    ap.add_argument("--grid_s", type=float, default=0, help="time kept for the grid after tune")
    ap.add_argument("--ptxas", action="store_true",
                    help="dump ptxas output (MOSAIC_GPU_DUMP_PTXAS) and report register counts")
    a = ap.parse_args()
    ptx_dir = None
    if a.ptxas:  # read by Mosaic GPU when it compiles, so setting it here (before) is enough
        ptx_dir = "/tmp/mosaic_gpu_dump"
        os.makedirs(ptx_dir, exist_ok=True)
        os.environ["MOSAIC_GPU_DUMP_TO"] = ptx_dir
        os.environ["MOSAIC_GPU_DUMP_PTXAS"] = "1"
    global ROWS_FILE
    ROWS_FILE = os.path.join(a.out, "rows.jsonl")
    deadline = time.time() + a.budget_s
    log(jax.devices(), jax.__version__)
    rows = []
    modes = a.mode.split(",")
    try:
        if "dump" in modes:  # one small launch, for MOSAIC_GPU_DUMP_* (SASS, ptxas resources)
            rows.append(bench_point(2, 32, 8, 128, 8192, 2, 2, 128, reps=3))
        if "check" in modes:
            log("CHECK", "PASS" if check(rows) else "FAIL")
        if "variants" in modes:
            variants(rows, deadline, PtxasLog(ptx_dir))
        flags = None
        if "tune" in modes:
            flags = tune(rows, deadline - a.grid_s)
            log(f"grid flags from the tune: {flags}")
        if "grid" in modes:
            grid(rows, deadline, [int(b) for b in a.batches.split(",")], flags,
                 [int(h) for h in a.hq.split(",")], [int(t) for t in a.ts.split(",")],
                 [tuple(map(int, x.split(":"))) for x in a.bits_g.split(",")],
                 [x for x in a.fp16.split(",") if x], not a.no_twin,
                 [int(w) for w in a.wg.split(",")] if a.wg else [None],
                 [bool(int(x)) for x in a.lp.split(",")])
    finally:
        with open(os.path.join(a.out, f"decode_attention_{'_'.join(modes)}.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)
        log(variants_table(rows) if "variants" in modes else table(rows))


if __name__ == "__main__":
    sys.exit(main())
