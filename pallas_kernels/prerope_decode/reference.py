"""`prerope_decode_reference`: the kernel's twin in float32 jnp.

The same call as `prerope_decode`, computed plainly: the layer's codes unpacked to the token
order (`pallas_kernels.layout.unpack_tokens`), dequantized, keys taken to the model's basis and
rotated by RoPE at their positions, softmax over the held positions at or past `sinks`, float32
throughout. The kernel differs by its fp16 keys and bf16 weighted P; the tests bound the
difference.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.layout import (
    to_cache_order,
    unblock_columns,
    unpack_tokens,
    value_codes_blocked,
)
from pallas_kernels.prerope_decode.kernel import STAGES, capacity_of, check_inputs


def _rope(x, positions, inv_freq):
    """x [..., T, D] rotated at `positions` [T] (half-split layout, float32 angles)."""
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def prerope_decode_reference(
    q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer, inv_freq,
    key_basis=None, *, key_bits: int, value_bits: int, group_size: int, sm_scale: float,
    basis_scale: float = 1.0, sinks: int = 0, origin=0, splits: int | None = None,
    stages: int = STAGES, interpret=False,
):  # fmt: skip
    """`prerope_decode` in float32 (`basis_scale`, `splits`, `stages` and `interpret` concern
    the kernel's operands and launch and are ignored): (o [B, Hq, D], lse [B, Hq]); o = 0 and
    lse = -inf for a row with no positions; NaN for a layer outside [0, L)."""
    del basis_scale, splits, stages, interpret
    D = q.shape[-1]
    key_basis = jnp.eye(D, dtype=jnp.float32) if key_basis is None else key_basis
    check_inputs(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, inv_freq,
                 key_basis, key_bits=key_bits, value_bits=value_bits,
                 group_size=group_size)  # fmt: skip
    L, B, H = k_codes.shape[:3]
    Tq, G = capacity_of(v_codes, value_bits), group_size
    layer = jnp.asarray(layer, jnp.int32)
    at = jnp.clip(layer, 0, L - 1)
    per_group = lambda x, axis: jnp.repeat(x[at].astype(jnp.float32), G, axis=axis)
    kc = unpack_tokens(k_codes[at], key_bits, axis=-2).astype(jnp.float32)  # [B, H, Tq, D]
    k = kc * per_group(k_scale, -2) + per_group(k_min, -2)
    t = jnp.arange(Tq)
    position = jnp.asarray(origin, jnp.int32) + t
    k = _rope(jnp.einsum("bhtc,cd->bhtd", k, key_basis.astype(jnp.float32),
                         precision="highest"), position, inv_freq)  # fmt: skip
    vcodes = unblock_columns(v_codes[at]) if value_codes_blocked(value_bits) else v_codes[at]
    vc = unpack_tokens(vcodes, value_bits, axis=-1).astype(jnp.float32)  # [B, H, D, Tq]
    in_order = lambda x: to_cache_order(per_group(x, -2), -1)  # [B, H, D, Tq], token order
    v = (vc * in_order(v_scale) + in_order(v_min)).swapaxes(-1, -2)  # [B, H, Tq, D]
    g = q.shape[1] // H
    qg = q.astype(jnp.float32).reshape(B, H, g, D) * sm_scale
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision="highest")
    held = jnp.clip(num_tokens, 0, Tq)
    mask = (t[None, :] < held[:, None]) & (position >= sinks)[None, :]  # [B, Tq]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(s - m_safe)
    total = p.sum(-1)
    o = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision="highest")
    ok = total > 0
    o = o / jnp.where(ok, total, 1.0)[..., None]
    lse = jnp.where(ok, m_safe[..., 0] + jnp.log(jnp.where(ok, total, 1.0)), -jnp.inf)
    o = jnp.where((layer >= 0) & (layer < L), o, jnp.nan)
    return o.reshape(B, H * g, D), lse.reshape(B, H * g)
