"""`prerope_decode_reference`: the kernel's twin in float32 jnp.

The same call as `prerope_decode`, computed plainly: the layer's codes unpacked to the token
order (`pallas_kernels.layout.unpack_tokens`), dequantized, keys taken to the model's basis and
rotated by RoPE at their positions, the windows' and sinks' keys beside them likewise, softmax
over the attended positions, float32 throughout. The kernel differs by its fp16 keys and 16-bit
weighted P; the tests bound the difference.
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
from pallas_kernels.prerope_decode.kernel import (
    STAGES,
    capacity_of,
    check_full_precision,
    check_inputs,
    held_positions,
)


def _rope(x, positions, inv_freq):
    """x [..., T, D] rotated at `positions` (broadcasting to x.shape[:-1]; half-split layout,
    float32 angles)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _full_precision(at, windows, sinks, held, length):
    """The windows' and sinks' keys, values [B, H, T', D] float32, their positions [B, T'] and
    which of them are attended [B, T'] (`prerope_decode`'s rules), sinks first."""
    keys, values, positions, attended = [], [], [], []
    if sinks is not None:
        n = sinks[0].shape[-2]
        j = jnp.broadcast_to(jnp.arange(n), (held.shape[0], n))
        keys.append(sinks[0][at].astype(jnp.float32))
        values.append(sinks[1][at].astype(jnp.float32))
        positions.append(j)
        attended.append(j < held[:, None])
    if windows is not None:
        w = windows[0].shape[-2]
        s = jnp.arange(w)[None, :]
        p = length[:, None] - 1 - (length[:, None] - 1 - s) % w  # the newest p = s (mod W)
        keys.append(windows[0][at].astype(jnp.float32))
        values.append(windows[1][at].astype(jnp.float32).swapaxes(-1, -2))
        positions.append(p)
        attended.append(p >= 0)
    cat = lambda xs, axis: jnp.concatenate(xs, axis=axis)
    return cat(keys, -2), cat(values, -2), cat(positions, 1), cat(attended, 1)


def prerope_decode_reference(
    q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, num_tokens, layer, inv_freq,
    key_basis=None, *, key_bits: int, value_bits: int, group_size: int, sm_scale: float,
    basis_scale: float = 1.0, skip: int = 0, origin=0, windows=None, sinks=None,
    max_len: int = 0, splits: int | None = None, stages: int = STAGES, interpret=False,
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
    window, _ = check_full_precision(windows, sinks, skip, origin, L=L, B=B, H=H, D=D, Tq=Tq)
    held, length = held_positions(num_tokens, window, max_len, Tq)
    layer = jnp.asarray(layer, jnp.int32)
    at = jnp.clip(layer, 0, L - 1)
    per_group = lambda x, axis: jnp.repeat(x[at].astype(jnp.float32), G, axis=axis)
    kc = unpack_tokens(k_codes[at], key_bits, axis=-2).astype(jnp.float32)  # [B, H, Tq, D]
    k = kc * per_group(k_scale, -2) + per_group(k_min, -2)
    t = jnp.arange(Tq)
    position = jnp.broadcast_to(jnp.asarray(origin, jnp.int32) + t, (B, Tq))
    vcodes = unblock_columns(v_codes[at]) if value_codes_blocked(value_bits) else v_codes[at]
    vc = unpack_tokens(vcodes, value_bits, axis=-1).astype(jnp.float32)  # [B, H, D, Tq]
    in_order = lambda x: to_cache_order(per_group(x, -2), -1)  # [B, H, D, Tq], token order
    v = (vc * in_order(v_scale) + in_order(v_min)).swapaxes(-1, -2)  # [B, H, Tq, D]
    mask = (t[None, :] < held[:, None]) & (position >= skip)  # [B, Tq]
    if windows is not None or sinks is not None:
        fk, fv, fpos, fmask = _full_precision(at, windows, sinks, held, length)
        k, v = jnp.concatenate([k, fk], -2), jnp.concatenate([v, fv], -2)
        position = jnp.concatenate([position, fpos], 1)
        mask = jnp.concatenate([mask, fmask], 1)
    k = jnp.einsum("bhtc,cd->bhtd", k, key_basis.astype(jnp.float32), precision="highest")
    k = _rope(k, position[:, None, :], inv_freq)
    g = q.shape[1] // H
    qg = q.astype(jnp.float32).reshape(B, H, g, D) * sm_scale
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision="highest")
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
