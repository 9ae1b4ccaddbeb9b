"""The log-sum-exp merge of partial attentions, defined once: the kernels merge their splits
with it, and `kivi_jax.attention` merges the quantized region with the residual window. Pure
jnp, importing only jax."""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array


def merge_partials(o_parts: Array, lse_parts: Array, axis: int = 0) -> tuple[Array, Array]:
    """Merge normalized partial attentions over disjoint key sets.

    o_parts [..., P, ..., D] and lse_parts [..., P, ...] hold the P parts along `axis` (a
    non-negative axis, the same in both; o's last axis is the head dim) -> (o [..., D],
    lse [...]). Parts with lse = -inf (no keys) weigh nothing; where every part is empty, o = 0
    and lse = -inf.
    """
    m = jnp.max(lse_parts, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_parts - m_safe)  # exp(-inf) = 0 for empty parts
    total = jnp.sum(w, axis=axis)
    o = jnp.sum(jnp.expand_dims(w, -1) * o_parts, axis=axis)
    ok = total > 0
    o = o / jnp.where(ok, total, 1.0)[..., None]
    m_safe = jnp.squeeze(m_safe, axis)
    return o, jnp.where(ok, m_safe + jnp.log(jnp.where(ok, total, 1.0)), -jnp.inf)
