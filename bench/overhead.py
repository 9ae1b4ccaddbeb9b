"""What a `kivi_decode` call costs besides the kernel: the kernel alone against the whole call.

    PYTHONPATH=. python3 bench/overhead.py --points 8x131072,1x8192 --kbg 2:128,2:32,4:128

Per point (Hq=32, Hkv=8, D=128, choose_tuning's tuning), timed as bench/decode_attention.py
(ROUNDS x L calls in one jitted fori_loop, median launch time after warm-up), in one process:

- `full`: `kivi_decode` as the benchmark times it (q prologue, kernel, log-sum-exp merge of
  the splits, the loop's accumulation);
- `kernel`: the kernel alone on operands prepared once outside the loop (`_kernel_call`), its
  partial outputs carried as the loop state (nothing else runs in the loop body);
- `merge`: the merge and the accumulation alone, on fixed partial outputs (no kernel); what
  is left of `full` is the prologue (q scaling, the metadata) and the gaps between kernels;
- `merge=NAME`: `full` with another merge of the partials (`MERGES`), checked against the
  library's merge on the same partials.

Then the number of GPU kernels (fusions, custom calls) in the compiled loop body of `full`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import decode_attention as da  # noqa: E402

from pallas_kernels import kivi_decode_sm90 as kd  # noqa: E402


def merge_fused(o_parts, lse_parts):
    """The merge as one weighted reduction over S (no einsum): [..., S, D, N] -> [..., N, D]."""
    mx = lse_parts.max(axis=-2)
    safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    w = jnp.exp(lse_parts - safe[..., None, :])
    tot = w.sum(axis=-2)
    o = (o_parts * w[..., :, None, :]).sum(axis=-3)  # [..., D, N]
    o = jnp.where(tot[..., None, :] > 0, o / jnp.where(tot > 0, tot, 1.0)[..., None, :], 0.0)
    lse = jnp.where(tot > 0, safe + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
    return jnp.swapaxes(o, -1, -2), lse


MERGES = {"fused": merge_fused}


def loop(L, body, init):
    return lambda *a: jax.lax.fori_loop(0, da.ROUNDS * L, lambda i, c: body(i, c, *a), init)


def point(B, T, kb, G, Hq=32, Hkv=8, D=128, reps=10):
    L, cache, tun, q, nt, kw = da.kernel_inputs(B, T, kb, G, Hq, Hkv, D)
    # the decomposition is of the launch with the XLA merge and prologue (where choose_tuning
    # takes merge_splits and q_prologue, runs 125-127, `full` is the kernel alone but for them)
    tun = dataclasses.replace(tun, merge_splits=False, q_prologue=False, pdl=False)
    ck = dict(**kw, tuning=tun, interpret=False, stage_smem=False)
    rows = {}

    full = da.kivi_fn(L, kw, tun)
    rows["full"] = da.time_layers(full, (q, nt, *cache), reps=reps)[0]

    kern, args, nq = kd._kernel_call(q, cache, nt, jnp.int32(0), **ck)
    meta0, rest = args[0], args[1:]
    parts = jax.eval_shape(kern, *args)
    zeros = tuple(jnp.zeros(p.shape, p.dtype) for p in parts)

    def kbody(i, carry, meta, *rest):
        return kern(meta.at[0].set(i % L), *rest)
    rows["kernel"] = da.time_layers(jax.jit(loop(L, kbody, zeros)), (meta0, *rest), reps=reps)[0]

    o_p, lse_p = kern(*args)  # real partials (some splits may be empty: -inf lse)

    def mbody(i, acc, o_p, lse_p):
        o_p, acc = jax.lax.optimization_barrier((o_p, acc))  # not loop-invariant
        o, lse = kd.merge_partials(o_p, lse_p)
        return acc + o[:, :, :nq].reshape(B, Hq, D)
    rows["merge"] = da.time_layers(
        jax.jit(loop(L, mbody, jnp.zeros(q.shape, jnp.float32))), (o_p, lse_p), reps=reps)[0]

    ref_o, ref_lse = kd.merge_partials(o_p, lse_p)
    for name, fn in MERGES.items():
        o2, lse2 = fn(o_p, lse_p)
        err = float(jnp.abs(o2 - ref_o).max())
        lerr = float(jnp.abs(jnp.where(jnp.isfinite(ref_lse), lse2 - ref_lse, 0.0)).max())
        print(f"  merge={name}: max |o - o_lib| {err:.2e}, |lse - lse_lib| {lerr:.2e}")
        saved = kd.merge_partials
        kd.merge_partials = fn
        try:
            rows[f"merge={name}"] = da.time_layers(da.kivi_fn(L, kw, tun), (q, nt, *cache),
                                                   reps=reps)[0]
        finally:
            kd.merge_partials = saved

    hlo = full.lower(q, nt, *cache).compile().as_text()
    kinds = re.findall(r"= \S+ (fusion|custom-call)\(", hlo)
    calls = re.findall(r'custom_call_target="([^"]+)"', hlo)
    print(f"  compiled: {kinds.count('fusion')} fusions, {kinds.count('custom-call')} custom "
          f"calls ({', '.join(sorted(set(calls)))}) in the whole program")
    del cache
    n = da.ROUNDS * L
    return {k: 1e3 * t / n for k, t in rows.items()}, tun


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default="8x131072,1x8192", help="BxT list")
    ap.add_argument("--kbg", default="2:128,2:32,4:128", help="bits:G list")
    a = ap.parse_args()
    out = []
    for B, T, kb, G in da.points_kbg(a.points, a.kbg):
        r, tun = point(B, T, kb, G)
        out.append((B, T, kb, G, tun, r))
        print(B, T, kb, G, {k: round(v, 4) for k, v in r.items()}, flush=True)
    names = list(out[0][5])
    print("| B | T | bits | G | W, S | " + " | ".join(names) + " | full - kernel |")
    print("|---" * (6 + len(names)) + "|")
    for B, T, kb, G, tun, r in out:
        cells = " | ".join(f"{r[k]:.4f}" for k in names)
        print(f"| {B} | {T} | {kb} | {G} | {tun.wg_per_block}, {tun.num_splits} | {cells} | "
              f"{r['full'] - r['kernel']:.4f} |")


if __name__ == "__main__":
    main()
