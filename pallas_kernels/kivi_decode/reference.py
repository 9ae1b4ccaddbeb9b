"""`kivi_decode_reference`: the kernel's twin in float32.

The same function as `kivi_decode`, factored differently: the key scale folded into q per token
group, the value scale into p per token and channel group, the minimums as biases; with
fp8_values it models the kernel's e4m3 rounding against the kernel's own running max.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.kivi_decode.config import STEP_TOKENS, TuningConfig, choose_tuning
from pallas_kernels.kivi_decode.decode import (
    check_inputs,
    check_out_dtype,
    check_signs,
    check_sinks,
    check_windows,
    rotated_query,
    sink_keys,
    sinks_in_kernel,
)
from pallas_kernels.layout import cache_slot, to_cache_order, unblock_columns, unpack_tokens
from pallas_kernels.merge import merge_partials
from pallas_kernels.rotation import unrotate_rows
from pallas_kernels.sm90.codes import f8_field_spec
from pallas_kernels.sm90.layout import PLANE


def _running_max(x, tuning: TuningConfig):
    """x [..., Tq] -> the kernel's running max at every position: the max over the position's
    split up to the end of its step (splits of ceil(steps / S) steps of 256 tokens)."""
    Tq = x.shape[-1]
    TS = STEP_TOKENS
    per = -(-(Tq // TS) // tuning.num_splits)  # steps per split
    step_max = x.reshape(*x.shape[:-1], Tq // TS, TS).max(axis=-1)
    run = jnp.concatenate(
        [
            lax.cummax(step_max[..., a : a + per], axis=step_max.ndim - 1)
            for a in range(0, Tq // TS, per)
        ],
        axis=-1,
    )
    return jnp.repeat(run, TS, axis=-1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "key_bits",
        "value_bits",
        "group_size",
        "sm_scale",
        "low_precision",
        "fp8_values",
        "tuning",
        "max_len",
        "skip",
        "out_dtype",
        "q_signs",
        "o_signs",
    ),
)
def kivi_decode_reference(
    q,
    k_codes,
    k_scale,
    k_min,
    v_codes,
    v_scale,
    v_min,
    num_tokens,
    layer,
    *,
    key_bits: int,
    value_bits: int,
    group_size: int,
    sm_scale: float,
    tuning=None,
    interpret=False,
    low_precision: bool = False,
    fp8_values: bool = False,
    windows=None,
    max_len: int = 0,
    skip: int = 0,
    sinks=None,
    out_dtype=jnp.float32,
    q_signs=None,
    o_signs=None,
):
    """The kernel's twin in float32, in folded form: key scale folded into q per token group,
    value scale into p per token and channel group, minimums as biases. Same signature and
    outputs as `kivi_decode` (tuning and interpret ignored; low_precision is fp8_values).
    fp8_values (G = D): P * s_t rounded to e4m3 through fp16 as the kernel does with
    `TuningConfig.fp8_values`, relative to the kernel's running max of logit + ln s_t (per
    split, updated every sub-step; `tuning` gives the splits and sub-steps, default
    `choose_tuning`'s), so the rounding is the kernel's up to f32 arithmetic."""
    del interpret
    fp8_values = fp8_values or low_precision  # the kernel's name for the fp8 value product
    out_dtype = check_out_dtype(out_dtype)
    L, B, Hq, Hkv, D, Tq = check_inputs(
        q,
        k_codes,
        k_scale,
        k_min,
        v_codes,
        v_scale,
        v_min,
        num_tokens,
        layer,
        key_bits,
        value_bits,
        group_size,
    )
    G, nq = group_size, Hq // Hkv
    f32 = jnp.float32
    if sinks is not None:
        check_sinks(sinks, L, B, Hkv, D, skip)
    q_signs = check_signs(q_signs, D)
    q = rotated_query(q, q_signs)  # float32 from here
    # a rotated q reaches the windows' product (and the sinks' in the kernel's chunk) rounded
    # to the windows' dtype, as the kernel's operand; by reduce_precision, which XLA keeps
    # (a round trip through the 16-bit dtype it may drop: its excess-precision rule)
    qw = q
    if q_signs is not None and windows is not None:
        fi = jnp.finfo(windows[0].dtype)
        qw = lax.reduce_precision(q, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
    if windows is not None:  # num_tokens: the rows' lengths; the newest W are the windows'
        W = check_windows(windows, L, B, Hkv, D)
        n_all = jnp.asarray(num_tokens, jnp.int32)
        if max_len:
            n_all = jnp.minimum(n_all, max_len)
        num_tokens = jnp.clip(n_all - W, 0, Tq)
    take = lambda x: lax.dynamic_index_in_dim(x, layer, 0, keepdims=False).astype(f32)
    sel = lambda x: lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)
    kc = unpack_tokens(sel(k_codes), key_bits, axis=2)  # [B, Hkv, Tq, D]
    if v_codes.ndim == 6:  # the cache's blocked form
        v_codes = unblock_columns(v_codes)
    vc = unpack_tokens(sel(v_codes), value_bits, axis=3)  # [B, Hkv, D, Tq]
    ks, kz = take(k_scale), take(k_min)
    vs, vz = to_cache_order(take(v_scale), -1), to_cache_order(take(v_min), -1)
    qs = q.astype(f32).reshape(B, Hkv, nq, D) * sm_scale
    # keys: q'_g = q * s_g (per token group g), bias_g = q . z_g
    qg = qs[:, :, None] * ks[:, :, :, None, :]  # [B,H,Tq/G,nq,D]
    kcg = kc.astype(f32).reshape(B, Hkv, Tq // G, G, D)
    logits = jnp.einsum("bhgtd,bhgnd->bhngt", kcg, qg, precision="highest")
    logits = logits + jnp.einsum("bhgd,bhnd->bhng", kz, qs, precision="highest")[..., None]
    logits = logits.reshape(B, Hkv, nq, Tq)
    n = jnp.minimum(jnp.asarray(num_tokens, jnp.int32), Tq)
    valid = (jnp.arange(Tq)[None, :] < n[:, None]) & (jnp.arange(Tq)[None, :] >= skip)  # [B, Tq]
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    mx = logits.max(axis=-1)
    safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
    p = jnp.exp(logits - safe[..., None])  # [B,H,nq,Tq]
    tot = p.sum(axis=-1)
    # values: P'_c = p * s_v[t, c] per channel group c, bias = sum_t p * z_v[t, c]
    pg = p[:, :, :, None, :] * vs[:, :, None]  # [B,H,nq,D/G,Tq]
    if fp8_values:
        if G != D:
            raise ValueError(f"fp8_values needs group_size == head_dim, got G={G}, D={D}")
        if tuning is None:
            tuning = choose_tuning(
                B,
                Hkv,
                Tq,
                key_bits=key_bits,
                value_bits=value_bits,
                group_size=G,
                head_dim=D,
                q_heads=nq,
            )
        s1 = jnp.maximum(vs[:, :, 0], 2.0**-24)[:, :, None]  # [B,H,1,Tq]
        lg = logits + jnp.log(s1)
        ref = _running_max(lg, tuning)  # the kernel's reference point of every token
        seen = jnp.isfinite(ref)  # positions before a split's first valid token: masked
        ref = jnp.where(seen, ref, 0.0)
        bt = jnp.exp(lg - ref)  # P * s_t <= 1 against the running max
        mx = lg.max(axis=-1)
        safe = jnp.where(jnp.isfinite(mx), mx, 0.0)
        rescale = jnp.where(seen, jnp.exp(ref - safe[..., None]), 0.0)  # the kernel's alphas
        p = bt / s1 * rescale
        tot = p.sum(axis=-1)
        Pv = 8 // value_bits  # field weight of each plane, then of each token's plane
        wgt = np.array([f8_field_spec(value_bits, j)[2] for j in range(Pv)], np.float32)[
            (cache_slot(np.arange(Tq)) // PLANE) % Pv
        ]
        b8 = (bt * (256.0 / wgt)).astype(jnp.float16).astype(jnp.float8_e4m3fn)
        pg = (b8.astype(f32) * (wgt / 256.0) * rescale)[:, :, :, None, :]
    vcg = vc.astype(f32).reshape(B, Hkv, D // G, G, Tq)
    o = jnp.einsum("bhncT,bhcgT->bhncg", pg, vcg, precision="highest")
    o = o + jnp.einsum("bhnT,bhcT->bhnc", p, vz, precision="highest")[..., None]
    o = o.reshape(B, Hkv, nq, D)
    ok = tot > 0
    o = jnp.where(ok[..., None], o / jnp.where(ok, tot, 1.0)[..., None], 0.0)
    lse = jnp.where(ok, safe + jnp.log(jnp.where(ok, tot, 1.0)), -jnp.inf)
    if windows is not None:
        kw, vw = (sel(x).astype(f32) for x in windows)  # [B, Hkv, W, D], [B, Hkv, D, W]
        qws = qw.reshape(B, Hkv, nq, D) * sm_scale
        s = jnp.einsum("bhnd,bhwd->bhnw", qws, kw, precision="highest")
        held = jnp.arange(W)[None, :] < jnp.clip(n_all, 0, W)[:, None]  # [B, W]
        # a held logit of -inf becomes NaN (the kernel's rule, `kivi_jax.attention`'s)
        s = jnp.where(held[:, None, None], jnp.where(s == -jnp.inf, jnp.nan, s), -jnp.inf)
        m = s.max(axis=-1, keepdims=True)
        pw = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        lw = pw.sum(axis=-1)
        has = lw != 0  # (a NaN sum stays NaN)
        ow = jnp.einsum("bhnw,bhdw->bhnd", pw, vw, precision="highest")
        ow = jnp.where(has[..., None], ow / jnp.where(has, lw, 1.0)[..., None], 0.0)
        lsew = jnp.where(
            has,
            jnp.where(jnp.isfinite(m[..., 0]), m[..., 0], 0.0) + jnp.log(jnp.where(has, lw, 1.0)),
            -jnp.inf,
        )
        o, lse = merge_partials(jnp.stack([o, ow]), jnp.stack([lse, lsew]))
    if sinks is not None:  # the first N positions from their full-precision buffers, those
        # below the codes' split (the rest are in the windows)
        held = jnp.minimum(n, sinks[0].shape[3])
        in_kernel = windows is not None and sinks_in_kernel(sinks, W, windows[0].dtype)
        keys = sink_keys(qw if in_kernel else q, sinks, layer, sm_scale, held)
        o, lse = merge_partials(o[:, :, None], lse[:, :, None], axis=2, keys=keys)
    o_signs = check_signs(o_signs, D)
    if o_signs is not None:
        o = unrotate_rows(o, o_signs)
    o = jnp.where((layer >= 0) & (layer < L), o, jnp.nan)  # read clamped; the output NaN
    return o.reshape(B, Hq, D).astype(out_dtype), lse.reshape(B, Hq)
