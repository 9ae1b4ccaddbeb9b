"""Attention error of KIVI's 2/4-bit cache, and what the Pallas kernel adds to it, on float K/V
quantized by the library.

    python -m bench.quant_error                             # KIVI alone (any backend)
    python -m bench.quant_error --kernel --ts 8192,131072   # and the kernel (Hopper GPU)
    python -m bench.quant_error --interpret --ts 1024       # the kernel, GPU interpreter (slow)

Inputs: K, V [B=2, Hkv=8, T, D=128] bf16 with the structure of real ones: every channel has
its own mean (N(0, 2) per channel and head) plus N(0, 1) per token, and four key channels are
8x larger (the outliers KIVI's per-channel keys are for); without channel means the output is
an average of noise, near zero, and every error is large against it. Rows of T and T/2 + 1
tokens, quantized by `KiviCache.prefill` (G = --group-size, R = 128); bf16 queries of std 1
(flat attention) and 4 (peaked), 32 query heads. Per (bits, T, q std), relative errors are
max |o - o_ref| / max |o_ref|:

  KIVI vs dense      the jnp reference over the quantized cache against float32 attention
                     over the unquantized K, V: the error of KIVI itself.
  kernel, lowp       implementation "pallas" and "pallas-lowp" (the opt-in fp8 value product,
                     at G = D; elsewhere the same as "pallas"): "vs dense / vs KIVI", the second
                     being the kernel's own error (its bf16 output is one unit ~4e-3).
  twin               `kivi_decode` against its float32 twin `kivi_decode_reference` over the
                     quantized region (float32 outputs, no bf16 rounding): o's relative error
                     and max |lse - lse_ref|, where the kernel's accumulation order shows.

Feeds the precision tables of docs/performance.md (and the method of docs/blackwell.md's
precision check); --json writes the rows with an `env` block. The KIVI column runs anywhere;
the kernel columns need a Hopper GPU (--kernel) or the interpreter (--interpret).
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp

import kivi_jax
from bench import common
from pallas_kernels.kivi_decode import kivi_decode, kivi_decode_reference

BATCH, Q_HEADS, KV_HEADS, HEAD_DIM, RESIDUAL = 2, 32, 8, 128, 128
Q_STDS = (1.0, 4.0)


def structured_kv(key, batch, kv_heads, tokens, head_dim):
    """K, V [1, B, Hkv, T, D] bf16: per-channel means, per-token noise, outlier key channels."""
    ks = jax.random.split(key, 4)
    shape = (1, batch, kv_heads, tokens, head_dim)
    mean = lambda k: 2.0 * jax.random.normal(k, (1, batch, kv_heads, 1, head_dim))
    k = jax.random.normal(ks[0], shape) + mean(ks[2])
    k = k.at[..., :4].multiply(8.0).astype(jnp.bfloat16)
    v = (jax.random.normal(ks[1], shape) + mean(ks[3])).astype(jnp.bfloat16)
    return k, v


def dense_attention(q, k, v, lengths):
    """float32 softmax attention, q [B, Hq, D] over k, v [B, Hkv, T, D], ragged lengths."""
    b, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, d) / math.sqrt(d)
    s = jnp.einsum("bhnd,bhtd->bhnt", qg, k.astype(jnp.float32), precision="highest")
    s = jnp.where(jnp.arange(t)[None, None, None] < lengths[:, None, None, None], s, -jnp.inf)
    o = jnp.einsum(
        "bhnt,bhtd->bhnd", jax.nn.softmax(s, axis=-1), v.astype(jnp.float32), precision="highest"
    )
    return o.reshape(b, hq, d)


def rel(o, ref) -> float:
    o, ref = o.astype(jnp.float32), ref.astype(jnp.float32)
    return float(jnp.abs(o - ref).max() / jnp.abs(ref).max())


def twin_errors(q, cache: kivi_jax.KiviCache, interpret: bool) -> tuple[float, float]:
    """(o relative error, max |lse - lse_ref|) of the kernel against its float32 twin over the
    quantized region of layer 0."""
    cfg = cache.config
    args = (
        q,
        cache.keys.codes,
        cache.keys.scale,
        cache.keys.minimum,
        cache.values.codes,
        cache.values.scale,
        cache.values.minimum,
        cache.quantized_split(),
        0,
    )
    kw = dict(
        key_bits=cfg.key_bits,
        value_bits=cfg.value_bits,
        group_size=cfg.group_size,
        sm_scale=1 / math.sqrt(q.shape[-1]),
        interpret=interpret,
    )
    o, lse = kivi_decode(*args, **kw)
    ro, rlse = kivi_decode_reference(*args, **kw)
    finite = jnp.isfinite(rlse)
    lse_err = float(jnp.abs(jnp.where(finite, lse - rlse, 0.0)).max())
    return rel(o, ro), lse_err


def error_rows(bits, ts, *, group_size=128, kernel=False, interpret=False, log=None):
    """One row per (bits, T, q std) with the errors of the module docstring (the kernel's
    only with kernel or interpret)."""
    rows = []
    for kb in bits:
        for t in ts:
            k, v = structured_kv(jax.random.key(t + kb), BATCH, KV_HEADS, t, HEAD_DIM)
            lengths = jnp.array([t, t // 2 + 1], jnp.int32)
            cache = kivi_jax.make_cache(
                f"kivi{kb}",
                num_layers=1,
                batch=BATCH,
                kv_heads=KV_HEADS,
                head_dim=HEAD_DIM,
                max_len=t,
                group_size=group_size,
                residual_length=RESIDUAL,
            )
            cache = cache.prefill(k, v, lengths)
            for std in Q_STDS:
                q = std * jax.random.normal(jax.random.key(7 + kb), (BATCH, Q_HEADS, HEAD_DIM))
                q = q.astype(jnp.bfloat16)
                dense = dense_attention(q, k[0], v[0], lengths)
                kivi = kivi_jax.decode_attention(q, cache, 0, implementation="reference")
                row = dict(bits=kb, T=t, G=group_size, q_std=std, kivi_vs_dense=rel(kivi, dense))
                if kernel or interpret:
                    for name, impl in (("kernel", "pallas"), ("lowp", "pallas-lowp")):
                        o = kivi_jax.decode_attention(
                            q, cache, 0, implementation=impl, interpret=interpret
                        )
                        row[f"{name}_vs_dense"] = rel(o, dense)
                        row[f"{name}_vs_kivi"] = rel(o, kivi)
                    row["twin_o"], row["twin_lse"] = twin_errors(q, cache, interpret)
                rows.append(row)
                if log:
                    log(table_line(row))
    return rows


def table_head(kernel: bool) -> str:
    cols = ["bits", "T", "q std", "KIVI vs dense"]
    if kernel:
        cols += ["kernel vs dense / vs KIVI", "lowp vs dense / vs KIVI", "twin: o / lse"]
    return "| " + " | ".join(cols) + " |\n" + "|---" * len(cols) + "|"


def table_line(r: dict) -> str:
    cells = [str(r["bits"]), str(r["T"]), f"{r['q_std']:g}", f"{r['kivi_vs_dense']:.2e}"]
    if "twin_o" in r:
        cells += [f"{r[f'{n}_vs_dense']:.2e} / {r[f'{n}_vs_kivi']:.1e}" for n in ("kernel", "lowp")]
        cells.append(f"{r['twin_o']:.1e} / {r['twin_lse']:.1e}")
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ts", default="8192,131072", help="comma list of T")
    ap.add_argument("--bits", default="2,4", help="comma list of bits (keys and values alike)")
    ap.add_argument("--group-size", type=int, default=128, help="KIVI G")
    ap.add_argument("--kernel", action="store_true", help="also the kernel (Hopper GPU)")
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="also the kernel, under the GPU interpreter (any backend; slow)",
    )
    ap.add_argument("--json", default=None, help="results file (rows and an env block)")
    a = ap.parse_args(argv)
    env = common.env_info(sys.argv[1:] if argv is None else argv, "quant_error")
    print(
        f"{env['device']} | jax {env['jax']} | B={BATCH} Hq={Q_HEADS} Hkv={KV_HEADS} "
        f"D={HEAD_DIM} G={a.group_size} R={RESIDUAL}"
    )
    print(table_head(a.kernel or a.interpret), flush=True)
    rows = error_rows(
        common.parse_ints(a.bits),
        common.parse_ints(a.ts),
        group_size=a.group_size,
        kernel=a.kernel,
        interpret=a.interpret,
        log=lambda line: print(line, flush=True),
    )
    if a.json:
        common.write_json(a.json, env=env, rows=rows)
    return rows


if __name__ == "__main__":
    main()
